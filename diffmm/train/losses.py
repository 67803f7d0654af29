"""Training losses: CLIP's symmetric contrastive loss over features gathered from every rank, and next-token loss.

Distributed contrastive loss, with ``W`` ranks each holding ``B`` pairs:

* ``gather_with_grad=True`` (default): features are all-gathered with an autograd-aware collective
  (:class:`AllGatherWithGrad`), whose backward sums the gradients that every rank's loss sends to
  each rank's features (a reduce-scatter). Combined with DDP's gradient averaging, the update
  equals that of one process on the whole ``W * B`` batch, with or without ``local_loss``.
* ``local_loss=True``: each rank only computes the rows of the logit matrix that belong to its own
  pairs, ``(B, W*B)`` instead of ``(W*B, W*B)``; same gradients (with gathered gradients), ``W``
  times less logit memory and compute.
* ``gather_with_grad=False``: plain ``all_gather`` with the local slice put back so gradients reach
  the local features only (open_clip's cheaper default); not the combined-batch gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

#: targets with this value are not scored (torch's ``cross_entropy`` convention, which ``diffmm.data.recall`` follows)
IGNORE_INDEX = -100


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or fp64 when it already is."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class AllGatherWithGrad(torch.autograd.Function):
    """``(B, ...)`` on every rank -> ``(W*B, ...)`` rank-major; backward: sum the gradient over ranks, keep our rows.

    All ranks must pass the same shape. The backward is a reduce-scatter (NCCL) or an all-reduce
    followed by slicing (other backends, e.g. gloo).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        ctx.rows = (rank * x.shape[0], (rank + 1) * x.shape[0])
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        lo, hi = ctx.rows
        grad = grad.contiguous()
        if dist.get_backend() == "nccl":
            out = grad.new_empty((hi - lo, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad)
            return out
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad[lo:hi]


class ContrastiveLoss(nn.Module):
    """Symmetric InfoNCE of CLIP on L2-normalised features, gathered across ranks.

    Args:
        local_loss: compute only this rank's rows of the logit matrix (see module doc).
        gather_with_grad: autograd-aware gather (see module doc).
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = True) -> None:
        super().__init__()
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad

    def gather(self, features: torch.Tensor) -> torch.Tensor:
        """All-gather ``(B, D)`` features from every rank into ``(W*B, D)``, rank-major; with ``gather_with_grad``
        gradients flow to every rank's features, otherwise only this rank's slice carries gradients."""
        rank, world = _world()
        if world == 1:
            return features
        if self.gather_with_grad:
            return AllGatherWithGrad.apply(features)
        parts = [torch.empty_like(features) for _ in range(world)]
        dist.all_gather(parts, features.detach().contiguous())
        parts[rank] = features
        return torch.cat(parts, 0)

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor,
                logit_scale: torch.Tensor) -> torch.Tensor:
        """Mean of the image->text and text->image cross entropies.

        Args:
            image_features: (B, D) this rank's image embeddings, normalised.
            text_features: (B, D) this rank's text embeddings, normalised; row i pairs with image i.
            logit_scale: 0-d, the temperature already exponentiated (and clamped).
        """
        rank, B = _world()[0], image_features.shape[0]
        all_img, all_txt = self.gather(image_features), self.gather(text_features)
        if self.local_loss:
            logits_per_image = logit_scale * image_features @ all_txt.T   # (B, W*B)
            logits_per_text = logit_scale * text_features @ all_img.T     # (B, W*B)
            labels = torch.arange(B, device=image_features.device) + rank * B
        else:
            logits_per_image = logit_scale * all_img @ all_txt.T           # (W*B, W*B)
            logits_per_text = logits_per_image.T
            labels = torch.arange(all_img.shape[0], device=image_features.device)
        # cross entropy in (at least) fp32 whatever the autocast dtype
        return 0.5 * (F.cross_entropy(_fp32(logits_per_image), labels)
                      + F.cross_entropy(_fp32(logits_per_text), labels))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross entropy of ``logits (B, N, V)`` against ``targets (B, N)`` (``ignore_index`` not scored), in fp32."""
    return F.cross_entropy(_fp32(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
