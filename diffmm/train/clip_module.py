"""LightningModule for contrastive image-text training of (Diff)CLIP models, with optional zero-shot
classification during validation."""
from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.eval.classnames import get_classnames
from diffmm.eval.image_sources import open_image_source
from diffmm.eval.zeroshot import zero_shot
from diffmm.hub.factory import apply_swap, create_model
from diffmm.train.base import TrainModule
from diffmm.train.losses import ContrastiveLoss
from diffmm.models.clip.preprocess import tokenizer_for, transforms_for

log = logging.getLogger("diffmm.train")

class ZeroShotHook:
    """Zero-shot top-1/top-5 on a labelled image set, run at the end of validation epochs on rank 0, through
    ``diffmm.eval.zeroshot`` (what ``diffmm eval zeroshot`` runs).

    Args:
        dataset: image source spec of ``diffmm.eval.image_sources.open_image_source`` (image folder,
            ``idx:FOLDER`` for Fashion-MNIST, or label shards).
        classnames: built-in name, file or list (``diffmm.eval.classnames.get_classnames``).
        templates: built-in name, file or list of prompt templates.
        every_n_epochs: run when ``(epoch + 1) % every_n_epochs == 0``.
        batch_size, num_workers: of the image source.
        max_batches: stop after this many batches (quick checks).
        label_field: label key of shards (``cls`` or ``json:NAME``).
        split: IDX split (``train``/``test``).
    """

    def __init__(self, dataset: str, classnames: str | list[str], templates: str | list[str] = "simple",
                 every_n_epochs: int = 1, batch_size: int = 64, num_workers: int = 0,
                 max_batches: Optional[int] = None, label_field: str = "cls", split: str = "test") -> None:
        self.dataset, self.classnames, self.templates = dataset, classnames, templates
        self.every_n_epochs, self.batch_size, self.num_workers = max(1, every_n_epochs), batch_size, num_workers
        self.max_batches, self.label_field, self.split = max_batches, label_field, split

    def run(self, model: nn.Module, *, epoch: int, rank: int = 0) -> dict[str, float]:
        """Evaluate ``model`` with its own preprocessing (image size, mean/std, tokenizer truncation: what
        ``diffmm eval`` uses); returns ``{"top1": ..., "top5": ...}`` or ``{}`` when skipped."""
        if rank != 0 or (epoch + 1) % self.every_n_epochs:
            return {}
        names = get_classnames(self.classnames)
        _, transform = transforms_for(model)
        source = open_image_source(self.dataset, transform, classnames=names, label_field=self.label_field,
                                   split=self.split, batch_size=self.batch_size, num_workers=self.num_workers)
        modes = [(m, m.training) for m in model.modules()]  # locked towers stay in eval mode afterwards
        model.eval()
        try:
            result = zero_shot(model, tokenizer_for(model), source, names, self.templates,
                               show_progress=False, max_batches=self.max_batches)
        finally:
            for m, mode in modes:
                m.training = mode
        log.info("zero-shot epoch %d: top1 %.4f top5 %.4f on %d images", epoch, result.top1, result.top5, result.n)
        return {"top1": result.top1, "top5": result.top5}


#: open_clip's clamp of the learnable temperature: exp(logit_scale) <= 100
MAX_LOGIT_SCALE = math.log(100.0)


class CLIPModule(TrainModule):
    """Trains a CLIP-style model (``encode_image``, ``encode_text``, ``logit_scale``) on (images, tokens) batches.
    LiT (locked towers, feature caches, a tower's own lr): :class:`~diffmm.train.LiTModule`.

    Args:
        model_name: any name ``diffmm.create_model`` accepts: a diffmm config (``diffmm.list_models()``, e.g.
            ``DiffCLIP-Tiny``, ``CLIP-Tiny``, ``OpenCLIP-ViT-B-16``), ``open_clip:NAME``, or a checkpoint path.
        model_kwargs: extra keyword arguments of ``diffmm.create_model`` (config overrides).
        pretrained: initial weights (anything ``diffmm.create_model(pretrained=...)`` accepts: open_clip, timm,
            official DiffCLIP, diffmm export, a Lightning ``.ckpt``).
        swap: convert the attention after ``pretrained`` is loaded: keyword arguments of ``diffmm.swap_attention``
            (``attention``: ``diff`` | ``diff_v2``, ``towers``, ``layers``, ``init``: ``upcycle`` | ``scratch``,
            ``lambda_init``, ``seed``). ``{init: upcycle}`` fine-tunes a pretrained CLIP as a DiffCLIP whose first
            outputs (and loss) are the pretrained model's. Checkpoints hold the swapped model and its config, so they
            resume and load (``diffmm eval --model last.ckpt``) without the pretrained file.
        trust_pickle: allow a ``pretrained`` file that needs full unpickling (the official DiffCLIP
            ``checkpoint_best.pt``); only for files you trust.
        model: an already built model (Python use; overrides ``model_name``; ``swap`` still applies).
        local_loss: compute only this rank's rows of the logit matrix (open_clip ``--local-loss``).
        gather_with_grad: gather features across ranks with gradients (exact combined-batch gradients).
        lr, min_lr, weight_decay, betas, eps, warmup_steps, warmup_epochs, total_steps: optimizer recipe
            (defaults: the DiffCLIP recipe, arXiv 2503.06626; ``warmup_epochs=1`` there).
        no_decay: extra parameter-name fragments without weight decay (besides biases, norms, lambdas,
            logit_scale and 1-D parameters), e.g. ``[positional_embedding, pos_embed, cls_token]`` as timm does.
        grad_checkpointing, compile, log_lambdas: see :class:`~diffmm.train.base.TrainModule`.
        zeroshot: optional zero-shot evaluation during validation, keyword arguments of
            :class:`ZeroShotHook` (needs ``diffmm.eval.zeroshot``).
    """

    def __init__(self, model_name: str = "DiffCLIP-Tiny", model_kwargs: Optional[dict] = None,
                 pretrained: Optional[str] = None, model: Optional[nn.Module] = None, *,
                 swap: Optional[dict[str, Any]] = None, trust_pickle: bool = False,
                 local_loss: bool = False, gather_with_grad: bool = True,
                 lr: float = 5e-4, min_lr: float = 1e-5, weight_decay: float = 0.5,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 warmup_steps: int = 0, warmup_epochs: Optional[float] = None, total_steps: Optional[int] = None,
                 grad_checkpointing: bool = False, compile: bool = False, log_lambdas: bool = True,
                 no_decay: Optional[list[str]] = None, zeroshot: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        if model is None:
            model = create_model(model_name, pretrained or None, swap=swap, trust_pickle=trust_pickle,
                                 **dict(model_kwargs or {}))
        elif swap:
            apply_swap(model, swap)
        for attr in ("encode_image", "encode_text", "logit_scale"):
            if not hasattr(model, attr):
                raise TypeError(f"CLIPModule: {type(model).__name__} has no {attr!r}; "
                                "expected open_clip's model interface")
        if getattr(model, "logit_bias", None) is not None:
            raise ValueError("CLIPModule: the model has a logit_bias (init_logit_bias, a SigLIP-style model); its "
                             "sigmoid loss is not implemented, only CLIP's contrastive loss")
        self.setup_model(model)
        self.loss_fn = ContrastiveLoss(local_loss=local_loss, gather_with_grad=gather_with_grad)
        self.zeroshot = ZeroShotHook(**zeroshot) if zeroshot else None

    # ----- steps --------------------------------------------------------------------------------
    def features(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2-normalised image (B, D) and text (B, D) features and the clamped scale exp(logit_scale)."""
        out = self.run_model(images, tokens)
        if isinstance(out, dict):
            img, txt, scale = out["image_features"], out["text_features"], out["logit_scale"]
        else:
            img, txt, scale = out[0], out[1], out[2]
        # forward returns open_clip's unclamped exp(logit_scale); DiffCLIP's cap is its config's logit_scale_max
        cap = min(float(getattr(getattr(self.model, "config", None), "logit_scale_max", 100.0)), 100.0)
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale.clamp(max=cap)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, tokens = batch
        img, txt, scale = self.features(images, tokens)
        loss = self.loss_fn(img, txt, scale)
        extra = {"train/logit_scale": float(scale.detach())} if self.should_log_now() else None
        self.log_step(loss, images.shape[0], "samples_per_s", extra)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        scale = self.model.logit_scale
        if scale.numel() == 1:  # open_clip clamps the parameter after every optimizer step (FSDP: the cap in
            with torch.no_grad():  # features() still holds when the parameter is a sharded view)
                scale.clamp_(0, MAX_LOGIT_SCALE)

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        images, tokens = batch
        img, txt, scale = self.features(images, tokens)
        logits = scale * img @ txt.T  # (B, B) within this rank's batch
        labels = torch.arange(img.shape[0], device=img.device)
        loss = 0.5 * (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels))
        i2t = (logits.argmax(1) == labels).float().mean()
        t2i = (logits.argmax(0) == labels).float().mean()
        bs = img.shape[0]
        self.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, batch_size=bs, prog_bar=stage == "val")
        self.log(f"{stage}/i2t_top1", i2t, on_epoch=True, sync_dist=True, batch_size=bs)
        self.log(f"{stage}/t2i_top1", t2i, on_epoch=True, sync_dist=True, batch_size=bs)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test")

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Normalised image and text features of a batch (written by the prediction writer)."""
        images, tokens = batch
        img, txt, scale = self.features(images, tokens)
        return {"image_features": img.float().cpu(), "text_features": txt.float().cpu(),
                "similarity": (img @ txt.T).float().cpu()}

    def on_validation_epoch_end(self) -> None:
        if self.zeroshot is None or self.trainer.sanity_checking or self.sharded():
            return  # sharded parameters: the unwrapped model cannot run alone
        results = self.zeroshot.run(self.model, epoch=self.current_epoch, rank=self.global_rank)
        if results:
            self.log_dict({f"zeroshot/{k}": float(v) for k, v in results.items()}, sync_dist=False, rank_zero_only=True)
