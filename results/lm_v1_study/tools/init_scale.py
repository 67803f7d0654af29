"""Init-time scale measurements: standard vs DIFF V1 vs V2 tiny LM (the compare_lm_variants config).

Per block on one val batch (8 x 128): RMS of the residual stream entering the block, of the attention
branch output and of the MLP branch output; for V1 the RMS of the pre-norm head output (A1 - lambda A2) V by
position; and the gradient RMS per parameter kind after one backward pass.
"""
import json, math, sys
sys.path.insert(0, "/work/main")
import torch
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.nn.rope import apply_rope
from diffmm.ops import diff_attention

torch.set_num_threads(1)
d = torch.load("/tmp/diffmm_compare_lm/pydocs-bpe2048.pt", weights_only=True)
val, vocab = d["val"], int(d["vocab_size"])
vg = torch.Generator().manual_seed(12345)
starts = torch.randint(0, len(val) - 129, (8, 8), generator=vg)[0]
rows = torch.stack([val[s:s + 129] for s in starts.tolist()]).long()
x_ids, y_ids = rows[:, :-1], rows[:, 1:]
rms = lambda t: t.float().pow(2).mean().sqrt().item()

def measure(variant, seed, heads=4, out_scale=1.0):
    torch.manual_seed(seed)
    m = DiffLM(LMConfig(vocab_size=vocab, block_size=128, n_layer=4, n_embd=128, n_head=heads, attention=variant))
    if out_scale != 1.0:
        with torch.no_grad():
            for b in m.blocks:
                b.attn.out_proj.weight.mul_(out_scale)
    rec = {"resid_in": [], "attn_out": [], "mlp_out": [], "attn_in_rms": [], "out_proj_in": []}
    pre = []
    def attn_hook(mod, args, kw, out):
        rec["attn_out"].append(rms(out))
        x = args[0]
        rec["attn_in_rms"].append(rms(x))
        if variant == "diff":
            B, N, _ = x.shape
            h, hk, dd = mod.num_heads, mod.num_kv_heads, mod.head_dim
            q = apply_rope(mod.q_proj(x).view(B, N, 2 * h, dd), *kw["rope"])
            k = apply_rope(mod.k_proj(x).view(B, N, 2 * hk, dd), *kw["rope"])
            v = mod.v_proj(x).view(B, N, hk, 2 * dd)
            raw = diff_attention(q, k, v, mod.lambda_full(), causal=True)  # (B, N, h, 2d) pre-norm
            r = raw.float().pow(2).mean(dim=(0, 2, 3)).sqrt()  # per position
            pre.append({"pos0": r[0].item(), "pos1-15": r[1:16].mean().item(), "pos16-63": r[16:64].mean().item(),
                        "pos64-127": r[64:].mean().item(), "v_rms": rms(v), "lambda": mod.lambda_full().item(),
                        "lambda_init": mod.lambda_init})
    hooks = []
    for b in m.blocks:
        hooks.append(b.attn.out_proj.register_forward_pre_hook(lambda mod, args: rec["out_proj_in"].append(rms(args[0]))))
        hooks.append(b.register_forward_pre_hook(lambda mod, args: rec["resid_in"].append(rms(args[0]))))
        hooks.append(b.attn.register_forward_hook(attn_hook, with_kwargs=True))
        hooks.append(b.mlp.register_forward_hook(lambda mod, a, out: rec["mlp_out"].append(rms(out))))
    _, loss = m(x_ids, y_ids)
    for h_ in hooks:
        h_.remove()
    loss.backward()
    kinds = {}
    for n, p in m.named_parameters():
        if p.grad is None:
            continue
        k = n.split(".")[-2] + "." + n.split(".")[-1] if "blocks" in n else n
        k = k.replace("attn.", "")
        kinds.setdefault(k, []).append((p.grad.float().pow(2).sum().item(), p.numel(), p.detach().float().pow(2).sum().item()))
    grads = {k: {"grad_rms": math.sqrt(sum(a for a, _, _ in v) / sum(b for _, b, _ in v)),
                 "w_rms": math.sqrt(sum(c for _, _, c in v) / sum(b for _, b, _ in v))} for k, v in kinds.items()}
    total = math.sqrt(sum(p.grad.pow(2).sum().item() for p in m.parameters() if p.grad is not None))
    return dict(variant=variant, seed=seed, heads=heads, out_scale=out_scale, loss=loss.item(), grad_norm=total,
                **rec, v1_prenorm=pre, grads=grads)

out = []
for variant, heads, sc in [("standard", 4, 1.0), ("diff", 4, 1.0), ("diff_v2", 4, 1.0), ("diff", 4, 0.1),
                           ("standard", 8, 1.0), ("diff", 8, 1.0)]:
    for seed in (0, 1, 2):
        out.append(measure(variant, seed, heads, sc))
json.dump(out, open(sys.argv[1], "w"), indent=1)
import statistics as st
f = lambda xs: " ".join(f"{x:.4f}" for x in xs)
for variant, heads, sc in [("standard", 4, 1.0), ("diff", 4, 1.0), ("diff_v2", 4, 1.0), ("diff", 4, 0.1),
                           ("standard", 8, 1.0), ("diff", 8, 1.0)]:
    rs = [r for r in out if r["variant"] == variant and r["heads"] == heads and r["out_scale"] == sc]
    avg = lambda key: [st.mean(r[key][i] for r in rs) for i in range(4)]
    print(f"## {variant} heads={heads} out_scale={sc}: loss {st.mean(r['loss'] for r in rs):.4f} "
          f"grad norm {st.mean(r['grad_norm'] for r in rs):.3f}")
    print("  resid_in per block :", f(avg("resid_in")))
    print("  out_proj input RMS :", f(avg("out_proj_in")))
    print("  attn_out per block :", f(avg("attn_out")))
    print("  mlp_out  per block :", f(avg("mlp_out")))
    if rs[0]["v1_prenorm"]:
        for i in range(4):
            p = {k: st.mean(r["v1_prenorm"][i][k] for r in rs) for k in rs[0]["v1_prenorm"][i]}
            print(f"  V1 layer {i} pre-norm RMS: " + " ".join(f"{k}={v:.4f}" for k, v in p.items()))
    g = rs[0]["grads"]
    print("  grad rms (seed 0):", " ".join(f"{k}={v['grad_rms']:.2e}" for k, v in sorted(g.items())))
