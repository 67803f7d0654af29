"""Data modules under a real Trainer: resume through Lightning's stateful-dataloader protocol, shards
without ``sizes.json``, test/predict fallbacks and predict keys."""
from __future__ import annotations

import glob
import logging
import os
import shutil
import warnings

import pytorch_lightning as pl
import torch

from diffmm.train.callbacks import PredictionWriter
from diffmm.train.datamodules import ImageTextDataModule
from diffmm.train.resume import TrainingProgress


class Recorder(pl.LightningModule):
    """Records a fingerprint of every training batch; predicts the image means."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.seen: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        images, tokens = batch
        self.seen.append((self.global_step, round(float(images.sum()), 3), int(tokens.sum())))
        return self.lin(images.mean(dim=(2, 3))).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.val_batches = getattr(self, "val_batches", 0) + 1

    def test_step(self, batch, batch_idx):
        return None

    def predict_step(self, batch, batch_idx):
        images, _ = batch
        return {"mean": images.mean(dim=(1, 2, 3))}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _dm(train, val=None, **kw):
    return ImageTextDataModule(train_shards=train, val_shards=val, batch_size=4, num_workers=0, image_size=16,
                               context_length=8, shuffle_buffer=8, seed=1, **kw)


def _trainer(root, max_steps, **kw):
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=5, save_top_k=-1)
    # TrainingProgress: where training stands, which the data follows (the diffmm CLI adds it)
    return pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=[ckpt, TrainingProgress()],
                      default_root_dir=root, **kw)


def test_resume_mid_epoch_through_the_stateful_loader_protocol(tmp_path, image_text_data):
    train, _ = image_text_data                          # 96 samples / batch 4 = 24 batches per epoch
    full = Recorder()
    _trainer(str(tmp_path / "full"), 30).fit(full, datamodule=_dm(train))   # crosses into epoch 1

    first = Recorder()
    _trainer(str(tmp_path / "cut"), 25).fit(first, datamodule=_dm(train))
    ckpt = os.path.join(tmp_path, "cut", "ckpt", "epoch=1-step=25.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    [pos] = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (pos["epoch"], pos["batches"], pos["epoch_batches"]) == (1, 1, 24)

    resumed = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(str(tmp_path / "cut"), 30).fit(resumed, datamodule=_dm(train), ckpt_path=ckpt)
    assert not [w for w in caught if "not resumable" in str(w.message)], "Lightning thinks the loader is not resumable"
    assert resumed.seen == full.seen[25:]               # the same batches, augmentations included


def test_shards_without_sizes_json_train_and_are_counted_once(tmp_path, image_text_data, caplog):
    train, val = image_text_data
    for spec, name in ((train, "train"), (val, "val")):
        os.makedirs(tmp_path / name)
        for f in glob.glob(os.path.join(os.path.dirname(spec), "*.tar")):
            shutil.copy(f, tmp_path / name)
    train_glob, val_glob = str(tmp_path / "train" / "*.tar"), str(tmp_path / "val" / "*.tar")
    assert not glob.glob(str(tmp_path / "*" / "sizes.json"))
    dm = _dm(train_glob, val_glob)
    with caplog.at_level(logging.INFO, logger="diffmm.data"):
        loader = dm.train_dataloader()
        assert len(loader) == 96 // 4
    assert "counted 96 samples in 3 shard(s)" in caplog.text
    assert os.path.exists(tmp_path / "train" / ".diffmm-counts.json")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffmm.data"):
        assert len(_dm(train_glob).train_dataloader()) == 24   # from the cache: nothing counted again
    assert "counted" not in caplog.text
    model = Recorder()
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=1,
                         val_check_interval=3, default_root_dir=str(tmp_path))
    trainer.fit(model, datamodule=_dm(train_glob, val_glob))
    assert len(model.seen) == 3 and model.val_batches == 1 + 1   # sanity check + one validation


def test_test_and_predict_fall_back_to_val_shards_and_predictions_carry_keys(tmp_path, image_text_data, caplog):
    _, val = image_text_data
    dm = _dm(None, val)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[PredictionWriter(str(tmp_path / "pred"))])
    with caplog.at_level(logging.INFO, logger="diffmm.train"):
        trainer.test(Recorder(), datamodule=dm, verbose=False)
    lines = [r.getMessage() for r in caplog.records if "using the validation shards" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("test: data.test_shards is not set")
    trainer.predict(Recorder(), datamodule=dm, return_predictions=False)
    pred = torch.load(tmp_path / "pred" / "predictions_rank0.pt", weights_only=True)
    assert pred["mean"].shape == (16,)
    assert pred["keys"] == [f"{i:05d}" for i in range(16)]   # in shard order, one per row


def _even_key(sample: dict) -> bool:
    return int(sample["__key__"]) % 2 == 0


def _fails_on_four(sample: dict) -> dict:
    if sample["__key__"] == "00004":
        raise ValueError("no fours")
    return sample


def test_webdataset_stages_and_handler_reach_the_datasets(image_text_data):
    """``stages`` / ``handler`` of the data module run on the raw samples of every stage's dataset."""
    import webdataset as wds

    _, val = image_text_data
    dm = _dm(None, val, stages=[wds.select(_even_key), wds.map(_fails_on_four)], handler=wds.ignore_and_continue)
    loader = dm.predict_dataloader()
    rows = sum(len(images) for images, _ in loader)
    assert rows == 7 and dm.predict_keys() == [f"{i:05d}" for i in range(0, 16, 2) if i != 4]
    counts = dm.data_stats("predict").snapshot()
    assert (counts["skip_filtered"], counts["skip_stage_error"]) == (8, 1)
