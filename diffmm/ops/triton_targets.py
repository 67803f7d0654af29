"""Compile the fused kernels for a GPU that is not there, and report what each binary needs.

Triton compiles ahead of time for an explicit target with no GPU: a stand-in driver
(``triton.runtime.driver.driver.set_active``) answers the target, device, stream and device properties, and
``JITFunction.warmup`` compiles without launching; the bundled ``cuobjdump`` reads registers, stack frame
and spill stores out of each cubin. :func:`compile_report` runs the project's own wrappers (``fwd_launches``,
``bwd_launches``) and autotuners on meta tensors, so exactly the tiles the pruner keeps for that target compile.

Relies on Triton's driver and compiler internals as of Triton 3.6 to 3.8 (:data:`TRITON_RANGE`);
:func:`unsupported_reason` says why another version cannot be driven. Cubin figures are kept per compiled kernel
(its hash covers source, target and options) under ``~/.cache/diffmm/cubin`` next to Triton's own cache, so a
warm rerun only loads binaries. ``python -m diffmm.ops.triton_targets --write docs/kernels.md`` renews the docs
table.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.runtime.driver import driver

from diffmm.ops import triton_diff_bwd as _bwd
from diffmm.ops import triton_diff_fwd as _fwd

TRITON_RANGE = ((3, 6), (3, 9))  # [low, high) of the Triton versions whose internals this module drives
# Shared memory per block (opt-in maximum) and registers per block of each compute capability.
TARGETS = {"sm_80": (80, 166912), "sm_86": (86, 101376), "sm_89": (89, 101376), "sm_90": (90, 232448)}
REGS_PER_BLOCK = 65536
RECORDS = Path(os.environ.get("DIFFMM_CUBIN_RECORDS", Path.home() / ".cache" / "diffmm" / "cubin"))
_STL_BYTES = {".64": 8, ".128": 16, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}  # other STL widths store 4 bytes


@dataclass
class Compiled:
    """One compiled kernel: what it is, which tile, and what its cubin and Triton's metadata say."""

    target: str
    kernel: str
    d: int
    dtype: str
    causal: bool
    config: str
    ptx_target: str
    cubin_ok: bool
    registers: int
    spill_stores: int
    stack: int
    shared: int
    shared_limit: int

    @property
    def ok(self) -> bool:
        """Launchable (valid cubin, shared memory within the limit) and spill-free."""
        return self.cubin_ok and self.shared <= self.shared_limit and self.spill_stores == 0 and self.stack == 0


def unsupported_reason() -> Optional[str]:
    """None when this Triton can be driven by the stand-in driver, else why not."""
    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    lo, hi = TRITON_RANGE
    if not lo <= version < hi:
        return f"Triton {triton.__version__} is outside the driven range [{lo[0]}.{lo[1]}, {hi[0]}.{hi[1]})"
    if _fwd.INTERPRET:
        return "the kernels were imported under TRITON_INTERPRET=1"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.knobs import nvidia
        nvidia.ptxas.path, nvidia.cuobjdump.path  # noqa: B018  (the bundled tools; sm_80 to sm_90 need no other)
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"Triton's NVIDIA backend or its ptxas / cuobjdump is missing: {e}"
    return None


class _Utils:
    def __init__(self, props: dict):
        self.props = props

    def get_device_properties(self, device) -> dict:
        return dict(self.props)


class StandInDriver:
    """Answers what Triton asks of a CUDA driver when it compiles (never when it launches)."""

    def __init__(self, arch: int, max_shared_mem: int, max_num_regs: int = REGS_PER_BLOCK):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)
        self.utils = _Utils({"max_shared_mem": max_shared_mem, "max_num_regs": max_num_regs,
                             "multiprocessor_count": 1, "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1,
                             "mem_bus_width": 1})

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch  # one binder cache per target in each JITFunction

    def get_current_stream(self, device=None) -> int:
        return 0


@contextlib.contextmanager
def stand_in(target: str):
    """Make Triton compile for ``target`` (a key of :data:`TARGETS`) inside the block."""
    arch, smem = TARGETS[target]
    previous = getattr(driver, "_active", None)
    driver.set_active(StandInDriver(arch, smem))
    try:
        yield
    finally:
        driver.set_active(previous)


def _binary_record(kernel) -> dict:
    """Registers, stack frame and spill-store bytes of a kernel's cubin, kept under :data:`RECORDS`.

    Read from the binary itself (``cuobjdump -res-usage -sass``): spill stores are its ``STL`` (store to local)
    instructions, summed by width, the figure ``ptxas -v`` prints as "bytes spill stores".
    """
    path = RECORDS / f"{kernel.hash}.json"
    if path.exists():
        return json.loads(path.read_text())
    from triton.knobs import nvidia
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "k.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([nvidia.cuobjdump.path, "-res-usage", "-sass", str(cubin)], capture_output=True,
                             text=True, check=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", out).groups())
    stores = sum(_STL_BYTES.get(m.group(1) or "", 4) for m in re.finditer(r"\bSTL(\.\w+)?\s", out))
    rec = {"registers": regs, "spill_stores": stores, "stack": stack}
    RECORDS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return rec


def kept_configs(launch) -> list:
    """The configs the launch's autotuner keeps for the active target (None for a plain JIT kernel)."""
    tuner = launch.kernel
    if not hasattr(tuner, "prune_configs"):
        return [None]
    tuner.nargs = dict(zip(tuner.arg_names, launch.args))
    try:
        return list(tuner.prune_configs(dict(launch.kwargs)))
    finally:
        tuner.nargs = None


def _inputs(d: int, dtype: torch.dtype, causal: bool, N: int = 1024, h: int = 4):
    """Meta tensors shaped like a training call (contiguous projections, norm on, no padding)."""
    def t(*shape, dt=dtype):
        return torch.empty(shape, device="meta", dtype=dt)
    q, k, v = t(1, N, 2 * h, d), t(1, N, 2 * h, d), t(1, N, h, 2 * d)
    lam, w = t(dt=torch.float32), t(2 * d, dt=torch.float32)
    (y, o1, o2, lse1, lse2, rstd), fwd = _fwd.fwd_launches(q, k, v, lam, w, None, causal, True, 1e-5)
    _, bwd = _bwd.bwd_launches(torch.empty_like(y), q, k, v, lam, w, None, o1, o2, lse1, lse2, rstd, causal, True)
    return dict(zip(("fwd", "bwd_pre", "bwd_dkdv", "bwd_dq"), fwd + bwd))


def compile_one(target: str, name: str, launch, config) -> Compiled:
    """Compile ``launch`` with ``config`` (None: a plain JIT kernel) under the stand-in for ``target``."""
    kwargs = dict(launch.kwargs, **(config.all_kwargs() if config is not None else {}))
    fn = launch.kernel.fn if config is not None else launch.kernel
    with stand_in(target):
        kernel = fn.warmup(*launch.args, grid=(1,), **kwargs)
    rec = _binary_record(kernel)
    desc = (f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} w{config.num_warps} s{config.num_stages}"
            if config is not None else f"w{launch.kwargs.get('num_warps', 4)}")
    q = launch.args[0]
    return Compiled(target, name, kwargs["D"], str(q.dtype).replace("torch.", ""), kwargs.get("CAUSAL", False),
                    desc, re.search(r"\.target (sm_\w+)", kernel.asm["ptx"]).group(1),
                    kernel.asm.get("cubin", b"")[:4] == b"\x7fELF", rec["registers"], rec["spill_stores"],
                    rec["stack"], kernel.metadata.shared, TARGETS[target][1])


def compile_report(target: str, d: int, dtype: torch.dtype, causal: bool, kernels=None) -> list[Compiled]:
    """Compile every kernel (or those named in ``kernels``) of one (d, dtype, causal) call for ``target``, once
    per config its autotuner keeps there, and report each binary."""
    out = []
    for name, launch in _inputs(d, dtype, causal).items():
        if kernels is None or name in kernels:
            with stand_in(target):
                configs = kept_configs(launch)
            out += [compile_one(target, name, launch, config) for config in configs]
    return out


def process_report() -> dict:
    """What this process compiled and chose: each autotuner's pick per key, and every binary of the fused kernels
    (tile, warps, stages, shared memory; ``n_regs`` / ``n_spills`` as the device reports them once launched)."""
    kernels = {"fwd": _fwd._fwd_kernel, "bwd_pre": _bwd._bwd_pre_kernel, "bwd_dkdv": _bwd._dkdv_kernel,
               "bwd_dq": _bwd._dq_kernel}
    picks = {name: {str(k): str(v) for k, v in t.cache.items()} for name, t in kernels.items()
             if isinstance(getattr(t, "cache", None), dict)}
    binaries = []
    for name, t in kernels.items():
        jit = getattr(t, "fn", t)
        for device, caches in getattr(jit, "device_caches", {}).items():
            for k in list(caches[0].values()):
                consts = {jit.arg_names[p[0]] if isinstance(p, tuple) else p: v for p, v in k.src.constants.items()}
                binaries.append({"kernel": name, "device": device, "target": k.metadata.target.arch,
                                 **{c: consts[c] for c in ("D", "CAUSAL", "PREC", "BLOCK_M", "BLOCK_N") if c in consts},
                                 "num_warps": k.metadata.num_warps, "num_stages": k.metadata.num_stages,
                                 "shared": k.metadata.shared, "n_regs": getattr(k, "n_regs", None),
                                 "n_spills": getattr(k, "n_spills", None)})
    return {"autotune": picks, "binaries": binaries}


def table(rows: list[Compiled]) -> str:
    """Markdown: one line per (target, d, kernel) over dtypes and causal; the worst figure of its configs."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.target, r.d, r.kernel), []).append(r)
    lines = ["| target | d | kernel | configs kept | registers | spill stores (B) | stack (B) | shared KB (limit) "
             "| ok |", "|---|---|---|---|---|---|---|---|---|"]
    for (target, d, kernel), rs in groups.items():
        configs = ", ".join(dict.fromkeys(r.config for r in rs))
        lines.append(f"| {target} | {d} | {kernel} | {configs} | {max(r.registers for r in rs)} | "
                     f"{max(r.spill_stores for r in rs)} | {max(r.stack for r in rs)} | "
                     f"{max(r.shared for r in rs) / 1024:.0f} "
                     f"({rs[0].shared_limit / 1024:.0f}) | {'yes' if all(r.ok for r in rs) else 'NO'} |")
    return "\n".join(lines)


def write_table(markdown: Path, text: str) -> None:
    """Replace the table in ``markdown`` that starts with the same header line as ``text``."""
    lines, new = markdown.read_text().split("\n"), text.split("\n")
    start = lines.index(new[0])
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    markdown.write_text("\n".join(lines[:start] + new + lines[end:]))


def main(argv: Optional[list[str]] = None) -> None:
    """Compile the whole matrix and print the table; ``--write FILE`` replaces it in a markdown file (the docs),
    ``-v`` prints every binary as a JSON line too."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", type=Path, help="markdown file whose table to replace, e.g. docs/kernels.md")
    parser.add_argument("-v", action="store_true", help="print one JSON line per binary")
    args = parser.parse_args(argv)
    rows = [r for target in TARGETS for d in (64, 128) for dtype in (torch.bfloat16, torch.float16)
            for causal in (False, True) for r in compile_report(target, d, dtype, causal)]
    for r in rows if args.v else []:
        print(json.dumps(asdict(r)))
    print(table(rows))
    if args.write:
        write_table(args.write, table(rows))


if __name__ == "__main__":
    main()
