"""Record what attention layers compute, without editing the model: hooks capture q and k, maps are recomputed.

    with AttentionRecorder(model) as rec:
        model(idx)
    for r in rec.records:            # one per attention call, in call order
        r.logits()                   # (B, Hq, N, S) raw scores q.k * scale of every query map
        r.maps()                     # (B, h, N, S) what mixes the values: A, or A1 - lambda*A2 for DIFF

Supported layers: diffmm ``DiffAttention`` / ``Attention`` / ``DiffV2Attention`` (forward hooks on
``q_proj`` / ``k_proj`` plus a pre-hook for ``rope`` / ``attn_mask`` / ``causal``), torch
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

log = logging.getLogger("diffmm.eval")


@dataclass
class AttentionRecord:
    """One attention call: query maps ``q`` (B, Hq, N, d) and key heads ``k`` (B, Hk, S, d), fp32, RoPE applied.

    Attributes:
        kind: ``standard`` (Hq = heads), ``diff`` (Hq = 2h components, maps 2i, 2i+1 form head i) or
            ``diff_v2`` (same pairing, per-token lambda).
        kv_index: (Hq,) key head used by each query map.
        allowed: bool, broadcastable to (B, Hq, N, S); None = everything allowed.
        bias: finite additive mask, broadcastable; None = no bias.
        lam: ``diff``: 0-d lambda; ``diff_v2``: (B, N, h) sigmoid(lambda logits).
    """

    name: str
    kind: str
    q: torch.Tensor
    k: torch.Tensor
    scale: float
    kv_index: torch.Tensor
    allowed: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    lam: Optional[torch.Tensor] = None

    @property
    def num_heads(self) -> int:
        """Heads whose maps :meth:`maps` returns (differential heads for DIFF layers)."""
        return self.q.shape[1] // (1 if self.kind == "standard" else 2)

    def logits(self) -> torch.Tensor:
        """Raw scores (B, Hq, N, S) = q.k * scale (+ finite additive mask); masked entries not removed."""
        s = self.q @ self.k[:, self.kv_index].transpose(-1, -2) * self.scale
        return s + self.bias if self.bias is not None else s

    def valid(self) -> torch.Tensor:
        """Bool (B, Hq, N, S): entries that take part in the softmax."""
        B, Hq, N, _ = self.q.shape
        S = self.k.shape[2]
        if self.allowed is None:
            return torch.ones(B, Hq, N, S, dtype=torch.bool, device=self.q.device)
        return self.allowed.expand(B, Hq, N, S)

    def probs(self) -> torch.Tensor:
        """Softmax of every query map (B, Hq, N, S); fully masked rows are 0."""
        s = self.logits()
        if self.allowed is not None:
            s = s.masked_fill(~self.allowed, float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.nan_to_num(p, nan=0.0)

    def select_queries(self, rows: torch.Tensor | slice) -> "AttentionRecord":
        """The same record restricted to some query positions (e.g. ``slice(-1, None)`` for the last one)."""
        def rows_of(t):
            return t if t is None or t.shape[2] == 1 else t[:, :, rows]

        lam = self.lam[:, rows] if self.kind == "diff_v2" else self.lam
        return AttentionRecord(self.name, self.kind, self.q[:, :, rows], self.k, self.scale, self.kv_index,
                               rows_of(self.allowed), rows_of(self.bias), lam)

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
def _causal(N: int, S: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask (N, S), True = allowed (diffmm's convention)."""
    return torch.ones(N, S, dtype=torch.bool, device=device).tril(S - N)


def _mask_parts(mask: Optional[torch.Tensor], *, true_means_masked: bool, key_padding: bool = False
                ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(allowed bool, finite additive bias), both 4-D and broadcastable to (B, H, N, S).

    ``mask``: bool (True = attend, or True = masked when ``true_means_masked``) or additive float
    (-inf = masked); a key-padding mask is (B, S), other masks (N, S), (B, N, S) or (B, H, N, S).
    """
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        allowed, bias = (~mask if true_means_masked else mask), None
    else:
        m = mask.float()
        finite = torch.isfinite(m)
        allowed, bias = finite, torch.where(finite, m, torch.zeros_like(m))
        if not bool(bias.any()):
            bias = None
        if bool(finite.all()):
            allowed = None

    def to4(t):
        if t is None:
            return None
        if key_padding:
            return t[:, None, None, :]
        return {2: lambda: t[None, None], 3: lambda: t[:, None], 4: lambda: t}[t.dim()]()

    return to4(allowed), to4(bias)


def _and(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    return a if b is None else a & b


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
        self.model, self.include, self.on_record = model, include, on_record
        self.records: list[AttentionRecord] = []
        self.layers: list[tuple[str, nn.Module, str]] = []
        self._handles: list[Any] = []
        self._skipped_cache = False

    # ---- discovery
    @staticmethod
    def layer_kind(m: nn.Module) -> Optional[str]:
        """Which hook set handles ``m`` (None = not an attention layer we know)."""
        name = type(m).__name__
        mod = type(m).__module__
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "num_heads") and hasattr(m, "head_dim"):
            if hasattr(m, "lambda_proj"):
                return "diffmm_diff_v2"
            return "diffmm_diff" if hasattr(m, "lambda_full") else "diffmm_standard"
        if isinstance(m, nn.MultiheadAttention):
            return "torch_mha"
        if name == "Attention" and mod.startswith("open_clip") and hasattr(m, "in_proj_weight"):
            return "open_clip"
        if mod.startswith("timm") and hasattr(m, "qkv") and hasattr(m, "num_heads"):
            return "timm_diff" if hasattr(m, "_compute_lambda") else "timm"
        return None

    def __enter__(self) -> "AttentionRecorder":
        inside: list[str] = []
        for name, m in self.model.named_modules():
            kind = self.layer_kind(m)
            if kind is None or any(name.startswith(p + ".") for p in inside):
                continue
            inside.append(name)
            if self.include is not None and not self.include(name):
                continue
            self.layers.append((name, m, kind))
            getattr(self, f"_hook_{kind.split('_', 1)[0] if kind.startswith('diffmm') else kind}")(name, m, kind)
        if not self.layers:
            log.warning("AttentionRecorder: no supported attention layer found in the model")
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        self.records.clear()

    def _emit(self, rec: AttentionRecord) -> None:
        if self.on_record is not None:
            self.on_record(rec)
        else:
            self.records.append(rec)

    # ---- diffmm layers: hooks on q_proj / k_proj and on the layer
    def _hook_diffmm(self, name: str, m: nn.Module, kind: str) -> None:
        state: dict[str, Any] = {}

        def pre(mod, args, kwargs):
            state.clear()
            state["x"] = args[0] if args else kwargs["x"]
            state["kw"] = kwargs

        def grab(key):
            def hook(mod, args, out):
                state[key] = out
            return hook

        def post(mod, args, kwargs, out):
            kw = state.get("kw", {})
            if kw.get("kv_cache") is not None:
                if not self._skipped_cache:
                    log.warning("AttentionRecorder: calls with a KV cache are not recorded")
                    self._skipped_cache = True
                return
            self._emit(self._diffmm_record(name, mod, kind, state))

        self._handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                          m.q_proj.register_forward_hook(grab("q")), m.k_proj.register_forward_hook(grab("k")),
                          m.register_forward_hook(post, with_kwargs=True)]

    @staticmethod
    def _diffmm_record(name: str, m: nn.Module, kind: str, state: dict) -> AttentionRecord:
        from diffmm.nn.rope import apply_rope

        x, kw = state["x"], state["kw"]
        B, N, _ = x.shape
        qo, ko = state["q"].detach(), state["k"].detach()
        S = ko.shape[1]
        h, hk, d = m.num_heads, m.num_kv_heads, m.head_dim
        if kind == "diffmm_diff":
            q, k = qo.view(B, N, 2 * h, d), ko.view(B, S, 2 * hk, d)
            rep = h // hk
            kv_index = torch.tensor([2 * (c // 2 // rep) + c % 2 for c in range(2 * h)])
        elif kind == "diffmm_diff_v2":
            q, k = qo.view(B, N, 2 * h, d), ko.view(B, S, hk, d)
            kv_index = torch.arange(2 * h) // (2 * h // hk)
        else:
            q, k = qo.view(B, N, h, d), ko.view(B, S, hk, d)
            kv_index = torch.arange(h) // (h // hk)
        if getattr(m, "use_rope", False) and kw.get("rope") is not None:
            q, k = apply_rope(q, *kw["rope"]), apply_rope(k, *kw["rope"])
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        q, k = q.to(ct).transpose(1, 2), k.to(ct).transpose(1, 2)  # (B, H, N, d), (B, Hk, S, d)
        causal = kw.get("causal")
        causal = m.causal if causal is None else causal
        am = kw.get("attn_mask")
        allowed, bias = _mask_parts(am, true_means_masked=False, key_padding=am is not None and am.dtype == torch.bool)
        if kind != "diffmm_standard" and bias is not None and bias.shape[1] == h and h > 1:
            bias = bias.repeat_interleave(2, dim=1)  # per-head bias -> both query maps of the head
        if kind != "diffmm_standard" and allowed is not None and allowed.shape[1] == h and h > 1:
            allowed = allowed.repeat_interleave(2, dim=1)
        if causal:
            allowed = _and(allowed, _causal(N, S, q.device)[None, None])
        lam = None
        if kind == "diffmm_diff":
            lam = m.lambda_full().detach().to(ct)
        elif kind == "diffmm_diff_v2":
            lam = torch.sigmoid(m.lambda_logits(state["x"]).detach().to(ct))  # (B, N, h)
        return AttentionRecord(name, kind.split("_", 1)[1], q, k, d ** -0.5, kv_index.to(q.device), allowed, bias, lam)

    # ---- torch nn.MultiheadAttention (self- or cross-attention)
    def _hook_torch_mha(self, name: str, m: nn.MultiheadAttention, kind: str) -> None:
        def pre(mod, args, kwargs):
            names = ("query", "key", "value")
            vals = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
            query, key = vals["query"], vals["key"] if vals["key"] is not None else vals["query"]
            if not mod.batch_first:
                query, key = query.transpose(0, 1), key.transpose(0, 1)
            E, H = mod.embed_dim, mod.num_heads
            if mod.in_proj_weight is not None:
                wq, wk = mod.in_proj_weight[:E], mod.in_proj_weight[E:2 * E]
            else:
                wq, wk = mod.q_proj_weight, mod.k_proj_weight
            bq = bk = None
            if mod.in_proj_bias is not None:
                bq, bk = mod.in_proj_bias[:E], mod.in_proj_bias[E:2 * E]
            B, N, S, d = query.shape[0], query.shape[1], key.shape[1], E // H
            ct = torch.float64 if query.dtype == torch.float64 else torch.float32
            q = F.linear(query, wq, bq).detach().to(ct).view(B, N, H, d).transpose(1, 2)
            k = F.linear(key, wk, bk).detach().to(ct).view(B, S, H, d).transpose(1, 2)
            am = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
            if am is not None and am.dim() == 3:  # (B*H, N, S) in torch's convention
                am = am.reshape(B, H, N, S)
            allowed, bias = _mask_parts(am, true_means_masked=True)
            kpm = kwargs.get("key_padding_mask", args[3] if len(args) > 3 else None)
            if kpm is not None:
                a2, b2 = _mask_parts(kpm, true_means_masked=True, key_padding=True)
                allowed = _and(allowed, a2)
                bias = b2 if bias is None else (bias if b2 is None else bias + b2)
            if kwargs.get("is_causal") and am is None:
                allowed = _and(allowed, _causal(N, S, q.device)[None, None])
            self._emit(AttentionRecord(name, "standard", q, k, d ** -0.5, torch.arange(H, device=q.device),
                                       allowed, bias))

        self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))

    # ---- open_clip's own Attention
    def _hook_open_clip(self, name: str, m: nn.Module, kind: str) -> None:
        def pre(mod, args, kwargs):
            if mod.logit_scale is not None:
                raise NotImplementedError(f"{name}: scaled-cosine attention is not supported by AttentionRecorder")
            x = args[0] if args else kwargs["x"]
            am = args[1] if len(args) > 1 else kwargs.get("attn_mask")
            B, N, _ = x.shape
            H, d = mod.num_heads, mod.head_dim
            q, k, _ = F.linear(x, mod.in_proj_weight, mod.in_proj_bias).chunk(3, dim=-1)
            ct = torch.float64 if x.dtype == torch.float64 else torch.float32
            q = mod.ln_q(q.reshape(B, N, H, d).transpose(1, 2)).detach().to(ct)
            k = mod.ln_k(k.reshape(B, N, H, d).transpose(1, 2)).detach().to(ct)
            allowed, bias = _mask_parts(am, true_means_masked=True)
            self._emit(AttentionRecord(name, "standard", q, k, mod.scale, torch.arange(H, device=q.device),
                                       allowed, bias))

        self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))

    # ---- timm Attention / DiffAttention
    def _hook_timm(self, name: str, m: nn.Module, kind: str) -> None:
        self._hook_timm_any(name, m, diff=False)

    def _hook_timm_diff(self, name: str, m: nn.Module, kind: str) -> None:
        self._hook_timm_any(name, m, diff=True)

    def _hook_timm_any(self, name: str, m: nn.Module, diff: bool) -> None:
        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs["x"]
            am = args[1] if len(args) > 1 else kwargs.get("attn_mask")
            is_causal = args[2] if len(args) > 2 else kwargs.get("is_causal", False)
            B, N, _ = x.shape
            H, d = mod.num_heads, mod.head_dim
            ct = torch.float64 if x.dtype == torch.float64 else torch.float32
            if diff:
                q, k, _ = mod.qkv(x).chunk(3, dim=2)
                q = mod.q_norm(q.reshape(B, N, 2 * H, d).transpose(1, 2)).detach().to(ct)
                k = mod.k_norm(k.reshape(B, N, 2 * H, d).transpose(1, 2)).detach().to(ct)
                kv_index, lam = torch.arange(2 * H), mod._compute_lambda().detach().to(ct)
            else:
                qkv = mod.qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
                q, k = mod.q_norm(qkv[0]).detach().to(ct), mod.k_norm(qkv[1]).detach().to(ct)
                kv_index, lam = torch.arange(H), None
            allowed, bias = _mask_parts(am, true_means_masked=False)
            if is_causal:
                allowed = _and(allowed, _causal(N, N, q.device)[None, None])
            self._emit(AttentionRecord(name, "diff" if diff else "standard", q, k, float(mod.scale),
                                       kv_index.to(q.device), allowed, bias, lam))

        self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
