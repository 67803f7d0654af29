"""TEST-ONLY config builders and log readers of the training tests (tiny YAML configs for the ``diffmm`` CLI)."""
from __future__ import annotations

import csv
import os

import yaml


def trainer_cfg(root: str, max_steps: int, **kw) -> dict:
    cfg = {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "log_every_n_steps": 1,
           "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": root,
           "limit_val_batches": 2, "num_sanity_val_steps": 0, "check_val_every_n_epoch": None}
    cfg.update(kw)
    return cfg


def lm_config(root: str, text_data, max_steps: int = 30, **trainer_kw) -> dict:
    train, val, tok = text_data
    return {
        "seed_everything": 0,
        "trainer": trainer_cfg(root, max_steps, **trainer_kw),
        "model": {"class_path": "diffmm.train.LMModule", "init_args": {
            "model_name": "diff-tiny", "model_kwargs": {"n_layer": 1, "n_embd": 32, "n_head": 4, "block_size": 32},
            "tokenizer": tok, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 3}},
        "data": {"class_path": "diffmm.train.TextDataModule", "init_args": {
            "train_shards": train, "val_shards": val, "batch_size": 8, "num_workers": 0}},
    }


#: diffmm's DiffCLIP-Tiny / CLIP-Tiny configs shrunk further for tests (16 px, width 32, one layer per tower)
SHRINK = {"embed_dim": 16,
          "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 32, "layers": 1, "head_width": 8},
          "text_cfg": {"context_length": 16, "width": 32, "heads": 4, "layers": 1}}


def clip_config(root: str, image_text_data, max_steps: int = 30, model_name: str | None = "DiffCLIP-Tiny",
                **trainer_kw) -> dict:
    """A CLIP fit config; ``model_name=None`` uses the test-only stand-in model of train_helpers."""
    train, val = image_text_data
    if model_name is None:
        model = {"model": {"class_path": "train_helpers.TinyCLIP",
                           "init_args": {"image_size": 16, "context_length": 16}}}
    else:
        model = {"model_name": model_name, "model_kwargs": SHRINK}
    return {
        "seed_everything": 0,
        "trainer": trainer_cfg(root, max_steps, **trainer_kw),
        "model": {"class_path": "diffmm.train.CLIPModule", "init_args": {
            **model, "lr": 5e-3, "min_lr": 1e-4, "weight_decay": 0.1, "warmup_steps": 3}},
        "data": {"class_path": "diffmm.train.ImageTextDataModule", "init_args": {
            "train_shards": train, "val_shards": val, "batch_size": 16, "num_workers": 0}},
    }


def write_yaml(path, cfg: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return str(path)


def read_metrics(root: str) -> list[dict]:
    """Rows of the newest CSV log under ``root/csv``."""
    versions = sorted(os.listdir(os.path.join(root, "csv")), key=lambda v: int(v.split("_")[1]))
    with open(os.path.join(root, "csv", versions[-1], "metrics.csv")) as f:
        return list(csv.DictReader(f))


def series(rows: list[dict], key: str) -> dict[int, float]:
    """step -> value of ``key`` (rows without it skipped)."""
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}
