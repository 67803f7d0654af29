"""Tiles of the fused kernels, and the pruner that keeps those the active device can launch.

Every tile in :data:`TILES` compiles without register spills for sm_80, sm_86, sm_89 and sm_90 at its head dim
(bf16 and fp16, causal or not): ``tests/ops/test_triton_targets.py`` compiles exactly the kept tiles for those
targets, and docs/kernels.md (section 4.1) has the table. Shared memory is not estimated: the pruner compiles
each listed tile for the active target (what the autotuner does next anyway; the binary stays in Triton's
cache) and keeps those within the per-block limit Triton's driver reports, so a stand-in driver
(:mod:`diffmm.ops.triton_targets`) exercises it with no GPU, and an sm_86/89 card (99 KB) drops the tiles
that only an A100/H100 holds. ``DIFFMM_TRITON_AUTOTUNE=0`` keeps only the first tile that fits.
"""
from __future__ import annotations

import os

import triton
from triton.runtime.driver import driver

# DIFFMM_TRITON_AUTOTUNE=0: skip tuning, use the first tile that fits (faster start-up, e.g. in CI).
AUTOTUNE = os.environ.get("DIFFMM_TRITON_AUTOTUNE", "1") != "0"
MAX_THREAD_REGS = 255  # what ptxas may give one thread; a tile's warps must fit the block's register file

# kernel -> head dim (d <= 64 uses the 64 list) -> (BLOCK_M, BLOCK_N, num_warps, num_stages), first = the
# AUTOTUNE=0 choice where it fits. Larger tiles spill at 255 registers (fp32 accumulators of 2 maps, 2d wide).
TILES = {
    "fwd": {64: [(64, 64, 8, 2), (64, 32, 8, 2)],
            128: [(32, 32, 8, 2), (32, 64, 8, 1)]},
    "bwd_dkdv": {64: [(64, 32, 8, 2), (32, 32, 8, 2)],
                 128: [(32, 32, 8, 2)]},
    "bwd_dq": {64: [(64, 32, 8, 2), (32, 64, 8, 2)],
               128: [(32, 64, 8, 2), (32, 32, 8, 2), (64, 32, 8, 2)]},
}
# Added on sm_90 only: 64 query rows let the d = 128 forward use Hopper's wgmma; on sm_8x it spills.
HOPPER_TILES = {"fwd": {128: [(64, 32, 8, 2)]}}


def tile(config: triton.Config) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a config."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def configs(kernel: str) -> list[triton.Config]:
    """Every tile of ``kernel`` (all head dims, in order) as autotune configs."""
    tiles = dict.fromkeys(t for table in (TILES, HOPPER_TILES) for by_d in table.get(kernel, {}).values()
                          for t in by_d)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def device_limits() -> tuple[int, int]:
    """(shared memory bytes, registers) per block of the active device, as Triton's driver reports them."""
    active = driver.active
    props = active.utils.get_device_properties(active.get_current_device())
    return props["max_shared_mem"], props["max_num_regs"]


def tiles_for(kernel: str, d: int, arch: int) -> list[tuple[int, int, int, int]]:
    """The tiles of ``kernel`` for head dim ``d`` on compute capability ``arch`` (e.g. 90), in order."""
    d = 64 if d <= 64 else 128
    return TILES[kernel][d] + (HOPPER_TILES.get(kernel, {}).get(d, []) if arch == 90 else [])


def pruner(kernel: str, jit_fn):
    """``early_config_prune`` for ``kernel`` (a key of :data:`TILES`) whose JIT function is ``jit_fn``."""

    def prune(configs, named_args, **kwargs):
        listed = tiles_for(kernel, kwargs["D"], driver.active.get_current_target().arch)
        candidates = sorted((c for c in configs if tile(c) in listed), key=lambda c: listed.index(tile(c)))
        smem, regs = device_limits()
        keep = []
        for c in candidates:
            if c.num_warps * 32 * MAX_THREAD_REGS > regs:
                continue
            binary = jit_fn.warmup(*named_args.values(), grid=(1,), **kwargs, **c.all_kwargs())
            if binary.metadata.shared <= smem:
                keep.append(c)
                if not AUTOTUNE:
                    break
        return keep or candidates[-1:]  # nothing fits: the launch raises Triton's OutOfResources

    return prune


def autotune(kernel: str, jit_fn, key: list[str]):
    """``jit_fn`` autotuned over the tiles of ``kernel``, pruned to what the device launches."""
    return triton.autotune(configs(kernel), key=key,
                           prune_configs_by={"early_config_prune": pruner(kernel, jit_fn)})(jit_fn)
