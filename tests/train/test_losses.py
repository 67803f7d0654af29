"""Contrastive loss: float64 reference, open_clip's ClipLoss, and 2-process gloo gradients == one process on the
combined batch (the gathered loss with gradients, with and without local_loss)."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from diffmm.train.losses import ContrastiveLoss, next_token_loss


def reference_clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE written out with explicit log-softmax sums (float64)."""
    logits = scale * img @ txt.T
    n = logits.shape[0]
    i2t = -(logits.diag() - torch.logsumexp(logits, dim=1)).sum() / n
    t2i = -(logits.diag() - torch.logsumexp(logits, dim=0)).sum() / n
    return (i2t + t2i) / 2


def test_contrastive_matches_reference_and_open_clip():
    from open_clip.loss import ClipLoss

    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(12, 8, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(torch.randn(12, 8, generator=g, dtype=torch.float64), dim=-1)
    scale = torch.tensor(14.3, dtype=torch.float64)
    ours = ContrastiveLoss()(img, txt, scale)
    torch.testing.assert_close(ours, reference_clip_loss(img, txt, scale))
    theirs = ClipLoss()(img.float(), txt.float(), scale.float())
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-5, atol=1e-6)


def test_next_token_loss_matches_reference():
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 1] = -100
    keep = targets != -100
    ref = -(torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0])[keep].mean()
    torch.testing.assert_close(next_token_loss(logits, targets).double(), ref)


# ----- distributed gradients ---------------------------------------------------------------------
D_IN, D_OUT, B_LOCAL, WORLD = 6, 5, 4, 2


def _towers(seed: int = 0) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    img_tower = torch.nn.Linear(D_IN, D_OUT).double()
    txt_tower = torch.nn.Linear(D_IN, D_OUT).double()
    scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    return img_tower, txt_tower, scale


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(WORLD * B_LOCAL, D_IN, generator=g, dtype=torch.float64),
            torch.randn(WORLD * B_LOCAL, D_IN, generator=g, dtype=torch.float64))


def _grads(img_tower, txt_tower, scale) -> dict[str, torch.Tensor]:
    out = {f"img.{n}": p.grad.clone() for n, p in img_tower.named_parameters()}
    out.update({f"txt.{n}": p.grad.clone() for n, p in txt_tower.named_parameters()})
    out["scale"] = scale.grad.clone()
    return out


def _single_process_grads(local_loss: bool) -> dict[str, torch.Tensor]:
    img_tower, txt_tower, scale = _towers()
    x_img, x_txt = _batch()
    loss = ContrastiveLoss(local_loss=local_loss)(F.normalize(img_tower(x_img), dim=-1),
                                                  F.normalize(txt_tower(x_txt), dim=-1), scale)
    loss.backward()
    return _grads(img_tower, txt_tower, scale)


def _worker(rank: int, port: int, configs: list[tuple[bool, bool]], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x_img, x_txt = _batch()
        sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
        for local_loss, with_grad in configs:
            img_tower, txt_tower, scale = _towers()
            loss = ContrastiveLoss(local_loss=local_loss, gather_with_grad=with_grad)(
                F.normalize(img_tower(x_img[sl]), dim=-1), F.normalize(txt_tower(x_txt[sl]), dim=-1), scale)
            loss.backward()
            grads = _grads(img_tower, txt_tower, scale)
            for g in grads.values():  # what DDP does: average parameter gradients over ranks
                dist.all_reduce(g)
                g /= WORLD
            if rank == 0:
                out[(local_loss, with_grad)] = {k: v.clone() for k, v in grads.items()}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ddp_grads():
    configs = [(False, True), (True, True), (True, False)]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), configs, out), nprocs=WORLD, start_method="spawn", join=True)
        return dict(out)


@pytest.mark.parametrize("local_loss", [False, True])
def test_two_rank_gathered_loss_gives_combined_batch_gradients(ddp_grads, local_loss):
    ref = _single_process_grads(local_loss=False)
    got = ddp_grads[(local_loss, True)]
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_gather_without_grad_is_not_the_combined_gradient(ddp_grads):
    """The cheaper open_clip mode (no gradient through gathered copies) differs: the check above can fail."""
    ref = _single_process_grads(local_loss=False)
    got = ddp_grads[(True, False)]
    assert any(not torch.allclose(got[k], ref[k], rtol=1e-6, atol=1e-9) for k in ref)
