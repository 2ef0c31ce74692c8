"""The shared-memory pipeline of the two decode GEMMs (kernels/gemm_stream_k.py, kernels/gemm_wide.py):
how deep a TMA -> wgmma pipeline may be, what a 0/1 knob of a stage's contents may be, the L2 hint of their weight stream, how a box is
loaded into one CTA's stage or multicast into a cluster's (or into the first rows of a
buffer), and how the CTAs of a cluster agree that their stage barriers exist (and outlive
every peer's use) and free a stage."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int16, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from . import weight_blocks

SMEM_BUDGET = 200 * 1024   # default depth: leaves room on the SM for a PDL dependent's CTAs
SMEM_MAX = 220 * 1024      # the ``stages`` knob: under the 227 KB an sm_90 CTA may use (barriers, alignment)
MAX_STAGES = 16
# L2 eviction hint for the W stream (CUTLASS's CacheHintSm90::EVICT_FIRST): weights are read
# once per step, so they should not push x, the partials or the next kernel's data out of L2.
EVICT_FIRST = 0x12F0000000000000


def pipeline_stages(stages: int | None, stage_bytes: int, budget: int = SMEM_BUDGET) -> int:
    """The pipeline depth: as many stages of ``stage_bytes`` as ``budget`` (SMEM_BUDGET, or at
    most SMEM_MAX where the kernel measured faster deeper) holds, or the ``stages`` knob, which
    may go up to SMEM_MAX (no room left for a PDL dependent's CTAs)."""
    if stages is None:
        stages = max(2, min(MAX_STAGES, min(budget, SMEM_MAX) // stage_bytes))
    if not 2 <= stages <= MAX_STAGES or stages * stage_bytes > SMEM_MAX:
        raise ValueError(f"stages={stages} unsupported: 2..{MAX_STAGES} stages of "
                         f"{stage_bytes} bytes within {SMEM_MAX} bytes of shared memory")
    return int(stages)


def on_off_knob(name: str, value: int | None, default: bool, allowed: bool, where: str) -> int:
    """A 0/1 tuning knob (``x_trim``, ``y_staging``): ``default`` when not given; 1 only where
    ``allowed`` (``where`` says where, for the error)."""
    if value is None:
        value = int(default)
    if value not in (0, 1) or (value and not allowed):
        raise ValueError(f"{name}={value} unsupported here (0, or 1 {where})")
    return int(value)


def block_rows_knob(value: int | None, blocked: bool) -> int:
    """The ``w_block_rows`` knob of both decode GEMMs: rows per block of a blocked W (64 by
    default; 16 as a measurement variant, kernels/weight_blocks.py), 64 when W is row-major."""
    if value is None:
        value = weight_blocks.BLOCK
    if value not in weight_blocks.ROW_BLOCKS or (value != weight_blocks.BLOCK and not blocked):
        raise ValueError(f"w_block_rows={value} unsupported here ({weight_blocks.BLOCK}, or "
                         f"{' or '.join(str(r) for r in weight_blocks.ROW_BLOCKS if r != weight_blocks.BLOCK)} "
                         f"with W in blocks: w_blocked=1)")
    return int(value)


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


def first_rows_layout(buffers, rows: int):
    """The first ``rows`` rows (whole 8-row swizzle atoms) of every buffer of ``buffers``, a
    128B-swizzled K-major (rows, K, buffer) layout: the same swizzle and strides, fewer rows.
    TMA boxes shorter than the buffer land there, so that rows past the end of x are not
    loaded (TMA would zero-fill them, at a cost: bench/gemm_notes.md §23)."""
    outer = buffers.outer
    return cute.make_composed_layout(
        buffers.inner, 0, cute.make_layout(((8, rows // 8), *outer.shape[1:]), stride=outer.stride))


def row_pieces_layout(buffers, rows: int, step: int, count: int):
    """Every buffer of ``buffers`` (a 128B-swizzled K-major (rows, K, buffer) layout) seen as
    ``count`` pieces of ``rows`` rows starting ``step`` rows apart (whole 8-row swizzle atoms;
    pieces may overlap): a (rows, K, (piece, buffer)) layout over the same bytes. The swizzle
    follows the shared-memory address, so a box landing in a piece is laid out as if the whole
    buffer had been one box."""
    outer = buffers.outer
    (atom_rows, _), k_mode, (_, n_buffers) = outer.shape
    (row_stride, atom_stride), k_stride, (_, buffer_stride) = outer.stride
    return cute.make_composed_layout(
        buffers.inner, 0, cute.make_layout(
            ((atom_rows, rows // atom_rows), k_mode, (count, n_buffers)),
            stride=((row_stride, atom_stride), k_stride, (atom_stride * (step // atom_rows), buffer_stride))))


def w_global_layout(n: int, k: int, blocked: bool, rows: int = weight_blocks.BLOCK):
    """W's (n, k) layout in global memory: row-major [N, K], or kernels/weight_blocks.py's
    [N/rows, K/64, rows, 64] blocks, as ((row in block, row block), (k in block, k block))."""
    if not blocked:
        return cute.make_layout((n, k), stride=(k, 1))
    b = weight_blocks.BLOCK
    return cute.make_layout(((rows, n // rows), (b, k // b)), stride=((b, rows * k), (1, rows * b)))


def tma_load_op(multicast: int):
    """The bulk tensor copy into shared memory: multicast into ``multicast`` CTAs of a cluster,
    or into this CTA only."""
    return cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()


def tma_load(atom, src, dst, bar, multicast: int, cache_policy=None, mask=None) -> None:
    """Issue one TMA box load of ``atom`` (made with tma_load_op(multicast)) completing on the
    mbarrier ``bar``: multicast into the CTAs of the cluster that ``mask`` names (one bit per
    CTA rank; by default the first ``multicast``), with the L2 ``cache_policy`` hint if given."""
    hints = {} if cache_policy is None else {"cache_policy": cache_policy}
    if multicast > 1:
        hints["mcast_mask"] = Int16((1 << multicast) - 1) if mask is None else mask
    cute.copy(atom, src, dst, tma_bar_ptr=bar, **hints)


@cute.jit
def barriers_ready(cluster: cutlass.Constexpr) -> None:
    """After the stage barriers are initialised: no CTA of the cluster may multicast into a
    peer or arrive on its barriers before they exist (a CTA barrier when there is no cluster)."""
    if const_expr(cluster > 1):
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
    else:
        cute.arch.sync_threads()


@cute.jit
def peers_done(cluster: cutlass.Constexpr) -> None:
    """Before exit: no CTA of the cluster leaves while a peer may still multicast into it or
    arrive on its barriers (nothing to wait for without a cluster)."""
    if const_expr(cluster > 1):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
