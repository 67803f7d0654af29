"""The fused kernels compile for sm_80, sm_86, sm_89 and sm_90 with no GPU: launchable and spill-free.

Through the project's wrappers and autotuners under a stand-in driver (``diffmm.ops.triton_targets``): d 64 and
128, bf16 and fp16, causal and not, every tile the pruner keeps for the target. Each binary must target the
architecture, be an ELF cubin, need no more shared memory than the target's per-block limit and spill nothing
(no ``STL`` in its SASS, no stack frame). Needs Triton 3.6-3.8 (``TRITON_RANGE``; skipped with the reason
otherwise) and no ``TRITON_INTERPRET``. Binaries come from Triton's cache and their figures from
``~/.cache/diffmm/cubin``, so a warm run takes seconds; a cold one compiles ~45 binaries per target (~50 s of CPU
each).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from diffmm.ops import triton_targets as T  # noqa: E402
from diffmm.ops import triton_tiles  # noqa: E402

REASON = T.unsupported_reason()
needs_driver = pytest.mark.skipif(REASON is not None, reason=REASON or "")
KERNELS = {"fwd", "bwd_pre", "bwd_dkdv", "bwd_dq"}


@needs_driver
@pytest.mark.timeout(1500)  # cold, on a loaded 2-core machine: ~50 s of CPU, 5 min of wall time per target
@pytest.mark.parametrize("target", list(T.TARGETS))
def test_kernels_compile_for_target_launchable_and_spill_free(target):
    rows = [r for d in (64, 128) for dtype in (torch.bfloat16, torch.float16) for causal in (False, True)
            for r in T.compile_report(target, d, dtype, causal)]
    assert {r.kernel for r in rows} == KERNELS
    assert {(r.d, r.dtype, r.causal) for r in rows if r.kernel == "bwd_dkdv"} == {
        (d, dt, c) for d in (64, 128) for dt in ("bfloat16", "float16") for c in (False, True)}
    ptx = target + ("a" if target == "sm_90" else "")  # Hopper's wgmma needs the arch-specific sm_90a
    bad = [r for r in rows if not r.ok or r.ptx_target != ptx or r.registers > 255]
    assert not bad, "\n" + T.table(bad)


@needs_driver
def test_pruner_follows_the_drivers_shared_memory(monkeypatch):
    """sm_86/89 (99 KB) drop the tiles only sm_80/90 hold, sm_90 adds its wgmma tile; AUTOTUNE=0 keeps the first
    tile that fits."""
    def kept(target, name="bwd_dq", d=128):
        with T.stand_in(target):
            return [triton_tiles.tile(c) for c in T.kept_configs(T._inputs(d, torch.float16, True)[name])]

    listed = triton_tiles.TILES["bwd_dq"][128]
    assert kept("sm_80") == listed == kept("sm_90")
    small = kept("sm_86")
    assert small and small == kept("sm_89") and set(small) < set(listed)
    fwd = triton_tiles.TILES["fwd"][128]
    assert kept("sm_80", "fwd") == fwd and kept("sm_90", "fwd") == triton_tiles.tiles_for("fwd", 128, 90) != fwd
    monkeypatch.setattr(triton_tiles, "AUTOTUNE", False)
    assert kept("sm_90") == listed[:1] and kept("sm_86") == small[:1]


@needs_driver
def test_process_report_lists_compiled_binaries():
    T.compile_report("sm_89", 64, torch.float16, False, kernels=["fwd"])
    bins = [b for b in T.process_report()["binaries"] if b["target"] == 89 and b["kernel"] == "fwd"]
    tiles = {(b["BLOCK_M"], b["BLOCK_N"], b["num_warps"], b["num_stages"]) for b in bins if b["D"] == 64}
    assert tiles and tiles <= set(triton_tiles.TILES["fwd"][64])
    assert all(b["shared"] > 0 and b["n_regs"] is None for b in bins)  # never loaded on a device


@needs_driver
def test_a_spilling_tile_is_caught():
    """64 query rows at d = 128 spill on sm_80 (ptxas -v: 60 bytes spill stores, 56 bytes stack frame): the cubin
    check sees it, so the test above can fail."""
    launch = T._inputs(128, torch.bfloat16, True)["fwd"]
    config = next(c for c in launch.kernel.configs if triton_tiles.tile(c) == (64, 32, 8, 2))
    r = T.compile_one("sm_80", "fwd", launch, config)
    assert r.spill_stores > 0 and r.stack > 0 and not r.ok
    assert r.registers == 255 and r.cubin_ok and r.shared <= r.shared_limit


def test_write_table_replaces_only_the_table(tmp_path):
    doc = tmp_path / "k.md"
    doc.write_text("intro\n\n| target | d |\n|---|---|\n| old | 1 |\n\nafter\n")
    T.write_table(doc, "| target | d |\n|---|---|\n| sm_80 | 64 |\n| sm_90 | 128 |")
    assert doc.read_text() == "intro\n\n| target | d |\n|---|---|\n| sm_80 | 64 |\n| sm_90 | 128 |\n\nafter\n"
