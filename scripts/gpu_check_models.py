"""Parts 3 and 4 of ``scripts/gpu_check.py``: attention layers (DIFF V1 / V2 vs standard) and whole training steps.

Part 3 reuses ``scripts/bench_diff_v2.py`` (layers built by ``create_attention``, the prefill / training / decode
steps, the FLOP model): one layer of each type at equal width, causal, automatic backend (V1 -> the fused
kernel on CUDA), bf16; ``fwd`` = prefill under no_grad, ``fwdbwd`` = a layer training step, ``decode`` = one token
over an N-position KV cache (ms per token).

Part 4: one bf16 (autocast, fp32 master weights, fused AdamW) training step of DiffCLIP-ViT-B/16 (batch 128,
random images and captions) and of the first layers of the DIFF LM paper shapes (830M: d = 96; 1.4B: d = 128),
each with the ``triton`` and the ``sdpa`` backend from the same initial weights and batch, plus the standard
twin (CLIP-ViT-B/16, Transformer) for reference. The first step's losses of ``triton`` and ``sdpa`` must agree
within ``LOSS_RTOL``; throughput is the median of the timed steps after two untimed ones.
"""
from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import torch

import bench_diff_v2 as BV
from gpu_check_lib import DTYPE_NAMES, Ctx, err_line, fmt, free_memory, sync, time_ms

TYPES = BV.TYPES  # standard, diff, diff_v2
MODES = ("fwd", "fwdbwd", "decode")
LOSS_RTOL = 1e-2  # bf16 keeps ~3 significant digits; a mean loss over the batch differs far less than one ulp

LAYER_GPU = [dict(name="E512-H8-B1", dim=512, heads=8, kv_heads=None, batch=1, seqs=[1024, 4096, 8192]),
             dict(name="E2048-H16-B4", dim=2048, heads=16, kv_heads=None, batch=4, seqs=[1024, 4096])]
LAYER_DRY = [dict(name="E128-H4-B1", dim=128, heads=4, kv_heads=None, batch=1, seqs=[20])]

CLIP_GPU = dict(batch=128, diff="DiffCLIP-ViT-B-16", standard="CLIP-ViT-B-16", overrides={})
CLIP_DRY = dict(batch=2, diff="DiffCLIP-Tiny", standard="CLIP-Tiny",
                overrides=dict(vision_cfg=dict(layers=1, image_size=32),
                               text_cfg=dict(layers=1, context_length=16, vocab_size=1000)))
LM_LAYERS = 4
LM_GPU = dict(batch=8, seq=2048, shapes={"830m": {"n_layer": LM_LAYERS}, "1.4b": {"n_layer": LM_LAYERS}})
LM_DRY = dict(batch=1, seq=16, shapes={  # toy widths with the paper shapes' head dims (96, 128)
    "830m": dict(n_layer=1, n_embd=192, n_head=2, vocab_size=512, block_size=16),
    "1.4b": dict(n_layer=1, n_embd=256, n_head=2, vocab_size=512, block_size=16)})


# ------------------------------------------------------------------------------------------------ part 3


def _auto_backends(a, device, dtype) -> dict:
    from diffmm.ops import AttentionCall, select_backend

    d = a.dim // a.heads
    q = torch.empty(1, 1, a.heads, d, device=device, dtype=dtype)
    return {"diff": select_backend(AttentionCall("diff", q, None, True, d, 2 * d)).name,
            "standard": select_backend(AttentionCall("standard", q, None, True, d, d)).name}


def run_layers(ctx: Ctx, part: dict) -> None:
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    part.update(rows=[], skipped=[], dtype=DTYPE_NAMES[dtype])
    todo = [(cfg, N, mode) for cfg in (LAYER_DRY if ctx.dry else LAYER_GPU) for N in cfg["seqs"] for mode in MODES]
    for i, (cfg, N, mode) in enumerate(todo):
        label = f"{cfg['name']} N={N} {mode}"
        if ctx.out_of_time(part, label, len(todo) - i, "rows"):
            break
        a = SimpleNamespace(dim=cfg["dim"], heads=cfg["heads"], kv_heads=cfg["kv_heads"], batch=cfg["batch"],
                            backend=None)
        row = {"config": cfg["name"], "dim": a.dim, "heads": a.heads, "batch": a.batch, "N": N, "mode": mode}
        try:
            row["backends"] = _auto_backends(a, ctx.device, dtype)
        except Exception as e:  # noqa: BLE001
            row["backends"] = {"error": err_line(e)}
        for t in TYPES:
            try:
                step = BV.make_step(BV.build(t, a, ctx.device, dtype), mode, N, a, ctx.device, dtype)
                ms = time_ms(step, ctx.device, reps=1 if ctx.dry else None, warmup=0 if ctx.dry else 2)
                row[f"{t}_ms"] = ms / (BV.DECODE_INNER if mode == "decode" else 1)
                row[f"{t}_mib"] = BV.cuda_peak_mib(step, ctx.device) if ctx.cuda else None
                row[f"{t}_flops_ratio"] = BV.forward_flops(t, mode, N, a) / BV.forward_flops("standard", mode, N, a)
                del step
            except Exception as e:  # noqa: BLE001  (one type failing must not lose the others)
                row[f"{t}_error"] = err_line(e)
            free_memory(ctx.device)
        part["rows"].append(row)
        ctx.progress("3/diff-v2", f"{i + 1}/{len(todo)} {label}: " + ", ".join(
            f"{t} {fmt(row.get(f'{t}_ms'), '.3f')} ms" if f"{t}_ms" in row else f"{t} ERROR {row[f'{t}_error']}"
            for t in TYPES))
        ctx.rec.save()


def layers_markdown(part: dict) -> list[str]:
    lines = [f"One layer per type at equal width (V1: half the heads, two components; V2: 2x query maps), causal, "
             f"{part.get('dtype')}, automatic backend; decode = ms per token over an N-position KV cache; "
             "FLOPs = forward matmul FLOPs / standard's (scripts/bench_diff_v2.py)", "",
             "| config | N | mode | V1 backend | standard ms | V1 ms | V2 ms | V1/std | V2/std | FLOPs V1/std | "
             "FLOPs V2/std | standard MiB | V1 MiB | V2 MiB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in part.get("rows", []):
        s = r.get("standard_ms")
        ratio = lambda t: fmt(r[f"{t}_ms"] / s, ".2f") + "x" if s and f"{t}_ms" in r else "-"  # noqa: E731
        cell = lambda t: fmt(r.get(f"{t}_ms"), ".3f") if f"{t}_ms" in r else f"ERROR {r.get(f'{t}_error', '')[:40]}"  # noqa: E731
        lines.append(f"| {r['config']} | {r['N']} | {r['mode']} | {r.get('backends', {}).get('diff', '?')} | "
                     f"{cell('standard')} | {cell('diff')} | {cell('diff_v2')} | {ratio('diff')} | {ratio('diff_v2')} | "
                     f"{fmt(r.get('diff_flops_ratio'), '.2f')}x | {fmt(r.get('diff_v2_flops_ratio'), '.2f')}x | "
                     f"{fmt(r.get('standard_mib'), '.1f')} | {fmt(r.get('diff_mib'), '.1f')} | "
                     f"{fmt(r.get('diff_v2_mib'), '.1f')} |")
    for s in part.get("skipped", []):
        lines.append(f"- skipped {s['what']}: {s['reason']}")
    return lines


# ------------------------------------------------------------------------------------------------ part 4


def _clip_job(ctx: Ctx, spec: dict, name: str, backend: str):
    from diffmm.hub.factory import create_model
    from diffmm.train.losses import ContrastiveLoss

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = create_model(name, attn_backend=backend, **spec["overrides"])
    v, t = model.config.vision_cfg, model.config.text_cfg
    g = torch.Generator().manual_seed(1)
    B = spec["batch"]
    images = torch.randn(B, 3, v.image_size, v.image_size, generator=g)
    texts = torch.randint(1, t.vocab_size - 1, (B, t.context_length), generator=g)
    ends = torch.randint(4, t.context_length, (B,), generator=g)
    for i, e in enumerate(ends.tolist()):  # EOT (the largest id) then zero padding, as the CLIP tokenizer does
        texts[i, e] = t.vocab_size - 1
        texts[i, e + 1:] = 0
    images, texts = images.to(ctx.device), texts.to(ctx.device)
    crit = ContrastiveLoss()

    def loss_fn():
        img, txt, scale = model(images, texts, normalize=True)
        return crit(img, txt, scale)

    return model, loss_fn, B, "samples"


def _lm_job(ctx: Ctx, spec: dict, shape: str, attention: str, backend: str):
    from diffmm.models.lm import DiffLM, LMConfig

    prefix = "diff" if attention == "diff" else "transformer"
    cfg = LMConfig.from_name(f"{prefix}-{shape}", attn_backend=backend, **spec["shapes"][shape])
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = DiffLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (spec["batch"], spec["seq"] + 1), generator=g).to(ctx.device)

    def loss_fn():
        return model(ids[:, :-1], ids[:, 1:])[1]

    return model, loss_fn, spec["batch"] * spec["seq"], "tokens"


def train_steps(ctx: Ctx, model, loss_fn, amp: bool, timed: int) -> dict:
    """Two untimed steps (losses and the first step's grad norm recorded), then ``timed`` timed steps (0: the
    second step is timed; dry run)."""
    from diffmm.train.optim import build_adamw, param_groups

    model.train()
    opt = build_adamw(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.98), eps=1e-8)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {"params_m": sum(p.numel() for p in params) / 1e6}

    def step(record: bool = False):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn()
        loss.backward()
        if record:
            out["grad_norm0"] = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params if p.grad is not None])).item()
        opt.step()
        return loss.detach()

    out["loss0"] = step(record=True).float().item()  # same weights and batch for every backend: comparable
    if timed == 0:  # dry run: time the second step itself (the interpreter makes every step costly)
        t = time.perf_counter()
        out["loss1"] = step().float().item()
        out["step_ms"] = (time.perf_counter() - t) * 1e3
        return out
    out["loss1"] = step().float().item()  # after one identical update
    if ctx.cuda:
        sync(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    out["step_ms"] = time_ms(step, ctx.device, reps=timed, warmup=0)
    if ctx.cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30
    return out


def run_train(ctx: Ctx, part: dict) -> None:
    clip, lm = (CLIP_DRY, LM_DRY) if ctx.dry else (CLIP_GPU, LM_GPU)
    amp = not ctx.dry
    part.update(rows=[], skipped=[], checks=[], amp="bf16 autocast" if amp else "none (fp32 dry run)",
                lm_layers={k: v["n_layer"] for k, v in lm["shapes"].items()}, lm_batch=[lm["batch"], lm["seq"]],
                clip_batch=clip["batch"], clip_models=[clip["diff"], clip["standard"]])
    jobs = [("clip", clip["diff"], "diff", "triton"), ("clip", clip["diff"], "diff", "sdpa"),
            ("clip", clip["standard"], "standard", "sdpa")]
    for shape in lm["shapes"]:
        jobs += [("lm", shape, "diff", "triton"), ("lm", shape, "diff", "sdpa"), ("lm", shape, "standard", "sdpa")]
    for i, (kind, name, attention, backend) in enumerate(jobs):
        model_name = name if kind == "clip" else f"{'diff' if attention == 'diff' else 'transformer'}-{name} " \
                                                 f"({lm['shapes'][name]['n_layer']} layers)"
        label = f"{model_name} {backend}"
        if ctx.out_of_time(part, label, len(jobs) - i, "jobs"):
            break
        row = {"kind": kind, "group": name, "model": model_name, "attention": attention, "backend": backend}
        model, t_job = None, time.time()
        try:
            model, loss_fn, per_step, unit = (_clip_job(ctx, clip, name, backend) if kind == "clip" else
                                              _lm_job(ctx, lm, name, attention, backend))
            row.update(train_steps(ctx, model, loss_fn, amp, timed=0 if ctx.dry else 3), unit=unit,
                       per_step=per_step, status="ok")
            row["throughput"] = per_step / row["step_ms"] * 1e3
        except RuntimeError as e:
            msg = err_line(e)
            unsupported = f"attention backend '{backend}' cannot run this call" in str(e)
            row.update(status="unsupported" if unsupported else "ERROR", reason=msg)
        except Exception as e:  # noqa: BLE001
            row.update(status="ERROR", reason=err_line(e))
        del model
        gc.collect()
        free_memory(ctx.device)
        row["wall_s"] = round(time.time() - t_job, 1)  # model build, compiles, all steps
        part["rows"].append(row)
        _check_losses(ctx, part, row)
        ctx.progress("4/train", f"{i + 1}/{len(jobs)} {label}: " + (
            f"loss {row['loss0']:.4f} -> {row['loss1']:.4f}, {row['step_ms']:.1f} ms/step, "
            f"{row['throughput']:.0f} {row['unit']}/s" if row["status"] == "ok" else f"{row['status']}: {row['reason']}"))
        ctx.rec.save()


def _check_losses(ctx: Ctx, part: dict, row: dict) -> None:
    """Once both backends of a DIFF model ran: their first-step losses must agree within LOSS_RTOL."""
    if row["attention"] != "diff":
        return
    pair = {r["backend"]: r for r in part["rows"] if r["group"] == row["group"] and r["attention"] == "diff"
            and r["status"] == "ok"}
    if set(pair) != {"triton", "sdpa"} or row["backend"] not in pair:
        return
    a, b = pair["triton"], pair["sdpa"]
    rel0 = abs(a["loss0"] - b["loss0"]) / max(abs(b["loss0"]), 1.0)
    chk = {"model": row["model"], "loss0_rel_diff": rel0, "tol": LOSS_RTOL, "ok": rel0 <= LOSS_RTOL,
           "loss1_rel_diff": abs(a["loss1"] - b["loss1"]) / max(abs(b["loss1"]), 1.0),
           "grad_norm0_rel_diff": abs(a["grad_norm0"] - b["grad_norm0"]) / max(b["grad_norm0"], 1e-12),
           "speed_triton_over_sdpa": b["step_ms"] / a["step_ms"]}
    part["checks"].append(chk)
    if not chk["ok"]:
        ctx.failures.append(f"train step {row['model']}: first-step loss triton {a['loss0']:.5f} vs sdpa "
                            f"{b['loss0']:.5f} (rel {rel0:.2e} > {LOSS_RTOL:.0e})")


def train_markdown(part: dict) -> list[str]:
    lines = [f"{part.get('amp')}; AdamW (fused on CUDA); CLIP batch {part.get('clip_batch')}; LM batch x sequence "
             f"{part.get('lm_batch')}, first layers of the DIFF paper shapes {part.get('lm_layers')}; "
             "median of the timed steps after two untimed ones; job s = model build + compiles + all steps", "",
             "| model | attention | backend | params M | loss step 0 | loss step 1 | ms/step | throughput | "
             "peak GiB | job s | status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in part.get("rows", []):
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['attention']} | {r['backend']} | | | | | | | {r.get('wall_s', '')} | "
                         f"{r['status']}: {r.get('reason', '')[:100]} |")
            continue
        lines.append(f"| {r['model']} | {r['attention']} | {r['backend']} | {r['params_m']:.1f} | {r['loss0']:.5f} | "
                     f"{r['loss1']:.5f} | {r['step_ms']:.1f} | {r['throughput']:.0f} {r['unit']}/s | "
                     f"{fmt(r.get('peak_gib'), '.1f')} | {r.get('wall_s', '')} | ok |")
    if part.get("checks"):
        lines += ["", "| model | loss0 rel diff triton vs sdpa | tol | loss1 rel diff | grad-norm rel diff | "
                      "triton speed / sdpa | result |", "|---|---:|---:|---:|---:|---:|---|"]
        for c in part["checks"]:
            lines.append(f"| {c['model']} | {c['loss0_rel_diff']:.2e} | {c['tol']:.0e} | {c['loss1_rel_diff']:.2e} | "
                         f"{c['grad_norm0_rel_diff']:.2e} | {c['speed_triton_over_sdpa']:.2f}x | "
                         f"{'pass' if c['ok'] else 'FAIL'} |")
    for s in part.get("skipped", []):
        lines.append(f"- skipped {s['what']}: {s['reason']}")
    return lines


__all__ = ["run_layers", "layers_markdown", "run_train", "train_markdown", "LOSS_RTOL"]
