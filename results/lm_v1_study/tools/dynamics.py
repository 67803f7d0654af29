"""Training dynamics probe: the compare_lm_variants loop (same seed/batches/optimizer) for one variant, logging
every 10 steps on a fixed train batch: residual RMS and max after each block, attention-branch RMS per block,
V1 pre-norm head-output RMS (median / 1st percentile over tokens and heads), lambda, grad norm.

    python dynamics.py VARIANT SEED OUT.json [--v1-out-init-scale S] [--lr LR]
"""
import importlib.util, json, math, statistics, sys
sys.path.insert(0, "/work/main")
import torch
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.nn.rope import apply_rope
from diffmm.ops import diff_attention
spec = importlib.util.spec_from_file_location("clv", "/work/main/scripts/compare_lm_variants.py")
clv = importlib.util.module_from_spec(spec); spec.loader.exec_module(clv)
torch.set_num_threads(1)
variant, seed, outp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
extra = sys.argv[4:]
out_scale = float(extra[extra.index("--v1-out-init-scale") + 1]) if "--v1-out-init-scale" in extra else 1.0
lr = float(extra[extra.index("--lr") + 1]) if "--lr" in extra else 3e-3
lam_init = extra[extra.index("--lambda-init") + 1] if "--lambda-init" in extra else "depth"
class A: pass
a = A(); a.lr, a.warmup, a.steps, a.seq, a.batch, a.wd, a.clip = lr, 30, 300, 128, 8, 0.05, 1.0
train, val, vocab, _ = clv.load_corpus(clv.PYDOC_SOURCES, "/tmp/diffmm_compare_lm", 2048)
torch.manual_seed(seed)
model = DiffLM(LMConfig(vocab_size=vocab, block_size=128, n_layer=4, n_embd=128, n_head=4, attention=variant,
                            lambda_init=lam_init))
if variant == "diff" and out_scale != 1.0:
    with torch.no_grad():
        for b in model.blocks:
            b.attn.out_proj.weight.mul_(out_scale)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=a.lr, betas=(0.9, 0.98), eps=1e-8)
g = torch.Generator().manual_seed(1000 + seed)
pg = torch.Generator().manual_seed(777)
probe_x, _ = clv.windows(val, torch.randint(0, len(val) - 129, (8,), generator=pg), 128)
rms = lambda t: t.float().pow(2).mean().sqrt().item()

@torch.no_grad()
def probe():
    rec = {"resid_rms": [], "resid_max": [], "attn_rms": [], "attn_max": [], "prenorm_med": [], "prenorm_p01": [],
           "lambda": [], "diff_norm_w": [], "out_w_rms": [], "v_w_rms": []}
    hooks = []
    def ah(mod, args, kw, out):
        rec["attn_rms"].append(rms(out)); rec["attn_max"].append(out.abs().max().item())
        rec["out_w_rms"].append(rms(mod.out_proj.weight)); rec["v_w_rms"].append(rms(mod.v_proj.weight))
        if hasattr(mod, "lambda_full"):
            x = args[0]; B, N, _ = x.shape; h, hk, d = mod.num_heads, mod.num_kv_heads, mod.head_dim
            q = apply_rope(mod.q_proj(x).view(B, N, 2 * h, d), *kw["rope"])
            k = apply_rope(mod.k_proj(x).view(B, N, 2 * hk, d), *kw["rope"])
            v = mod.v_proj(x).view(B, N, hk, 2 * d)
            raw = diff_attention(q, k, v, mod.lambda_full(), causal=True)
            r = raw.float().pow(2).mean(-1).sqrt().flatten()  # per token and head
            rec["prenorm_med"].append(r.median().item()); rec["prenorm_p01"].append(r.quantile(0.01).item())
            rec["lambda"].append(mod.lambda_full().item()); rec["diff_norm_w"].append(rms(mod.diff_norm.weight))
    rec["out_proj_in_rms"] = []
    for b in model.blocks:
        hooks.append(b.attn.out_proj.register_forward_pre_hook(
            lambda m, args: rec["out_proj_in_rms"].append(rms(args[0]))))
        hooks.append(b.attn.register_forward_hook(ah, with_kwargs=True))
        def bh(m, args, o):
            rec["resid_rms"].append(rms(o)); rec["resid_max"].append(o.abs().max().item())
        hooks.append(b.register_forward_hook(bh))
    model.eval(); model.forward_hidden(probe_x); model.train()
    for h_ in hooks: h_.remove()
    return rec

log = []
norms = []
for step in range(a.steps):
    x, y = clv.windows(train, torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=g), a.seq)
    for group in opt.param_groups:
        group["lr"] = clv.lr_at(step, a)
    if step % 10 == 0:
        rec = probe(); rec["step"] = step
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True); loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip).item()
    norms.append(gn)
    if step % 10 == 0:
        rec["loss"], rec["grad_norm"] = loss.item(), gn; log.append(rec)
        print(step, f"loss {loss.item():.3f} gn {gn:.2f} resid_rms", [round(v, 3) for v in rec["resid_rms"]],
              "attn_rms", [round(v, 3) for v in rec["attn_rms"]], "lam", [round(v, 3) for v in rec["lambda"]],
              "p01", [round(v, 4) for v in rec["prenorm_p01"]],
              "oin", [round(v, 3) for v in rec["out_proj_in_rms"]], flush=True)
    opt.step()
json.dump({"variant": variant, "seed": seed, "out_scale": out_scale, "lambda_init": lam_init, "lr": lr, "log": log, "grad_norms": norms},
          open(outp, "w"))
