"""Parts 3 and 4 of the GPU check (``scripts/gpu_check.py``): one layer of DIFF V1 / V2 / standard attention
(prefill, training step, decoding), and training steps of DiffCLIP and DIFF LM layer stacks, triton vs sdpa."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from diffmm.models.clip.config import CLIPConfig, load_config_file
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.nn import KVCache, create_attention
from diffmm.ops import AttentionCall, select_backend
from gpucheck.record import DTYPE_NAMES, Ctx, err_line, free_memory, peak_mib, run_cases, sync, time_ms

ROOT = Path(__file__).resolve().parents[2]
# Part 3.
LAYER_TYPES = ("standard", "diff", "diff_v2")
MODES = ("fwd", "fwdbwd", "decode")
DECODE_INNER = 20  # decode steps per timed call
LAYER_GPU = [dict(name="E512-H8-B1", dim=512, heads=8, batch=1, seqs=[1024, 4096, 8192]),
             dict(name="E2048-H16-B4", dim=2048, heads=16, batch=4, seqs=[1024, 4096])]
LAYER_DRY = [dict(name="E128-H4-B1", dim=128, heads=4, batch=1, seqs=[20])]

# Part 4. The LM shapes of the DIFF paper (830M: head dim 96, which the fused kernel does not take; 1.4B: 128).
LOSS_RTOL = 1e-2  # bf16 keeps ~3 significant digits; a mean loss over the batch differs far less than one ulp
CLIP_GPU = dict(batch=128, diff="DiffCLIP-ViT-B-16", standard="CLIP-ViT-B-16", overrides={})
CLIP_DRY = dict(batch=2, diff="DiffCLIP-Tiny", standard="CLIP-Tiny",
                overrides=dict(vision_cfg=dict(layers=1, image_size=32),
                               text_cfg=dict(layers=1, context_length=16, vocab_size=1000)))
LM_GPU = dict(batch=8, seq=2048, shapes={"830m": {"layers": 4}, "1.4b": {"layers": 4}})
LM_DRY = dict(batch=1, seq=16, shapes={  # toy widths with the paper shapes' head dims (96, 128)
    "830m": dict(layers=1, width=192, heads=2, vocab_size=512, context_length=16),
    "1.4b": dict(layers=1, width=256, heads=2, vocab_size=512, context_length=16)})


# ---------------------------------------------------------------------------------------------- 3. diff_v2


def layer_step(attn_type: str, mode: str, N: int, cfg: dict, device, dtype) -> Callable[[], None]:
    """One measured call of a causal layer (automatic backend) on x (B, N, E): ``fwd`` prefill under no_grad,
    ``fwdbwd`` a layer training step, ``decode`` ``DECODE_INNER`` single tokens over an N-position KV cache."""
    torch.manual_seed(0)
    m = create_attention(attn_type, cfg["dim"], cfg["heads"], causal=True).to(device=device, dtype=dtype)
    x = torch.randn(cfg["batch"], N, cfg["dim"], device=device, dtype=dtype)
    if mode == "fwdbwd":
        x.requires_grad_(True)

        def step():
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).float().sum().backward()
        return step
    if mode == "fwd":
        @torch.no_grad()
        def prefill():
            m(x)
        return prefill
    cache, last = KVCache(N), x[:, N - 1:]
    with torch.no_grad():
        m(x[:, :N - 1], kv_cache=cache)  # prefill N - 1 positions

    @torch.no_grad()
    def decode():
        for _ in range(DECODE_INNER):
            cache.length = N - 1  # rewind, then attend 1 token over N keys
            m(last, kv_cache=cache)
    return decode


def forward_flops(attn_type: str, mode: str, N: int, cfg: dict) -> float:
    """Matmul FLOPs of one causal forward; ``diff`` counted as the fused kernel runs it (docs/kernels.md).

    fwd+bwd costs about 3x the forward for every type, so the ratios of the forward apply to it too.
    """
    E, H = cfg["dim"], cfg["heads"]
    d = E // H
    n_q = 1 if mode == "decode" else N
    pairs = N if mode == "decode" else N * (N + 1) / 2  # causal (query, key) pairs
    q_out = 2 * E if attn_type == "diff_v2" else E
    proj = 2 * n_q * E * (q_out + 2 * E + E + (H if attn_type == "diff_v2" else 0))
    return proj + {"standard": 4, "diff": 6, "diff_v2": 8}[attn_type] * pairs * d * H


def layer_case(ctx: Ctx, item: tuple, row: dict, dtype) -> None:
    """Every layer type at one size and mode; one type failing is recorded (status ``partial``), not the row."""
    cfg, N, mode = item
    d = cfg["dim"] // cfg["heads"]
    q = torch.empty(1, 1, cfg["heads"], d, device=ctx.device, dtype=dtype)
    row["backends"] = {"diff": select_backend(AttentionCall("diff", q, None, True, d, 2 * d)).name,
                       "standard": select_backend(AttentionCall("standard", q, None, True, d, d)).name}
    for t in LAYER_TYPES:
        try:
            step = layer_step(t, mode, N, cfg, ctx.device, dtype)
            ms = time_ms(step, ctx.device, reps=1 if ctx.dry else None, warmup=0 if ctx.dry else 2)
            row[f"{t}_ms"] = ms / (DECODE_INNER if mode == "decode" else 1)
            row[f"{t}_mib"] = peak_mib(step, ctx.device)
            row[f"{t}_flops_ratio"] = forward_flops(t, mode, N, cfg) / forward_flops("standard", mode, N, cfg)
            if "standard_ms" in row:
                row[f"{t}_vs_standard"] = row[f"{t}_ms"] / row["standard_ms"]
        except Exception as e:  # noqa: BLE001
            row[f"{t}_error"] = err_line(e)
        free_memory(ctx.device)
    errors = [f"{t}: {row[f'{t}_error']}" for t in LAYER_TYPES if f"{t}_error" in row]
    row["status"] = "partial" if errors else "ok"
    if errors:
        row["reason"] = "; ".join(errors)


def run_layers(ctx: Ctx, part: dict) -> None:
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    part["notes"] = [f"one layer per type at equal width (V1: half the heads, two components; V2: 2x query maps), "
                     f"causal, {DTYPE_NAMES[dtype]}, automatic backend; decode = ms per token over an N-position KV "
                     "cache; FLOPs = forward matmul FLOPs / standard's"]
    todo = [(cfg, N, mode) for cfg in (LAYER_DRY if ctx.dry else LAYER_GPU) for N in cfg["seqs"] for mode in MODES]

    def describe(item):
        cfg, N, mode = item
        return {"label": f"{cfg['name']} N={N} {mode}", "config": cfg["name"], "dim": cfg["dim"],
                "heads": cfg["heads"], "batch": cfg["batch"], "N": N, "mode": mode}

    run_cases(ctx, part, "3/diff-v2", todo, describe, lambda item, row: layer_case(ctx, item, row, dtype))


# ------------------------------------------------------------------------------------------------ 4. train


def clip_config(name: str, overrides: dict) -> CLIPConfig:
    """A named CLIP config (``diffmm/model_configs/NAME.json``) with ``overrides`` merged in."""
    return load_config_file(ROOT / "diffmm" / "model_configs" / f"{name}.json").replace(**overrides)


def clip_job(ctx: Ctx, spec: dict, name: str, backend: str):
    """A CLIP model by config name, and its symmetric InfoNCE loss on one batch of random images and captions."""
    cfg = clip_config(name, dict(spec["overrides"], attn_backend=backend))
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = DiffCLIP(cfg)
    v, t, B = cfg.vision_cfg, cfg.text_cfg, spec["batch"]
    g = torch.Generator().manual_seed(1)
    images = torch.randn(B, 3, v.image_size, v.image_size, generator=g).to(ctx.device)
    texts = torch.randint(1, t.vocab_size - 1, (B, t.context_length), generator=g)
    for i, end in enumerate(torch.randint(4, t.context_length, (B,), generator=g).tolist()):
        texts[i, end] = t.vocab_size - 1  # EOT (the largest id), then zero padding, as the CLIP tokenizer does
        texts[i, end + 1:] = 0
    texts, labels = texts.to(ctx.device), torch.arange(B, device=ctx.device)

    def loss_fn():
        img, txt, scale = model(images, texts, normalize=True)
        logits = scale * img @ txt.T
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    return model, loss_fn, B, "samples"


def lm_job(ctx: Ctx, spec: dict, shape: str, attention: str, backend: str, head: str):
    """The first layers of a DIFF LM paper shape (or its Transformer twin) and its next-token loss on one batch:
    through the fused head loss (``head="fused"``, how ``LMModule`` trains) or the full logits (``"logits"``)."""
    prefix = "diff" if attention == "diff" else "transformer"
    cfg = LMConfig.from_name(f"{prefix}-{shape}", attn_backend=backend, **spec["shapes"][shape])
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = DiffLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (spec["batch"], spec["seq"] + 1), generator=g).to(ctx.device)
    loss = lambda: model(ids[:, :-1], ids[:, 1:], return_logits=head == "logits")[1]  # noqa: E731
    return model, loss, spec["batch"] * spec["seq"], "tokens"


def train_steps(ctx: Ctx, model, loss_fn, row: dict) -> None:
    """Two untimed steps (their losses, the first one's grad norm), then the median of 3 timed steps (dry run: the
    second step is timed, the interpreter makes every step costly)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, fused=ctx.cuda)
    row["params_m"] = sum(p.numel() for p in params) / 1e6

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.cuda):
            loss = loss_fn()
        loss.backward()
        opt.step()
        return loss.detach()

    row["loss0"] = step().float().item()  # same weights and batch for every backend: comparable
    row["grad_norm0"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float())
                                                              for p in params if p.grad is not None])).item()
    start = time.perf_counter()
    row["loss1"] = step().float().item()  # after one identical update
    row["step_ms"] = (time.perf_counter() - start) * 1e3
    if ctx.cuda:
        sync(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        row["step_ms"] = time_ms(step, ctx.device, reps=3, warmup=0)
        row["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30


def train_case(ctx: Ctx, part: dict, item: tuple, row: dict, clip: dict, lm: dict) -> None:
    kind, name, attention, backend, head = item
    start = time.time()
    try:
        model, loss_fn, per_step, unit = (clip_job(ctx, clip, name, backend) if kind == "clip" else
                                          lm_job(ctx, lm, name, attention, backend, head))
        train_steps(ctx, model, loss_fn, row)
        row.update(unit=unit, per_step=per_step, throughput=per_step / row["step_ms"] * 1e3, status="ok")
    except RuntimeError as e:  # a shape the backend does not take (830M: head dim 96) is recorded, not an error
        if f"attention backend '{backend}' cannot run this call" not in str(e):
            raise
        row.update(status="unsupported", reason=err_line(e))
    finally:
        row["wall_s"] = round(time.time() - start, 1)  # model build, compiles, all steps
    check_losses(ctx, part, row)


def check_losses(ctx: Ctx, part: dict, row: dict) -> None:
    """Once both backends of a DIFF model ran (fused head for LMs), and once an LM's sdpa row ran with both heads:
    their first-step losses must agree within ``LOSS_RTOL``."""
    if row["attention"] != "diff" or row["status"] != "ok":
        return
    done = {(r["backend"], r["head"]): r for r in part["rows"] + [row]
            if r["group"] == row["group"] and r["attention"] == "diff" and r["status"] == "ok"}
    fused = "fused" if row["kind"] == "lm" else "-"
    pairs = {"triton vs sdpa": (("triton", fused), ("sdpa", fused)),
             "fused head vs logits (sdpa)": (("sdpa", "fused"), ("sdpa", "logits"))}
    for compared, (first, second) in pairs.items():
        if (row["backend"], row["head"]) in (first, second) and first in done and second in done:
            add_check(ctx, part, row["model"], compared, done[first], done[second])


def add_check(ctx: Ctx, part: dict, model: str, compared: str, a: dict, b: dict) -> None:
    """Rows ``a`` and ``b`` of one model: losses, gradient norms, speed and peak memory side by side."""
    rel0 = abs(a["loss0"] - b["loss0"]) / max(abs(b["loss0"]), 1.0)
    chk = {"model": model, "compared": compared, "loss0_rel_diff": rel0, "tol": LOSS_RTOL, "ok": rel0 <= LOSS_RTOL,
           "loss1_rel_diff": abs(a["loss1"] - b["loss1"]) / max(abs(b["loss1"]), 1.0),
           "grad_norm0_rel_diff": abs(a["grad_norm0"] - b["grad_norm0"]) / max(b["grad_norm0"], 1e-12),
           "speed_first_over_second": b["step_ms"] / a["step_ms"]}
    if "peak_gib" in a and "peak_gib" in b:
        chk["peak_first_over_second"] = a["peak_gib"] / b["peak_gib"]
    part["checks"].append(chk)
    if not chk["ok"]:
        ctx.failures.append(f"train step {model} ({compared}): first-step loss {a['loss0']:.5f} vs "
                            f"{b['loss0']:.5f} (rel {rel0:.2e} > {LOSS_RTOL:.0e})")


def run_train(ctx: Ctx, part: dict) -> None:
    clip, lm = (CLIP_DRY, LM_DRY) if ctx.dry else (CLIP_GPU, LM_GPU)
    part.update(checks=[], amp="none (fp32 dry run)" if ctx.dry else "bf16 autocast",
                lm_layers={k: v["layers"] for k, v in lm["shapes"].items()}, lm_batch=[lm["batch"], lm["seq"]],
                clip_batch=clip["batch"], clip_models=[clip["diff"], clip["standard"]])
    part["notes"] = [f"{part['amp']}; AdamW (fused on CUDA); CLIP batch {clip['batch']}; LM batch x sequence "
                     f"{part['lm_batch']}, first layers of the DIFF paper shapes {part['lm_layers']}; median of the "
                     "timed steps after two untimed ones; job s = model build + compiles + all steps",
                     "LM loss through the fused head (DiffLM(..., return_logits=False), how LMModule trains); one "
                     "DIFF sdpa row per LM shape through the full logits (head: logits) for its time and memory",
                     f"the first-step losses of triton and sdpa, and of the two heads, must agree within "
                     f"{LOSS_RTOL:.0%} (relative)"]
    todo = [("clip", clip["diff"], "diff", "triton", "-"), ("clip", clip["diff"], "diff", "sdpa", "-"),
            ("clip", clip["standard"], "standard", "sdpa", "-")]
    for shape in lm["shapes"]:
        todo += [("lm", shape, "diff", "triton", "fused"), ("lm", shape, "diff", "sdpa", "fused"),
                 ("lm", shape, "diff", "sdpa", "logits"), ("lm", shape, "standard", "sdpa", "fused")]

    def describe(item):
        kind, name, attention, backend, head = item
        model = name if kind == "clip" else (f"{'diff' if attention == 'diff' else 'transformer'}-{name} "
                                             f"({lm['shapes'][name]['layers']} layers)")
        return {"label": f"{model} {backend}" + (f" {head} head" if kind == "lm" else ""), "kind": kind,
                "group": name, "model": model, "attention": attention, "backend": backend, "head": head}

    run_cases(ctx, part, "4/train", todo, describe, lambda item, row: train_case(ctx, part, item, row, clip, lm))
