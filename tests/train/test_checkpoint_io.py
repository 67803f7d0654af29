"""Atomic checkpoint writes: a write that dies half-way leaves the previous checkpoint intact."""
from __future__ import annotations

import os

import pytest
import torch

import diffmm.train.checkpoint_io as cio
from diffmm.train.checkpoint_io import AtomicCheckpointIO


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed during the write")

    monkeypatch.setattr(cio.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert os.listdir(path.parent) == ["last.ckpt"]  # no temp file left behind

    io.save_checkpoint({"global_step": 3}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 3


def test_ckpt_path_last_picks_newest_of_last_and_slurm_hpc(tmp_path):
    from diffmm.train.checkpoint_io import candidate_checkpoints

    ckpt_dir = str(tmp_path / "checkpoints")
    assert candidate_checkpoints(ckpt_dir, str(tmp_path)) == []
    (tmp_path / "checkpoints").mkdir()
    last, hpc = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "hpc_ckpt_3.ckpt"
    periodic = tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"
    for path in (last, hpc, periodic):
        path.write_bytes(b"x")
    os.utime(last, (1000, 1000))
    os.utime(periodic, (1000, 1000))
    os.utime(hpc, (2000, 2000))
    assert candidate_checkpoints(ckpt_dir, str(tmp_path)) == [str(hpc), str(last), str(periodic)]
    os.utime(last, (3000, 3000))
    assert candidate_checkpoints(ckpt_dir, str(tmp_path))[0] == str(last)
