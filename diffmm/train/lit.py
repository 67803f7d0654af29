"""LiT training (Zhai et al., arXiv 2111.07991): :class:`LiTModule` is a :class:`~diffmm.train.CLIPModule` that locks
(freezes) a tower's encoder, optionally leaves parts of it trainable, gives a tower's encoder its own lr, and computes
what a locked tower does the same way every step once per caption or image (feature caches)."""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.hub.factory import model_kind
from diffmm.models.weight_refs import (WEIGHT_REFS_KEY, pretrained_source, restore_weights, tensor_bytes,
                                       weight_reference, weights_digest)
from diffmm.train.clip_module import CLIPModule

log = logging.getLogger("diffmm.train")

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
    device = visual.cls_token.device
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    parts = [("patch_embed", visual.patch_embed), ("norm_pre", visual.norm_pre),
             *((f"blocks.{i}", b) for i, b in enumerate(visual.blocks[:start]))]
    tensors = {"cls_token": visual.cls_token, "pos_embed": visual.pos_embed}
    tensors.update({f"{name}.{k}": t for name, module in parts
                    for k, t in (*module.named_parameters(), *module.named_buffers())})
    described = f"{device}|{autocast}|" + "|".join(f"{name}={module!r}" for name, module in parts)
    return hashlib.blake2b((described + weights_digest(tensors)).encode(), digest_size=16).digest()


class LiTModule(CLIPModule):
    """A :class:`~diffmm.train.CLIPModule` with locked towers and feature caches; every other argument is
    ``CLIPModule``'s (``model_name``, ``pretrained``, ``lr``, ``zeroshot``, ...).

    Args:
        lock_text / lock_image: the tower's encoder is frozen and kept in eval mode (no dropout); its projection to
            the joint space still trains.
        lock_text_unlocked / lock_image_unlocked: parameter-name fragments of a locked tower that still train
            (partial unlocking), e.g. ``[lambda_, LayerNorm]`` for the lambdas and norms of an upcycled MiniLM.
        cache_text_features: with a locked Hugging Face text tower, compute what its locked layers give each caption
            once and reuse it (kept in memory for up to ``cache_text_max`` distinct captions): the pooled features
            when nothing of it trains, else the hidden states entering its first unlocked layer.
        text_lr: peak lr of the text tower's encoder (its projection keeps ``lr``).
        cache_image_features: with a locked diffmm image tower (DiffCLIP), compute the tokens entering its first
            block with trainable parameters once per distinct image and reuse them (up to ``cache_image_max``
            images, kept in memory for the process and shared by modules with the same locked weights:
            :data:`SHARED_IMAGE_CACHES`, :func:`clear_image_caches`; an image is its preprocessed pixels, so this
            pays only with a deterministic train transform: ``data.crop_scale: [1.0, 1.0]``).
        image_lr: peak lr of the image tower's encoder (its projection keeps ``lr``).
        param_lr: parameter-name prefixes or glob patterns of the model with their own peak lr, taking precedence over
            ``text_lr`` / ``image_lr`` (e.g. ``{"*.lambda_*": 1e-2, "*.norm_gate": 1e-2}`` lets the lambdas and norm
            gates of upcycled blocks move while the blocks train at ``image_lr``).
        save_locked: save the locked weights in checkpoints. ``False``: a locked tower that the model's config takes
            from a pretrained source (``text_cfg.hf_model_name``, ``vision_cfg.pretrained``; the model built from
            ``model_name`` without ``pretrained``, ``swap`` or ``model``) is named in checkpoints by its source and a
            SHA-256 of its weights (:mod:`diffmm.models.weight_refs`), and only what trained is saved; resuming
            rebuilds it from the source and checks the hash.
        kwargs: :class:`~diffmm.train.CLIPModule`'s arguments.
    """

    def __init__(self, *, lock_text: bool = False, lock_text_unlocked: Optional[list[str]] = None,
                 lock_image: bool = False, lock_image_unlocked: Optional[list[str]] = None,
                 cache_text_features: bool = False, cache_text_max: int = 1_000_000, text_lr: Optional[float] = None,
                 cache_image_features: bool = False, cache_image_max: int = 50_000, image_lr: Optional[float] = None,
                 param_lr: Optional[dict[str, float]] = None,
                 save_locked: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # saves these arguments with CLIPModule's as hyper-parameters
        model = self.model
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
        #: the locked weights checkpoints name instead of storing: source -> state-dict names of ``self.model``
        self.referenced: dict[str, list[str]] = {}
        hp = self.hparams
        if not save_locked and kwargs.get("model") is None and not hp.pretrained and not hp.swap \
                and model_kind(hp.model_name) == "config":
            for tower in self.locked:
                source, prefixes = pretrained_source(model, tower), tuple(tower_prefixes(model, tower))
                names = [n for n, p in model.named_parameters() if n.startswith(prefixes) and not p.requires_grad]
                if source and names:
                    self.referenced[source] = names
        if not save_locked and not self.referenced:
            log.warning("model.save_locked false: no locked tower of this model comes from a pretrained source "
                        "named in its config; checkpoints hold every weight")

    def train(self, mode: bool = True) -> "LiTModule":
        """Train mode, except the locked towers' encoders (they stay in eval mode)."""
        super().train(mode)
        for tower in self.locked:
            for module in tower_modules(self.model, tower):
                module.eval()
        return self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """CLIPModule's checkpoint; the locked weights of :attr:`referenced` replaced by their references."""
        super().on_save_checkpoint(checkpoint)
        sd, refs = checkpoint["state_dict"], []
        for source, names in self.referenced.items():
            keys = ["model." + n for n in names]
            if all(k in sd for k in keys):  # (a strategy that saves other keys keeps every weight)
                refs.append(weight_reference({n: sd[k] for n, k in zip(names, keys)}, source))
                for k in keys:
                    del sd[k]
        if refs:
            checkpoint[WEIGHT_REFS_KEY] = refs

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put the weights a checkpoint names back from this module's model (built from their sources)."""
        restore_weights(checkpoint["state_dict"], checkpoint.get(WEIGHT_REFS_KEY), self.model.state_dict(),
                        prefix="model.")

    def param_lrs(self) -> dict[str, float]:
        lrs = {k: float(v) for k, v in (self.hparams.param_lr or {}).items()}
        for tower, lr in (("text", self.hparams.text_lr), ("visual", self.hparams.image_lr)):
            if lr is not None:
                lrs.update({p: lr for p in tower_prefixes(self.model, tower)})
        return lrs

    # ----- features -----------------------------------------------------------------------------
    def features(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :meth:`CLIPModule.features`, through the feature caches where they are on."""
        if self._text_cache is None and self._image_cache is None:
            return super().features(images, tokens)
        img = self.cached_image_features(images) if self._image_cache is not None else self.model.encode_image(images)
        txt = self.cached_text_features(tokens) if self._text_cache is not None else self.model.encode_text(tokens)
        value = getattr(self.model, "logit_scale_value", None)  # DiffCLIP: clamped at its logit_scale_max
        scale = value() if value is not None else self.model.logit_scale.exp()
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale.clamp(max=100.0)

    def cached_text_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Projected text features (B, D) of a locked text tower, whose frozen part runs once per caption: the pooled
        features when nothing of it trains, else the hidden states before the first layer with trainable parameters
        (the layers from there on run every step)."""
        text, start = self.model.text, self._cache_layers
        pooled_only = start == len(text.transformer.encoder.layer)

        def locked_part(rows: list[int]) -> Any:
            if pooled_only:
                return text.forward_features(tokens[rows])  # (n, W)
            hidden, mask = text.prefix(tokens[rows], start)  # (n, L', W), (n, L')
            return [h[m] for h, m in zip(hidden, mask)]  # (tokens, W) each

        keys = [row.tobytes() for row in tokens.cpu().numpy()]
        rows = cached(self._text_cache, keys, locked_part, self.hparams.cache_text_max)
        if pooled_only:
            return text.proj(torch.stack(rows))
        lengths = torch.tensor([len(r) for r in rows], device=rows[0].device)
        mask = torch.arange(int(lengths.max()), device=lengths.device)[None, :] < lengths[:, None]  # (B, L')
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
        keys = [hashlib.blake2b(tensor_bytes(row), digest_size=16).digest() for row in images.detach().cpu()]
        hidden = cached(self._image_cache, keys, lambda rows: visual.prefix(images[rows], start),
                        self.hparams.cache_image_max)  # (1 + P, W) each
        return visual.suffix(torch.stack(hidden), start) @ self.model.image_projection


def cached(cache: dict[bytes, torch.Tensor], keys: list[bytes], compute: Any, limit: int) -> list[torch.Tensor]:
    """The value of each key: from ``cache``, or ``compute(rows)`` (without gradients) on the first row of each key
    not cached (duplicates run once), stored while the cache stays within ``limit`` entries."""
    new: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        if k not in cache:
            new.setdefault(k, i)
    found: dict[bytes, torch.Tensor] = {}
    if new:
        with torch.no_grad():
            found = dict(zip(new, compute(list(new.values()))))
        if len(cache) + len(found) <= limit:
            cache.update(found)
    return [found[k] if k in found else cache[k] for k in keys]


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
