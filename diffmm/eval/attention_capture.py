"""Record what attention layers compute, without editing the model: hooks capture q and k, maps are recomputed.

    with AttentionRecorder(model) as rec:
        model(idx)
    for r in rec.records:            # one per attention call, in call order
        r.logits()                   # (B, Hq, N, S) raw scores q.k * scale of every query map
        r.maps()                     # (B, h, N, S) what mixes the values: A, or A1 - lambda*A2 for DIFF

Supported layers: every diffmm attention layer (:class:`diffmm.nn.AttentionLayer`: a pre-hook translates the
call to the native one with ``native_args``, the layer's ``capture`` gives its query/key maps and lambda), torch
``nn.MultiheadAttention`` (open_clip's default blocks), open_clip's ``Attention``, timm's
``Attention`` and ``DiffAttention`` (pre-hooks; q/k recomputed from the layer's weights).
Calls that use a KV cache are not recorded.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffmm.nn import AttentionLayer

log = logging.getLogger("diffmm.eval")


@dataclass
class AttentionRecord:
    """One attention call: query maps ``q`` (B, Hq, N, d) and key heads ``k`` (B, Hk, S, d), fp32, RoPE applied.

    Attributes:
        kind: ``standard`` (Hq = heads), ``diff`` (Hq = 2h components, maps 2i, 2i+1 form head i) or
            ``diff_v2`` (same pairing, per-token lambda).
        kv_index: (Hq,) key head used by each query map.
        mask: additive mask broadcastable to (B, Hq, N, S): -inf where masked, else a finite bias; None = none.
        lam: ``diff``: 0-d lambda; ``diff_v2``: (B, N, h) sigmoid(lambda logits).
    """

    name: str
    kind: str
    q: torch.Tensor
    k: torch.Tensor
    scale: float
    kv_index: torch.Tensor
    mask: Optional[torch.Tensor] = None
    lam: Optional[torch.Tensor] = None

    @property
    def num_heads(self) -> int:
        """Heads whose maps :meth:`maps` returns (differential heads for DIFF layers)."""
        return self.q.shape[1] // (1 if self.kind == "standard" else 2)

    def logits(self) -> torch.Tensor:
        """Raw scores (B, Hq, N, S) = q.k * scale (+ the finite bias of the mask); masked entries not removed."""
        s = self.q @ self.k[:, self.kv_index].transpose(-1, -2) * self.scale
        return s if self.mask is None else s + torch.where(torch.isfinite(self.mask), self.mask, 0.0)

    def valid(self) -> torch.Tensor:
        """Bool (B, Hq, N, S): entries that take part in the softmax."""
        shape = (*self.q.shape[:3], self.k.shape[2])
        if self.mask is None:
            return torch.ones(shape, dtype=torch.bool, device=self.q.device)
        return torch.isfinite(self.mask).expand(shape)

    def probs(self) -> torch.Tensor:
        """Softmax of every query map (B, Hq, N, S); fully masked rows are 0."""
        s = self.q @ self.k[:, self.kv_index].transpose(-1, -2) * self.scale
        return torch.nan_to_num(torch.softmax(s if self.mask is None else s + self.mask, dim=-1), nan=0.0)

    def select_queries(self, rows: torch.Tensor | slice) -> "AttentionRecord":
        """The same record restricted to some query positions (e.g. ``slice(-1, None)`` for the last one)."""
        mask = self.mask if self.mask is None or self.mask.shape[2] == 1 else self.mask[:, :, rows]
        lam = self.lam[:, rows] if self.kind == "diff_v2" else self.lam
        return AttentionRecord(self.name, self.kind, self.q[:, :, rows], self.k, self.scale, self.kv_index, mask, lam)

    def maps(self) -> torch.Tensor:
        """Effective attention per head (B, h, N, S): A, A1 - lambda*A2, or A1 - sigmoid(lambda_t)*A2 (V2)."""
        p = self.probs()
        if self.kind == "standard":
            return p
        p1, p2 = p[:, 0::2], p[:, 1::2]
        if self.kind == "diff":
            return p1 - self.lam * p2
        return p1 - self.lam.permute(0, 2, 1)[..., None] * p2  # lam (B, N, h) -> (B, h, N, 1)


# --------------------------------------------------------------------------------- masks
def _additive(mask: Optional[torch.Tensor], *, true_means_masked: bool,
              key_padding: bool = False) -> Optional[torch.Tensor]:
    """A mask as a 4-D additive float mask broadcastable to (B, H, N, S): -inf where masked.

    ``mask``: bool (True = attend, or True = masked when ``true_means_masked``) or additive float (-inf = masked);
    a key-padding mask is (B, S), other masks (N, S), (B, N, S) or (B, H, N, S).
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        masked = mask if true_means_masked else ~mask
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(masked, float("-inf"))
    if key_padding:
        return mask[:, None, None, :].float()
    return (mask[:, None] if mask.dim() == 3 else mask.reshape((1,) * (4 - mask.dim()) + mask.shape)).float()


def _causal(N: int, S: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask (1, 1, N, S) as an additive mask (diffmm's convention)."""
    allowed = torch.ones(N, S, dtype=torch.bool, device=device).tril(S - N)
    return _additive(allowed, true_means_masked=False)


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sum of two additive masks, either of which may be None."""
    if a is None:
        return b
    return a if b is None else a + b


def _fp(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached in the dtype the maps are recomputed in: float64 stays, everything else becomes float32."""
    return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32)


# ------------------------------------------------------------------------------ recorder
class AttentionRecorder:
    """Context manager that records every supported attention call of ``model``.

    Args:
        model: any ``nn.Module``.
        include: keep only layers whose qualified name passes this filter (e.g. ``lambda n: n.startswith("visual")``).
        on_record: called with each :class:`AttentionRecord` instead of storing it (streaming statistics).
    """

    def __init__(self, model: nn.Module, include: Callable[[str], bool] | None = None,
                 on_record: Callable[[AttentionRecord], None] | None = None) -> None:
        self.model, self.include = model, include
        self.records: list[AttentionRecord] = []
        self._emit = on_record if on_record is not None else self.records.append
        self.layers: list[tuple[str, nn.Module, str]] = []
        self._handles: list[Any] = []
        self._skipped_cache = False

    @staticmethod
    def layer_kind(m: nn.Module) -> Optional[str]:
        """Which hooks handle ``m``: ``diffmm`` (any :class:`diffmm.nn.AttentionLayer`, swapped ones included),
        ``torch_mha``, ``open_clip``, ``timm`` or ``timm_diff``; None = not an attention layer we know."""
        mod = type(m).__module__
        if isinstance(m, AttentionLayer):
            return "diffmm"
        if isinstance(m, nn.MultiheadAttention):
            return "torch_mha"
        if type(m).__name__ == "Attention" and mod.startswith("open_clip") and hasattr(m, "in_proj_weight"):
            return "open_clip"
        if mod.startswith("timm") and hasattr(m, "qkv") and hasattr(m, "num_heads"):
            return "timm_diff" if hasattr(m, "_compute_lambda") else "timm"
        return None

    def __enter__(self) -> "AttentionRecorder":
        hooks = {"diffmm": self._hook_diffmm, "torch_mha": self._hook_torch_mha, "open_clip": self._hook_fused_qkv,
                 "timm": self._hook_fused_qkv, "timm_diff": self._hook_fused_qkv}
        inside: list[str] = []
        for name, m in self.model.named_modules():
            kind = self.layer_kind(m)
            if kind is None or any(name.startswith(p + ".") for p in inside):
                continue
            inside.append(name)
            if self.include is None or self.include(name):
                self.layers.append((name, m, kind))
                hooks[kind](name, m, kind)
        if not self.layers:
            log.warning("AttentionRecorder: no supported attention layer found in the model")
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- diffmm layers (in any call convention): the call translated to the native one, maps from the layer
    def _hook_diffmm(self, name: str, m: AttentionLayer, kind: str) -> None:
        def pre(mod, args, kwargs):
            call = mod.native_args(*args, **kwargs)
            if call.get("kv_cache") is not None:
                if not self._skipped_cache:
                    log.warning("AttentionRecorder: calls with a KV cache are not recorded")
                    self._skipped_cache = True
                return
            with torch.no_grad():
                self._emit(self._diffmm_record(name, mod, call))

        self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))

    @staticmethod
    def _diffmm_record(name: str, m: AttentionLayer, call: dict) -> AttentionRecord:
        x = call["x"]
        N = x.shape[1]
        qk = m.capture(x, call.get("rope"))
        q, k = _fp(qk.q).transpose(1, 2), _fp(qk.k).transpose(1, 2)  # (B, Hq, N, d), (B, Hk, S, d)
        causal = m.causal if call.get("causal") is None else call["causal"]
        am = call.get("attn_mask")
        mask = _additive(am, true_means_masked=False, key_padding=am is not None and am.dtype == torch.bool)
        Hq, h = q.shape[1], m.num_heads
        if Hq != h and h > 1 and mask is not None and mask.shape[1] == h:
            mask = mask.repeat_interleave(Hq // h, dim=1)  # a per-head mask applies to every query map of the head
        if causal:
            mask = _add(mask, _causal(N, k.shape[2], q.device))
        lam = None if qk.lam is None else _fp(qk.lam)
        return AttentionRecord(name, m.capture_kind, q, k, m.head_dim ** -0.5, qk.kv_index.to(q.device), mask, lam)

    # ---- torch nn.MultiheadAttention (self- or cross-attention): q/k recomputed from the layer's weights
    def _hook_torch_mha(self, name: str, m: nn.MultiheadAttention, kind: str) -> None:
        def pre(mod, args, kwargs):
            names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
            a = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
            query, key = a["query"], a["key"] if a["key"] is not None else a["query"]
            if not mod.batch_first:
                query, key = query.transpose(0, 1), key.transpose(0, 1)
            E, H = mod.embed_dim, mod.num_heads
            if mod.in_proj_weight is not None:
                wq, wk = mod.in_proj_weight[:E], mod.in_proj_weight[E:2 * E]
            else:
                wq, wk = mod.q_proj_weight, mod.k_proj_weight
            bq, bk = (mod.in_proj_bias[:E], mod.in_proj_bias[E:2 * E]) if mod.in_proj_bias is not None else (None, None)
            B, N, S, d = query.shape[0], query.shape[1], key.shape[1], E // H
            q = _fp(F.linear(query, wq, bq)).view(B, N, H, d).transpose(1, 2)
            k = _fp(F.linear(key, wk, bk)).view(B, S, H, d).transpose(1, 2)
            am = a["attn_mask"]
            if am is not None and am.dim() == 3:  # (B*H, N, S) in torch's convention
                am = am.reshape(B, H, N, S)
            mask = _add(_additive(am, true_means_masked=True),
                        _additive(a["key_padding_mask"], true_means_masked=True, key_padding=True))
            if kwargs.get("is_causal") and am is None:
                mask = _add(mask, _causal(N, S, q.device))
            self._emit(AttentionRecord(name, "standard", q, k, d ** -0.5, torch.arange(H, device=q.device), mask))

        self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))

    # ---- open_clip's own Attention, timm's Attention / DiffAttention: q/k recomputed from the fused qkv weights
    def _hook_fused_qkv(self, name: str, m: nn.Module, kind: str) -> None:
        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs["x"]
            am = args[1] if len(args) > 1 else kwargs.get("attn_mask")
            B, N, _ = x.shape
            H = 2 * mod.num_heads if kind == "timm_diff" else mod.num_heads  # query/key maps
            if kind == "open_clip":
                if mod.logit_scale is not None:
                    raise NotImplementedError(f"{name}: scaled-cosine attention is not supported by AttentionRecorder")
                q, k, _ = F.linear(x, mod.in_proj_weight, mod.in_proj_bias).chunk(3, dim=-1)
                q_norm, k_norm = mod.ln_q, mod.ln_k
            else:
                q, k, _ = mod.qkv(x).chunk(3, dim=-1)
                q_norm, k_norm = mod.q_norm, mod.k_norm
            q = _fp(q_norm(q.reshape(B, N, H, mod.head_dim).transpose(1, 2)))  # (B, H, N, d)
            k = _fp(k_norm(k.reshape(B, N, H, mod.head_dim).transpose(1, 2)))
            mask = _additive(am, true_means_masked=kind == "open_clip")
            if kind != "open_clip" and (args[2] if len(args) > 2 else kwargs.get("is_causal", False)):
                mask = _add(mask, _causal(N, N, q.device))
            lam = _fp(mod._compute_lambda()) if kind == "timm_diff" else None
            self._emit(AttentionRecord(name, "diff" if kind == "timm_diff" else "standard", q, k, float(mod.scale),
                                       torch.arange(H, device=q.device), mask, lam))

        self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
