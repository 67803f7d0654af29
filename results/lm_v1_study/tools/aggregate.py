import glob, json, os, statistics as st, sys
R = "/work/main/results/lm_v1_study"
rows = []
for p in sorted(glob.glob(f"{R}/*.json")):
    name = os.path.basename(p)[:-5]
    if name.startswith("dyn_") or name == "init_scale":
        continue
    d = json.load(open(p))
    for v in ("standard", "diff", "diff_v2"):
        rs = [r for r in d["results"] if r["variant"] == v]
        if not rs:
            continue
        vl = [r["val_loss"] for r in rs]
        sd = st.stdev(vl) if len(vl) > 1 else 0.0
        rows.append((name, v, d["args"]["heads"], d["args"]["lr"], " ".join(str(r["seed"]) for r in rs),
                     f"{st.mean(vl):.3f} ± {sd:.3f}", " / ".join(f"{x:.3f}" for x in vl),
                     " / ".join(str(r["spikes"]) for r in rs), f"{st.mean(r['top_hidden'] for r in rs):.1f}",
                     f"{st.mean(r['top_attn_logit'] for r in rs):.1f}"))
print("| run | variant | heads | lr | seeds | val loss mean ± std | per seed | spikes per seed | top-1 hidden (mean) | top-1 logit (mean) |")
print("|---|---|---:|---:|---|---:|---|---|---:|---:|")
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
