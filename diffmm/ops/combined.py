"""Differential attention with the two maps combined before V, in query chunks (pure PyTorch): the sdpa backend's
``combined`` layout, its default on CPU (:mod:`diffmm.ops.sdpa`; measurements and design: docs/attention.md)::

    P_m = softmax(Q_m K_m^T / sqrt(d) + mask)     m = 1, 2      (rows, S) per head, fp32
    A   = (P_1 - lam * P_2) V                                   (rows, 2d)

so it does the FLOPs of standard attention of equal width. The backward recomputes the maps chunk by chunk
(memory O(chunk x S), linear in N); causal chunks touch only the keys they see; GQA query heads are folded into
the rows, so K and V are never repeated. The temporaries live in per-thread scratch buffers reused by every chunk
and call (fresh multi-MiB buffers cost a page fault per 4 KiB), the softmax and its backward run in place, and the
optional per-head RMSNorm epilogue is fused into the same autograd node. Everything runs in fp32 (fp64 for fp64
inputs).
"""
from __future__ import annotations

import math
import threading
from typing import Optional

import torch

from diffmm.ops._validate import MaskSpec
from diffmm.ops.epilogue import compute_dtype

Tensor = torch.Tensor

#: Target number of score elements (both maps, all heads of a batch) per chunk: 2^22 fp32 = 16 MiB (measured
#: best or within noise of it from N = 512 to 4k; smaller chunks pay per-chunk overhead).
CHUNK_ELEMENTS = 1 << 22
#: Calls whose maps (both, all heads) fit in one chunk of at most this many elements keep them for the backward
#: instead of recomputing them (2^21 fp32 = 8 MiB per call; short sequences such as CLIP's).
SAVE_MAPS_ELEMENTS = 1 << 21

#: ATen's fused softmax backward, ``grad_input = p * (dp - rowsum(p * dp))`` in one pass and in place (a private
#: operator: docs/attention.md has the measured gain; tests/ops/test_private_ops.py checks it against autograd).
_softmax_bwd_out = torch.ops.aten._softmax_backward_data.out
_CAUSAL_BIAS: dict[tuple, torch.Tensor] = {}
#: Scratch buffers larger than this many elements are not kept between calls (2^24 fp32 = 64 MiB).
SCRATCH_MAX_ELEMENTS = 1 << 24
_SCRATCH = threading.local()


def _scratch(slot: str, n: int, like: torch.Tensor) -> torch.Tensor:
    """A flat workspace of ``n`` elements (like's dtype and device) that later calls on this thread reuse.

    For temporaries that die inside one forward or backward (never returned, never saved): a fresh multi-MiB
    tensor costs a page fault per 4 KiB on first touch once the allocator has given the memory back to the OS,
    which on the project's CPU machines made the head norm's backward 7x slower than its arithmetic
    (docs/attention.md, "Scratch buffers"). Keyed per thread, so concurrent calls never share one.
    """
    if n > SCRATCH_MAX_ELEMENTS or type(like) is not torch.Tensor or like.is_meta:  # fake/meta: never kept
        return like.new_empty(n)
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    key = (slot, like.dtype, like.device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
            buf = bufs[key] = torch.empty(n, dtype=like.dtype, device=like.device)
    return buf[:n]


def _scratch_like(slot: str, t: torch.Tensor) -> torch.Tensor:
    """A contiguous scratch tensor of t's shape, dtype and device (see :func:`_scratch`)."""
    return _scratch(slot, t.numel(), t).view(t.shape)


def _rows_per_chunk(B: int, h: int, N: int, S: int) -> int:
    """Rows per chunk, balanced so that the chunks have equal size (no ragged last chunk)."""
    rows = max(1, min(N, CHUNK_ELEMENTS // max(1, 2 * B * h * S)))
    chunks = math.ceil(N / rows)
    return math.ceil(N / chunks)


def _causal_bias(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(n, n) additive block: 0 on and below the diagonal, -inf above (cached per size, dtype, device)."""
    key = (n, dtype, device)
    bias = _CAUSAL_BIAS.get(key)
    if bias is None:
        if len(_CAUSAL_BIAS) > 64:
            _CAUSAL_BIAS.clear()
        hidden = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
        bias = _CAUSAL_BIAS[key] = torch.zeros(n, n, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return bias


class _Geometry:
    """Shapes shared by forward and backward; q12 (2, B, h_kv, g, N, d), k12 (2, B, h_kv, S, d)."""

    def __init__(self, B: int, h_kv: int, g: int, N: int, S: int, d: int, mask: torch.Tensor | None,
                 is_causal: bool, grad_wanted: bool):
        self.B, self.h_kv, self.g, self.N, self.S, self.d = B, h_kv, g, N, S, d
        self.h = self.h_kv * self.g
        self.mask, self.is_causal = mask, is_causal
        # Small calls keep their maps for the backward (no recompute, one chunk); large ones stay O(chunk x S).
        self.keep_maps = grad_wanted and 2 * self.B * self.h * self.N * self.S <= SAVE_MAPS_ELEMENTS
        self.rows = self.N if self.keep_maps else _rows_per_chunk(self.B, self.h, self.N, self.S)
        self.single_chunk = self.rows >= self.N

    def chunks(self):
        for i0 in range(0, self.N, self.rows):
            i1 = min(self.N, i0 + self.rows)
            # Causal (square, N == S): rows < i1 see keys < i1 only.
            yield i0, i1, (i1 if self.is_causal else self.S)

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """Flat buffer for the maps of the largest chunk (both maps): kept for the backward (``keep_maps``), else
        a scratch buffer reused by every chunk and call."""
        n = 2 * self.B * self.h * self.rows * self.S
        return like.new_empty(n) if self.keep_maps else _scratch("maps", n, like)

    def operands(self, q12, k12, i0, i1, s_vis):
        """Rows i0:i1 of q12 and keys :s_vis of k12 as (2*B*h_kv, g*n, d) and (2*B*h_kv, s_vis, d)."""
        B, h_kv, g, n, d = self.B, self.h_kv, self.g, i1 - i0, self.d
        qc = q12[..., i0:i1, :].reshape(2 * B * h_kv, g * n, d)  # a view unless g > 1
        kc = k12[..., :s_vis, :].reshape(2 * B * h_kv, s_vis, d)
        return qc, kc

    def scores(self, buf, q12, k12, i0, i1, s_vis):
        """Softmax maps of rows i0:i1 over keys :s_vis, in ``buf`` -> (p (2, B*h_kv, g*n, s_vis), qc, kc)."""
        B, h_kv, g, n = self.B, self.h_kv, self.g, i1 - i0
        qc, kc = self.operands(q12, k12, i0, i1, s_vis)
        size = 2 * B * h_kv * g * n * s_vis
        s = _scratch("scores", size, buf).view(2 * B * h_kv, g * n, s_vis)
        torch.bmm(qc, kc.transpose(1, 2), out=s)
        s6 = s.view(2, B, h_kv, g, n, s_vis)
        if self.is_causal:  # N == S and s_vis == i1: only the (n, n) diagonal block has hidden keys
            s6[..., i0:s_vis].add_(_causal_bias(n, s.dtype, s.device))
        if self.mask is not None:
            m = self.mask  # (B|1, 1|h, N|1, S), additive
            m = m[:, :, i0:i1] if m.shape[2] > 1 else m
            m = m[..., :s_vis]
            m = m.unflatten(1, (h_kv, g)) if m.shape[1] > 1 else m.unsqueeze(1)  # (B|1, h_kv|1, g|1, n|1, s_vis)
            s6.add_(m.to(s.dtype))  # additive (bool masks were converted once per call)
        # Into the maps' buffer, not in place: ATen's in-place softmax is 1.2-1.7x slower on rows whose length is
        # not a multiple of 16 (65, 77, 197 keys: the CLIP towers), and no faster on the others.
        p = torch.softmax(s, -1, out=buf[:size].view(s.shape))
        return p.view(2, B * h_kv, g * n, s_vis), qc, kc


def _dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of ``x`` in ``dtype`` (one pass; ``x`` itself when it already is one)."""
    if x.dtype == dtype and x.is_contiguous():
        return x
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _norm_forward(a: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm of ``a`` (B, h, N, 2d) over its last dim, written as ``a * rstd * w`` into ``out`` in the
    layer's layout (B, N, h, 2d). Returns rstd (B, h, N, 1). The norm reads ``a``, the product writes ``out`` (the
    transpose rides on it), the weight is one pass over ``out``.
    """
    rstd = torch.linalg.vector_norm(a, 2, -1, keepdim=True).square_().div_(a.shape[-1]).add_(eps).rsqrt_()
    torch.mul(a.transpose(1, 2), rstd.transpose(1, 2), out=out).mul_(w)
    return rstd


def _norm_backward(dy: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor, want_dw: bool):
    """Backward of ``y = a * rstd * w`` (per-row RMSNorm over the last dim), in a's (B, h, N, 2d) layout.

    ``dy`` may be a strided view (the transposed output gradient). Returns (da, dw); da is contiguous like a, in a
    scratch buffer (valid until the next call on this thread).
    """
    t = torch.mul(dy, a, out=_scratch_like("norm_t", a))  # contiguous, whatever dy's strides
    rows = t.view(-1, t.shape[-1])
    dw = torch.mv(rows.t(), rstd.view(-1)) if want_dw else None  # sum(dy * a * rstd) over rows
    dot = torch.mv(rows, w).view(rstd.shape)  # rowsum(dy * w * a)
    da = torch.mul(dy, w, out=_scratch_like("norm_da", a)).mul_(rstd)
    coef = rstd.pow(3).mul_(dot).div_(-a.shape[-1])  # -rstd^3 * mean(dy w a)
    return da.addcmul_(a, coef), dw


def _chunked_forward(q, k, v, lam, geo: _Geometry, ct: torch.dtype):
    """The chunked path: q, k, v copied into batched layouts. Returns a (B, h, N, 2d), the copies, maps, combined."""
    B, N, h_kv, g, S, d = geo.B, geo.N, geo.h_kv, geo.g, geo.S, geo.d
    # Component m of head i = (kv group, j) goes to q12[m, b, group, j]: one permuting copy, scaled by 1/sqrt(d).
    q12 = q.new_empty(2, B, h_kv, g, N, d, dtype=ct)
    q_perm = q.unflatten(2, (h_kv, g, 2)).permute(4, 0, 2, 3, 1, 5)
    if q.dtype == ct:
        torch.mul(q_perm, d ** -0.5, out=q12)
    else:  # 16-bit input: widen first, then scale in fp32
        q12.copy_(q_perm).mul_(d ** -0.5)
    k12 = _dense(k.unflatten(2, (h_kv, 2)).permute(3, 0, 2, 1, 4), ct)  # (2, B, h_kv, S, d)
    vt = _dense(v.permute(0, 2, 1, 3), ct)  # (B, h_kv, S, 2d)
    neg_lam = -lam
    buf = geo.buffer(q12)
    vb = vt.view(B * h_kv, S, 2 * d)
    maps = combined = None
    # a: (B*h_kv, g*N, 2d) = (B, h, N, 2d), the layout of the batched products (one chunk: the product itself)
    a = None if geo.single_chunk else q12.new_empty(B, h_kv, g, N, 2 * d)
    for i0, i1, s_vis in geo.chunks():
        p, _, _ = geo.scores(buf, q12, k12, i0, i1, s_vis)
        if geo.keep_maps:  # the maps and their combination both stay for the backward
            maps = p
            pc = combined = torch.addcmul(p[0], p[1], neg_lam)
        else:
            pc = p[0].addcmul_(p[1], neg_lam)  # P1 - lam P2, in place: (B*h_kv, g*n, s_vis)
        if a is None:  # one chunk: the product is a itself (saved for the backward)
            a = torch.bmm(pc, vb[:, :s_vis])  # (B*h_kv, g*N, 2d)
        else:
            o = torch.bmm(pc, vb[:, :s_vis], out=_scratch("o", B * geo.h * (i1 - i0) * 2 * d, pc).view(
                B * h_kv, g * (i1 - i0), 2 * d))
            a[:, :, :, i0:i1].copy_(o.view(B, h_kv, g, i1 - i0, 2 * d))
    return a.view(B, geo.h, N, 2 * d), (q12, k12, vt), maps, combined


def _chunked_backward(da, q12, k12, vt, lam, maps, combined, geo: _Geometry, dtypes):
    """Gradients of q, k, v (input layouts and dtypes) and lam (compute dtype) from da (B, h, N, 2d)."""
    B, h_kv, g, N, d, S, h = geo.B, geo.h_kv, geo.g, geo.N, geo.d, geo.S, geo.h
    ct = q12.dtype
    q_dt, k_dt, v_dt = dtypes
    neg_lam = -lam
    # The gradients in the compute layouts are scratch buffers: each is permuted into a fresh output at the end.
    dq12 = _scratch_like("dq12", q12)
    dk12 = _scratch_like("dk12", k12)  # every key row is written once with beta=0 before it accumulates
    dv = _scratch_like("dv", vt)  # (B, h_kv, S, 2d)
    dlam = torch.zeros((), dtype=ct, device=q12.device)
    buf = geo.buffer(q12) if maps is None else None
    dp_buf = _scratch("dp", B * h * geo.rows * S, q12)
    vb, dvb, dkb = vt.view(B * h_kv, S, 2 * d), dv.view(B * h_kv, S, 2 * d), dk12.view(2 * B * h_kv, S, d)
    da5 = da.view(B, h_kv, g, N, 2 * d)
    seen = 0  # keys [0, seen) already hold a partial dK / dV
    for i0, i1, s_vis in geo.chunks():
        n = i1 - i0
        if maps is not None:  # the forward kept them; ds goes to a fresh buffer (maps stay intact)
            p, qc, kc = maps, *geo.operands(q12, k12, i0, i1, s_vis)
            ds = _scratch_like("ds", p)
        else:
            p, qc, kc = geo.scores(buf, q12, k12, i0, i1, s_vis)  # p (2, B*h_kv, g*n, s_vis)
            ds = p  # the softmax backward runs in place over the recomputed maps
        do = da5[:, :, :, i0:i1].reshape(B * h_kv, g * n, 2 * d)  # a view for one chunk
        dp = dp_buf[:B * h * n * s_vis].view(B * h_kv, g * n, s_vis)
        torch.bmm(do, vb[:, :s_vis].transpose(1, 2), out=dp)  # dL/d(P1 - lam P2)
        dlam.add_(torch.vdot(p[1].reshape(-1), dp.view(-1)))  # sum(P2 * dp); dlam = -that
        if combined is not None:
            pc = combined
        else:  # P1 - lam P2
            pc = torch.addcmul(p[0], p[1], neg_lam, out=_scratch_like("combined", p[0]))
        _accumulate(dvb, pc.transpose(1, 2), do, seen, s_vis)
        # Softmax backward of each map with the same upstream dp (map 2's factor -lam is applied to the
        # small products at the end): ds[m] = P_m * (dp - rowsum(P_m * dp)).
        _softmax_bwd_out(dp, p[0], -1, ct, grad_input=ds[0])
        _softmax_bwd_out(dp, p[1], -1, ct, grad_input=ds[1])
        ds = ds.view(2 * B * h_kv, g * n, s_vis)
        if geo.single_chunk:
            torch.bmm(ds, kc, out=dq12.view(2 * B * h_kv, g * N, d))
        else:
            dq12[..., i0:i1, :].copy_(torch.bmm(ds, kc).view(2, B, h_kv, g, n, d))
        _accumulate(dkb, ds.transpose(1, 2), qc, seen, s_vis)
        seen = max(seen, s_vis)
    # Map 2's factor -lam, the 1/sqrt(d) of q, and the permutation back to the input layouts, in one pass each.
    factor = torch.stack([torch.ones_like(lam), neg_lam]).view(2, 1)  # (2, 1)
    dq = torch.empty(B, N, h_kv, g, 2, d, dtype=q_dt, device=q12.device)
    torch.mul(dq12.permute(1, 4, 2, 3, 0, 5), factor * d ** -0.5, out=dq)
    dk = torch.empty(B, S, h_kv, 2, d, dtype=k_dt, device=q12.device)
    torch.mul(dk12.permute(1, 3, 2, 0, 4), factor, out=dk)
    dv_out = torch.empty(B, S, h_kv, 2 * d, dtype=v_dt, device=q12.device).copy_(dv.permute(0, 2, 1, 3))
    return dq.view(B, N, 2 * h, d), dk.view(B, S, 2 * h_kv, d), dv_out, dlam.neg_()


def _row_major(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _standalone(t: Tensor, *inputs: Optional[Tensor]) -> Tensor:
    """``t`` as a custom op may return it: its own memory (no input's) in row-major strides (what the fake
    implementations promise); a copy only in the rare cases where ``_dense`` handed back a view."""
    if t.stride() == _row_major(t.shape) and not any(
            x is not None and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


# ---------------------------------------------------------------------------------------------
# custom ops, as in diffmm.ops.triton_diff: opaque nodes with fake implementations, so that torch.compile traces
# through the layer (fullgraph) and FakeTensorMode runs it; an autograd.Function ties forward and backward.


@torch.library.custom_op("diffmm::combined_diff_fwd", mutates_args=())
def combined_diff_fwd(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, w: Optional[Tensor], mask: Optional[Tensor],
                      empty_rows: Optional[Tensor], is_causal: bool, norm: bool, eps: float, grad_wanted: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward. Returns y (B, N, h, 2d) in q's dtype, then for the backward (compute dtype): the copies q12, k12, vt;
    the norm's input a (B, h, N, 2d) and rstd (B, h, N, 1); the kept maps and their combination (empty when not
    used). ``w``: the norm weight with (1 - lambda_init) folded in (None without the norm); ``mask``: additive."""
    with torch.autocast(q.device.type, enabled=False):  # the op sets its own precision
        B, N, H2, d = q.shape
        S, h_kv = k.shape[1], k.shape[2] // 2
        h = H2 // 2
        ct = compute_dtype(q.dtype)
        geo = _Geometry(B, h_kv, h // h_kv, N, S, d, mask, is_causal, grad_wanted)
        a, (q12, k12, vt), maps, combined = _chunked_forward(q, k, v, lam.to(ct), geo, ct)  # a (B, h, N, 2d)
        if empty_rows is not None:
            a.masked_fill_(empty_rows, 0.0)
        y = torch.empty(B, N, h, 2 * d, dtype=q.dtype, device=q.device)  # the layer's layout (a transposed)
        rstd = None
        if norm:
            rstd = _norm_forward(a, w.to(ct), eps, y)
        else:
            y.copy_(a.transpose(1, 2))
            a = None
        outs = (y, q12, k12, vt, a, rstd, maps, combined)
        return tuple(q12.new_empty(0) if t is None else _standalone(t, q, k, v) for t in outs)


@combined_diff_fwd.register_fake
def _(q, k, v, lam, w, mask, empty_rows, is_causal, norm, eps, grad_wanted):
    B, N, H2, d = q.shape
    S, h_kv = k.shape[1], k.shape[2] // 2
    h = H2 // 2
    g, ct = h // h_kv, compute_dtype(q.dtype)
    keep = _Geometry(B, h_kv, g, N, S, d, mask, is_causal, grad_wanted).keep_maps

    def new(*shape, on=True):
        return q.new_empty(*shape, dtype=ct) if on else q.new_empty(0, dtype=ct)

    return (q.new_empty(B, N, h, 2 * d), new(2, B, h_kv, g, N, d), new(2, B, h_kv, S, d), new(B, h_kv, S, 2 * d),
            new(B, h, N, 2 * d, on=norm), new(B, h, N, 1, on=norm), new(2, B * h_kv, g * N, S, on=keep),
            new(B * h_kv, g * N, S, on=keep))


@torch.library.custom_op("diffmm::combined_diff_bwd", mutates_args=())
def combined_diff_bwd(dy: Tensor, q12: Tensor, k12: Tensor, vt: Tensor, lam: Tensor, w: Optional[Tensor], a: Tensor,
                      rstd: Tensor, maps: Tensor, combined: Tensor, mask: Optional[Tensor],
                      empty_rows: Optional[Tensor], is_causal: bool, norm: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward. Returns dq, dk, dv (dy's dtype), dlam (lam's dtype) and dw (w's dtype; empty without the norm)."""
    with torch.autocast(dy.device.type, enabled=False):
        _, B, h_kv, g, N, d = q12.shape
        ct = q12.dtype
        geo = _Geometry(B, h_kv, g, N, k12.shape[3], d, mask, is_causal, maps.numel() > 0)
        dyt = dy.transpose(1, 2)  # (B, h, N, 2d): a view in the layout of a
        if dyt.dtype != ct:
            dyt = dyt.to(ct)
        dw = None
        if norm:
            da, dw = _norm_backward(dyt, a, rstd, w.to(ct), True)
            dw = dw.to(w.dtype)
        else:
            da = dyt.contiguous()
        if empty_rows is not None:
            da = da.masked_fill(empty_rows, 0.0)  # not in place: da may be dy itself
        kept = (maps, combined) if geo.keep_maps else (None, None)
        dq, dk, dv, dlam = _chunked_backward(da, q12, k12, vt, lam.to(ct), *kept, geo, (dy.dtype,) * 3)
        outs = (dq, dk, dv, dlam.to(lam.dtype), dw)
        return tuple(dy.new_empty(0) if t is None else _standalone(t, dy, q12, k12, vt) for t in outs)


@combined_diff_bwd.register_fake
def _(dy, q12, k12, vt, lam, w, a, rstd, maps, combined, mask, empty_rows, is_causal, norm):
    _, B, h_kv, g, N, d = q12.shape
    S = k12.shape[3]
    return (dy.new_empty(B, N, 2 * h_kv * g, d), dy.new_empty(B, S, 2 * h_kv, d), dy.new_empty(B, S, h_kv, 2 * d),
            lam.new_empty(()), w.new_empty(2 * d) if norm else dy.new_empty(0))


class _CombinedDiffAttention(torch.autograd.Function):
    """``apply(q, k, v, lam, w, mask, is_causal, norm, eps, empty_rows, grad_wanted) -> y`` (B, N, h, 2d)."""

    @staticmethod
    def forward(ctx, q, k, v, lam, w, mask, is_causal, norm, eps, empty_rows, grad_wanted):
        y, *saved = torch.ops.diffmm.combined_diff_fwd(q, k, v, lam, w, mask, empty_rows, is_causal, norm, eps,
                                                       grad_wanted)
        ctx.save_for_backward(*saved, lam, w, mask, empty_rows)
        ctx.is_causal, ctx.norm = is_causal, norm
        return y

    @staticmethod
    def backward(ctx, dy):
        q12, k12, vt, a, rstd, maps, combined, lam, w, mask, empty_rows = ctx.saved_tensors
        dq, dk, dv, dlam, dw = torch.ops.diffmm.combined_diff_bwd(dy, q12, k12, vt, lam, w, a, rstd, maps, combined,
                                                                  mask, empty_rows, ctx.is_causal, ctx.norm)
        return dq, dk, dv, dlam, (dw if w is not None else None), None, None, None, None, None, None


def _accumulate(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seen: int, s_vis: int) -> None:
    """``out[:, :s_vis] += x @ y`` where rows ``[seen, s_vis)`` of ``out`` are still unwritten (``seen <= s_vis``).

    ``out[:, :s_vis]`` is not contiguous across the batch when ``s_vis < S`` (causal chunks), and a batched
    matmul into such a view runs one GEMM per batch entry; so the product goes to a contiguous temporary first.
    """
    if s_vis == out.shape[1] and seen in (0, s_vis):  # the whole (contiguous) out, unwritten or all written
        if seen == 0:
            torch.bmm(x, y, out=out)
        else:
            out.baddbmm_(x, y)
        return
    prod = torch.bmm(x, y, out=_scratch("prod", x.shape[0] * x.shape[1] * y.shape[2], x).view(
        x.shape[0], x.shape[1], y.shape[2]))  # (batch, s_vis, cols)
    if seen:
        out[:, :seen].add_(prod[:, :seen])
    out[:, seen:s_vis].copy_(prod[:, seen:])


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool keep-mask as an additive one: 0 where kept, ``finfo.min`` where hidden.

    Finite, so a row whose visible keys are all hidden still has a finite softmax (its output and gradients are
    zeroed through ``empty_rows``), and an add is cheaper than a masked fill on every chunk.
    """
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def combined_diff_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor,
                            spec: MaskSpec, *, attn_mask: torch.Tensor | None = None, causal: bool = False,
                            norm_weight: torch.Tensor | None = None,
                            lambda_init: float | torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``(P_1 - lam P_2) V`` with the maps combined before V, and the optional fused head epilogue.

    Args:
        q: (B, N, 2h, d), k: (B, S, 2h_kv, d), v: (B, S, h_kv, 2d) in the interleaved component layout.
        lam: 0-d tensor.
        spec: the prepared mask (see :func:`diffmm.ops._validate.prepare_mask`).
        attn_mask, causal: the call's own mask arguments; a bool key-padding mask under a square causal mask
            keeps the chunked causal path (invisible keys skipped) with the padding as a (B, 1, 1, S) bias.
        norm_weight, lambda_init, eps: as :func:`diffmm.ops.diff_attention`; with ``lambda_init`` the output is
            ``RMSNorm(A) * norm_weight * (1 - lambda_init)``.
    Returns:
        (B, N, h, 2d) in q's dtype; rows that see no key are 0.
    """
    ct = compute_dtype(q.dtype)
    norm = lambda_init is not None
    w = None
    if norm:  # (1 - lambda_init) folded into the weight: autograd carries it to norm_weight (and a tensor lambda_init)
        base = norm_weight if norm_weight is not None else torch.ones(2 * q.shape[-1], dtype=ct, device=q.device)
        w = base * (1.0 - lambda_init)
    mask, is_causal = spec.mask, spec.is_causal
    if (causal and attn_mask is not None and attn_mask.dtype == torch.bool and q.shape[1] == k.shape[1]):
        mask, is_causal = _additive(attn_mask.to(q.device)[:, None, None, :], ct), True  # (B, 1, 1, S)
    elif mask is not None and mask.dtype == torch.bool:
        mask = _additive(mask, ct)
    grad_wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, lam, w))
    return _CombinedDiffAttention.apply(q, k, v, lam, w, mask, is_causal, norm, eps, spec.empty_rows, grad_wanted)
