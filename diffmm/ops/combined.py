"""Differential attention with the two maps combined before V, in query chunks (pure PyTorch).

The SDPA layouts pay for the differential structure in FLOPs: ``split`` computes every QK^T twice (four
d-wide products per head), ``pair`` runs two 2d-wide products per head on the math kernel. This path
instead forms the combined map once per query chunk and multiplies V once::

    P_m = softmax(Q_m K_m^T / sqrt(d) + mask)     m = 1, 2      (rows, S) per head, fp32
    A   = (P_1 - lam * P_2) V                                   (rows, 2d)

so it does the FLOPs of standard attention of equal width (two d-wide QK^T and one 2d-wide PV per head).
The backward recomputes the maps chunk by chunk instead of storing them, so memory is O(chunk x S), linear
in N, like a flash kernel. Causal chunks only touch the keys they can see. The matmuls are batched over
both maps and, for GQA, over the query heads of a kv group (folded into the rows), so K and V are never
repeated.

Everything runs in fp32 (fp64 for fp64 inputs). This is the sdpa backend's ``combined`` layout; the
auto-dispatch picks it on CPU (see :mod:`diffmm.ops.sdpa`).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from diffmm.ops._validate import MaskSpec
from diffmm.ops.epilogue import compute_dtype

#: Target number of score elements (both maps, all heads of a batch) per chunk: 2^22 fp32 = 16 MiB.
CHUNK_ELEMENTS = 1 << 22


def _rows_per_chunk(B: int, h: int, N: int, S: int) -> int:
    return max(1, min(N, CHUNK_ELEMENTS // max(1, 2 * B * h * S)))


class _Geometry:
    """Shapes shared by forward and backward."""

    def __init__(self, q12: torch.Tensor, k12: torch.Tensor, mask: torch.Tensor | None, is_causal: bool):
        self.B, _, self.h_kv, self.g, self.N, self.d = q12.shape  # q12 (B, 2, h_kv, g, N, d)
        self.S = k12.shape[3]
        self.h = self.h_kv * self.g
        self.mask, self.is_causal = mask, is_causal
        self.rows = _rows_per_chunk(self.B, self.h, self.N, self.S)

    def chunks(self):
        for i0 in range(0, self.N, self.rows):
            i1 = min(self.N, i0 + self.rows)
            # Causal (square, N == S): rows < i1 see keys < i1 only.
            yield i0, i1, (i1 if self.is_causal else self.S)

    def scores(self, q12, k12, i0, i1, s_vis):
        """Softmax maps of rows i0:i1 over keys :s_vis -> (B, 2, h_kv, g*rows, s_vis)."""
        B, h_kv, g, n, d = self.B, self.h_kv, self.g, i1 - i0, self.d
        qc = q12[:, :, :, :, i0:i1].reshape(B, 2, h_kv, g * n, d)
        s = torch.matmul(qc, k12[:, :, :, :s_vis].transpose(-1, -2))  # (B, 2, h_kv, g*n, s_vis)
        s6 = s.view(B, 2, h_kv, g, n, s_vis)
        if self.is_causal:  # N == S and s_vis == i1: only the (n, n) diagonal block has hidden keys
            hidden = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
            s6[..., i0:s_vis].masked_fill_(hidden, float("-inf"))
        if self.mask is not None:
            m = self.mask  # (B|1, 1|h, N|1, S)
            m = m[:, :, i0:i1] if m.shape[2] > 1 else m
            m = m[..., :s_vis].unsqueeze(1)  # (B|1, 1, 1|h, n|1, s_vis)
            if m.shape[2] > 1:
                m = m.unflatten(2, (h_kv, g))
            else:
                m = m.unsqueeze(2)  # (B|1, 1, 1, 1, n|1, s_vis)
            if m.dtype == torch.bool:
                s6.masked_fill_(~m, float("-inf"))
            else:
                s6.add_(m.to(s.dtype))
        return torch.softmax(s, dim=-1), qc


class _CombinedDiffAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q12, k12, v, lam, mask, is_causal):
        # q12 (B, 2, h_kv, g, N, d) pre-scaled by 1/sqrt(d); k12 (B, 2, h_kv, S, d); v (B, h_kv, S, 2d)
        geo = _Geometry(q12, k12, mask, is_causal)
        out = q12.new_empty(geo.B, geo.h_kv, geo.g, geo.N, v.shape[-1])  # (B, h_kv, g, N, 2d)
        for i0, i1, s_vis in geo.chunks():
            p, _ = geo.scores(q12, k12, i0, i1, s_vis)
            pc = p[:, 0].sub_(p[:, 1].mul_(lam))  # P1 - lam P2 (B, h_kv, g*n, s_vis), in place
            o = torch.matmul(pc, v[:, :, :s_vis])  # (B, h_kv, g*n, 2d)
            out[:, :, :, i0:i1] = o.view(geo.B, geo.h_kv, geo.g, i1 - i0, -1)
        ctx.save_for_backward(q12, k12, v, lam)
        ctx.geo = geo
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q12, k12, v, lam = ctx.saved_tensors
        geo = ctx.geo
        neg_lam = -lam
        dout = dout.contiguous()  # (B, h_kv, g, N, 2d)
        dq12 = torch.empty_like(q12)
        dk12 = torch.zeros_like(k12)
        dv = torch.zeros_like(v)
        dlam = torch.zeros((), dtype=q12.dtype, device=q12.device)
        B, h_kv, g = geo.B, geo.h_kv, geo.g
        for i0, i1, s_vis in geo.chunks():
            n = i1 - i0
            p, qc = geo.scores(q12, k12, i0, i1, s_vis)  # (B, 2, h_kv, g*n, s_vis)
            do = dout[:, :, :, i0:i1].reshape(B, h_kv, g * n, -1)  # (B, h_kv, g*n, 2d)
            dp = torch.matmul(do, v[:, :, :s_vis].transpose(-1, -2))  # dL/d(combined map)
            pc = torch.addcmul(p[:, 0], p[:, 1], neg_lam)  # P1 - lam P2
            dv[:, :, :s_vis] += torch.matmul(pc.transpose(-1, -2), do)
            del pc
            # Map m receives dP_m = c_m * dp with c_1 = 1, c_2 = -lam; softmax backward per map:
            # dS_m = c_m * P_m * (dp - rowsum(P_m * dp)).
            ds = p * dp.unsqueeze(1)  # (B, 2, h_kv, g*n, s_vis): P_m * dp
            row = ds.sum(dim=-1, keepdim=True)  # (B, 2, h_kv, g*n, 1)
            dlam -= row[:, 1].sum()
            ds.addcmul_(p, row, value=-1.0)  # P_m * (dp - rowsum(P_m * dp))
            del p
            ds[:, 1].mul_(neg_lam)
            dq12[:, :, :, :, i0:i1] = torch.matmul(ds, k12[:, :, :, :s_vis]).view(B, 2, h_kv, g, n, -1)
            dk12[:, :, :, :s_vis] += torch.matmul(ds.transpose(-1, -2), qc)
        return dq12, dk12, dv, dlam.to(lam.dtype).reshape(lam.shape), None, None


def combined_diff_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor,
                            spec: MaskSpec) -> torch.Tensor:
    """``(P_1 - lam P_2) V`` with the maps combined before V.

    Args:
        q: (B, N, 2h, d), k: (B, S, 2h_kv, d), v: (B, S, h_kv, 2d) in the interleaved component layout.
        lam: 0-d tensor.
        spec: the prepared mask (see :func:`diffmm.ops._validate.prepare_mask`).
    Returns:
        (B, h, N, 2d) in fp32 (fp64 for fp64 inputs): the input of the differential epilogue.
    """
    B, N, H2, d = q.shape
    S, h, h_kv = k.shape[1], H2 // 2, k.shape[2] // 2
    ct = compute_dtype(q.dtype)
    # Components: (B, N, 2h, d) -> (B, N, h, 2, d) -> (B, 2, h, N, d) -> (B, 2, h_kv, g, N, d)
    q12 = (q.to(ct) * d ** -0.5).unflatten(2, (h, 2)).permute(0, 3, 2, 1, 4)
    q12 = q12.reshape(B, 2, h_kv, h // h_kv, N, d)
    k12 = k.to(ct).unflatten(2, (h_kv, 2)).permute(0, 3, 2, 1, 4).contiguous()  # (B, 2, h_kv, S, d)
    vt = v.to(ct).transpose(1, 2).contiguous()  # (B, h_kv, S, 2d)
    out = _CombinedDiffAttention.apply(q12.contiguous(), k12, vt, lam.to(ct), spec.mask, spec.is_causal)
    return out.reshape(B, h, N, -1)  # (B, h, N, 2d)
