"""The one-chunk path of the ``combined`` layout: short sequences (CLIP-sized), fp32/fp64 inputs.

The chunked path (:mod:`diffmm.ops.combined`) first copies q, k and v into batched layouts, one permuting pass
each. When all query rows fit in one chunk, the batched products can read the caller's tensors directly
instead: in the layer's layouts q (B, N, 2h, d), k (B, S, 2h_kv, d), v (B, S, h_kv, 2d) one component
``q[:, :, c]`` is a (B, N, d) stack of matrices with a uniform batch stride and unit column stride, which BLAS
takes as is (measured: no slower than on contiguous copies). So the products run per component (2h QK^T
calls batched over B) into a score buffer laid out (2, h, B, N, S), and the 1/sqrt(d) scale rides on the
product (``baddbmm``'s alpha). Outputs of the products stay contiguous (a strided output is the slow case);
the gradients are permuted back to the input layouts in one pass each, as in the chunked path.

Same math, masks, epilogue and saved maps as the chunked path; :class:`diffmm.ops.combined._CombinedDiffAttention`
chooses between them.
"""
from __future__ import annotations

import torch

_softmax_out = torch.ops.aten._softmax.out
_softmax_bwd_out = torch.ops.aten._softmax_backward_data.out


def small_forward(q, k, v, lam, mask, causal_bias, empty_rows):
    """Scores, maps and ``A = (P1 - lam P2) V`` with q, k, v read in place.

    Args:
        q (B, N, 2h, d), k (B, S, 2h_kv, d), v (B, S, h_kv, 2d): one dtype (fp32 or fp64).
        lam: 0-d, q's dtype. mask: additive (B|1, 1|h, N|1, S) or None. causal_bias: (N, N) or None (N == S).
        empty_rows: bool (B|1, 1, N, 1) or None: rows that see no key (A = 0).
    Returns:
        a (h, B, N, 2d), maps p (2, h*B, N, S) and their combination pc (h*B, N, S), all contiguous.
    """
    B, N, H2, d = q.shape
    S, h_kv = k.shape[1], k.shape[2] // 2
    h = H2 // 2
    g = h // h_kv
    s = q.new_empty(2, h, B, N, S)  # s[m, i]: component m of head i
    for m in range(2):
        for i in range(h):
            kt = k[:, :, 2 * (i // g) + m].transpose(1, 2)  # (B, d, S)
            torch.baddbmm(s[m, i], q[:, :, 2 * i + m], kt, beta=0, alpha=d ** -0.5, out=s[m, i])
    if causal_bias is not None:
        s.add_(causal_bias)
    if mask is not None:
        s.add_(mask.transpose(0, 1))  # (1|h, B|1, N|1, S)
    p = _softmax_out(s, -1, False, out=s).view(2, h * B, N, S)
    pc = torch.addcmul(p[0], p[1], -lam)  # P1 - lam P2
    a = q.new_empty(h, B, N, 2 * d)
    pc4 = pc.view(h, B, N, S)
    for i in range(h):
        torch.bmm(pc4[i], v[:, :, i // g], out=a[i])
    if empty_rows is not None:
        a.masked_fill_(empty_rows.transpose(0, 1), 0.0)
    return a, p, pc


def small_backward(da, q, k, v, lam, p, pc):
    """Gradients of q, k, v and lam from ``da`` (h, B, N, 2d) = dL/dA (contiguous), in the input layouts."""
    B, N, H2, d = q.shape
    S, h_kv = k.shape[1], k.shape[2] // 2
    h = H2 // 2
    g = h // h_kv
    ct = p.dtype
    dp = q.new_empty(h, B, N, S)  # dL/d(P1 - lam P2)
    dv = q.new_empty(h_kv, B, S, 2 * d)
    pc4 = pc.view(h, B, N, S)
    for i in range(h):
        torch.bmm(da[i], v[:, :, i // g].transpose(1, 2), out=dp[i])
        if i % g == 0:
            torch.bmm(pc4[i].transpose(1, 2), da[i], out=dv[i // g])
        else:  # the other query heads of the kv group add to its dV
            dv[i // g].baddbmm_(pc4[i].transpose(1, 2), da[i])
    dlam = -torch.vdot(p[1].reshape(-1), dp.view(-1))  # -sum(P2 * dp)
    # Softmax backward of each map with the same upstream dp (map 2's factor -lam goes on the small products).
    ds = torch.empty_like(p)
    dpf = dp.view(h * B, N, S)
    _softmax_bwd_out(dpf, p[0], -1, ct, grad_input=ds[0])
    _softmax_bwd_out(dpf, p[1], -1, ct, grad_input=ds[1])
    ds5 = ds.view(2, h, B, N, S)
    dq12 = q.new_empty(2, h, B, N, d)
    dk12 = q.new_empty(2, h_kv, B, S, d)
    scale = d ** -0.5
    for m in range(2):
        for i in range(h):
            kv = i // g
            torch.bmm(ds5[m, i], k[:, :, 2 * kv + m], out=dq12[m, i])
            qc = q[:, :, 2 * i + m]
            torch.baddbmm(dk12[m, kv], ds5[m, i].transpose(1, 2), qc, beta=0 if i % g == 0 else 1, alpha=scale,
                          out=dk12[m, kv])
    # Map 2's factor -lam (and q's 1/sqrt(d)) with the permutation back to the input layouts, one pass each.
    factor = torch.stack([torch.ones_like(lam), -lam]).view(2, 1)
    dq = torch.empty(B, N, h, 2, d, dtype=q.dtype, device=q.device)
    torch.mul(dq12.permute(2, 3, 1, 0, 4), factor * scale, out=dq)
    dk = torch.empty(B, S, h_kv, 2, d, dtype=k.dtype, device=k.device)
    torch.mul(dk12.permute(2, 3, 1, 0, 4), factor, out=dk)
    dv_out = torch.empty(B, S, h_kv, 2 * d, dtype=v.dtype, device=v.device).copy_(dv.permute(1, 2, 0, 3))
    return dq.view(B, N, 2 * h, d), dk.view(B, S, 2 * h_kv, d), dv_out, dlam.to(ct)
