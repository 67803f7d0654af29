"""Forward Triton kernel of fused differential attention (design and FLOP model: docs/kernels.md).

One program owns ``BLOCK_M`` query rows of one differential head. It keeps two online-softmax
states ``(m_j, l_j)`` and two fp32 accumulators ``O_j`` (2d wide) that share every loaded K/V tile,
then forms ``A = O1/l1 - lam*O2/l2``, the optional per-head RMSNorm with its weight (the
``(1 - lambda_init)`` scale is folded into the weight by the caller) and writes the head output.

Scores live in the log2 domain (``qk_scale = d**-0.5 * log2(e)``), so the saved LSEs are base 2.
Rows that see no key get ``l = 0``: their output is 0, their LSE ``+inf`` and their rstd 0, which
makes every backward term of the row vanish.

Only plain pointer arithmetic is used (no ``tl.make_block_ptr``), so the same source runs on
Triton 3.6 and 3.8 and under ``TRITON_INTERPRET=1``. Interpretation is decided when this module
is imported (``triton.jit`` reads ``TRITON_INTERPRET`` at decoration time); ``INTERPRET`` records it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from diffmm.ops import triton_tiles

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# One fixed tile under the interpreter (small, so odd N crosses several blocks in tests).
INTERP_BLOCK_M = 16
INTERP_BLOCK_N = 16
LOG2E = 1.4426950408889634


@triton.jit
def _kv_range(start_m, N, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range of a query block: ``[0, full_end)`` needs no score mask, ``[full_end, hi)`` does."""
    if CAUSAL:
        off = S - N  # query i sees key j iff j <= i + off (bottom-right alignment)
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + off, 0), S)
        t = tl.maximum(start_m + off + 1, 0)  # keys < t are visible to every row of the block
        full_end = tl.minimum((t // BLOCK_N) * BLOCK_N, (S // BLOCK_N) * BLOCK_N)
    else:
        hi = S
        full_end = (S // BLOCK_N) * BLOCK_N
    full_end = tl.minimum(full_end, hi)
    return full_end, hi


@triton.jit
def _fwd_step(acc1, acc2, l1, l2, m1, m2, q1, q2, k_ptr, v_ptr, km_ptr, start_n, offs_m, offs_n, offs_d, offs_e,
              sks, skh, svs, N, S, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PREC: tl.constexpr):
    """One K/V tile for both maps: scores, masks, online-softmax updates."""
    cols = start_n + offs_n  # (BN,)
    kp = k_ptr + cols[:, None] * sks + offs_d[None, :]  # (BN, D): component 2g; 2g+1 is + skh
    vp = v_ptr + cols[:, None] * svs + offs_e[None, :]  # (BN, 2D)
    if MASKED:
        col_ok = cols < S
        k1 = tl.load(kp, mask=col_ok[:, None], other=0.0)
        k2 = tl.load(kp + skh, mask=col_ok[:, None], other=0.0)
        v = tl.load(vp, mask=col_ok[:, None], other=0.0)
    else:
        k1 = tl.load(kp)
        k2 = tl.load(kp + skh)
        v = tl.load(vp)
    s1 = tl.dot(q1, tl.trans(k1), input_precision=PREC) * qk_scale  # (BM, BN), log2 domain
    s2 = tl.dot(q2, tl.trans(k2), input_precision=PREC) * qk_scale
    if MASKED:
        keep = (cols < S)[None, :] & (offs_m >= 0)[:, None]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + (S - N))
        if HAS_PAD:
            pad = tl.load(km_ptr + cols, mask=cols < S, other=0) != 0
            keep = keep & pad[None, :]
        s1 = tl.where(keep, s1, float("-inf"))
        s2 = tl.where(keep, s2, float("-inf"))
    elif HAS_PAD:
        pad = tl.load(km_ptr + cols) != 0
        s1 = tl.where(pad[None, :], s1, float("-inf"))
        s2 = tl.where(pad[None, :], s2, float("-inf"))
    # map 1
    m1n = tl.maximum(m1, tl.max(s1, 1))
    m1u = tl.where(m1n == float("-inf"), 0.0, m1n)  # rows with nothing visible yet stay at 0
    p1 = tl.math.exp2(s1 - m1u[:, None])
    a1 = tl.math.exp2(m1 - m1u)
    l1 = l1 * a1 + tl.sum(p1, 1)
    acc1 = acc1 * a1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision=PREC)
    # map 2 (same V tile)
    m2n = tl.maximum(m2, tl.max(s2, 1))
    m2u = tl.where(m2n == float("-inf"), 0.0, m2n)
    p2 = tl.math.exp2(s2 - m2u[:, None])
    a2 = tl.math.exp2(m2 - m2u)
    l2 = l2 * a2 + tl.sum(p2, 1)
    acc2 = acc2 * a2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision=PREC)
    return acc1, acc2, l1, l2, m1n, m2n


@triton.jit(do_not_specialize=["N", "S"])  # one compile serves every sequence length
def _diff_fwd_kernel(Q, K, V, LAM, W, KMASK, Y, O1, O2, LSE1, LSE2, RSTD,
                     sqb, sqn, sqh, skb, sks, skh, svb, svs, svh, syb, syn, syh, smb,
                     N, S, H, REP, qk_scale, eps, N_BKT, S_BKT,
                     D: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, NORM: tl.constexpr,
                     PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N, BLOCK_M), h, B). Writes Y (B, N, h, 2D), O1/O2 (B, h, N, 2D) fp32, LSEs and rstd (B, h, N)."""
    pid_m = tl.program_id(0)
    hd = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    g = hd // REP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_e = tl.arange(0, 2 * D)
    row_ok = offs_m < N

    qp = Q + b * sqb + (2 * hd) * sqh + offs_m[:, None] * sqn + offs_d[None, :]  # (BM, D)
    q1 = tl.load(qp, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(qp + sqh, mask=row_ok[:, None], other=0.0)
    k_ptr = K + b * skb + (2 * g) * skh
    v_ptr = V + b * svb + g * svh
    km_ptr = KMASK + b * smb

    acc1 = tl.zeros([BLOCK_M, 2 * D], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, 2 * D], dtype=tl.float32)
    l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    m1 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    full_end, hi = _kv_range(start_m, N, S, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full_end, BLOCK_N):
        acc1, acc2, l1, l2, m1, m2 = _fwd_step(
            acc1, acc2, l1, l2, m1, m2, q1, q2, k_ptr, v_ptr, km_ptr, start_n, offs_m, offs_n, offs_d, offs_e,
            sks, skh, svs, N, S, qk_scale, False, CAUSAL, HAS_PAD, PREC)
    for start_n in range(full_end, hi, BLOCK_N):
        acc1, acc2, l1, l2, m1, m2 = _fwd_step(
            acc1, acc2, l1, l2, m1, m2, q1, q2, k_ptr, v_ptr, km_ptr, start_n, offs_m, offs_n, offs_d, offs_e,
            sks, skh, svs, N, S, qk_scale, True, CAUSAL, HAS_PAD, PREC)

    seen = l1 > 0.0  # (BM,) rows with at least one visible key (same set for both maps)
    o1 = acc1 / tl.where(seen, l1, 1.0)[:, None]  # (BM, 2D) = P1 V
    o2 = acc2 / tl.where(seen, l2, 1.0)[:, None]
    lam = tl.load(LAM).to(tl.float32)
    a = o1 - lam * o2
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(a * a, 1) / (2 * D) + eps)
        rstd = tl.where(seen, rstd, 0.0)
        w = tl.load(W + offs_e).to(tl.float32)  # norm weight * (1 - lambda_init)
        y = a * rstd[:, None] * w[None, :]
    else:
        rstd = tl.where(seen, 1.0, 0.0)
        y = a
    yp = Y + b * syb + hd * syh + offs_m[:, None] * syn + offs_e[None, :]
    tl.store(yp, y.to(Y.dtype.element_ty), mask=row_ok[:, None])
    bh = b * H + hd
    ob = bh * N * (2 * D)  # int64 scalar base; tile offsets stay int32
    ot = offs_m[:, None] * (2 * D) + offs_e[None, :]
    tl.store(O1 + ob + ot, o1, mask=row_ok[:, None])
    tl.store(O2 + ob + ot, o2, mask=row_ok[:, None])
    lse1 = tl.where(seen, m1 + tl.math.log2(tl.where(seen, l1, 1.0)), float("inf"))
    lse2 = tl.where(seen, m2 + tl.math.log2(tl.where(seen, l2, 1.0)), float("inf"))
    tl.store(LSE1 + bh * N + offs_m, lse1, mask=row_ok)
    tl.store(LSE2 + bh * N + offs_m, lse2, mask=row_ok)
    tl.store(RSTD + bh * N + offs_m, rstd, mask=row_ok)


if INTERPRET:
    _fwd_kernel = _diff_fwd_kernel
else:
    _fwd_kernel = triton_tiles.autotune("fwd", _diff_fwd_kernel,
                                        key=["N_BKT", "S_BKT", "D", "CAUSAL", "HAS_PAD", "NORM", "PREC"])


def length_bucket(n: int) -> int:
    """The autotune key of a sequence length: the next power of two (at least 16), so that prompts of
    varying length (and each decode step's growing S) reuse one tuned tile instead of re-benchmarking."""
    return triton.next_power_of_2(max(int(n), 16))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact (ieee) dots; 16-bit inputs use tensor cores with fp32 accumulation."""
    return "ieee" if dtype == torch.float32 else "tf32"


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **kwargs)``; ``grid`` may be a function of the chosen config."""

    kernel: object
    grid: object
    args: tuple
    kwargs: dict

    def __call__(self):
        return self.kernel[self.grid](*self.args, **self.kwargs)


def fwd_launches(q, k, v, lam, w, key_mask, causal: bool, norm: bool, eps: float):
    """Outputs (empty) and the launch that fills them; see :func:`diff_attn_fwd` for shapes.

    Split from the launch so that :mod:`diffmm.ops.triton_targets` compiles exactly what a call would run.
    """
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    dev = q.device
    y = torch.empty(B, N, h, 2 * d, device=dev, dtype=q.dtype)
    o1 = torch.empty(B, h, N, 2 * d, device=dev, dtype=torch.float32)
    o2 = torch.empty_like(o1)
    lse1 = torch.empty(B, h, N, device=dev, dtype=torch.float32)
    lse2, rstd = torch.empty_like(lse1), torch.empty_like(lse1)
    outs = (y, o1, o2, lse1, lse2, rstd)
    if N == 0 or B == 0 or h == 0:
        return outs, []
    w_arg = w if w is not None else lam  # never read when NORM is False
    km = key_mask if key_mask is not None else lam
    smb = key_mask.stride(0) if key_mask is not None else 0
    args = (q, k, v, lam, w_arg, km, y, o1, o2, lse1, lse2, rstd,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), y.stride(0), y.stride(1), y.stride(2), smb,
            N, S, h, h // h_kv, d ** -0.5 * LOG2E, float(eps), length_bucket(N), length_bucket(S))
    flags = dict(D=d, CAUSAL=bool(causal), HAS_PAD=key_mask is not None, NORM=bool(norm),
                 PREC=dot_precision(q.dtype))
    if INTERPRET:
        return outs, [Launch(_fwd_kernel, (triton.cdiv(N, INTERP_BLOCK_M), h, B), args,
                             dict(flags, BLOCK_M=INTERP_BLOCK_M, BLOCK_N=INTERP_BLOCK_N))]
    return outs, [Launch(_fwd_kernel, lambda META: (triton.cdiv(N, META["BLOCK_M"]), h, B), args, flags)]


def diff_attn_fwd(q, k, v, lam, w, key_mask, causal: bool, norm: bool, eps: float):
    """Launch the forward kernel.

    Args:
        q: (B, N, 2h, d), k: (B, S, 2h_kv, d), v: (B, S, h_kv, 2d); unit stride on the last dim.
        lam: 0-d fp32 tensor. w: (2d,) fp32 effective norm weight, or None. key_mask: (B, S) uint8 or None.

    Returns:
        y (B, N, h, 2d) in q's dtype; o1, o2 (B, h, N, 2d) fp32; lse1, lse2, rstd (B, h, N) fp32.
    """
    outs, launches = fwd_launches(q, k, v, lam, w, key_mask, causal, norm, eps)
    for launch in launches:
        launch()
    return outs
