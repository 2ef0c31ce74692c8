"""The decode GEMM's stream-K kernel for Hopper (sm_90a): ``y[M, N] = x[M, K] @ W[N, K]^T``.

Decode is weight-bandwidth bound: for M <= 64 the kernel's job is to stream W (N*K*2 bytes,
read once) from HBM at full speed, and to start streaming it *before* ``griddepcontrol.wait``
so that under PDL it overlaps the previous kernel. It is the default of kernels/gemm.py's
``plan``; the whole-K tiles of kernels/gemm_wide.py take over at many batch rows. Reasoning
and numbers: bench/gemm_notes.md.

Structure
---------
* **Swap AB**: the kernel computes ``y^T = W x^T`` with wgmma. W is the A operand (its N rows
  fill the instruction's M = 64), x is the B operand (the batch fills the instruction's N, which
  wgmma allows in steps of 8). M = 1 therefore pads to 8 batch columns, not to 64, and the same
  code is a real tensor-core GEMM at M = 256 (two consumer warpgroups of 128 batch columns).
* **Tiles**: a consumer warpgroup owns a *unit* of 128 W rows (two 64-row halves) x its batch
  columns. With ``silu_mul`` the two halves are gate rows ``[64u, 64u+64)`` and up rows
  ``[I+64u, ...)``, so one thread holds both accumulators of its output columns and the
  epilogue is ``silu(gate) * up`` in fp32, rounded once. A tile is one unit; for plain shapes
  at 65-200 batch rows it is the same 128 rows as two 64-row units on two warpgroups, each
  with every batch column (``HALF_WGS_ROWS``); above 128 rows otherwise two warpgroups split
  the batch. (The ``row_wgs`` knob puts two units side by side in general; with 128-row
  units that is a 256-row tile.) Where 64-row units nearly fill the SMs one per SM at
  129-256 rows (o_proj, down), and at 65-128 rows on short K (o_proj), each CTA takes one of
  them over the whole of K with every batch column and nothing is split
  (``UNIT_PER_CTA_ROWS``).
* **Stream-K over a persistent grid**: the (tile, k-block) iterations are laid end to end and
  cut into ``ctas`` equal contiguous ranges (ctas = number of SMs), one per CTA, so every SM
  streams the same number of weight bytes (at most one k-block apart) whatever N/128 is. A tile
  split between CTAs (at most 4) is reduced deterministically through a workspace: each
  contributor counts its arrival on the tile's counter; every one but the last publishes its
  fp32 partial and counts it on a second counter; the last waits for those partials (only
  ever on CTAs that already arrived, i.e. are running, so no co-residency is assumed), sums
  all partials in CTA order, its own from registers, writes y and resets both counters for
  the next launch. With small partials (M <= 16) and several CTAs ending in one tile, every
  contributor publishes *before* arriving instead (``publish_first``), which saves the last
  one a round trip. With large ones (two warpgroups, 129-200 rows) the fix-up is shared out
  instead (``fixup_split``): each warpgroup's part of the tile is summed and stored by one of
  the CTAs whose ranges end in it, which stages the others' parts with bulk copies. The
  order, not the arrival, fixes the result: replays are bitwise equal.
  When the tile is the last CTA's last (always, unless timing is pathological) and the
  others' partials fit in its drained pipeline buffers, it bulk-copies them there
  (``cp.async.bulk``, all in flight at once) and sums from shared memory; when they do not
  fit (M = 256: 128 KB each) and the reducer comes first in CTA order (in practice always),
  it stages them in rounds and sums into its own accumulators. Once summed, the partials are
  dropped from L2 (``discard.global.L2``): left dirty there, they were written back to HBM
  while the next kernels streamed (bench/gemm_notes.md §15).
* **Epilogue** (``y_staging``, from 64 batch columns): the bf16 output tile goes through shared
  memory, the stage the tile's last k-block used (held until the stores are done; where the
  tile does not fit there, M > 128 or a 64-row half per warpgroup, the drained pipeline of
  the CTA's last tile), and out as 16-byte vectors.
* **Pipeline**: a producer warp issues TMA (``cp.async.bulk.tensor``) loads of W (one 8 KB
  64x64 box per half, two per half with ``block_k = 128``; one contiguous read each when W is
  given as its 64 x 64 blocks, kernels/weight_blocks.py, which ``linear`` takes as a 4-D
  weight: the ``w_blocked`` layout, 2-7% faster than row-major) and x (one box per batch
  warpgroup; two, ending at round_up(M, 8), where M is 1-8 rows past a multiple of 16:
  ``x_trim``) per stage into 128B-swizzled shared memory, completing on an mbarrier armed with
  the bytes they deliver; ``stages`` is as deep as ~200 KB of shared memory allows (M <= 8: 11
  stages, 176 KB of W in flight per SM; M = 64: 8 x 16 KB, or 5 x 32 KB with 256-row tiles).
  Consumer warpgroups wait on the stage, run wgmma (keeping one k-block in flight), and
  release it.

PDL (DESIGN §4)
---------------
* ``griddepcontrol.launch_dependents`` at entry (``TRIGGER = "early"``): the dependents launch
  once every CTA has executed it, i.e. once the whole grid (one wave, ctas <= SMs) is resident,
  so a dependent can never take an SM from one of our CTAs; it then waits for our completion
  in its own ``griddepcontrol.wait``, and the next kernel (AttnRes, whose pre-phase reads only
  data complete at launch) overlaps our tail instead of starting after it. The ``trigger_at``
  knob moves the trigger later (after the wait, after the CTA's last k-block, or to exit) for
  measurement: in the step each later point was slower or tied at 1-64 rows, since a later
  trigger also delays the kernel after next, whose weight prologue then overlaps less
  (bench/gemm_notes.md §32).
* Before the wait the producer issues the W loads of the first ``stages`` pipeline stages
  (``PROLOGUE_INPUTS = ("weight",)``), and with the ``l2_prefetch`` knob (0 by default) an L2
  prefetch of the next iterations' W; the stage barrier already expects the x bytes too, so
  no consumer can start early.
* Every thread executes ``griddepcontrol.wait`` (``WAITS = True``): the producer right before
  its first x load, the consumers before any global access (workspace, counters, y).
* The workspace and counters are touched only after the wait, so kernels that share them in
  one stream are ordered by PDL completion itself.
"""

from __future__ import annotations

import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import gemm_wide, smem_pipeline, weight_blocks
from .compile_cache import CompileCache
from .gemm_contract import DEFAULT_SMS, K_ALIGN, check_shape
from .smem_pipeline import (EVICT_FIRST, barriers_ready, block_rows_knob, first_rows_layout, on_off_knob,
                            peers_done, pipeline_stages, release_stage, tma_load, tma_load_op, w_global_layout)
from .workspaces import Workspaces, workspace

# PDL traits of this kernel, read by the scheduler through kernels/gemm.py (DESIGN §4).
PROLOGUE_INPUTS = ("weight",)
WAITS = True
TRIGGER = "early"

# Tuning knobs of GemmConfig (None: the default), in cache-key order. Set by the benchmark
# (bench/gemm.py --tunings); the decode step always runs the defaults.
TUNING_KNOBS = ("block_k", "row_wgs", "l2_prefetch", "stages", "halves", "y_staging", "col_wgs",
                "publish_first", "cluster", "x_trim", "pre_wait_stages", "trigger_at", "w_blocked",
                "w_block_rows", "consumer_regs", "max_split", "fixup_split")
# Where a CTA executes ``launch_dependents`` (the ``trigger_at`` knob; TRIGGER stays "early",
# which is conservative for every one of them): at entry (the default), right after its PDL
# wait, once its consumers have streamed their last k-block (before the last tile's split
# reduction and epilogue), or never (the CTA counts as triggered when it exits). Entry was
# measured fastest or tied in the step at 1-64 rows (bench/gemm_notes.md §32; in the AttnRes
# chain alone the trigger after the last k-block won 0.4 us per link at M = 8 only).
TRIGGER_POINTS = ("entry", "wait", "streamed", "exit")
DEFAULT_BLOCK_K = 64       # 128 lost on 19 of 24 rows of bench/gemm.py (H200, bench/gemm_notes.md §6)
HALF_ROWS = 64             # W rows per wgmma (the instruction's M)
Y_STAGING_MIN_MMA_N = 64   # y through shared memory from 64 batch columns (GemmConfig.y_staging)
PUBLISH_FIRST_MAX_MMA_N = 16  # split tiles publish before arriving up to 16 batch columns (GemmConfig)
FIXUP_SPLIT_MIN_MMA_N = 144   # split tiles' fix-up shared out by warpgroup from 129 rows (GemmConfig)
# The split-tile reducer's wait for published partials gives up (``trap``: the launch fails
# with a CUDA error) after this long. Legitimately microseconds; a context switch to another
# process's work lasts milliseconds.
REDUCER_SPIN_LIMIT_NS = 2_000_000_000
# setmaxnreg (the ``consumer_regs`` knob): what the producer warpgroup keeps (one warp issues
# TMA loads; CUTLASS's warp-specialised Hopper kernels keep the same), what a consumer thread
# may then hold in accumulators, and one SM sub-partition's register file (32-bit registers).
PRODUCER_REGS = 40
CONSUMER_REGS_MAX_ACCS = 192
SUBPARTITION_REGS = 16384
# The most CTAs a split tile is spread over (``max_split``): fewer CTAs than SMs where tiles
# are few and long ranges would split them further (qkv's 40 256-row tiles: 117 CTAs).
MAX_SPLIT = 4
HALF_WGS_ROWS = (65, 200)  # plain shapes: a 64-row half per warpgroup at these M (GemmConfig)
UNIT_PER_CTA_ROWS = (65, 256)   # plain shapes: one whole-K 64-row unit per CTA at these M ...
UNIT_PER_CTA_MIN_FILL = 0.8     # ... when the units fill this share of the SMs (GemmConfig) ...
UNIT_PER_CTA_SHORT_K = 8192     # ... and up to 128 rows (gemm_wide.MAX_BATCH_TILE) only where K is at most this
# No L2 prefetch beyond the stages by default. 8 iterations gave the fastest AttnRes -> GEMM
# link and GEMM -> GEMM chain (gemm_notes.md §6; in session 17 still up to 4% on qkv in
# bench/gemm.py), but the decode step is 1.0-2.5% faster without it at 1-32 rows (8 and 93
# layers, A/B in one process, bitwise-equal logits; §26), and ties at 64.
DEFAULT_L2_PREFETCH = 0


def _round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


class GemmConfig:
    """Every static decision for one (M, K, N, epilogue, ctas, block_k, row_wgs), in plain Python.

    Vocabulary: a *half* is 64 W rows (one wgmma M); a *unit* is what one consumer warpgroup
    owns in a tile: ``halves`` halves (silu_mul: one gate half and the matching up half); a
    *tile* is ``row_wgs`` units side by side, each on its own warpgroup, times the whole batch
    (split over ``col_wgs`` warpgroups when M > 128).
    """

    def __init__(self, m: int, k: int, n: int, epilogue: str | None = None, ctas: int = DEFAULT_SMS, *,
                 block_k: int | None = None, row_wgs: int | None = None, l2_prefetch: int | None = None,
                 stages: int | None = None, halves: int | None = None, y_staging: int | None = None,
                 col_wgs: int | None = None, publish_first: int | None = None, cluster: int | None = None,
                 x_trim: int | None = None, pre_wait_stages: int | None = None,
                 trigger_at: int | None = None, w_blocked: int | None = None,
                 w_block_rows: int | None = None, consumer_regs: int | None = None,
                 max_split: int | None = None, fixup_split: int | None = None):
        check_shape(m, k, n, epilogue)
        self.m, self.k, self.n, self.epilogue = int(m), int(k), int(n), epilogue
        self.silu = epilogue == "silu_mul"
        self.n_out = n // 2 if self.silu else n
        # K per pipeline stage: 64 (one 128-byte swizzle atom per W row) or 128 (two atoms, so
        # each row contributes 256 contiguous bytes per stage; coarser stream-K balance).
        if block_k is None:
            block_k = DEFAULT_BLOCK_K if k % DEFAULT_BLOCK_K == 0 else K_ALIGN
        if block_k not in (64, 128) or k % block_k:
            raise ValueError(f"block_k={block_k} unsupported: 64 or 128, dividing K={k}")
        self.block_k = block_k
        self.k_blocks = k // block_k

        # Plain shapes at HALF_WGS_ROWS batch rows: each 128-row tile's two 64-row halves on
        # two warpgroups (64-row units, ``row_wgs`` = 2), each with all batch columns, instead
        # of one warpgroup holding both halves. Twice the warpgroups issuing wgmma and
        # sharing the epilogue and the reduction, the same tiles and stages. Measured on an
        # H200 (bench/gemm_notes.md §13): 0-7.5% faster at M = 128 and 4.5-7.7% at 200 on
        # down / qkv / o_proj, the same at M <= 64, mixed at 256 (o_proj +7%).
        # Plain shapes at UNIT_PER_CTA_ROWS batch rows whose 64-row units nearly fill the SMs
        # one per SM (o_proj and down: 112 units on 132 SMs): each CTA computes one unit over
        # the whole of K with every batch column in one warpgroup, so nothing is split and
        # there is no reduction; the grid is the units. cuBLAS's own tiling of o_proj at
        # 144-208 rows (64 W rows x all batch rows on 112 CTAs). Measured on an H200
        # (bench/gemm_notes.md §22, §23): o_proj 10-22% faster than the split at 144-208 rows
        # and 3-10% at 72-128 (4 interleaved rounds). Up to 128 rows the split's tail is
        # smaller (~6-9 µs), so it outweighs the 15% idle SMs only on a short stream: down
        # (K = 18432) was 2-5% slower with one unit per CTA at 72-80 rows and tied at 96-128,
        # hence UNIT_PER_CTA_SHORT_K there. (At 16-64 rows: a tie on o_proj at 32 and 64,
        # slower at 16, §22.)
        unit_per_cta = False
        if (halves, row_wgs, col_wgs) == (None, None, None) and not self.silu \
                and UNIT_PER_CTA_ROWS[0] <= m <= UNIT_PER_CTA_ROWS[1] and n % HALF_ROWS == 0 \
                and UNIT_PER_CTA_MIN_FILL * ctas <= n // HALF_ROWS <= ctas \
                and (m > gemm_wide.MAX_BATCH_TILE or k <= UNIT_PER_CTA_SHORT_K):
            halves, row_wgs, col_wgs = 1, 1, 1
            unit_per_cta = True
        elif (halves, row_wgs, col_wgs) == (None, None, None) and not self.silu \
                and HALF_WGS_ROWS[0] <= m <= HALF_WGS_ROWS[1] and n % (2 * HALF_ROWS) == 0:
            halves, row_wgs, col_wgs = 1, 2, 1
        # Units: two halves when they exist (silu: gate + up; else 128 contiguous rows), or
        # the ``halves`` knob: 1 gives 64-row units, twice the tiles (fewer CTAs per split
        # tile, half-size partials) for twice the x re-reads.
        if halves is None:
            halves = 2 if (self.silu or n % (2 * HALF_ROWS) == 0) else 1
        if halves not in (1, 2) or (self.silu and halves != 2) or n % (halves * HALF_ROWS):
            raise ValueError(f"halves={halves} unsupported here (N={n}, epilogue={epilogue!r})")
        self.halves = int(halves)
        self.unit_cols = HALF_ROWS if self.silu else HALF_ROWS * self.halves   # y columns per unit
        self.units = self.n_out // self.unit_cols
        # Batch columns: one consumer warpgroup up to 128, two beyond. wgmma allows N in steps
        # of 8, but CuTe DSL 4.8.1 aborts building the swizzled B layout for an odd number of
        # 8-row atoms (24, 40, ...), so N is 8 or a multiple of 16.
        # (The ``col_wgs`` knob: 1 above 128 rows gives each warpgroup all batch columns, up
        # to wgmma's N = 256, with 64-row units on two row warpgroups: half the W rows per
        # instruction, the same accumulators.)
        if col_wgs is None:
            col_wgs = 1 if m <= 128 else 2
        per_wg = -(-m // col_wgs)
        mma_n = 8 if per_wg <= 8 else _round_up(per_wg, 16)
        # Registers per consumer thread (``consumer_regs``): by default every thread gets the
        # same share, at most 168 with two consumer warpgroups (an SM sub-partition holds 16K
        # registers and gets three of the nine warps), so at most 128 fp32 accumulators per
        # thread: halves x 64 x mma_n over 128 threads. With the knob the producer becomes a
        # warpgroup that gives registers back (setmaxnreg, PRODUCER_REGS) and the consumers
        # take ``consumer_regs``, room for 192 accumulators: two 64-row halves at up to 192
        # batch columns, i.e. 256-row tiles on two warpgroups at 129-192 rows, which read x
        # from L2 once per 256 W rows instead of once per 128.
        self.consumer_regs = self._consumer_regs(consumer_regs)
        max_accs = CONSUMER_REGS_MAX_ACCS if self.consumer_regs else 128
        if col_wgs not in (1, 2) or self.halves * mma_n * HALF_ROWS // 128 > max_accs:
            raise ValueError(f"col_wgs={col_wgs} unsupported here (M={m}, halves={self.halves}: at most "
                             f"{max_accs} fp32 accumulators per consumer thread, halves x 64 x {mma_n} / 128"
                             + ("" if self.consumer_regs else "; consumer_regs allows more") + ")")
        self.col_wgs = int(col_wgs)
        self.mma_n = mma_n
        # x is re-read from L2 once per tile: with two units per tile (256 W rows) that costs
        # mma_n/256 of the W bytes instead of mma_n/128, for a coarser stream-K step (32 KB of
        # W per iteration), partials twice as large and fewer stages. Measured on an H200
        # (bench/gemm.py, 2026-11-30): 256-row tiles were slower on all four Kimi shapes at
        # every M (gate_up M=64: 141.5 vs 133.1 us), so the default is one unit per tile.
        if row_wgs is None:
            row_wgs = 1
        if row_wgs not in (1, 2) or self.units % row_wgs or row_wgs * self.col_wgs > 2:
            raise ValueError(f"row_wgs={row_wgs} unsupported here (units={self.units}, col_wgs={self.col_wgs})")
        self.row_wgs = row_wgs
        self.wgs = self.row_wgs * self.col_wgs
        self.tiles = self.units // self.row_wgs
        self.iters = self.tiles * self.k_blocks
        self.unit_per_cta = unit_per_cta
        if max_split is None:
            max_split = MAX_SPLIT
        if not 2 <= max_split <= 8:
            raise ValueError(f"max_split={max_split} unsupported: 2..8 CTAs per split tile")
        self.max_split = int(max_split)
        self.ctas = self.tiles if unit_per_cta else self._ctas_for(self.tiles, ctas)
        self.max_segs = max(self.cta_of((t + 1) * self.k_blocks - 1) - self.cta_of(t * self.k_blocks) + 1
                            for t in range(self.tiles))

        # + one producer warp, or with consumer_regs a producer warpgroup (setmaxnreg works on
        # whole warpgroups) whose other three warps only wait for the previous grid and exit.
        self.threads = 128 * self.wgs + (128 if self.consumer_regs else 32)
        self.producer_warp = 4 * self.wgs
        if self.consumer_regs and (self.wgs * self.consumer_regs + PRODUCER_REGS) * 32 > SUBPARTITION_REGS:
            raise ValueError(f"consumer_regs={self.consumer_regs} unsupported with {self.wgs} consumer warpgroups: "
                             f"an SM sub-partition holds one warp of each warpgroup and {SUBPARTITION_REGS} "
                             f"registers, so at most {(SUBPARTITION_REGS // 32 - PRODUCER_REGS) // self.wgs // 8 * 8}")
        self.w_boxes = self.row_wgs * self.halves   # 64-row W buffers per stage
        self.w_stage_bytes = self.w_boxes * HALF_ROWS * block_k * 2
        self.x_stage_bytes = self.col_wgs * self.mma_n * block_k * 2
        self.stage_bytes = self.w_stage_bytes + self.x_stage_bytes
        self.stages = pipeline_stages(stages, self.stage_bytes)
        # Iterations beyond the shared-memory stages whose W tiles are prefetched into L2
        # before the PDL wait, so HBM keeps streaming while the previous kernel finishes.
        if l2_prefetch is None:
            l2_prefetch = DEFAULT_L2_PREFETCH
        if not 0 <= l2_prefetch <= 64:
            raise ValueError(f"l2_prefetch={l2_prefetch} unsupported: 0..64 iterations")
        self.l2_prefetch = int(l2_prefetch)
        # How many of the prologue's stages load their W before the PDL wait (the others load
        # theirs right after it, with their x): every stage by default.
        if pre_wait_stages is None:
            pre_wait_stages = self.stages
        if not 0 <= pre_wait_stages <= self.stages:
            raise ValueError(f"pre_wait_stages={pre_wait_stages} unsupported: 0..{self.stages} (the stages)")
        self.pre_wait_stages = int(pre_wait_stages)
        if trigger_at is None:
            trigger_at = 0
        if not 0 <= trigger_at < len(TRIGGER_POINTS):
            raise ValueError(f"trigger_at={trigger_at} unsupported: 0..{len(TRIGGER_POINTS) - 1} "
                             f"({', '.join(TRIGGER_POINTS)})")
        self.trigger_at = int(trigger_at)
        # W's memory order (``w_blocked``; ``linear`` sets it from the weight's shape): row-
        # major [N, K], or kernels/weight_blocks.py's 64 x 64 blocks of 8 KB, each contiguous,
        # a row block's blocks in K order. Then one TMA box is one contiguous 8 KB read instead
        # of 64 rows' 128-byte pieces K*2 bytes apart: fewer DRAM row activations per byte,
        # 2-7% faster at 1-64 rows on an H200 (bench/gemm_notes.md §33). With block_k = 128 a
        # half's box spans two blocks (a 3-D tensor map): tied at 8-16 rows, 1-4% slower at
        # 32-64 (§33), so 64 stays the default here too.
        self.w_blocked = on_off_knob("w_blocked", w_blocked, False, True,
                                     "with W given as its blocks (kernels/weight_blocks.py)")
        # Rows per block (``w_block_rows``, from the weight's shape): 64, or 16 as a measurement
        # variant (a 64-row box is then four 2 KB blocks; bench/gemm_notes.md §34).
        self.w_block_rows = block_rows_knob(w_block_rows, self.w_blocked)
        # Accumulator floats per thread per half (64 x mma_n over 128 threads).
        self.frag = HALF_ROWS * self.mma_n // 128
        # Workspace: two partial slots per CTA (its first and last segment can be partial).
        self.slot_floats = self.wgs * self.halves * self.frag * 128
        self.workspace_floats = 2 * self.ctas * self.slot_floats
        # The reducer of a tile that is its CTA's last stages the other contributors'
        # partials into the (then idle) pipeline buffers with bulk copies when they fit: all
        # of them in flight at once instead of one register-limited round trip per
        # contributor (and per 16 accumulators above M = 64). Not at M = 256 (128 KB each).
        self.slot_bytes = 4 * self.slot_floats
        staging_bytes = self.stages * self.stage_bytes
        self.bulk_reduce = staging_bytes // self.slot_bytes >= self.max_segs - 1
        # When they do not all fit (M = 256: 128 KB partials), the reducer that comes first in
        # CTA order (in practice always: the tile's first contributor ends its range there,
        # the others start theirs) sums into its own accumulators, staging the others in rounds
        # of as many as fit: §10: the register path's 16-accumulator round trips left a
        # 10-17 µs tail at M = 256. A round stages *pieces*: whole partials, or where not even
        # one fits (256-row tiles at 192 rows: 192 KB partials in 168 KB of buffers) each
        # warpgroup's halves apart (48 KB), ``slot_pieces`` per partial.
        self.slot_pieces = 1 if self.slot_bytes <= staging_bytes else self.wgs * self.halves
        self.piece_floats = self.slot_floats // self.slot_pieces
        self.pieces_per_round = staging_bytes // (4 * self.piece_floats)
        # Epilogue through shared memory (``y_staging``): each warpgroup writes its bf16 output
        # tile into the buffers of the stage it consumed last (released only afterwards), then
        # stores y as 16-byte vectors, a warp writing four whole 128-byte row segments per
        # instruction. Stored straight from the fragment layout, every 2-byte store instruction
        # touches 8 half-filled sectors: 1.0 / 2.1 µs of the reducer's tail at M = 64 / 128
        # (bench/gemm_notes.md §8). Each output half's tile (mma_n x 64 bf16) goes into the
        # warpgroup's W boxes of that stage if it fits there, the last one into the stage's
        # x buffer otherwise (when no other warpgroup shares it). For M > 128 (two batch
        # warpgroups), and with a 64-row half per warpgroup (16 KB of output against its own
        # 8 KB W box at 128 rows), it does not fit there; then the CTA's last tile (where its
        # reducer is) stages y in the drained pipeline instead (``y_held`` false), the others
        # store from the fragments (§10: 4.3 µs of direct stores in the reducer's tail at
        # M = 256).
        # Measured (bench/gemm.py --tunings y_staging=0, H200): 2.5-4% faster on all four Kimi
        # shapes at M = 128, -1.2% to +0.6% at 64, and 0.3-1.9% slower at 8 (holding the
        # stage through the epilogue costs more there than the few stores it saves), so the
        # default is on from 64 batch columns.
        self.out_halves = 1 if self.silu else self.halves
        self.y_places = self._y_places()
        y_drained_fits = self.wgs * self.out_halves * self.mma_n * HALF_ROWS * 2 <= self.stages * self.stage_bytes
        stageable = self.y_places is not None or y_drained_fits
        self.y_staging = on_off_knob("y_staging", y_staging, stageable and self.mma_n >= Y_STAGING_MIN_MMA_N,
                                     stageable, "when the output tile fits in shared memory")
        self.y_held = bool(self.y_staging and self.y_places is not None)   # in the held stage
        # Split-tile protocol (reduce_split_tile). Arrive first: a contributor learns from the
        # arrival counter whether it is last before it publishes, so the last one never writes
        # its partial; but one that is not last publishes only after that round trip, and the
        # last one then polls a second counter for the publication: dependent round trips
        # between contributors that end their ranges in the same tile, at the kernel's end.
        # Publish first: every contributor writes its partial, then arrives with a release;
        # whoever arrives last has acquired every partial and needs no second counter, for
        # one more partial write per tile. Several CTAs end in one tile when a CTA's range is
        # shorter than a tile (down, qkv, o_proj on 132 SMs; not gate_up). Measured on an H200
        # (bench/gemm_notes.md §19): there, at M <= 8, publishing first is 1-3.5% faster
        # (o_proj 29.3 -> 28.7 µs); from 32 rows, where a partial is >= 16 KB, it is 0.5-2%
        # slower (10-30% at 128-256), and on gate_up 0.4% slower.
        if publish_first is None:
            publish_first = int(self.mma_n <= PUBLISH_FIRST_MAX_MMA_N and self.iters < self.ctas * self.k_blocks)
        if publish_first not in (0, 1):
            raise ValueError(f"publish_first={publish_first} unsupported: 0 or 1")
        self.publish_first = int(publish_first)
        # Clusters sharing x (``cluster`` CTAs): where every CTA streams one whole tile, all of
        # them read the same x boxes in the same order, so ``cluster`` neighbouring CTAs can
        # each load 1/cluster of every x box and multicast it into all of them: x leaves L2
        # once per cluster (cuBLAS's 4 x 1 clusters at o_proj 144-208 rows). The slices must be
        # whole 8-row swizzle atoms. Measured on an H200 (bench/gemm_notes.md §22, two runs):
        # pairs 5-15% slower (each stage refilled only when both CTAs released it), clusters of
        # four -1 to -8% on 10 of 12 o_proj / down rows at 160-224 and +1.5 / +10% on two; off
        # by default.
        if cluster is None:
            cluster = 1
        shares_x = self.max_segs == 1 and self.ctas == self.tiles and self.ctas % cluster == 0 \
            and self.mma_n % (8 * cluster) == 0
        if cluster not in (1, 2, 4) or (cluster > 1 and not shares_x):
            raise ValueError(f"cluster={cluster} unsupported here (1; 2 or 4 when every CTA computes one "
                             f"whole tile ({self.ctas} CTAs, {self.tiles} tiles), the grid divides into "
                             f"clusters and the x box's {self.mma_n} rows into 8-row slices per CTA)")
        self.cluster = int(cluster)
        # x boxes trimmed to the rows that exist (``x_trim``). The batch columns are mma_n, a
        # multiple of 16, so for M not a multiple of 16 a box of mma_n rows reaches up to 15
        # rows past x, which TMA zero-fills: at 116-120 rows that cost o_proj 1-3%
        # (bench/gemm_notes.md §23). Where M is 1-8 rows past a multiple of 16, the box is
        # loaded as two: the first mma_n - 16 rows and the 8-row swizzle atom after them (CuTe
        # DSL 4.8.1 aborts building a TMA box of an odd number of 8-row atoms), so nothing past
        # round_up(M, 8) is loaded; the buffer's last 8 rows keep whatever they held, and the
        # batch columns computed from them (>= M) are never stored. One batch warpgroup, no
        # cluster slices, one swizzle atom of K per row.
        trimmable = self.col_wgs == 1 and self.cluster == 1 and self.block_k == K_ALIGN \
            and self.mma_n >= 32 and _round_up(self.m, 8) < self.mma_n
        self.x_trim = on_off_knob("x_trim", x_trim, trimmable, trimmable,
                                  f"when M = {self.m} is 1-8 rows past a multiple of 16 above 16, with one "
                                  f"batch warpgroup, cluster=1, block_k={K_ALIGN}")
        # (rows, first row) of each x box of a batch warpgroup's buffer.
        self.x_boxes = ((self.mma_n - 16, 0), (8, self.mma_n - 16)) if self.x_trim else ((self.mma_n, 0),)
        # What TMA delivers per stage (the stage barrier's transaction count).
        self.stage_tx_bytes = self.w_stage_bytes + self.col_wgs * sum(r for r, _ in self.x_boxes) * block_k * 2
        # The split-tile fix-up shared out by warpgroup (``fixup_split``). Where a CTA's range
        # is shorter than a tile, two CTAs end their ranges in one tile (qkv at 129-200 rows:
        # 52 of its 80 tiles on 132 SMs); both finish streaming at the kernel's end, and with
        # one reducer the other publishes its whole partial, the reducer then sums every
        # partial and stores the whole y tile: three serial steps of the kernel's tail (2.4,
        # 2.9 and 2.0 µs at qkv 192 on an H100, bench/gemm_notes.md §49). With the knob, each
        # warpgroup's part of the tile (its unit, or its batch columns) has one owner among
        # the CTAs whose range *ends* in the tile (``late_ctas``; in turn, ``part_owner``):
        # every other CTA publishes that part and counts it on the part's counter, the owner
        # waits for the count, bulk-copies the parts into its own share of its drained
        # pipeline (``fixup_region_floats`` floats per warpgroup), sums them in CTA order and
        # stores that part of y. So each late CTA publishes, sums and stores half as much,
        # and a CTA's two warpgroups do one part each at once. Same adds in the same order:
        # the same bits as the single reducer. Measured on an H100 (bench/gemm_notes.md §50,
        # 3 interleaved rounds): qkv 1.1-2.4% faster at 144-192 rows (the tail after the last
        # k-block 5.1 -> 3.9 µs at 192), gate_up and lm_head tied to 2% faster at 144-200, but
        # qkv 1.1% slower at 96 (partials of 48 KB, whose round trips are short anyway), so it
        # is on by default with two warpgroups from FIXUP_SPLIT_MIN_MMA_N batch columns up.
        self.part_floats = self.halves * self.frag * 128        # one warpgroup's share of a slot
        self.part_bytes = 4 * self.part_floats
        y_part_floats = self.out_halves * self.mma_n * HALF_ROWS // 2 if self.y_staging else 0
        self.fixup_region_floats = max((self.max_segs - 1) * self.part_floats, y_part_floats)
        fixup_fits = self.max_segs > 1 and not self.publish_first \
            and self.wgs * 4 * self.fixup_region_floats <= staging_bytes
        self.fixup_split = on_off_knob("fixup_split", fixup_split,
                                       fixup_fits and self.wgs == 2 and self.mma_n >= FIXUP_SPLIT_MIN_MMA_N, fixup_fits,
                                       "where tiles are split, with publish_first=0, and every warpgroup's "
                                       f"partials and y fitting its share of the {staging_bytes // 1024} KB "
                                       "pipeline")

    @staticmethod
    def _consumer_regs(consumer_regs: int | None) -> int:
        """The ``consumer_regs`` knob checked: 0 (off) or setmaxnreg's registers per consumer thread."""
        if consumer_regs is None:
            return 0
        if consumer_regs != 0 and not (PRODUCER_REGS < consumer_regs <= 256 and consumer_regs % 8 == 0):
            raise ValueError(f"consumer_regs={consumer_regs} unsupported: 0 (off) or a multiple of 8 in "
                             f"{PRODUCER_REGS + 8}..256 (setmaxnreg)")
        return int(consumer_regs)

    def _y_places(self) -> list[tuple[str, int]] | None:
        """Per output half: ("w", element offset into the warpgroup's W boxes of a stage) or
        ("x", 0) for the stage's x buffer; None if the output tile does not fit."""
        if self.col_wgs != 1:
            return None
        piece = self.mma_n * HALF_ROWS                       # bf16 elements per output half
        w_elems = self.halves * HALF_ROWS * self.block_k     # this warpgroup's W boxes
        places = []
        for h in range(self.out_halves):
            if (h + 1) * piece <= w_elems:
                places.append(("w", h * piece))
            elif self.row_wgs == 1 and h == self.out_halves - 1 and piece <= self.mma_n * self.block_k:
                places.append(("x", 0))
            else:
                return None
        return places

    def _ctas_for(self, tiles: int, sms: int) -> int:
        """One CTA per SM, each with at least 1 / (max_split - 1) of a tile's k-blocks, so a
        tile is split over at most ``max_split`` CTAs (by default 4: at most 3 partials for
        the last one to load in turn); only small problems get fewer CTAs than SMs."""
        min_len = -(-self.k_blocks // (self.max_split - 1))
        return max(1, min(int(sms), tiles * self.k_blocks // min_len))

    def key(self) -> tuple:
        """Everything the compiled kernel depends on: (M, K, N, epilogue, ctas, *tuning)."""
        return (self.m, self.k, self.n, self.epilogue, self.ctas,
                *(getattr(self, knob) for knob in TUNING_KNOBS))

    @classmethod
    def from_key(cls, key: tuple) -> "GemmConfig":
        m, k, n, epilogue, ctas, *tuning = key
        return cls(m, k, n, epilogue, ctas, **dict(zip(TUNING_KNOBS, tuning)))

    # The stream-K bookkeeping in plain integers. The kernel evaluates the same formulas on
    # device values (DecodeGemmKernel.cta_of / slot_of); tests check their invariants here.
    def cta_range(self, c: int) -> tuple[int, int]:
        """[begin, end) of CTA c's (tile, k-block) iterations, g = tile * k_blocks + k_block."""
        return (c * self.iters) // self.ctas, ((c + 1) * self.iters) // self.ctas

    def cta_of(self, g: int) -> int:
        """The CTA whose range holds iteration g."""
        return ((g + 1) * self.ctas - 1) // self.iters

    def slot_of(self, c: int, tile: int) -> int:
        """Workspace slot of CTA c's partial of ``tile``."""
        return 2 * c if self.cta_range(c)[0] >= tile * self.k_blocks else 2 * c + 1

    def late_ctas(self, tile: int) -> range:
        """The CTAs whose ranges end in ``tile`` (it is their last): all of a split tile's
        but the last one, and that one too when its range ends with the tile."""
        t_end = (tile + 1) * self.k_blocks
        c_lo, c_hi = self.cta_of(tile * self.k_blocks), self.cta_of(t_end - 1)
        return range(c_lo, min(c_hi, self.cta_of(t_end) - 1) + 1)

    def part_owner(self, tile: int, wg: int) -> int:
        """With ``fixup_split``: the CTA that sums warpgroup ``wg``'s part of split ``tile``."""
        late = self.late_ctas(tile)
        return late[wg % len(late)]

    def __repr__(self) -> str:
        return (f"GemmConfig(m={self.m}, k={self.k}, n={self.n}, epilogue={self.epilogue!r}, "
                f"ctas={self.ctas}, tiles={self.tiles}, block_k={self.block_k}, k_blocks={self.k_blocks}, "
                f"stages={self.stages}, wgs={self.row_wgs}x{self.col_wgs}, mma_n={self.mma_n}, "
                f"l2_prefetch={self.l2_prefetch}, y_staging={self.y_staging}, "
                f"publish_first={self.publish_first}, cluster={self.cluster}"
                + (", x_trim=1" if self.x_trim else "")
                + (f", pre_wait_stages={self.pre_wait_stages}" if self.pre_wait_stages < self.stages else "")
                + (f", trigger_at={TRIGGER_POINTS[self.trigger_at]}" if self.trigger_at else "")
                + (", w_blocked=1" if self.w_blocked else "")
                + (", fixup_split=1" if self.fixup_split else "")
                + (f", w_block_rows={self.w_block_rows}" if self.w_block_rows != weight_blocks.BLOCK else "")
                + (f", consumer_regs={self.consumer_regs}" if self.consumer_regs else "")
                + (f", max_split={self.max_split}" if self.max_split != MAX_SPLIT else "") + ")")



class DecodeGemmKernel:
    """``y = x @ W^T`` (optionally ``silu(gate) * up``) for one static GemmConfig."""

    def __init__(self, cfg: GemmConfig):
        self.cfg = cfg

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        x_addr: Int64,
        w_addr: Int64,
        y_addr: Int64,
        ws_addr: Int64,
        counter_addr: Int64,
        stream: cuda.CUstream,
        use_pdl: Boolean,
    ):
        cfg = self.cfg
        gmem = cute.AddressSpace.gmem
        # Row-major (K contiguous) global tensors. x's row count is a *dynamic* value (the
        # same number, not known to the layout algebra) for every M: with a static M = 1,
        # CuTe DSL 4.8.1 drops the size-1 batch mode from the TMA coordinate tensor
        # ((1,K):(0,1@0)) and emits cp.async.bulk.tensor.1d (SASS UTMALDG.1D) against the
        # rank-2 tensor map it encodes (dims K x 1, box 64 x mma_n): the rank mismatch is an
        # illegal instruction on the GPU (H200, 2026-11-30). A dynamic row count keeps the
        # batch mode, so every M in 1..256 issues the same 2-D x loads as M = 8 (the tensor
        # map's dims and box are unchanged: K x M, box block_k x mma_n). Box rows >= M are
        # out of bounds of the map, so TMA zero-fills them (nothing is read past x), and the
        # epilogue masks batch rows >= M. tests/test_gemm_compile.py checks every TMA load is
        # .2d with two coordinates and that M = 1..7 have M = 8's instruction skeleton.
        x_rows = Int32(cfg.m)
        mX = cute.make_tensor(
            cute.make_ptr(BFloat16, x_addr, gmem, assumed_align=16),
            cute.make_layout((x_rows, cfg.k), stride=(cfg.k, 1)),
        )
        mW = cute.make_tensor(cute.make_ptr(BFloat16, w_addr, gmem, assumed_align=16),
                              w_global_layout(cfg.n, cfg.k, cfg.w_blocked, cfg.w_block_rows))
        mY = cute.make_tensor(
            cute.make_ptr(BFloat16, y_addr, gmem, assumed_align=16),
            # Dynamic row count too: no static size-1 batch mode anywhere (the epilogue's mask
            # `m < cfg.m` is what keeps stores in bounds).
            cute.make_layout((x_rows, cfg.n_out), stride=(cfg.n_out, 1)),
        )
        mWs = cute.make_tensor(
            cute.make_ptr(Float32, ws_addr, gmem, assumed_align=16),
            cute.make_layout(cfg.workspace_floats),
        )
        mCount = cute.make_tensor(
            cute.make_ptr(Int32, counter_addr, gmem, assumed_align=4),
            cute.make_layout(2 * cfg.tiles),      # arrived[tiles], ready[tiles]
        )

        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (1, 1, 1), tiler_mn=(HALF_ROWS, cfg.mma_n),
        )
        mma_tiler = (HALF_ROWS, cfg.mma_n, cfg.block_k)
        # Per stage: one (64 x block_k) W buffer per half of every unit (w_boxes), one
        # (mma_n x block_k) x buffer per batch warpgroup.
        sW_layout = sm90_utils.make_smem_layout_a(k_major, mma_tiler, BFloat16, cfg.stages * cfg.w_boxes)
        sX_layout = sm90_utils.make_smem_layout_b(k_major, mma_tiler, BFloat16, cfg.stages * cfg.col_wgs)

        tma_w, mW_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mW,
            cute.slice_(sW_layout, (None, None, 0)), (HALF_ROWS, cfg.block_k),
        )
        # In a cluster each CTA loads 1/cluster of every x box's rows and multicasts them.
        # With x_trim a second atom loads the 8-row tail box (else the kernel is handed the
        # first again and never uses it: no second tensor map encoded per launch).
        (x_rows, _), (tail_rows, _) = cfg.x_boxes[0], cfg.x_boxes[-1]
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(
            tma_load_op(cfg.cluster), mX, cute.slice_(first_rows_layout(sX_layout, x_rows), (None, None, 0)),
            (x_rows, cfg.block_k), num_multicast=cfg.cluster,
        )
        tma_x_tail, mX_tail_tma = tma_x, mX_tma
        if const_expr(cfg.x_trim):
            tma_x_tail, mX_tail_tma = cpasync.make_tiled_tma_atom(
                tma_load_op(1), mX, cute.slice_(first_rows_layout(sX_layout, tail_rows), (None, None, 0)),
                (tail_rows, cfg.block_k),
            )

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, cfg.stages]
            empty: cute.struct.MemRange[Int64, cfg.stages]
            flag: cute.struct.MemRange[Int32, 4]
            # The reducer's bulk copies landed (with fixup_split: each warpgroup's).
            staged: cute.struct.MemRange[Int64, cfg.wgs if cfg.fixup_split else 1]
            sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sW_layout)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_w, mW_tma, tma_x, mX_tma, tma_x_tail, mX_tail_tma, mY, mWs, mCount, tiled_mma, sW_layout, sX_layout,
        ).launch(
            grid=[cfg.ctas, 1, 1],
            block=[cfg.threads, 1, 1],
            cluster=[cfg.cluster, 1, 1] if const_expr(cfg.cluster > 1) else None,
            stream=stream,
            use_pdl=use_pdl,
        )

    # --------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        mW_tma: cute.Tensor,
        tma_x: cute.CopyAtom,
        mX_tma: cute.Tensor,
        tma_x_tail: cute.CopyAtom,
        mX_tail_tma: cute.Tensor,
        mY: cute.Tensor,
        mWs: cute.Tensor,
        mCount: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sW_layout: cute.ComposedLayout,
        sX_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        # Trigger early: the grid is a single wave, so dependents cannot displace our CTAs.
        if const_expr(cfg.trigger_at == 0):
            cute.arch.griddepcontrol_launch_dependents()

        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        if warp == cfg.producer_warp:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)
            if const_expr(cfg.x_trim):
                cpasync.prefetch_descriptor(tma_x_tail)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        flag = storage.flag.data_ptr()
        staged = storage.staged.data_ptr()
        # sW then sX, contiguous (both 1024-aligned, sW a whole number of 8 KB boxes): the
        # reducer's staging area once the pipeline is drained.
        stage_area = cute.recast_ptr(storage.sW.data_ptr(), dtype=Float32)
        stage_bufs = (storage.sW.data_ptr(), storage.sX.data_ptr())   # bf16, for y_staging
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        # TMA's views of the x buffers: the x_boxes' rows of each (the whole buffer unless
        # x_trim; the tail box's view starts at its first row, a whole number of 1 KB swizzle
        # atoms in, so the swizzle phase is the buffer's).
        (x_rows, _), (tail_rows, tail_first) = cfg.x_boxes[0], cfg.x_boxes[-1]
        sX_box = storage.sX.get_tensor(first_rows_layout(sX_layout, x_rows).outer, swizzle=sX_layout.inner)
        sX_tail = cute.make_tensor(
            cute.recast_ptr(storage.sX.data_ptr() + tail_first * cfg.block_k, sX_layout.inner, dtype=BFloat16),
            first_rows_layout(sX_layout, tail_rows).outer)

        if warp == cfg.producer_warp:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(cfg.stages):
                    cute.arch.mbarrier_init(full + s, 1)
                    # One release per consumer warp of each CTA of the cluster (all of
                    # them multicast x into this stage).
                    cute.arch.mbarrier_init(empty + s, 4 * cfg.wgs * cfg.cluster)
                for w in cutlass.range_constexpr(cfg.wgs if cfg.fixup_split else 1):
                    cute.arch.mbarrier_init(staged + w, 1)
            cute.arch.mbarrier_init_fence()
        barriers_ready(cfg.cluster)

        # This CTA's contiguous range [g_begin, g_end) of (tile, k-block) iterations.
        g_begin = (cta * cfg.iters) // cfg.ctas
        g_end = ((cta + 1) * cfg.iters) // cfg.ctas
        n_iters = g_end - g_begin

        # With consumer_regs, each role sets its registers (setmaxnreg) at the top of its own
        # branch: ptxas honours it only for code the instruction dominates.
        if warp >= cfg.producer_warp:
            if const_expr(cfg.consumer_regs):
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == cfg.producer_warp:
                self.producer(tma_w, mW_tma, (tma_x, tma_x_tail), (mX_tma, mX_tail_tma), sW, (sX_box, sX_tail), full,
                              empty, g_begin, n_iters, cta % cfg.cluster)
            else:
                # The producer warpgroup's idle warps (consumer_regs): the PDL wait, as every thread.
                cute.arch.griddepcontrol_wait()
        else:
            if const_expr(cfg.consumer_regs):
                cute.arch.setmaxregister_increase(cfg.consumer_regs)
            # Consumers touch global memory (workspace, counters, y) only after the wait.
            cute.arch.griddepcontrol_wait()
            if const_expr(cfg.trigger_at == 1):
                cute.arch.griddepcontrol_launch_dependents()
            self.consumer(tiled_mma, sW, sX, full, empty, flag, staged, stage_area, stage_bufs, mY, mWs,
                          mCount, cta, tidx, warp, lane, g_begin, g_end)
        peers_done(cfg.cluster)

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def w_row_block(self, tile: Int32, r: cutlass.Constexpr, half: cutlass.Constexpr) -> Int32:
        """Index of the 64-row block of W holding half ``half`` of unit ``r`` of ``tile``."""
        cfg = self.cfg
        unit = tile * cfg.row_wgs + r
        if const_expr(cfg.silu):
            return unit + half * cfg.units      # gate rows, then up rows (+I = units * 64)
        return unit * cfg.halves + half

    @cute.jit
    def producer(self, tma_w, mW_tma, tma_xs, mX_tmas, sW, sXs, full, empty, g_begin, n_iters, rank):
        """``tma_xs``, ``mX_tmas``, ``sXs``: (first, tail) x box atoms, tensors and shared-memory
        views (cfg.x_boxes; the tail is used only with x_trim)."""
        cfg = self.cfg
        # (TMA, row_block, k_block) views of W and x; (TMA, buffer) views of shared memory.
        gW = cute.local_tile(mW_tma, (HALF_ROWS, cfg.block_k), (None, None))
        tWsW, tWgW = cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        x_views = []
        for b in cutlass.range_constexpr(len(cfg.x_boxes)):
            rows = cfg.x_boxes[b][0]
            gX = cute.local_tile(mX_tmas[b], (rows, cfg.block_k), (None, None))
            tXsX, tXgX = cpasync.tma_partition(   # in a cluster: this CTA's slice of the rows
                tma_xs[b], rank, cute.make_layout(cfg.cluster), cute.group_modes(sXs[b], 0, 2),
                cute.group_modes(gX, 0, 2))
            x_views.append((tma_xs[b], tXgX, tXsX))
        evict_first = Int64(EVICT_FIRST)

        # Prologue, before the PDL wait: weight traffic only. The stages are fresh (no empty
        # wait); each barrier is armed with the whole stage (W + x) so it cannot complete
        # before the x bytes land after the wait.
        n_pre = cutlass.min(n_iters, cfg.stages)
        n_early = cutlass.min(n_pre, cfg.pre_wait_stages)
        for i in cutlass.range(n_early, unroll=1):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + i, cfg.stage_tx_bytes)
            self.load_w(tma_w, tWgW, tWsW, g_begin + i, i, full + i, evict_first)

        # Then (l2_prefetch > 0; off by default, see DEFAULT_L2_PREFETCH) an L2 prefetch of the
        # next iterations' W tiles: still weight traffic only, meant to keep HBM busy when the
        # stages are full before the previous kernel ends. No barrier tracks it; the later TMA
        # loads simply find the lines in L2.
        n_pf = cutlass.min(n_iters, n_pre + cfg.l2_prefetch)
        for i in cutlass.range(n_pre, n_pf, unroll=1):
            self.prefetch_w(tma_w, tWgW, g_begin + i)

        cute.arch.griddepcontrol_wait()

        # x for the stages whose W is on its way, then the rest of the prologue's stages
        # (pre_wait_stages < stages), still fresh: no empty wait.
        for i in cutlass.range(n_early, unroll=1):
            self.load_x(x_views, g_begin + i, i, full + i)
        for i in cutlass.range(n_early, n_pre, unroll=1):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + i, cfg.stage_tx_bytes)
            self.load_w(tma_w, tWgW, tWsW, g_begin + i, i, full + i, evict_first)
            self.load_x(x_views, g_begin + i, i, full + i)

        # Steady state: wait for the consumers to free a stage, refill it with W and x. (Keeping
        # the L2 prefetch l2_prefetch iterations ahead here as well was measured 8-27% slower at
        # every M and shape: bench/gemm_notes.md §7.)
        for i in cutlass.range(n_pre, n_iters, unroll=1):
            s = i % cfg.stages
            phase = (i // cfg.stages) % 2
            cute.arch.mbarrier_wait(empty + s, phase ^ 1)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + s, cfg.stage_tx_bytes)
            self.load_w(tma_w, tWgW, tWsW, g_begin + i, s, full + s, evict_first)
            self.load_x(x_views, g_begin + i, s, full + s)

    @cute.jit
    def load_w(self, tma_w, tWgW, tWsW, g: Int32, stage: Int32, bar, evict_first: Int64):
        """TMA of iteration g's W boxes (every half of every unit of its tile, at its k-block)
        into pipeline stage ``stage``, completing on ``bar``."""
        cfg = self.cfg
        tile = g // cfg.k_blocks
        kb = g - tile * cfg.k_blocks
        for r in cutlass.range_constexpr(cfg.row_wgs):
            for h in cutlass.range_constexpr(cfg.halves):
                cute.copy(tma_w, tWgW[(None, self.w_row_block(tile, r, h), kb)],
                          tWsW[(None, stage * cfg.w_boxes + r * cfg.halves + h)],
                          tma_bar_ptr=bar, cache_policy=evict_first)

    @cute.jit
    def load_x(self, x_views, g: Int32, stage: Int32, bar):
        """TMA of iteration g's x boxes (its k-block, every batch warpgroup's columns; with
        x_trim a warpgroup's buffer takes two boxes, ``x_views`` holds (atom, gmem, smem) of each)."""
        cfg = self.cfg
        kb = g - (g // cfg.k_blocks) * cfg.k_blocks
        for c in cutlass.range_constexpr(cfg.col_wgs):
            for b in cutlass.range_constexpr(len(cfg.x_boxes)):
                rows, first = cfg.x_boxes[b]
                tma_x, tXgX, tXsX = x_views[b]
                row_block = c + first // rows     # the box's rows of x in units of its height
                tma_load(tma_x, tXgX[(None, row_block, kb)], tXsX[(None, stage * cfg.col_wgs + c)], bar,
                         cfg.cluster)

    @cute.jit
    def prefetch_w(self, tma_w, tWgW, g: Int32):
        """L2 prefetch of iteration g's W boxes (no shared memory, no barrier)."""
        cfg = self.cfg
        tile = g // cfg.k_blocks
        kb = g - tile * cfg.k_blocks
        with cute.arch.elect_one():
            for r in cutlass.range_constexpr(cfg.row_wgs):
                for h in cutlass.range_constexpr(cfg.halves):
                    cute.prefetch(tma_w, tWgW[(None, self.w_row_block(tile, r, h), kb)])

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def cta_of(self, g: Int32) -> Int32:
        """The CTA whose range holds iteration g (inverse of g_begin = cta * iters // ctas)."""
        cfg = self.cfg
        return ((g + 1) * cfg.ctas - 1) // cfg.iters

    @cute.jit
    def slot_of(self, c: Int32, tile: Int32) -> Int32:
        """Workspace slot of CTA c's partial of ``tile``: 2c if its range starts inside the tile
        (the tile is its first segment), else 2c + 1 (the tile is its last segment)."""
        cfg = self.cfg
        c_begin = (c * cfg.iters) // cfg.ctas
        slot = 2 * c + 1
        if c_begin >= tile * cfg.k_blocks:
            slot = 2 * c
        return slot

    @cute.jit
    def consumer(self, tiled_mma, sW, sX, full, empty, flag, staged, stage_area, stage_bufs, mY, mWs,
                 mCount, cta, tidx, warp, lane, g_begin, g_end):
        cfg = self.cfg
        wg = warp // 4
        wg_row = wg // cfg.col_wgs      # which unit of the tile (W rows)
        wg_col = wg % cfg.col_wgs       # which batch columns
        wg_tid = tidx % 128
        thr_mma = tiled_mma.get_slice(wg_tid)
        tCsW = thr_mma.partition_A(sW)
        tCsX = thr_mma.partition_B(sX)
        tCrW = tiled_mma.make_fragment_A(tCsW)
        tCrX = tiled_mma.make_fragment_B(tCsX)
        # (row, batch column) of each accumulator element, for the epilogue.
        tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((HALF_ROWS, cfg.mma_n)))
        accs = [cute.make_rmem_tensor(tCcAcc.shape, Float32) for _ in range(cfg.halves)]
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        k_steps = cute.size(tCrW, mode=[2])

        t_first = g_begin // cfg.k_blocks
        t_last = (g_end - 1) // cfg.k_blocks
        for tile in cutlass.range(t_first, t_last + 1, unroll=1):
            t_base = tile * cfg.k_blocks
            kb_lo = cutlass.max(g_begin - t_base, 0)
            kb_hi = cutlass.min(g_end - t_base, cfg.k_blocks)
            for h in cutlass.range_constexpr(cfg.halves):
                accs[h].fill(0.0)
            for kb in cutlass.range(kb_lo, kb_hi, unroll=1):
                i = t_base + kb - g_begin
                s = i % cfg.stages
                cute.arch.mbarrier_wait(full + s, (i // cfg.stages) % 2)
                warpgroup.fence()
                for h in cutlass.range_constexpr(cfg.halves):
                    for kk in cutlass.range_constexpr(k_steps):
                        cute.gemm(tiled_mma, accs[h],
                                  tCrW[(None, None, kk, s * cfg.w_boxes + wg_row * cfg.halves + h)],
                                  tCrX[(None, None, kk, s * cfg.col_wgs + wg_col)],
                                  accs[h])
                warpgroup.commit_group()
                # Keep this k-block's wgmma in flight; the previous one is done, free its stage.
                warpgroup.wait_group(1)
                if kb > kb_lo and lane == 0:
                    release_stage(empty + (i - 1) % cfg.stages, cfg.cluster)
            warpgroup.wait_group(0)
            if const_expr(cfg.trigger_at == 2):
                if tile == t_last:
                    cute.arch.griddepcontrol_launch_dependents()   # the CTA's first such call counts
            # The stage of the tile's last k-block: with y_staging the epilogue writes y there,
            # so it is released only after the epilogue.
            s_last = (t_base + kb_hi - 1 - g_begin) % cfg.stages
            ybuf = (stage_bufs, s_last)
            if const_expr(not cfg.y_held):
                if lane == 0:
                    release_stage(empty + s_last, cfg.cluster)

            if kb_lo == 0 and kb_hi == cfg.k_blocks:
                self.store_tile(accs, tCcAcc, mY, tile, wg_row, wg_col, ybuf, wg_tid, tile == t_last)
            elif const_expr(cfg.fixup_split):
                self.reduce_split_tile_in_parts(accs, tCcAcc, mY, mWs, mCount, cta, tile, wg, wg_row, wg_col,
                                                wg_tid, staged, stage_area, stage_bufs)
            else:
                self.reduce_split_tile(accs, tCcAcc, mY, mWs, mCount, flag, cta, tile, wg, wg_tid,
                                       tile == t_last, staged, stage_area, ybuf)
            if const_expr(cfg.y_held):
                # This warp's generic-proxy accesses to the stage are done; order them before
                # the producer's next TMA (async proxy) writes into it, then release it.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
                if lane == 0:
                    release_stage(empty + s_last, cfg.cluster)

    @cute.jit
    def store_tile(self, accs, tCcAcc, mY, tile, wg_row, wg_col, ybuf, wg_tid, drained):
        """Epilogue of one finished unit: fp32 accumulators -> bf16 y, batch rows >= M masked.
        ``drained``: this is the CTA's last tile (no TMA load is still to come)."""
        cfg = self.cfg
        if const_expr(cfg.y_held):
            self.store_tile_staged(accs, tCcAcc, mY, tile, wg_row, wg_col,
                                   self.held_stage_pieces(ybuf, wg_row), wg_tid)
        elif const_expr(cfg.y_staging):
            if drained:
                self.store_tile_staged(accs, tCcAcc, mY, tile, wg_row, wg_col,
                                       self.drained_pieces(ybuf, wg_row, wg_col), wg_tid)
            else:
                self.store_tile_direct(accs, tCcAcc, mY, tile, wg_row, wg_col)
        else:
            self.store_tile_direct(accs, tCcAcc, mY, tile, wg_row, wg_col)

    @cute.jit
    def held_stage_pieces(self, ybuf, wg_row):
        """Where each output half's bf16 tile goes in the held stage (GemmConfig.y_places)."""
        cfg = self.cfg
        (w_base, x_base), s = ybuf
        bases = []
        for h in cutlass.range_constexpr(cfg.out_halves):
            where, offset = cfg.y_places[h]
            if const_expr(where == "w"):
                bases.append(w_base + (s * cfg.w_boxes + wg_row * cfg.halves) * (HALF_ROWS * cfg.block_k) + offset)
            else:
                bases.append(x_base + s * (cfg.mma_n * cfg.block_k))
        return bases

    @cute.jit
    def drained_pieces(self, ybuf, wg_row, wg_col):
        """Where each output half's bf16 tile goes in the drained pipeline: one after another,
        per warpgroup, from the start of the buffers."""
        cfg = self.cfg
        (w_base, _), _ = ybuf
        piece_elems = cfg.mma_n * HALF_ROWS
        first = (wg_row * cfg.col_wgs + wg_col) * cfg.out_halves
        return [w_base + (first + h) * piece_elems for h in range(cfg.out_halves)]

    @cute.jit
    def out_value(self, accs, h: cutlass.Constexpr, j: cutlass.Constexpr) -> Float32:
        """Output half h's fp32 value at accumulator j: the accumulator, or silu(gate) * up."""
        cfg = self.cfg
        val = accs[h][j]
        if const_expr(cfg.silu):
            gate = accs[0][j]
            val = gate / (Float32(1.0) + cute.math.exp(-gate)) * accs[1][j]
        return val

    @cute.jit
    def out_col(self, unit, h: cutlass.Constexpr):
        """First y column of output half h of ``unit``."""
        cfg = self.cfg
        col = unit * HALF_ROWS
        if const_expr(not cfg.silu):
            col = (unit * cfg.halves + h) * HALF_ROWS
        return col

    @cute.jit
    def store_tile_staged(self, accs, tCcAcc, mY, tile, wg_row, wg_col, bases, wg_tid, wg_barrier=None):
        """y through shared memory (``bases``: one mma_n x 64 bf16 tile per output half): bf16 into a
        [batch][64 rows] tile per output half whose 16-byte chunks are XOR-swizzled by the
        batch index (chunk = row // 8 ^ batch % 8), so the fragment's 2-byte writes and the
        16-byte reads are both bank-conflict free; then each thread stores 16-byte vectors of
        y rows (a warp: four whole 128-byte row segments). ``wg_barrier``: the named barrier
        of this warpgroup alone when only it uses ``bases`` (fixup_split), else every
        consumer's."""
        cfg = self.cfg
        bar_id, bar_threads = (1, 128 * cfg.wgs) if const_expr(wg_barrier is None) else (wg_barrier, 128)
        unit = tile * cfg.row_wgs + wg_row
        pieces = [cute.make_tensor(base, cute.make_layout(cfg.mma_n * HALF_ROWS)) for base in bases]
        # The stage may still be being read by other threads (the reducer's staged partials).
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=bar_threads)
        for j in cutlass.range_constexpr(cute.size(tCcAcc)):
            row, col = tCcAcc[j]
            idx = col * HALF_ROWS + (((row // 8) ^ (col % 8)) * 8) + row % 8
            for h in cutlass.range_constexpr(cfg.out_halves):
                pieces[h][idx] = self.out_value(accs, h, j).to(BFloat16)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=bar_threads)
        vec4 = ir.VectorType.get([4], Int32.mlir_type)
        vectors = cfg.mma_n * (HALF_ROWS // 8)
        for h in cutlass.range_constexpr(cfg.out_halves):
            col0 = self.out_col(unit, h)
            for i in cutlass.range_constexpr(-(-vectors // 128)):
                v = wg_tid + 128 * i
                b = v // 8                      # batch column within this warpgroup's
                c = v % 8
                m = wg_col * cfg.mma_n + b
                if v < vectors and m < cfg.m:
                    bits = cute.arch.load((pieces[h].iterator + (b * HALF_ROWS + (c ^ (b % 8)) * 8)).llvm_ptr, vec4)
                    cute.arch.store((mY.iterator + (m * cfg.n_out + col0 + c * 8)).llvm_ptr, bits)

    @cute.jit
    def store_tile_direct(self, accs, tCcAcc, mY, tile, wg_row, wg_col):
        """y straight from the fragment layout (2-byte stores)."""
        cfg = self.cfg
        unit = tile * cfg.row_wgs + wg_row
        for j in cutlass.range_constexpr(cute.size(tCcAcc)):
            row, col = tCcAcc[j]
            m = wg_col * cfg.mma_n + col
            if m < cfg.m:
                for h in cutlass.range_constexpr(cfg.out_halves):
                    mY[m, self.out_col(unit, h) + row] = self.out_value(accs, h, j).to(BFloat16)

    @cute.jit
    def part_ptr(self, base, part, h: cutlass.Constexpr, j4: cutlass.Constexpr, wg_tid):
        """ws_ptr by part: ``part`` = slot * wgs + wg counts ``part_floats`` blocks from ``base``."""
        cfg = self.cfg
        vec = ((part * cfg.halves + h) * (cfg.frag // 4) + j4) * 128 + wg_tid
        return (base + vec * 4).llvm_ptr

    @cute.jit
    def ws_ptr(self, base, slot, wg, h: cutlass.Constexpr, j4: cutlass.Constexpr, wg_tid):
        """Address of accumulators 4*j4 .. 4*j4+3 of half h of thread wg_tid's partial in slot
        ``slot`` of the workspace (``base`` = its first float; the reducer's shared-memory
        staging area has the same layout). Fragment order, thread-minor, four floats per
        thread: each (slot, wg, h, j4) is 128 consecutive 16-byte vectors, so a warp's partial
        stores and loads are 512 contiguous bytes, one 16-byte access per thread; a slot is
        ``slot_bytes`` contiguous bytes, its warpgroups' parts one after another."""
        return self.part_ptr(base, slot * self.cfg.wgs + wg, h, j4, wg_tid)

    @cute.jit
    def reduce_split_tile(self, accs, tCcAcc, mY, mWs, mCount, flag, cta, tile, wg, wg_tid,
                          last_tile, staged, stage_area, ybuf):
        """A tile whose k-blocks are spread over CTAs c_lo..c_hi (at most ``max_segs``).

        Every contributor counts its arrival on ``arrived[tile]``; the last one sums all
        partials in CTA order (its own from registers) and writes y. The order, not the
        arrival, fixes the result, so it is deterministic. The last one also resets the
        counters to zero. How the others' partials reach it (``cfg.publish_first``):

        * arrive first: whoever is not last then publishes its fp32 partial and bumps
          ``ready[tile]``; the last one waits for ``ready`` (only on CTAs that already
          arrived, so it never waits on a CTA that is not running);
        * publish first: everyone publishes, then arrives with a release, so the last one has
          every partial once it has read the count (one round trip fewer when two
          contributors end together; the last one's own partial is written for nothing).

        Measured (per-CTA timeline, bench/gemm_notes.md §7): at M = 64 this tail was 2-23 µs,
        the largest loss of the kernel, so the partials move as 16-byte vectors, the last CTA
        loads only the partials that exist, and one thread per CTA does the release/acquire
        (barrier, then fence + atomic: CUTLASS's semaphore pattern) instead of every thread
        fencing. The sum itself then still cost one register-limited round trip per
        contributor (and per 16 accumulators above M = 64: 7 µs at M = 128), so the reducer of
        its CTA's last tile stages the partials in shared memory first (§8: 0.7-1.0 µs at
        M = 64, 2.7 at 128).
        """
        cfg = self.cfg
        consumers = 128 * cfg.wgs
        leader = wg_tid == 0 and wg == 0
        p_arrived = (mCount.iterator + tile).llvm_ptr
        p_ready = (mCount.iterator + (cfg.tiles + tile)).llvm_ptr
        c_lo = self.cta_of(tile * cfg.k_blocks)
        c_hi = self.cta_of(tile * cfg.k_blocks + cfg.k_blocks - 1)

        # The first barrier also keeps the leader from overwriting flag[0] before every
        # consumer has read the previous segment's value.
        if const_expr(cfg.publish_first):
            # Publish, then arrive with acquire-release semantics: the release (after the
            # barrier, so cumulative over every consumer thread's stores) hands our partial
            # over; the acquire, should we be last, takes every other contributor's. One
            # atomic: a separate acquire fence after it cost the reducer 0.3 µs (§19).
            self.publish_partial(accs, mWs, cta, tile, wg, wg_tid)
            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
            if leader:
                flag[0] = cute.arch.atomic_add(p_arrived, Int32(1), sem="acq_rel", scope="gpu")
        else:
            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
            if leader:
                flag[0] = cute.arch.atomic_add(p_arrived, Int32(1), sem="relaxed", scope="gpu")
        cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
        arrived = flag[0]

        if arrived != c_hi - c_lo:
            if const_expr(not cfg.publish_first):
                # Not last: publish the partial, then one release by the leader after the
                # barrier (cumulative over every consumer thread's stores).
                self.publish_partial(accs, mWs, cta, tile, wg, wg_tid)
                cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
                if leader:
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.red(p_ready, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")
        else:
            if leader:
                if const_expr(not cfg.publish_first):
                    # Every other contributor has arrived; wait until each has published.
                    # They are running and publish right after arriving: microseconds.
                    self.wait_for_count(p_ready, c_hi - c_lo)
                    mCount[cfg.tiles + tile] = Int32(0)
                mCount[tile] = Int32(0)   # counters back to zero for the next launch; nobody
                                          # else touches them in this one
                if const_expr(cfg.bulk_reduce):
                    if last_tile:
                        # Our pipeline is drained: bulk-copy every other partial into it. They
                        # were written by other SMs (generic proxy) and acquired above; the
                        # proxy fence orders that before the bulk copies' (async proxy) reads.
                        cute.arch.fence_proxy("async.global")
                        cute.arch.mbarrier_arrive_and_expect_tx(staged, (c_hi - c_lo) * cfg.slot_bytes)
                        for c in cutlass.range(c_lo, c_hi + 1, unroll=1):
                            if c != cta:
                                src = mWs.iterator + self.slot_of(c, tile) * cfg.slot_floats
                                dst = stage_area + self.staged_slot(c, c_lo, cta) * cfg.slot_floats
                                bulk_copy_g2s(dst, src, cfg.slot_bytes, staged)
            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
            if const_expr(cfg.bulk_reduce):
                if last_tile:
                    cute.arch.mbarrier_wait(staged, 0)     # once per CTA: its last tile
                    self.sum_partials(accs, stage_area, c_lo, c_hi, cta, tile, wg, wg_tid, True)
                else:
                    self.sum_partials(accs, mWs.iterator, c_lo, c_hi, cta, tile, wg, wg_tid, False)
            elif const_expr(cfg.pieces_per_round > 0):
                if last_tile and cta == c_lo:
                    self.sum_partials_in_rounds(accs, stage_area, mWs, staged, c_lo, c_hi, tile, wg,
                                                wg_tid, leader)
                else:
                    self.sum_partials(accs, mWs.iterator, c_lo, c_hi, cta, tile, wg, wg_tid, False)
            else:
                self.sum_partials(accs, mWs.iterator, c_lo, c_hi, cta, tile, wg, wg_tid, False)
            self.store_tile(accs, tCcAcc, mY, tile, wg // cfg.col_wgs, wg % cfg.col_wgs, ybuf, wg_tid,
                            last_tile)
            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)   # every partial read
            self.discard_partials(mWs, c_lo, c_hi, cta, tile, wg, wg_tid)

    @cute.jit
    def reduce_split_tile_in_parts(self, accs, tCcAcc, mY, mWs, mCount, cta, tile, wg, wg_row, wg_col, wg_tid,
                                   staged, stage_area, stage_bufs):
        """``fixup_split``: a split tile's fix-up shared out by warpgroup (GemmConfig).

        Warpgroup w's part of the tile belongs to ``part_owner``: the late CTAs (whose ranges
        end here, so this is their last tile and their pipeline is drained) take the parts in
        turn. Any other CTA's warpgroup w publishes its part of the partial and counts it on
        the part's counter (``tile * wgs + w``); the owner's waits for every count, bulk-copies
        the others' parts into its own share of the drained pipeline, sums them in CTA order
        (its own from registers), stores its part of y from there, resets the counter and
        drops the parts from L2. The warpgroups of one CTA go their own ways (named barrier 2
        + w): the one that owns its part sums while the other publishes.
        """
        cfg = self.cfg
        t_end = (tile + 1) * cfg.k_blocks
        c_lo = self.cta_of(tile * cfg.k_blocks)
        c_hi = self.cta_of(t_end - 1)
        late_hi = cutlass.min(c_hi, self.cta_of(t_end) - 1)
        owner = c_lo + wg % (late_hi - c_lo + 1)
        wg_leader = wg_tid == 0
        wg_barrier = 2 + wg
        p_parts = (mCount.iterator + (tile * cfg.wgs + wg)).llvm_ptr
        # Every warpgroup is past its last wgmma before an owner writes into the pipeline's
        # buffers (the other one may still read the last stage).
        cute.arch.barrier(barrier_id=1, number_of_threads=128 * cfg.wgs)
        if owner != cta:
            self.publish_partial(accs, mWs, cta, tile, wg, wg_tid)
            cute.arch.barrier(barrier_id=wg_barrier, number_of_threads=128)
            if wg_leader:
                # One release after the barrier, cumulative over the warpgroup's stores.
                cute.arch.fence_acq_rel_gpu()
                cute.arch.red(p_parts, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")
        else:
            region = stage_area + wg * cfg.fixup_region_floats
            bar = staged + wg
            if wg_leader:
                # The other CTAs run (or will: the grid is one wave behind whatever kernel
                # holds the SMs, and nobody publishing waits on anything): microseconds.
                self.wait_for_count(p_parts, c_hi - c_lo)
                mCount[tile * cfg.wgs + wg] = Int32(0)    # for the next launch; nobody else reads it
                # Written by other SMs (generic proxy), acquired above; the bulk copies read
                # through the async proxy.
                cute.arch.fence_proxy("async.global")
                cute.arch.mbarrier_arrive_and_expect_tx(bar, (c_hi - c_lo) * cfg.part_bytes)
                for c in cutlass.range(c_lo, c_hi + 1, unroll=1):
                    if c != cta:
                        src = self.published_part(mWs, c, tile, wg)
                        dst = region + self.staged_slot(c, c_lo, cta) * cfg.part_floats
                        bulk_copy_g2s(dst, src, cfg.part_bytes, bar)
            cute.arch.mbarrier_wait(bar, 0)      # once per warpgroup: its CTA's last tile
            self.sum_partials(accs, region, c_lo, c_hi, cta, tile, wg, wg_tid, True,
                              part_of=lambda c: self.staged_slot(c, c_lo, cta))
            if const_expr(cfg.y_staging):
                piece_elems = cfg.mma_n * HALF_ROWS
                y_base = stage_bufs[0] + wg * 2 * cfg.fixup_region_floats      # bf16 elements
                self.store_tile_staged(accs, tCcAcc, mY, tile, wg_row, wg_col,
                                       [y_base + h * piece_elems for h in range(cfg.out_halves)], wg_tid,
                                       wg_barrier=wg_barrier)
            else:
                self.store_tile_direct(accs, tCcAcc, mY, tile, wg_row, wg_col)
            # The bulk copies have read the parts (the mbarrier): drop them from L2 unwritten.
            lines = cfg.part_bytes // 128
            for c in cutlass.range(c_lo, c_hi + 1, unroll=1):
                if c != cta:
                    for line in cutlass.range(wg_tid, lines, 128, unroll=1):
                        discard_l2(self.published_part(mWs, c, tile, wg) + line * 32)

    @cute.jit
    def published_part(self, mWs, c, tile, wg):
        """Where contributor c's part ``wg`` of ``tile`` is in the workspace (its first float)."""
        return mWs.iterator + (self.slot_of(c, tile) * self.cfg.wgs + wg) * self.cfg.part_floats

    @cute.jit
    def wait_for_count(self, p_count, count):
        """Poll the counter at ``p_count`` (acquire, GPU scope) until it reads ``count``. A count
        that never comes (a counter another kernel touched) traps after REDUCER_SPIN_LIMIT_NS:
        the launch fails with a CUDA error instead of hanging the GPU."""
        deadline = cute.arch.globaltimer() + REDUCER_SPIN_LIMIT_NS
        seen = cute.arch.load(p_count, Int32, sem="acquire", scope="gpu")
        while seen != count:
            if cute.arch.globaltimer() > deadline:
                cute.arch.inline_ptx("trap;")
            seen = cute.arch.load(p_count, Int32, sem="acquire", scope="gpu")

    @cute.jit
    def publish_partial(self, accs, mWs, cta, tile, wg, wg_tid):
        """Store this thread's accumulators into the CTA's workspace slot for ``tile``."""
        cfg = self.cfg
        f32x4 = ir.VectorType.get([4], Float32.mlir_type)
        my_slot = self.slot_of(cta, tile)
        for h in cutlass.range_constexpr(cfg.halves):
            for j4 in cutlass.range_constexpr(cfg.frag // 4):
                v = vector.from_elements(f32x4, [accs[h][4 * j4 + e].ir_value() for e in range(4)])
                cute.arch.store(self.ws_ptr(mWs.iterator, my_slot, wg, h, j4, wg_tid), v)

    @cute.jit
    def discard_partials(self, mWs, c_lo, c_hi, cta, tile, wg, wg_tid):
        """Drop the other contributors' partials (read by now) from L2 without writing them
        back: dirty workspace lines would otherwise be written to HBM when something evicts
        them, i.e. during the next kernels' streams (M x 128 x 4 bytes per split, ~4 MB per
        call at M = 64). The next launch writes a slot before anyone reads it."""
        cfg = self.cfg
        consumers = 128 * cfg.wgs
        lines = cfg.slot_bytes // 128
        # Publishing first, the reducer wrote its own slot too.
        keep = Int32(-1) if cfg.publish_first else cta
        for c in cutlass.range(c_lo, c_hi + 1, unroll=1):
            if c != keep:
                base = mWs.iterator + self.slot_of(c, tile) * cfg.slot_floats
                for line in cutlass.range(wg * 128 + wg_tid, lines, consumers, unroll=1):
                    discard_l2(base + line * 32)

    @cute.jit
    def staged_slot(self, c: Int32, c_lo: Int32, cta: Int32) -> Int32:
        """Where contributor c's partial lands in the staging area: the others in CTA order."""
        j = c - c_lo
        if c > cta:
            j = j - 1
        return j

    @cute.jit
    def sum_partials(self, accs, base, c_lo, c_hi, cta, tile, wg, wg_tid, staged: cutlass.Constexpr,
                     part_of=None):
        """accs <- the sum of the tile's partials in CTA order, ours from registers, the others
        from the staging area in shared memory (``staged``) or from the workspace (written by
        other SMs: through L2, ld.cg). With more than 64 accumulators (M > 64) they go in
        chunks of 16, so the running sums and the loaded vectors fit in registers beside the
        accumulators (no spills). Either source gives the same bits: the same adds in the
        same order. ``part_of(c)``: where only this warpgroup's parts were staged
        (fixup_split), the index of contributor c's among them (``part_ptr``)."""
        cfg = self.cfg
        f32x4 = ir.VectorType.get([4], Float32.mlir_type)
        n_acc = cfg.halves * cfg.frag
        chunk = n_acc if n_acc <= 64 else 16
        for f0 in cutlass.range_constexpr(0, n_acc, chunk):
            size = min(chunk, n_acc - f0)      # the last chunk may be short (M = 200: 104 accumulators)
            fs = [(f // cfg.frag, f % cfg.frag) for f in range(f0, f0 + size)]   # (half, j)
            total = cute.make_rmem_tensor(size, Float32)
            total.fill(0.0)
            for c in cutlass.range(c_lo, c_hi + 1, unroll=1):
                if c == cta:
                    for i in cutlass.range_constexpr(size):
                        total[i] = total[i] + accs[fs[i][0]][fs[i][1]]
                else:
                    # From shared memory (staged: the others packed in CTA order) or from
                    # the contributor's workspace slot, through L2 (another SM wrote it).
                    if const_expr(part_of is not None):
                        src = part_of(c)
                    elif const_expr(staged):
                        src = self.staged_slot(c, c_lo, cta) * cfg.wgs + wg
                    else:
                        src = self.slot_of(c, tile) * cfg.wgs + wg
                    parts = [cute.arch.load(self.part_ptr(base, src, fs[i][0], fs[i][1] // 4, wg_tid),
                                            f32x4, cop=None if staged else "cg") for i in range(0, size, 4)]
                    for i in cutlass.range_constexpr(size):
                        part = Float32(vector.extract(parts[i // 4], dynamic_position=[],
                                                      static_position=[i % 4]))
                        total[i] = total[i] + part
            for i in cutlass.range_constexpr(size):
                accs[fs[i][0]][fs[i][1]] = total[i]

    @cute.jit
    def sum_partials_in_rounds(self, accs, stage_area, mWs, staged, c_lo, c_hi, tile, wg, wg_tid, leader):
        """accs (this CTA's partial, the first in CTA order) += the later contributors'
        partials in CTA order, bulk-copied into the drained pipeline buffers
        ``pieces_per_round`` pieces at a time (the ``staged`` mbarrier, one phase per round):
        whole partials, or each partial's (warpgroup, half) blocks apart (``slot_pieces``),
        in the order (contributor, block), so every accumulator still meets the contributors
        in CTA order. The same adds in the same order as sum_partials, whose running total
        starts at +0.0: accumulators start at +0.0 and only add, so no partial is -0.0 and
        0 + P = P exactly; the result is bitwise the same whichever path the reducer takes."""
        cfg = self.cfg
        consumers = 128 * cfg.wgs
        f32x4 = ir.VectorType.get([4], Float32.mlir_type)
        per = cfg.pieces_per_round
        pieces = (c_hi - c_lo) * cfg.slot_pieces
        rounds = (pieces + per - 1) // per
        if leader:
            # The partials were written by other SMs (generic proxy) and acquired; order that
            # before the bulk copies' (async proxy) reads.
            cute.arch.fence_proxy("async.global")
        for r in cutlass.range(rounds, unroll=1):
            first = r * per
            count = cutlass.min(pieces - first, per)
            if leader:
                cute.arch.mbarrier_arrive_and_expect_tx(staged, count * 4 * cfg.piece_floats)
                for q in cutlass.range(count, unroll=1):
                    f = first + q
                    c = c_lo + 1 + f // cfg.slot_pieces
                    src = mWs.iterator + (self.slot_of(c, tile) * cfg.slot_floats
                                          + (f % cfg.slot_pieces) * cfg.piece_floats)
                    bulk_copy_g2s(stage_area + q * cfg.piece_floats, src, 4 * cfg.piece_floats, staged)
            cute.arch.mbarrier_wait(staged, r % 2)
            # 16 accumulators at a time, each chunk a loop over the round's pieces, so that
            # ptxas does not hoist every load at once.
            for h in cutlass.range_constexpr(cfg.halves):
                for j4s in cutlass.range_constexpr(0, cfg.frag // 4, 4):
                    for q in cutlass.range(count, unroll=1):
                        if const_expr(cfg.slot_pieces == 1):
                            block = (q * cfg.wgs + wg) * cfg.halves + h      # ws_ptr's layout, j4 = 0
                            self.add_staged(accs, h, j4s, stage_area + (block * cfg.frag * 128 + wg_tid * 4), f32x4)
                        elif (first + q) % cfg.slot_pieces == wg * cfg.halves + h:
                            # This warpgroup's half of a later contributor: one block of the slot.
                            self.add_staged(accs, h, j4s, stage_area + (q * cfg.piece_floats + wg_tid * 4), f32x4)
            # Everyone has read this round's buffers before the next round overwrites them.
            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)

    @cute.jit
    def add_staged(self, accs, h: cutlass.Constexpr, j4s: cutlass.Constexpr, first, f32x4):
        """accs[h][4 j4 .. 4 j4 + 3] += the staged vectors j4 = j4s .. j4s + 3 of one block of
        a partial (ws_ptr's layout), ``first`` this thread's j4 = 0 vector in shared memory
        (the next ones 128 vectors apart)."""
        cfg = self.cfg
        for j4 in cutlass.range_constexpr(j4s, min(j4s + 4, cfg.frag // 4)):
            part = cute.arch.load((first + j4 * 512).llvm_ptr, f32x4)
            for e in cutlass.range_constexpr(4):
                accs[h][4 * j4 + e] = accs[h][4 * j4 + e] + Float32(
                    vector.extract(part, dynamic_position=[], static_position=[e]))


def discard_l2(line) -> None:
    """``discard.global.L2``: invalidate the 128-byte L2 line at global ``line`` (128-byte
    aligned) without writing it back; its contents become undefined."""
    llvm.inline_asm(
        None,
        [line.toint().ir_value()],
        "discard.global.L2 [$0], 128;",
        "l,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def bulk_copy_g2s(dst, src, nbytes, bar) -> None:
    """``cp.async.bulk`` of ``nbytes`` (a multiple of 16) from global ``src`` to shared ``dst``,
    completing on the mbarrier ``bar`` (armed with the bytes by the caller)."""
    llvm.inline_asm(
        None,
        [dst.toint().ir_value(), src.toint().ir_value(), Int32(nbytes).ir_value(), bar.toint().ir_value()],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# ------------------------------------------------------------------------------------------------
# Compilation and the compile cache.
# ------------------------------------------------------------------------------------------------
def _compile_args():
    z = Int64(0)
    return (z, z, z, z, z, cuda.CUstream(0), Boolean(True))


def _build(*key, options: str = ""):
    kernel = DecodeGemmKernel(GemmConfig.from_key(key))
    if options:
        return cute.compile(kernel, *_compile_args(), options=options)
    return cute.compile(kernel, *_compile_args())


_CACHE = CompileCache("gemm_stream_k", _build, (sys.modules[__name__], smem_pipeline, weight_blocks))


def compile_cache() -> CompileCache:
    return _CACHE


def compile_stream_k(cfg: GemmConfig, options: str | None = None):
    """The compiled kernel of ``cfg``: from the compile cache (in process, then on disk), or
    compiled afresh with ``options`` (e.g. ``--keep-ptx --dump-dir D``, so ``.__ptx__`` is there)."""
    if options:
        return _build(*cfg.key(), options=options)
    return _CACHE.get(cfg.key())


# ------------------------------------------------------------------------------------------------
# Workspace: fp32 partials + per-tile arrival counters, per (device, configuration) and owner.
# ------------------------------------------------------------------------------------------------
def _workspace(cfg: GemmConfig, device, workspaces: Workspaces | None = None):
    """(partials, counters) for one configuration on one device, from ``workspaces`` (default:
    the process's shared ones; kernels/workspaces.py), allocated at the first call.

    Counters start at zero and every launch leaves them at zero (the last CTA of a split tile
    resets its counter), so the buffers are reused by every launch of this configuration with
    this owner. Two launches that share them are ordered: all their accesses happen after
    griddepcontrol.wait, i.e. after the previous kernel in the stream completed. Launches that
    share them on two streams at once are not: give each stream's work its own ``Workspaces``.
    """
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()

    def make():
        return (torch.empty(max(cfg.workspace_floats, 4), dtype=torch.float32, device=device),
                torch.zeros(2 * cfg.tiles, dtype=torch.int32, device=device))

    return workspace(workspaces, ("gemm", index, cfg.key()), make, lambda: f"linear: {cfg} on {device}")


def launch(cfg: GemmConfig, x, weight, out, stream, use_pdl: bool, workspaces: Workspaces | None = None) -> None:
    """Launch ``cfg``'s kernel on checked tensors (kernels/gemm.py ``linear``) on the torch
    ``stream``, with the PDL attribute when ``use_pdl``; its split-K workspace comes from
    ``workspaces`` (``_workspace``)."""
    fn = _CACHE.on_device(cfg.key(), weight.device.index)
    partials, counters = _workspace(cfg, weight.device, workspaces)
    fn(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), partials.data_ptr(), counters.data_ptr(),
        cuda.CUstream(stream.cuda_stream), bool(use_pdl),
    )
