"""The shared-memory pipeline of the two decode GEMMs (kernels/gemm.py, kernels/gemm_wide.py):
how deep a TMA -> wgmma pipeline may be, the L2 hint of their weight stream, and how a consumer
frees a stage when the CTAs of a cluster multicast into each other's stages."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

SMEM_BUDGET = 200 * 1024   # default depth: leaves room on the SM for a PDL dependent's CTAs
SMEM_MAX = 220 * 1024      # the ``stages`` knob: under the 227 KB an sm_90 CTA may use (barriers, alignment)
MAX_STAGES = 16
# L2 eviction hint for the W stream (CUTLASS's CacheHintSm90::EVICT_FIRST): weights are read
# once per step, so they should not push x, the partials or the next kernel's data out of L2.
EVICT_FIRST = 0x12F0000000000000


def pipeline_stages(stages: int | None, stage_bytes: int) -> int:
    """The pipeline depth: as many stages of ``stage_bytes`` as SMEM_BUDGET holds, or the
    ``stages`` knob, which may go up to SMEM_MAX (no room left for a PDL dependent's CTAs)."""
    if stages is None:
        stages = max(2, min(MAX_STAGES, SMEM_BUDGET // stage_bytes))
    if not 2 <= stages <= MAX_STAGES or stages * stage_bytes > SMEM_MAX:
        raise ValueError(f"stages={stages} unsupported: 2..{MAX_STAGES} stages of "
                         f"{stage_bytes} bytes within {SMEM_MAX} bytes of shared memory")
    return int(stages)


@cute.jit
def release_stage(bar, cluster: cutlass.Constexpr) -> None:
    """Free a pipeline stage: arrive on its empty barrier ``bar`` in every CTA of the cluster
    (each CTA's producer multicasts into all of them, so each waits for every consumer), or in
    this CTA only."""
    if const_expr(cluster > 1):
        for r in cutlass.range_constexpr(cluster):
            cute.arch.mbarrier_arrive(bar, Int32(r))
    else:
        cute.arch.mbarrier_arrive(bar)
