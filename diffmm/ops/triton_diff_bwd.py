"""Backward Triton kernels of fused differential attention (design and FLOP model: docs/kernels.md).

Three launches, all deterministic (no atomics; partial sums are reduced with torch):

1. ``_bwd_pre_kernel`` (per query row): RMSNorm backward ``G = dL/dA``, ``delta_j = rowsum(G * O_j)``,
   and per-block partial sums of the norm-weight gradient. ``dlambda = -sum(delta_2)``.
2. ``_bwd_dkdv_kernel`` (per key block of one kv group): loops over the group's query heads and
   query blocks; ``dV += (P1 - lam*P2)^T G``, ``dK_j += dS_j^T Q_j``.
3. ``_bwd_dq_kernel`` (per query block of one head): loops over key blocks; ``dQ_j += dS_j K_j``.

Both maps share ``dP = G V^T`` (computed once per tile):
``dS1 = P1 * (dP - delta_1)``, ``dS2 = -lam * P2 * (dP - delta_2)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffmm.ops import triton_tiles
from diffmm.ops.triton_diff_fwd import (INTERP_BLOCK_M, INTERP_BLOCK_N, INTERPRET, LOG2E, Launch, _kv_range,
                                        dot_precision, length_bucket)


def _pre_block(d: int) -> int:
    """Rows per program of the pre-pass: ~4k elements per (rows, 2d) tile keeps its six tiles in registers."""
    return INTERP_BLOCK_M if INTERPRET else max(16, 4096 // (2 * d))


@triton.jit(do_not_specialize=["N"])
def _bwd_pre_kernel(DY, O1, O2, RSTD, LAM, W, G, DELTA1, DELTA2, DW_PART,
                    sdb, sdn, sdh, N, H,
                    D: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid (cdiv(N, BLOCK_M), h, B). G (B, h, N, 2D) in the input dtype; deltas (B, h, N) fp32."""
    pid_m = tl.program_id(0)
    hd = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, 2 * D)
    row_ok = offs_m < N
    bh = b * H + hd
    dy = tl.load(DY + b * sdb + hd * sdh + offs_m[:, None] * sdn + offs_e[None, :],
                 mask=row_ok[:, None], other=0.0).to(tl.float32)  # (BM, 2D)
    ob = bh * N * (2 * D)  # int64 scalar base; tile offsets stay int32
    ot = offs_m[:, None] * (2 * D) + offs_e[None, :]
    o1 = tl.load(O1 + ob + ot, mask=row_ok[:, None], other=0.0)
    o2 = tl.load(O2 + ob + ot, mask=row_ok[:, None], other=0.0)
    rstd = tl.load(RSTD + bh * N + offs_m, mask=row_ok, other=0.0)  # 0 on rows that see no key
    lam = tl.load(LAM).to(tl.float32)
    a = o1 - lam * o2
    if NORM:
        w = tl.load(W + offs_e).to(tl.float32)
        da = dy * w[None, :]
        c = tl.sum(da * a, 1) / (2 * D)  # mean(dA * A)
        g = rstd[:, None] * da - a * (rstd * rstd * rstd * c)[:, None]
        dw = tl.sum(dy * a * rstd[:, None], 0)  # (2D,) partial gradient of the effective weight
        n_m = tl.num_programs(0)
        tl.store(DW_PART + (bh * n_m + pid_m) * (2 * D) + offs_e, dw)
    else:
        g = dy * rstd[:, None]
    tl.store(G + ob + ot, g.to(G.dtype.element_ty), mask=row_ok[:, None])
    tl.store(DELTA1 + bh * N + offs_m, tl.sum(g * o1, 1), mask=row_ok)
    tl.store(DELTA2 + bh * N + offs_m, tl.sum(g * o2, 1), mask=row_ok)


@triton.jit
def _dkdv_step(dk1, dk2, dv, k1, k2, v, q_ptr, g_ptr, lse1_ptr, lse2_ptr, dl1_ptr, dl2_ptr, lam, start_m, offs_m,
               offs_d, offs_e, cols, sqn, sqh, N, S, qk_scale,
               D: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """One query tile against the program's key block. Transposed tiles: (BN, BM)."""
    rows = start_m + offs_m
    row_ok = rows < N
    qp = q_ptr + rows[:, None] * sqn + offs_d[None, :]
    q1 = tl.load(qp, mask=row_ok[:, None], other=0.0)  # (BM, D)
    q2 = tl.load(qp + sqh, mask=row_ok[:, None], other=0.0)
    lse1 = tl.load(lse1_ptr + rows, mask=row_ok, other=float("inf"))  # out-of-range rows get P = 0
    lse2 = tl.load(lse2_ptr + rows, mask=row_ok, other=float("inf"))
    p1 = tl.math.exp2(tl.dot(k1, tl.trans(q1), input_precision=PREC) * qk_scale - lse1[None, :])  # (BN, BM)
    p2 = tl.math.exp2(tl.dot(k2, tl.trans(q2), input_precision=PREC) * qk_scale - lse2[None, :])
    if MASKED:  # causal diagonal
        keep = cols[:, None] <= rows[None, :] + (S - N)
        p1 = tl.where(keep, p1, 0.0)
        p2 = tl.where(keep, p2, 0.0)
    g = tl.load(g_ptr + rows[:, None] * (2 * D) + offs_e[None, :], mask=row_ok[:, None], other=0.0)
    dp = tl.dot(v, tl.trans(g), input_precision=PREC)  # (BN, BM) = (G V^T)^T, shared by both maps
    dl1 = tl.load(dl1_ptr + rows, mask=row_ok, other=0.0)
    dl2 = tl.load(dl2_ptr + rows, mask=row_ok, other=0.0)
    dv += tl.dot((p1 - lam * p2).to(g.dtype), g, input_precision=PREC)  # (BN, 2D)
    ds1 = p1 * (dp - dl1[None, :])
    ds2 = -lam * p2 * (dp - dl2[None, :])
    dk1 += tl.dot(ds1.to(q1.dtype), q1, input_precision=PREC)  # (BN, D)
    dk2 += tl.dot(ds2.to(q2.dtype), q2, input_precision=PREC)
    return dk1, dk2, dv


@triton.jit(do_not_specialize=["N", "S"])
def _bwd_dkdv_kernel(Q, K, V, G, LSE1, LSE2, DL1, DL2, LAM, KMASK, DK, DV,
                     sqb, sqn, sqh, skb, sks, skh, svb, svs, svh, smb,
                     N, S, H, REP, qk_scale, sm_scale, N_BKT, S_BKT,
                     D: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(S, BLOCK_N), h_kv, B). dK/dV have k's/v's strides; one program owns its rows, so no atomics."""
    pid_n = tl.program_id(0)
    gi = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_e = tl.arange(0, 2 * D)
    col_ok = cols < S
    kb = b * skb + (2 * gi) * skh  # int64 scalar bases; tile offsets stay int32
    vb = b * svb + gi * svh
    kt = cols[:, None] * sks + offs_d[None, :]  # (BN, D)
    vt = cols[:, None] * svs + offs_e[None, :]  # (BN, 2D)
    k1 = tl.load(K + kb + kt, mask=col_ok[:, None], other=0.0)
    k2 = tl.load(K + kb + skh + kt, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + vb + vt, mask=col_ok[:, None], other=0.0)
    lam = tl.load(LAM).to(tl.float32)
    dk1 = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, 2 * D], dtype=tl.float32)
    if CAUSAL:
        off = S - N  # rows i >= j - off see key j
        lo = (tl.maximum(start_n - off, 0) // BLOCK_M) * BLOCK_M
        t = tl.maximum(start_n + BLOCK_N - 1 - off, 0)
        full_start = tl.maximum(((t + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo)  # blocks from here see every key
        mid = tl.minimum(full_start, N)
    else:
        lo = 0
        mid = 0
    for r in range(0, REP):
        hd = gi * REP + r
        bh = b * H + hd
        q_ptr = Q + b * sqb + (2 * hd) * sqh
        g_ptr = G + bh * N * (2 * D)
        for start_m in range(lo, mid, BLOCK_M):
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, q_ptr, g_ptr, LSE1 + bh * N, LSE2 + bh * N,
                                      DL1 + bh * N, DL2 + bh * N, lam, start_m, offs_m, offs_d, offs_e, cols,
                                      sqn, sqh, N, S, qk_scale, D, True, PREC)
        for start_m in range(mid, N, BLOCK_M):
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, q_ptr, g_ptr, LSE1 + bh * N, LSE2 + bh * N,
                                      DL1 + bh * N, DL2 + bh * N, lam, start_m, offs_m, offs_d, offs_e, cols,
                                      sqn, sqh, N, S, qk_scale, D, False, PREC)
    if HAS_PAD:  # a padded key takes no part: its gradients are exactly 0
        pad = tl.load(KMASK + b * smb + cols, mask=col_ok, other=0) != 0
        dk1 = tl.where(pad[:, None], dk1, 0.0)
        dk2 = tl.where(pad[:, None], dk2, 0.0)
        dv = tl.where(pad[:, None], dv, 0.0)
    tl.store(DK + kb + kt, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DK + kb + skh + kt, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + vb + vt, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_step(dq1, dq2, q1, q2, g, lse1, lse2, dl1, dl2, lam, k_ptr, v_ptr, km_ptr, start_n, offs_m, offs_n,
             offs_d, offs_e, sks, skh, svs, N, S, qk_scale,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PREC: tl.constexpr):
    """One key tile for the program's query block."""
    cols = start_n + offs_n
    kp = k_ptr + cols[:, None] * sks + offs_d[None, :]
    vp = v_ptr + cols[:, None] * svs + offs_e[None, :]
    if MASKED:
        col_ok = cols < S
        k1 = tl.load(kp, mask=col_ok[:, None], other=0.0)
        k2 = tl.load(kp + skh, mask=col_ok[:, None], other=0.0)
        v = tl.load(vp, mask=col_ok[:, None], other=0.0)
    else:
        k1 = tl.load(kp)
        k2 = tl.load(kp + skh)
        v = tl.load(vp)
    p1 = tl.math.exp2(tl.dot(q1, tl.trans(k1), input_precision=PREC) * qk_scale - lse1[:, None])  # (BM, BN)
    p2 = tl.math.exp2(tl.dot(q2, tl.trans(k2), input_precision=PREC) * qk_scale - lse2[:, None])
    if MASKED:
        keep = (cols < S)[None, :] & (offs_m >= 0)[:, None]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + (S - N))
        if HAS_PAD:
            keep = keep & (tl.load(km_ptr + cols, mask=cols < S, other=0) != 0)[None, :]
        p1 = tl.where(keep, p1, 0.0)
        p2 = tl.where(keep, p2, 0.0)
    elif HAS_PAD:
        pad = tl.load(km_ptr + cols) != 0
        p1 = tl.where(pad[None, :], p1, 0.0)
        p2 = tl.where(pad[None, :], p2, 0.0)
    dp = tl.dot(g, tl.trans(v), input_precision=PREC)  # (BM, BN) = G V^T, shared by both maps
    ds1 = p1 * (dp - dl1[:, None])
    ds2 = -lam * p2 * (dp - dl2[:, None])
    dq1 += tl.dot(ds1.to(k1.dtype), k1, input_precision=PREC)  # (BM, D)
    dq2 += tl.dot(ds2.to(k2.dtype), k2, input_precision=PREC)
    return dq1, dq2


@triton.jit(do_not_specialize=["N", "S"])
def _bwd_dq_kernel(Q, K, V, G, LSE1, LSE2, DL1, DL2, LAM, KMASK, DQ,
                   sqb, sqn, sqh, skb, sks, skh, svb, svs, svh, smb,
                   N, S, H, REP, qk_scale, sm_scale, N_BKT, S_BKT,
                   D: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(N, BLOCK_M), h, B). dQ has q's strides."""
    pid_m = tl.program_id(0)
    hd = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    g_kv = hd // REP
    bh = b * H + hd
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_e = tl.arange(0, 2 * D)
    row_ok = offs_m < N
    qb = b * sqb + (2 * hd) * sqh  # int64 scalar base; tile offsets stay int32
    qt = offs_m[:, None] * sqn + offs_d[None, :]
    q1 = tl.load(Q + qb + qt, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(Q + qb + sqh + qt, mask=row_ok[:, None], other=0.0)
    g = tl.load(G + bh * N * (2 * D) + (offs_m[:, None] * (2 * D) + offs_e[None, :]), mask=row_ok[:, None],
                other=0.0)
    lse1 = tl.load(LSE1 + bh * N + offs_m, mask=row_ok, other=float("inf"))
    lse2 = tl.load(LSE2 + bh * N + offs_m, mask=row_ok, other=float("inf"))
    dl1 = tl.load(DL1 + bh * N + offs_m, mask=row_ok, other=0.0)
    dl2 = tl.load(DL2 + bh * N + offs_m, mask=row_ok, other=0.0)
    lam = tl.load(LAM).to(tl.float32)
    k_ptr = K + b * skb + (2 * g_kv) * skh
    v_ptr = V + b * svb + g_kv * svh
    km_ptr = KMASK + b * smb
    dq1 = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    full_end, hi = _kv_range(start_m, N, S, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full_end, BLOCK_N):
        dq1, dq2 = _dq_step(dq1, dq2, q1, q2, g, lse1, lse2, dl1, dl2, lam, k_ptr, v_ptr, km_ptr, start_n, offs_m,
                            offs_n, offs_d, offs_e, sks, skh, svs, N, S, qk_scale, False, CAUSAL, HAS_PAD, PREC)
    for start_n in range(full_end, hi, BLOCK_N):
        dq1, dq2 = _dq_step(dq1, dq2, q1, q2, g, lse1, lse2, dl1, dl2, lam, k_ptr, v_ptr, km_ptr, start_n, offs_m,
                            offs_n, offs_d, offs_e, sks, skh, svs, N, S, qk_scale, True, CAUSAL, HAS_PAD, PREC)
    tl.store(DQ + qb + qt, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    tl.store(DQ + qb + sqh + qt, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


if INTERPRET:
    _dkdv_kernel, _dq_kernel = _bwd_dkdv_kernel, _bwd_dq_kernel
else:
    _key = ["N_BKT", "S_BKT", "D", "CAUSAL", "HAS_PAD", "PREC"]  # lengths bucketed (length_bucket)
    _dkdv_kernel = triton_tiles.autotune("bwd_dkdv", _bwd_dkdv_kernel, _key)
    _dq_kernel = triton_tiles.autotune("bwd_dq", _bwd_dq_kernel, _key)


def bwd_launches(dy, q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd, causal: bool, norm: bool):
    """``(dq, dk, dv, dl2, dw_part)`` (empty) and the three launches that fill them (see :func:`diff_attn_bwd`)."""
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    dev = q.device
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    pre_block = _pre_block(d)
    n_pre = triton.cdiv(N, pre_block)
    g = torch.empty(B, h, N, 2 * d, device=dev, dtype=q.dtype)  # G = dL/dA, operand of the tensor-core dots
    dl1 = torch.empty(B, h, N, device=dev, dtype=torch.float32)
    dl2 = torch.empty_like(dl1)
    dw_part = torch.zeros(B * h * n_pre if norm else 1, 2 * d, device=dev, dtype=torch.float32)
    outs = (dq, dk, dv, dl2, dw_part)
    if N == 0 or S == 0 or B == 0 or h == 0:
        return outs, []
    w_arg = w if w is not None else lam
    km = key_mask if key_mask is not None else lam
    smb = key_mask.stride(0) if key_mask is not None else 0
    pre = Launch(_bwd_pre_kernel, (n_pre, h, B), (dy, o1, o2, rstd, lam, w_arg, g, dl1, dl2, dw_part,
                                                  dy.stride(0), dy.stride(1), dy.stride(2), N, h),
                 dict(D=d, NORM=bool(norm), BLOCK_M=pre_block, **({} if INTERPRET else {"num_warps": 8})))
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), smb, N, S, h, h // h_kv, d ** -0.5 * LOG2E, d ** -0.5,
              length_bucket(N), length_bucket(S))
    flags = dict(D=d, CAUSAL=bool(causal), HAS_PAD=key_mask is not None, PREC=dot_precision(q.dtype))
    dkdv_args = (q, k, v, g, lse1, lse2, dl1, dl2, lam, km, dk, dv, *common)
    dq_args = (q, k, v, g, lse1, lse2, dl1, dl2, lam, km, dq, *common)
    if INTERPRET:
        flags.update(BLOCK_M=INTERP_BLOCK_M, BLOCK_N=INTERP_BLOCK_N)
        return outs, [pre, Launch(_dkdv_kernel, (triton.cdiv(S, INTERP_BLOCK_N), h_kv, B), dkdv_args, flags),
                      Launch(_dq_kernel, (triton.cdiv(N, INTERP_BLOCK_M), h, B), dq_args, flags)]
    return outs, [pre, Launch(_dkdv_kernel, lambda META: (triton.cdiv(S, META["BLOCK_N"]), h_kv, B), dkdv_args, flags),
                  Launch(_dq_kernel, lambda META: (triton.cdiv(N, META["BLOCK_M"]), h, B), dq_args, flags)]


def diff_attn_bwd(dy, q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd, causal: bool, norm: bool):
    """Launch the three backward kernels.

    Args:
        dy: (B, N, h, 2d) gradient of the output; other tensors as saved by ``diff_attn_fwd``.

    Returns:
        dq, dk, dv in the input dtype; dlam () fp32; dw (2d,) fp32 gradient of the effective norm weight
        (zeros when ``norm`` is False).
    """
    (dq, dk, dv, dl2, dw_part), launches = bwd_launches(dy, q, k, v, lam, w, key_mask, o1, o2, lse1, lse2, rstd,
                                                        causal, norm)
    if not launches:
        return dq.zero_(), dk.zero_(), dv.zero_(), lam.new_zeros(()), dw_part.sum(0)
    for launch in launches:
        launch()
    return dq, dk, dv, -dl2.sum(), dw_part.sum(0)
