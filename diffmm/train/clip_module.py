"""LightningModule for contrastive image-text training of (Diff)CLIP models, with optional zero-shot
classification during validation."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
from typing import Any, Iterator, Optional

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

# The checkpoint a run is about to resume from, while diffmm's CLI builds its classes (``resuming_from``): that
# checkpoint holds every weight, so a ``pretrained`` file that is gone by then is not needed.
_RESUME_CHECKPOINT: Optional[str] = None


@contextlib.contextmanager
def resuming_from(ckpt_path: Optional[str]) -> Iterator[None]:
    """Within this context ``CLIPModule`` skips a ``pretrained`` file that no longer exists, with a warning: the
    run resumes from ``ckpt_path``, whose weights replace the pretrained ones anyway. The hyperparameters keep the
    path, so the checkpoint still says where the run started from."""
    global _RESUME_CHECKPOINT
    previous, _RESUME_CHECKPOINT = _RESUME_CHECKPOINT, ckpt_path
    try:
        yield
    finally:
        _RESUME_CHECKPOINT = previous


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


#: ``cache_image_features``' caches, one per locked image-tower prefix (:func:`prefix_fingerprint`): modules of one
#: process with the same locked weights share it (the demo's runs compute DINOv2's locked blocks once)
SHARED_IMAGE_CACHES: dict[bytes, dict[bytes, torch.Tensor]] = {}


def clear_image_caches() -> None:
    """Free the memory of every ``cache_image_features`` cache of this process."""
    SHARED_IMAGE_CACHES.clear()


def prefix_fingerprint(visual: nn.Module, start: int) -> bytes:
    """A digest of what the tokens entering block ``start`` of a diffmm image tower depend on: the modules before it
    (their ``repr``: types, sizes, eps), their parameters and buffers (names, shapes, dtypes, bytes), the device
    and the autocast state the tokens are computed under."""
    h = hashlib.blake2b(digest_size=16)
    device = visual.cls_token.device
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    h.update(f"{device}|{autocast}".encode())
    parts = [("patch_embed", visual.patch_embed), ("norm_pre", visual.norm_pre),
             *((f"blocks.{i}", b) for i, b in enumerate(visual.blocks[:start]))]
    tensors = [("cls_token", visual.cls_token), ("pos_embed", visual.pos_embed)]
    for name, module in parts:
        h.update(f"{name}={module!r}".encode())
        tensors += [(f"{name}.{k}", t) for k, t in (*module.named_parameters(), *module.named_buffers())]
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


#: open_clip's clamp of the learnable temperature: exp(logit_scale) <= 100
MAX_LOGIT_SCALE = math.log(100.0)


class CLIPModule(TrainModule):
    """Trains a CLIP-style model (``encode_image``, ``encode_text``, ``logit_scale``) on (images, tokens) batches.

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
        lock_text / lock_image: LiT-style locking (arXiv 2111.07991): the tower's encoder is frozen and kept in
            eval mode (no dropout); its projection to the joint space still trains.
        lock_text_unlocked / lock_image_unlocked: parameter-name fragments of a locked tower that still train
            (partial unlocking), e.g. ``[lambda_, LayerNorm]`` for the lambdas and norms of an upcycled MiniLM.
        cache_text_features: with a locked Hugging Face text tower and nothing of it unlocked, compute each
            caption's pooled features once and reuse them (kept in memory for up to ``cache_text_max`` distinct
            captions), so training costs only the image tower and the projections.
        text_lr: peak lr of the text tower's encoder (its projection keeps ``lr``), e.g. a small lr for a
            pretrained text tower that is fine-tuned while a fresh image tower trains at ``lr``.
        cache_image_features: with a locked diffmm image tower (DiffCLIP), compute the tokens entering its first
            block with trainable parameters once per distinct image and reuse them (up to ``cache_image_max``
            images, kept in memory for the process and shared by modules with the same locked weights:
            :data:`SHARED_IMAGE_CACHES`, :func:`clear_image_caches`; an image is its preprocessed pixels, so this
            pays only with a deterministic train transform: ``data.crop_scale: [1.0, 1.0]``).
        image_lr: peak lr of the image tower's encoder (its projection keeps ``lr``).
    """

    def __init__(self, model_name: str = "DiffCLIP-Tiny", model_kwargs: Optional[dict] = None,
                 pretrained: Optional[str] = None, model: Optional[nn.Module] = None, *,
                 swap: Optional[dict[str, Any]] = None, trust_pickle: bool = False,
                 local_loss: bool = False, gather_with_grad: bool = True,
                 lr: float = 5e-4, min_lr: float = 1e-5, weight_decay: float = 0.5,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 warmup_steps: int = 0, warmup_epochs: Optional[float] = None, total_steps: Optional[int] = None,
                 grad_checkpointing: bool = False, compile: bool = False, log_lambdas: bool = True,
                 no_decay: Optional[list[str]] = None, zeroshot: Optional[dict[str, Any]] = None,
                 lock_text: bool = False, lock_text_unlocked: Optional[list[str]] = None, lock_image: bool = False,
                 lock_image_unlocked: Optional[list[str]] = None, cache_text_features: bool = False,
                 cache_text_max: int = 1_000_000, text_lr: Optional[float] = None,
                 cache_image_features: bool = False, cache_image_max: int = 50_000,
                 image_lr: Optional[float] = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        if pretrained and _RESUME_CHECKPOINT and not os.path.exists(os.path.expanduser(pretrained)):
            log.warning("model.pretrained %s is not there; it is not read: the run resumes from %s, which holds "
                        "every weight", pretrained, _RESUME_CHECKPOINT)
            pretrained = None
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
        self.locked: dict[str, list[str]] = {}
        for tower, on, unlocked in (("text", lock_text, lock_text_unlocked),
                                    ("visual", lock_image, lock_image_unlocked)):
            if on:
                self.locked[tower] = lock_tower(model, tower, unlocked or [])
        self._text_cache: Optional[dict[bytes, torch.Tensor]] = None
        if cache_text_features:
            if not lock_text or not hasattr(getattr(model, "text", None), "prefix"):
                raise ValueError("model.cache_text_features needs lock_text: true and a Hugging Face text tower "
                                 "(text_cfg.hf_model_name)")
            self._text_cache, self._cache_layers = {}, cached_layers(model, self.locked["text"])
        self._image_cache: Optional[dict[bytes, torch.Tensor]] = None
        if cache_image_features:
            if not lock_image or not hasattr(getattr(model, "visual", None), "prefix"):
                raise ValueError("model.cache_image_features needs lock_image: true and a diffmm image tower "
                                 "(a DiffCLIP model: diffmm.list_models())")
            # bound to its shared cache at the first batch, once the weights it depends on are final
            self._image_cache, self._image_start = {}, cached_blocks(model, self.locked["visual"])
            self._image_cache_bound = False
        self.setup_model(model)
        self.loss_fn = ContrastiveLoss(local_loss=local_loss, gather_with_grad=gather_with_grad)
        self.zeroshot = ZeroShotHook(**zeroshot) if zeroshot else None

    def train(self, mode: bool = True) -> "CLIPModule":
        """Train mode, except the locked towers' encoders (they stay in eval mode)."""
        super().train(mode)
        for tower in self.locked:
            for module in tower_modules(self.model, tower):
                module.eval()
        return self

    def param_lrs(self) -> dict[str, float]:
        lrs = {}
        for tower, lr in (("text", self.hparams.get("text_lr")), ("visual", self.hparams.get("image_lr"))):
            if lr is not None:
                lrs.update({p: lr for p in tower_prefixes(self.model, tower)})
        return lrs

    # ----- steps --------------------------------------------------------------------------------
    def cached_text_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Projected text features (B, D) of a locked text tower, whose frozen part runs once per caption: the pooled
        features when nothing of it trains, else the hidden states before the first layer with trainable parameters
        (the layers from there on run every step)."""
        cache, text, start = self._text_cache, self.model.text, self._cache_layers
        pooled_only = start == len(text.transformer.encoder.layer)
        keys = [row.tobytes() for row in tokens.cpu().numpy()]
        new: dict[bytes, int] = {}  # caption -> its first row, for captions not cached (duplicates run once)
        for i, k in enumerate(keys):
            if k not in cache:
                new.setdefault(k, i)
        found: dict[bytes, torch.Tensor] = {}
        if new:
            rows_new = tokens[list(new.values())]
            with torch.no_grad():
                if pooled_only:
                    found = dict(zip(new, text.forward_features(rows_new)))  # (W,) each
                else:
                    hidden, mask = text.prefix(rows_new, start)  # (n, L', W), (n, L')
                    found = {k: h[m] for k, h, m in zip(new, hidden, mask)}  # (tokens, W) each
            if len(cache) + len(found) <= self.hparams.cache_text_max:
                cache.update(found)
        rows = [found[k] if k in found else cache[k] for k in keys]
        if pooled_only:
            return text.proj(torch.stack(rows))
        mask = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.bool, device=rows[0].device)
        for i, r in enumerate(rows):
            mask[i, :len(r)] = True
        hidden = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (B, L', W)
        return text.proj(text.suffix(hidden, mask, start))

    def cached_image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Projected image features (B, D) of a locked diffmm image tower whose blocks before ``_image_start`` run
        once per distinct image (keyed by its preprocessed pixels); the blocks from there on run every step."""
        visual, start = self.model.visual, self._image_start
        images = images.to(visual.patch_embed.proj.weight.dtype)  # as encode_image does
        if not self._image_cache_bound:
            self._image_cache = SHARED_IMAGE_CACHES.setdefault(prefix_fingerprint(visual, start), {})
            self._image_cache_bound = True
        cache = self._image_cache
        keys = [hashlib.blake2b(row.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
                for row in images.detach().cpu().contiguous()]  # bytes of any dtype (bf16 has no numpy type)
        new: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            if k not in cache:
                new.setdefault(k, i)
        found: dict[bytes, torch.Tensor] = {}
        if new:
            with torch.no_grad():
                found = dict(zip(new, visual.prefix(images[list(new.values())], start)))  # (1 + P, W) each
            if len(cache) + len(found) <= self.hparams.cache_image_max:
                cache.update(found)
        hidden = torch.stack([found[k] if k in found else cache[k] for k in keys])  # (B, 1 + P, W)
        return visual.suffix(hidden, start) @ self.model.image_projection

    def features(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2-normalised image (B, D) and text (B, D) features and the clamped scale exp(logit_scale)."""
        if self._text_cache is not None or self._image_cache is not None:
            img = (self.cached_image_features(images) if self._image_cache is not None
                   else self.model.encode_image(images))
            txt = self.cached_text_features(tokens) if self._text_cache is not None else self.model.encode_text(tokens)
            value = getattr(self.model, "logit_scale_value", None)  # DiffCLIP: clamped at its logit_scale_max
            scale = value() if value is not None else self.model.logit_scale.exp()
            return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale.clamp(max=100.0)
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


#: the projections that stay trainable when their tower is locked (DiffCLIP, open_clip CLIP, Hugging Face towers)
PROJECTIONS = ("image_projection", "visual.proj", "text_projection", "text.proj", "text.text_projection")


def tower_prefixes(model: nn.Module, tower: str) -> list[str]:
    """Parameter-name prefixes of a tower's encoder (``'text'`` or ``'visual'``), projections excluded."""
    if tower == "visual":
        return ["visual."]
    if isinstance(getattr(model, "text", None), nn.Module):  # Hugging Face tower (DiffCLIP, open_clip CustomTextCLIP)
        inner = getattr(model.text, "transformer", None)
        return ["text.transformer."] if inner is not None else ["text."]
    return ["token_embedding.", "positional_embedding", "transformer.", "ln_final."]


def tower_modules(model: nn.Module, tower: str) -> list[nn.Module]:
    """The modules under a tower's encoder prefixes."""
    prefixes = tower_prefixes(model, tower)
    return [m for name, m in model.named_modules() if name and any((name + ".").startswith(p) for p in prefixes)]


def cached_layers(model: nn.Module, trainable: list[str]) -> int:
    """How many leading encoder layers of a locked Hugging Face text tower never change (all of them when nothing
    of it trains): what ``cache_text_features`` may compute once per caption. Trainable embeddings (or anything
    outside the layers) leave nothing to cache: a one-line error."""
    n = len(model.text.transformer.encoder.layer)
    first = n
    for name in trainable:
        head = "text.transformer.encoder.layer."
        if not name.startswith(head):
            raise ValueError(f"model.cache_text_features: {name} trains, so no part of the text tower is fixed; "
                             f"unlock only whole encoder layers from some layer on (or drop cache_text_features)")
        first = min(first, int(name[len(head):].split(".")[0]))
    return first


def cached_blocks(model: nn.Module, trainable: list[str]) -> int:
    """How many leading blocks of a locked diffmm image tower never change (all of them when nothing of it trains):
    what ``cache_image_features`` may compute once per image. Trainable embeddings (patches, positions, CLS) leave
    nothing to cache: a one-line error."""
    first = len(model.visual.blocks)
    for name in trainable:
        head = "visual.blocks."
        if name.startswith(head):
            first = min(first, int(name[len(head):].split(".")[0]))
        elif not name.startswith("visual.norm."):  # the final norm comes after the blocks
            raise ValueError(f"model.cache_image_features: {name} trains, so no part of the image tower is fixed; "
                             f"unlock only whole blocks from some block on and the final norm (or drop "
                             f"cache_image_features)")
    return first


def lock_tower(model: nn.Module, tower: str, unlocked: list[str]) -> list[str]:
    """Freeze a tower's encoder except parameters whose names contain a fragment of ``unlocked``; returns the
    names left trainable. A fragment that matches nothing is an error (a typo would silently freeze them)."""
    prefixes, trainable = tower_prefixes(model, tower), []
    seen = {f: False for f in unlocked}
    for name, p in model.named_parameters():
        if not any(name.startswith(x) for x in prefixes) or name.startswith(PROJECTIONS):
            continue
        hits = [f for f in unlocked if f in name]
        for f in hits:
            seen[f] = True
        p.requires_grad_(bool(hits))
        if hits:
            trainable.append(name)
    missing = [f for f, hit in seen.items() if not hit]
    if missing:
        raise ValueError(f"model.lock_{'image' if tower == 'visual' else 'text'}_unlocked: {', '.join(missing)} "
                         f"names no parameter of the {tower} tower")
    log.info("locked the %s tower: %d parameter tensors train (%s)", tower, len(trainable),
             ", ".join(trainable[:4]) + (" ..." if len(trainable) > 4 else ""))
    return trainable
