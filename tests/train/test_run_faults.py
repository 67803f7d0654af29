"""Faults of a training run, each one line and exit 2 with nothing lost: a second fit into a live run's folder,
temporaries of a live save, files unsafe to unpickle, a disk that fills during a save, FSDP on CPU."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import diffmm.train.checkpoint_io as cio
from diffmm.train.checkpoint_io import LOCK_NAME, RunLock, remove_stale_temporaries
from diffmm.train.cli import main, run_cli
from train_configs import clip_config, write_yaml


@pytest.fixture(scope="module")
def run(tmp_path_factory, image_text_data):
    """A finished 4-step run (checkpoints at steps 2 and 4) and its config."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = clip_config(str(tmp / "run"), image_text_data, max_steps=4, model_name=None, limit_val_batches=0)
    cfg["checkpoint"] = {"every_n_train_steps": 2, "save_top_k": -1}
    run_cli(["fit", "--config", write_yaml(tmp / "c.yaml", cfg)])
    return tmp / "run", cfg


def _copy(run, tmp_path, name="run"):
    root, cfg = run
    shutil.copytree(root, tmp_path / name)
    cfg = {**cfg, "trainer": {**cfg["trainer"], "default_root_dir": str(tmp_path / name)}}
    return tmp_path / name, write_yaml(tmp_path / f"{name}.yaml", cfg)


def _one_line(capsys, cmd="fit") -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("diffmm ")]
    assert len(err) == 1, err
    assert err[0].startswith(f"diffmm {cmd}: error: "), err
    return err[0]


def _snapshot(folder) -> dict[str, bytes]:
    return {p: open(os.path.join(folder, p), "rb").read() for p in os.listdir(folder) if p.endswith(".ckpt")}


# --------------------------------------------------------------------------------------- one run per folder
def test_second_fit_into_a_live_runs_folder_fails_naming_its_pid(tmp_path, capsys, run):
    root, cfg = _copy(run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from diffmm.train.checkpoint_io import "
                               "RunLock; lock = RunLock([sys.argv[1]]); print('locked', flush=True); time.sleep(60)",
                               str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _snapshot(root / "checkpoints")
        assert main(["fit", "--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "6"]) == 2
        line = _one_line(capsys)
        assert f"belongs to a running fit (PID {holder.pid} on " in line and "--trainer.default_root_dir" in line
        assert _snapshot(root / "checkpoints") == before  # nothing written, nothing removed
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the owner was killed: its lock died with it, the next fit owns the folder
    assert main(["fit", "--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "6"]) == 0
    assert torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert (root / LOCK_NAME).exists() and RunLock([str(root)]).release() is None  # released at the end


def test_temporaries_of_a_live_save_are_kept(tmp_path):
    live = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for pid in (live.pid, dead.pid, os.getpid()):
            (tmp_path / f".last.ckpt.tmp-{pid}").write_bytes(b"half a save")
        remove_stale_temporaries(str(tmp_path))
        assert os.listdir(tmp_path) == [f".last.ckpt.tmp-{live.pid}"]
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------------------------------- unsafe to unpickle
class _System:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Exec:
    def __reduce__(self):
        return exec, ("x = 1",)


def _hostile(tmp_path, kind: str) -> str:
    path = str(tmp_path / f"{kind}.ckpt")
    payload = {"state_dict": {}, "global_step": 1, "x": _System(str(tmp_path / "PWNED")) if "system" in kind
               else _Exec()}
    if kind.endswith("raw"):
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    else:
        torch.save(payload, path)
    return path


@pytest.mark.parametrize("kind", ["exec", "system", "system_raw"])
def test_unsafe_ckpt_path_is_refused_in_one_line(tmp_path, capsys, run, kind):
    _, cfg = _copy(run, tmp_path)
    path = _hostile(tmp_path, kind)
    for cmd in ("fit", "validate"):
        assert main([cmd, "--config", cfg, "--ckpt_path", path]) == 2
        line = _one_line(capsys, cmd)
        assert f"ckpt_path: {path} is refused as unsafe to unpickle (" in line, line
        assert "damaged" not in line and line.endswith("if you trust the file, pass --weights_only false")
        assert ("posix.system" in line) if kind == "system" else True
    assert not (tmp_path / "PWNED").exists()


def test_unsafe_last_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog, run):
    root, cfg = _copy(run, tmp_path)
    shutil.copy(_hostile(tmp_path, "system"), root / "checkpoints" / "last.ckpt")
    assert main(["fit", "--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "5"]) == 0
    assert "last.ckpt is refused as unsafe to unpickle" in caplog.text and "step=4.ckpt instead" in caplog.text
    assert torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5
    assert not (tmp_path / "PWNED").exists()


def test_trusted_checkpoint_loads_with_weights_only_false(tmp_path, run):
    root, cfg = _copy(run, tmp_path)
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["note"] = _Exec()  # a global weights-only loading refuses; harmless to run
    torch.save(ckpt, tmp_path / "trusted.ckpt")
    assert main(["fit", "--config", cfg, "--ckpt_path", str(tmp_path / "trusted.ckpt"), "--weights_only", "false",
                 "--trainer.max_steps", "5"]) == 0


# ------------------------------------------------------------------------------------------- disk full
@pytest.mark.parametrize("error", ["enospc", "torch"])
def test_disk_full_during_a_save_is_one_line_and_keeps_the_checkpoints(tmp_path, capsys, monkeypatch, run, error):
    root, cfg = _copy(run, tmp_path)
    before = _snapshot(root / "checkpoints")
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        f.write(b"\0" * 1000)
        if error == "enospc":
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(cio.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 0))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(cio.torch, "save", full_disk)
    assert main(["fit", "--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "6"]) == 2
    monkeypatch.setattr(cio.torch, "save", real_save)
    line = _one_line(capsys)
    assert "disk full: cannot save" in line and f"in {root / 'checkpoints'} (" in line and "MiB free" in line
    assert f"the newest intact checkpoint is {root / 'checkpoints'}" in line and "--ckpt_path last" in line
    assert _snapshot(root / "checkpoints") == before  # nothing overwritten, no temporary left
    assert not [n for n in os.listdir(root / "checkpoints") if ".tmp-" in n]


# ----------------------------------------------------------------------------------------------- FSDP on CPU
@pytest.mark.parametrize("strategy", ["fsdp", "diffmm.train.strategies.BlockFSDPStrategy"])
def test_fsdp_on_cpu_is_one_line(tmp_path, capsys, run, strategy):
    root, cfg = run
    cfg = {**cfg, "trainer": {**cfg["trainer"], "default_root_dir": str(tmp_path / "run"),
                              "strategy": strategy if strategy == "fsdp" else {"class_path": strategy}}}
    assert main(["fit", "--config", write_yaml(tmp_path / "fsdp.yaml", cfg)]) == 2
    line = _one_line(capsys)
    if strategy == "fsdp":  # Lightning's own one line
        assert "The strategy `fsdp` requires a GPU accelerator" in line
    else:
        assert "trainer.strategy: FSDP shards over GPUs and does not run on CPU; on CPU use strategy ddp" in line
