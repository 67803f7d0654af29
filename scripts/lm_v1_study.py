"""Tools of the tiny-LM DIFF V1 study (``results/lm_v1_study/REPORT.md``), around ``compare_lm_variants.py``.

    python scripts/lm_v1_study.py ablate --no-subnorm [compare_lm_variants options ...]
    python scripts/lm_v1_study.py dynamics diff 1 dyn_diff_s1.json [--v1-out-init-scale S] [--lr LR]
    python scripts/lm_v1_study.py init-scale init_scale.json > init_scale.txt
    python scripts/lm_v1_study.py table [--dir results/lm_v1_study] [--per-seed]

``ablate`` runs ``compare_lm_variants.py`` with one of these patches, applied in its own process only
(the library is untouched):

- ``--no-subnorm``: V1 layers skip the per-head RMSNorm and the (1 - lambda_init) factor, so the head
  output is the raw (A1 - lambda A2) V (what standard attention's A V is to it).
- ``--epilogue-scale S``: the (1 - lambda_init) factor after the per-head norm becomes S (a number, or
  ``depth`` = 1 - lambda_init_depth(l)); lambda itself is unchanged. Applies to V1 and to ``--std-subnorm``.
- ``--subnorm-eps X``: eps of V1's per-head RMSNorm (default 1e-5).
- ``--std-subnorm``: standard attention gets V1's head epilogue (parameter-free per-head RMSNorm times
  1 - lambda_init_depth(l), or S with ``--epilogue-scale``).

``dynamics`` reruns the compare loop (same seed, batches, optimizer) for one variant and probes a fixed
validation batch every 10 steps: residual RMS and max after each block, attention-branch RMS, out_proj
input RMS, V1's pre-norm head-output RMS (median / 1st percentile), lambda, norm weight, weight RMS,
grad norm. ``init-scale`` measures the same scales at initialisation (3 seeds, 6 model variants).
``table`` prints the markdown table of every run JSON in the study folder (REPORT.md section (a)).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics as st
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):  # diffmm (the checkout this script belongs to) and compare_lm_variants
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import compare_lm_variants as clv  # noqa: E402
from diffmm.models.lm import DiffLM, LMConfig  # noqa: E402
from diffmm.nn.attention import Attention  # noqa: E402
from diffmm.nn.diff_attention import DiffAttention  # noqa: E402
from diffmm.nn.lambdas import lambda_init_depth  # noqa: E402
from diffmm.nn.rope import apply_rope  # noqa: E402
from diffmm.ops import attention as std_attention  # noqa: E402
from diffmm.ops import diff_attention  # noqa: E402

STUDY_DIR = os.path.join("results", "lm_v1_study")


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


# ------------------------------------------------------------------------------------------ ablate
_EPI = None  # None: each layer's own (1 - lambda_init); 'depth': 1 - lambda_init_depth(l); else that number


def _epi_scale(layer_idx: int, own: float) -> float:
    if _EPI is None:
        return own
    return 1 - lambda_init_depth(layer_idx) if _EPI == "depth" else float(_EPI)


def _forward_no_subnorm(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
    """DiffAttention.forward without the per-head RMSNorm and (1 - lambda_init): raw (A1 - lambda A2) V."""
    B, N, _ = x.shape
    q, k, v = self._qkv(x, rope, kv_cache)
    out = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                         attn_mask=attn_mask, backend=self.backend)  # (B, N, h, 2d)
    return self.out_proj(out.reshape(B, N, 2 * self.num_heads * self.head_dim))


def _forward_epilogue(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
    """DiffAttention.forward with the (1 - lambda_init) factor of the head epilogue replaced by _epi_scale."""
    B, N, _ = x.shape
    q, k, v = self._qkv(x, rope, kv_cache)
    out = diff_attention(q, k, v, self.lambda_full(), causal=self.causal if causal is None else causal,
                         attn_mask=attn_mask, norm_weight=self.diff_norm.weight, lambda_init=self.lambda_init,
                         eps=self.diff_norm.eps, backend=self.backend)  # (B, N, h, 2d)
    out = out * (_epi_scale(self.layer_idx, 1 - self.lambda_init) / (1 - self.lambda_init))
    return self.out_proj(out.reshape(B, N, 2 * self.num_heads * self.head_dim))


def _forward_std_subnorm(self, x, *, attn_mask=None, rope=None, kv_cache=None, causal=None):
    """Standard attention + V1's head epilogue: parameter-free per-head RMSNorm * (1 - lambda_init(depth))."""
    B, N, _ = x.shape
    H, Hk, d = self.num_heads, self.num_kv_heads, self.head_dim
    q = self.q_proj(x).view(B, N, H, d)
    k = self.k_proj(x).view(B, N, Hk, d)
    v = self.v_proj(x).view(B, N, Hk, d)
    if self.use_rope:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = std_attention(q, k, v, causal=self.causal if causal is None else causal, attn_mask=attn_mask,
                        backend=self.backend)  # (B, N, H, d)
    out = F.rms_norm(out.float(), (d,), eps=1e-5) * _epi_scale(self.layer_idx, 1 - lambda_init_depth(self.layer_idx))
    return self.out_proj(out.to(x.dtype).reshape(B, N, H * d))


def apply_patches(argv: list[str]) -> tuple[list[str], list[str]]:
    """Apply the patches named in ``argv`` (removing their options); returns (rest of argv, tags)."""
    global _EPI
    argv, tag = list(argv), []
    if "--epilogue-scale" in argv:
        i = argv.index("--epilogue-scale")
        _EPI = argv[i + 1]
        del argv[i:i + 2]
        if _EPI != "depth":
            float(_EPI)  # a number or 'depth'
        DiffAttention.forward = _forward_epilogue
        tag.append(f"epilogue_scale={_EPI}")
    if "--std-subnorm" in argv:
        argv.remove("--std-subnorm")
        Attention.forward = _forward_std_subnorm
        tag.append("std_subnorm")
    if "--subnorm-eps" in argv:
        i = argv.index("--subnorm-eps")
        eps = float(argv[i + 1])
        del argv[i:i + 2]
        init = DiffAttention.__init__

        def _init_eps(self, *a, **k):
            init(self, *a, **k)
            self.diff_norm.eps = eps
        DiffAttention.__init__ = _init_eps
        tag.append(f"subnorm_eps={eps}")
    if "--no-subnorm" in argv:
        argv.remove("--no-subnorm")
        DiffAttention.forward = _forward_no_subnorm
        tag.append("no_subnorm")
    return argv, tag


def ablate(argv: list[str]) -> int:
    argv, tag = apply_patches(argv)
    rc = clv.main(argv)
    if "--json" in argv:
        path = argv[argv.index("--json") + 1]
        with open(path) as f:
            d = json.load(f)
        d["ablation"] = tag
        with open(path, "w") as f:
            json.dump(d, f, indent=1)
    return rc


# ---------------------------------------------------------------------------------------- dynamics
def _v1_prenorm(mod, x, rope) -> torch.Tensor:
    """V1's head output before the per-head norm, (A1 - lambda A2) V: (B, N, h, 2d)."""
    q, k, v = mod._qkv(x, rope, None)
    return diff_attention(q, k, v, mod.lambda_full(), causal=True)


def dynamics(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lm_v1_study.py dynamics")
    p.add_argument("variant", choices=clv.VARIANTS)
    p.add_argument("seed", type=int)
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--v1-out-init-scale", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lambda-init", default="depth")
    p.add_argument("--source", default=clv.PYDOC_SOURCES)
    p.add_argument("--cache", default=clv.DEFAULT_CACHE)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    a = argparse.Namespace(lr=args.lr, warmup=30, steps=300, seq=128, batch=8, wd=0.05, clip=1.0)
    train, val, vocab, _ = clv.load_corpus(args.source, args.cache, 2048)
    torch.manual_seed(args.seed)
    model = DiffLM(LMConfig(vocab_size=vocab, block_size=128, n_layer=4, n_embd=128, n_head=4,
                            attention=args.variant, lambda_init=args.lambda_init))
    if args.variant == "diff" and args.v1_out_init_scale != 1.0:
        with torch.no_grad():
            for b in model.blocks:
                b.attn.out_proj.weight.mul_(args.v1_out_init_scale)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.98), eps=1e-8)
    g = torch.Generator().manual_seed(1000 + args.seed)
    probe_x, _ = clv.windows(val, torch.randint(0, len(val) - 129, (8,), generator=torch.Generator().manual_seed(777)),
                             128)

    @torch.no_grad()
    def probe() -> dict:
        rec = {k: [] for k in ("resid_rms", "resid_max", "attn_rms", "attn_max", "prenorm_med", "prenorm_p01",
                               "lambda", "diff_norm_w", "out_w_rms", "v_w_rms", "out_proj_in_rms")}

        def attn_hook(mod, hargs, kw, out):
            rec["attn_rms"].append(_rms(out))
            rec["attn_max"].append(out.abs().max().item())
            rec["out_w_rms"].append(_rms(mod.out_proj.weight))
            rec["v_w_rms"].append(_rms(mod.v_proj.weight))
            if hasattr(mod, "lambda_full"):
                r = _v1_prenorm(mod, hargs[0], kw["rope"]).float().pow(2).mean(-1).sqrt().flatten()  # per token, head
                rec["prenorm_med"].append(r.median().item())
                rec["prenorm_p01"].append(r.quantile(0.01).item())
                rec["lambda"].append(mod.lambda_full().item())
                rec["diff_norm_w"].append(_rms(mod.diff_norm.weight))

        def block_hook(m, hargs, o):
            rec["resid_rms"].append(_rms(o))
            rec["resid_max"].append(o.abs().max().item())

        hooks = []
        for b in model.blocks:
            hooks.append(b.attn.out_proj.register_forward_pre_hook(
                lambda m, hargs: rec["out_proj_in_rms"].append(_rms(hargs[0]))))
            hooks.append(b.attn.register_forward_hook(attn_hook, with_kwargs=True))
            hooks.append(b.register_forward_hook(block_hook))
        model.eval()
        model.forward_hidden(probe_x)
        model.train()
        for h in hooks:
            h.remove()
        return rec

    log, norms = [], []
    for step in range(a.steps):
        x, y = clv.windows(train, torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=g), a.seq)
        for group in opt.param_groups:
            group["lr"] = clv.lr_at(step, a)
        if step % 10 == 0:
            rec = probe()
            rec["step"] = step
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip).item()
        norms.append(gn)
        if step % 10 == 0:
            rec["loss"], rec["grad_norm"] = loss.item(), gn
            log.append(rec)
            r3 = lambda key: [round(v, 3) for v in rec[key]]  # noqa: E731
            print(step, f"loss {loss.item():.3f} gn {gn:.2f} resid_rms", r3("resid_rms"), "attn_rms", r3("attn_rms"),
                  "lam", r3("lambda"), "p01", [round(v, 4) for v in rec["prenorm_p01"]], "oin", r3("out_proj_in_rms"),
                  flush=True)
        opt.step()
    with open(args.out, "w") as f:
        json.dump({"variant": args.variant, "seed": args.seed, "out_scale": args.v1_out_init_scale,
                   "lambda_init": args.lambda_init, "lr": args.lr, "log": log, "grad_norms": norms}, f)
    return 0


# -------------------------------------------------------------------------------------- init-scale
INIT_CONFIGS = [("standard", 4, 1.0), ("diff", 4, 1.0), ("diff_v2", 4, 1.0), ("diff", 4, 0.1),
                ("standard", 8, 1.0), ("diff", 8, 1.0)]


def _measure(variant: str, seed: int, heads: int, out_scale: float, vocab: int, x_ids, y_ids) -> dict:
    torch.manual_seed(seed)
    m = DiffLM(LMConfig(vocab_size=vocab, block_size=128, n_layer=4, n_embd=128, n_head=heads, attention=variant))
    if out_scale != 1.0:
        with torch.no_grad():
            for b in m.blocks:
                b.attn.out_proj.weight.mul_(out_scale)
    rec = {"resid_in": [], "attn_out": [], "mlp_out": [], "attn_in_rms": [], "out_proj_in": []}
    pre = []

    def attn_hook(mod, hargs, kw, out):
        rec["attn_out"].append(_rms(out))
        rec["attn_in_rms"].append(_rms(hargs[0]))
        if variant == "diff":
            q, k, v = mod._qkv(hargs[0], kw["rope"], None)
            r = _v1_prenorm(mod, hargs[0], kw["rope"]).float().pow(2).mean(dim=(0, 2, 3)).sqrt()  # per position
            pre.append({"pos0": r[0].item(), "pos1-15": r[1:16].mean().item(), "pos16-63": r[16:64].mean().item(),
                        "pos64-127": r[64:].mean().item(), "v_rms": _rms(v), "lambda": mod.lambda_full().item(),
                        "lambda_init": mod.lambda_init})

    hooks = []
    for b in m.blocks:
        hooks.append(b.attn.out_proj.register_forward_pre_hook(lambda mod, a: rec["out_proj_in"].append(_rms(a[0]))))
        hooks.append(b.register_forward_pre_hook(lambda mod, a: rec["resid_in"].append(_rms(a[0]))))
        hooks.append(b.attn.register_forward_hook(attn_hook, with_kwargs=True))
        hooks.append(b.mlp.register_forward_hook(lambda mod, a, out: rec["mlp_out"].append(_rms(out))))
    _, loss = m(x_ids, y_ids)
    for h in hooks:
        h.remove()
    loss.backward()
    kinds: dict[str, list] = {}
    for n, q in m.named_parameters():
        if q.grad is None:
            continue
        k = (n.split(".")[-2] + "." + n.split(".")[-1] if "blocks" in n else n).replace("attn.", "")
        kinds.setdefault(k, []).append((q.grad.float().pow(2).sum().item(), q.numel(), q.detach().float().pow(2).sum().item()))
    grads = {k: {"grad_rms": math.sqrt(sum(a for a, _, _ in v) / sum(b for _, b, _ in v)),
                 "w_rms": math.sqrt(sum(c for _, _, c in v) / sum(b for _, b, _ in v))} for k, v in kinds.items()}
    total = math.sqrt(sum(q.grad.pow(2).sum().item() for q in m.parameters() if q.grad is not None))
    return dict(variant=variant, seed=seed, heads=heads, out_scale=out_scale, loss=loss.item(), grad_norm=total,
                **rec, v1_prenorm=pre, grads=grads)


def init_scale(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lm_v1_study.py init-scale")
    p.add_argument("out", help="JSON file to write; the summary goes to stdout")
    p.add_argument("--source", default=clv.PYDOC_SOURCES)
    p.add_argument("--cache", default=clv.DEFAULT_CACHE)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    _, val, vocab, _ = clv.load_corpus(args.source, args.cache, 2048)
    starts = torch.randint(0, len(val) - 129, (8, 8), generator=torch.Generator().manual_seed(12345))[0]
    rows = torch.stack([val[s:s + 129] for s in starts.tolist()]).long()  # (8, 129)
    x_ids, y_ids = rows[:, :-1], rows[:, 1:]
    out = [_measure(v, seed, h, sc, vocab, x_ids, y_ids) for v, h, sc in INIT_CONFIGS for seed in (0, 1, 2)]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    f4 = lambda xs: " ".join(f"{x:.4f}" for x in xs)  # noqa: E731
    for variant, heads, sc in INIT_CONFIGS:
        rs = [r for r in out if r["variant"] == variant and r["heads"] == heads and r["out_scale"] == sc]
        avg = lambda key: [st.mean(r[key][i] for r in rs) for i in range(4)]  # noqa: E731
        print(f"## {variant} heads={heads} out_scale={sc}: loss {st.mean(r['loss'] for r in rs):.4f} "
              f"grad norm {st.mean(r['grad_norm'] for r in rs):.3f}")
        print("  resid_in per block :", f4(avg("resid_in")))
        print("  out_proj input RMS :", f4(avg("out_proj_in")))
        print("  attn_out per block :", f4(avg("attn_out")))
        print("  mlp_out  per block :", f4(avg("mlp_out")))
        if rs[0]["v1_prenorm"]:
            for i in range(4):
                pm = {k: st.mean(r["v1_prenorm"][i][k] for r in rs) for k in rs[0]["v1_prenorm"][i]}
                print(f"  V1 layer {i} pre-norm RMS: " + " ".join(f"{k}={v:.4f}" for k, v in pm.items()))
        print("  grad rms (seed 0):", " ".join(f"{k}={v['grad_rms']:.2e}" for k, v in sorted(rs[0]["grads"].items())))
    return 0


# ------------------------------------------------------------------------------------------- table
DESC = {
    "base_lr3e-3": "baseline (library defaults)",
    "heads8_lr3e-3": "--heads 8 (V1: 4 heads of d=16)",
    "lr1e-3": "baseline", "lr6e-4": "baseline",
    "v1_out0.1": "V1 out_proj init x0.1 (--v1-out-init-scale 0.1)",
    "v1_vinit5": "V1 v_proj init x5 (--v1-v-init-scale 5)",
    "v1_lamlr0.1": "lambda lr x0.1 (--lambda-lr-mult 0.1)",
    "v1_lam_constant": "lambda_init constant 0.8 (lambda AND epilogue factor 1-0.8=0.2)",
    "v1_lam_constant_lr1e-3": "lambda_init constant 0.8",
    "v1_no_subnorm": "no per-head RMSNorm, no (1-lambda_init) factor [patch]",
    "v1_no_subnorm_lr1e-3": "no per-head RMSNorm [patch]",
    "v1_no_subnorm_heads8": "no per-head RMSNorm, --heads 8 [patch]",
    "v1_subnorm_eps1e-2": "per-head RMSNorm eps 1e-2 instead of 1e-5 [patch]",
    "v1_lamconst_epidepth": "lambda_init 0.8 but epilogue factor 1-lambda_depth(l) [patch]",
    "v1_lamdepth_epi0.4": "depth lambda, epilogue factor 0.4 [patch]",
    "v1_lamdepth_epi0.2": "depth lambda, epilogue factor 0.2 [patch]",
    "v1_lamdepth_epi0.1": "depth lambda, epilogue factor 0.1 [patch]",
    "v1_lamdepth_epi0.05": "depth lambda, epilogue factor 0.05 [patch]",
    "v1_lamdepth_epi0.2_lr1e-3": "depth lambda, epilogue factor 0.2 [patch]",
    "v1_lamdepth_epi0.1_lr1e-3": "depth lambda, epilogue factor 0.1 [patch]",
    "std_subnorm": "standard + V1 head epilogue: per-head RMSNorm x (1-lambda_depth(l)) [patch]",
    "std_subnorm_epi0.2": "standard + per-head RMSNorm x 0.2 [patch]",
    "std_subnorm_epi0.1": "standard + per-head RMSNorm x 0.1 [patch]",
    "std_subnorm_epi0.05": "standard + per-head RMSNorm x 0.05 [patch]",
    "long1000_base": "baseline, 1000 steps, warmup 100",
    "long1000_v1_lam_constant": "lambda_init constant, 1000 steps",
    "long1000_v1_no_subnorm": "no per-head RMSNorm, 1000 steps [patch]",
    "long1000_v1_epi0.2": "epilogue factor 0.2, 1000 steps [patch]",
    "long1000_v1_epi0.1": "epilogue factor 0.1, 1000 steps [patch]",
    "long1000_v2": "baseline V2, 1000 steps",
}
VNAME = {"standard": "standard", "diff": "V1", "diff_v2": "V2"}


def _runs(folder: str) -> dict[str, dict]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name.startswith("dyn_") or name == "init_scale":
            continue
        with open(path) as f:
            runs[name] = json.load(f)
    return runs


def study_table(folder: str) -> str:
    """REPORT.md's table (a): every run, with the paired delta against the same-config standard baseline."""
    runs = {n: d for n, d in _runs(folder).items() if n in DESC}
    ref = {}  # standard val loss per (lr, steps, heads, seed), from the unpatched runs
    for name, d in runs.items():
        a = d["args"]
        for r in d["results"]:
            if r["variant"] == "standard" and "subnorm" not in name:
                ref[(a["lr"], a["steps"], a["heads"], r["seed"])] = r["val_loss"]
    lines = ["| json | attention | config | lr | steps | seeds | val loss mean ± std | Δ vs standard (paired, mean) "
             "| spikes per seed | top-1 hidden (mean) |", "|---|---|---|---:|---:|---|---:|---:|---|---:|"]
    for name in DESC:
        if name not in runs:
            continue
        a = runs[name]["args"]
        for v in clv.VARIANTS:
            rs = [r for r in runs[name]["results"] if r["variant"] == v]
            if not rs:
                continue
            vl = [r["val_loss"] for r in rs]
            sd = st.stdev(vl) if len(vl) > 1 else 0.0
            deltas = [r["val_loss"] - ref[key] for r in rs
                      if (key := (a["lr"], a["steps"], a["heads"], r["seed"])) in ref]
            is_ref = v == "standard" and "subnorm" not in name
            dl = f"{st.mean(deltas):+.3f}" if deltas and not is_ref else "—"
            cfg = DESC[name] + ("" if a["heads"] == 4 or "heads" in DESC[name] else f", heads {a['heads']}")
            lines.append(f"| {name} | {VNAME[v]} | {cfg} | {a['lr']:g} | {a['steps']} | "
                         f"{','.join(str(r['seed']) for r in rs)} | {st.mean(vl):.3f} ± {sd:.3f} | {dl} | "
                         f"{' / '.join(str(r['spikes']) for r in rs)} | {st.mean(r['top_hidden'] for r in rs):.1f} |")
    return "\n".join(lines) + "\n"


def per_seed_table(folder: str) -> str:
    """Every run JSON in ``folder`` (also runs not in DESC), with per-seed values and the mean top-1 logit."""
    lines = ["| run | variant | heads | lr | seeds | val loss mean ± std | per seed | spikes per seed "
             "| top-1 hidden (mean) | top-1 logit (mean) |", "|---|---|---:|---:|---|---:|---|---|---:|---:|"]
    for name, d in _runs(folder).items():
        for v in clv.VARIANTS:
            rs = [r for r in d["results"] if r["variant"] == v]
            if not rs:
                continue
            vl = [r["val_loss"] for r in rs]
            sd = st.stdev(vl) if len(vl) > 1 else 0.0
            cells = (name, v, d["args"]["heads"], d["args"]["lr"], " ".join(str(r["seed"]) for r in rs),
                     f"{st.mean(vl):.3f} ± {sd:.3f}", " / ".join(f"{x:.3f}" for x in vl),
                     " / ".join(str(r["spikes"]) for r in rs), f"{st.mean(r['top_hidden'] for r in rs):.1f}",
                     f"{st.mean(r['top_attn_logit'] for r in rs):.1f}")
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def table(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lm_v1_study.py table")
    p.add_argument("--dir", default=STUDY_DIR, help=f"folder of the run JSONs (default {STUDY_DIR})")
    p.add_argument("--per-seed", action="store_true", help="every JSON with per-seed values instead")
    args = p.parse_args(argv)
    sys.stdout.write(per_seed_table(args.dir) if args.per_seed else study_table(args.dir))
    return 0


COMMANDS = {"ablate": ablate, "dynamics": dynamics, "init-scale": init_scale, "table": table}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.split("\n\n")[1] if argv and argv[0] in ("-h", "--help") else
              f"usage: lm_v1_study.py {{{','.join(COMMANDS)}}} ...  (see the module docstring)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
