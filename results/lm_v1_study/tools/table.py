import glob, json, os, statistics as st
R = "/work/main/results/lm_v1_study"
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
ORDER = list(DESC)
runs = {}
for p in glob.glob(f"{R}/*.json"):
    name = os.path.basename(p)[:-5]
    if name in DESC:
        runs[name] = json.load(open(p))
# standard references per (lr, steps, heads)
ref = {}
for name, d in runs.items():
    for r in d["results"]:
        if r["variant"] == "standard" and "subnorm" not in name:
            a = d["args"]; ref[(a["lr"], a["steps"], a["heads"], r["seed"])] = r["val_loss"]
print("| json | attention | config | lr | steps | seeds | val loss mean ± std | Δ vs standard (paired, mean) | spikes per seed | top-1 hidden (mean) |")
print("|---|---|---|---:|---:|---|---:|---:|---|---:|")
for name in ORDER:
    if name not in runs: continue
    d = runs[name]; a = d["args"]
    for v in ("standard", "diff", "diff_v2"):
        rs = [r for r in d["results"] if r["variant"] == v]
        if not rs: continue
        vl = [r["val_loss"] for r in rs]
        sd = st.stdev(vl) if len(vl) > 1 else 0.0
        deltas = [r["val_loss"] - ref[(a["lr"], a["steps"], a["heads"], r["seed"])] for r in rs
                  if (a["lr"], a["steps"], a["heads"], r["seed"]) in ref]
        dl = f"{st.mean(deltas):+.3f}" if deltas and not (v == "standard" and "subnorm" not in name) else "—"
        vname = {"standard": "standard", "diff": "V1", "diff_v2": "V2"}[v]
        print(f"| {name} | {vname} | {DESC[name]}{'' if a['heads'] == 4 or 'heads' in DESC[name] else ', heads '+str(a['heads'])} | {a['lr']:g} | {a['steps']} | "
              f"{','.join(str(r['seed']) for r in rs)} | {st.mean(vl):.3f} ± {sd:.3f} | {dl} | "
              f"{' / '.join(str(r['spikes']) for r in rs)} | {st.mean(r['top_hidden'] for r in rs):.1f} |")
