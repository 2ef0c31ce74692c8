"""The decode GEMM at many batch rows: whole-K output tiles, sized so that one wave fills the SMs.

``y[M, N] = x[M, K] @ W[N, K]^T`` (bf16 in and out, fp32 accumulation), or with ``silu_mul``
``y = silu(g) * u`` where ``[g | u] = x @ W^T`` (W = [gate; up], N / 2 output columns).
``kernels/gemm_stream_k.py`` computes ``y^T = W x^T`` (W rows on the wgmma M side, in 64-row steps) and
splits K between CTAs (stream-K), which is what streams weights fastest at a few batch rows.
From ~120-128 rows the problem has enough work per W tile for another trade, the one cuBLAS makes
there (its Hopper kernel at o_proj M = 256 is a 112 x 128 tile on 128 CTAs, Nsight Compute,
bench/gemm_notes.md §21): no K split at all, so no fp32 partials, no reduction tail and no
counters, with the tile count matched to the SM count by the *W-row* side of the tile, which
wgmma allows in steps of 16 (its N) when x is the A operand.

Structure
---------
* **Orientation**: x is wgmma's A operand (its M = 64 batch rows per consumer warpgroup), W the
  B operand (its N = ``n_tile`` W rows, a multiple of 16 up to 256; of 32 with silu_mul, so that
  its gate and up halves are whole 16-row pieces, ``n_tile_step``). A tile is ``batch_tile``
  (64 or 128) batch rows x ``n_tile`` W rows over the whole of K; each consumer warpgroup
  owns 64 of its batch rows, and both read the tile's W from the same shared-memory buffer.
* **Tile shape** (``WideGemmConfig.choose_tile``): the largest (batch_tile, n_tile), counting
  only batch rows < M, whose tile count fills the grid's waves within 3% of the best (o_proj
  at 256 rows: 2 x 64 tiles of 128 x 112 on 132 SMs, 97%; at 128 rows 2 x 64 tiles of 64 x 112).
* **Clusters of CTAs** (``cluster``, ``x_group``): CTAs that read the same operand form a
  cluster; each loads its share of that operand's box and multicasts it into all of them, so
  it leaves L2 once per cluster. By default, where the batch tiles and the grid are even, a pair
  is the two batch tiles of a W tile and shares W; with a single batch tile (M <= 128) and
  several tiles per CTA it is two neighbouring W tiles and shares x (``cluster_shares``;
  measured slower with one tile per CTA). As knobs: ``x_group`` = 2 or 4 neighbouring W tiles
  sharing x with any number of batch tiles (cuBLAS's 4 x 1 cluster at qkv 192 rows), and
  ``cluster=4`` over an even number of batch tiles, 2 x 2 tiles, W shared by the two batch
  tiles and x by the two W tiles, each load multicast into its own pair only; ``cluster=3``
  (or ``cluster=4, x_group=1``) is three (four) batch tiles of one W tile sharing W, which
  with 64-row batch tiles at 129-192 rows leaves L2 once instead of three times (§46). The 2 x 2
  clusters measured slower (bench/gemm_notes.md §42): an H100 does not hold 32 four-CTA
  clusters of these 200-220 KB CTAs at once, so at 128-132 CTAs the last run as a second wave
  (1.6x), and at 112 CTAs, where all 28 fit, the 20 idle SMs cost more than the L2 reads saved
  (+4-6% at 256 rows). ``WideGemmConfig.tile_coords`` numbers the tiles so that a cluster's
  CTAs compute such a group at every step of the persistent loop.
* **Batch rows past M**: a warpgroup's 64-row x box that would reach past row M is moved back
  to end at M (``x_rows``; rows computed twice are stored once), because TMA's zero fill of
  the rows past x cost up to 40% at 160-200 rows. Below 48 rows, where no box can move back,
  the box holds only x's rows rounded up to 16 (``x_trim``; 8-26% faster than a 64-row box
  at 32-40 rows, bench/gemm_notes.md §24).
* **Persistent grid**: ``min(tiles, SMs)`` CTAs; CTA c computes tiles c, c + ctas, ... (without
  a cluster tile t is W tile t // batch_tiles, batch tile t % batch_tiles, so the CTAs that read
  the same W tile run side by side and the second read hits L2; ``tile_coords``). The producer
  warp streams (W, x) stages through all of its tiles without a break; the consumers drain
  each tile's wgmma, store it and go on.
* **Pipeline**: as in kernels/gemm_stream_k.py: a producer warp issues TMA loads of the stage's W
  (one n_tile x 64 box on rows; its 16-row pieces in blocks; two half boxes with silu_mul,
  ``WideGemmConfig.w_boxes_of_stage``) and one x box per consumer warpgroup (64 x 64) per
  stage into 128B-swizzled shared memory, completing on an mbarrier armed with the stage's bytes; consumer warpgroups
  run wgmma keeping one k-block in flight and release the stage before.
* **W in blocks** (``w_blocked``; kernels/weight_blocks.py's 64 x 64 blocks, which ``linear``
  takes as a 4-D weight): a tile's n_tile rows start at any multiple of 16, so they need not be
  whole blocks; each stage's W is then loaded as n_tile / 16 boxes of 16 rows, each one
  contiguous 2 KB of a block (4-D tensor map), into the same swizzled buffer (the swizzle
  follows the shared-memory address). In a pair sharing W, each CTA loads the even or the odd
  pieces and multicasts them whole. Faster than rows only with 160- and 256-row tiles, slower
  with 80 and 112, so the default on blocks is narrower (``BLOCKED_N_TILE_MULTIPLE``). In
  16-row blocks (``w_block_rows=16``, a measurement knob) a tile is whole blocks, so a stage
  is one 4-D box of them, or in a W pair one box of half of them per CTA (an odd count's
  halves overlap by one block, loaded by both): 1-4% faster than rows without a pair
  (bench/gemm_notes.md §34), tied to 2% faster with one at 256 rows, 9% slower at down's 128
  (§35). ``WideGemmConfig.w_boxes_of_stage`` says which.
* **silu_mul**: a tile's n_tile W rows are n_tile / 2 gate rows and the matching n_tile / 2 up
  rows (``I`` = N / 2 apart in W), loaded as two boxes (or their 16-row pieces) into the two
  halves of the stage's W buffer, so accumulator column c is a gate and c + n_tile / 2 its up
  (in wgmma's fragment the same thread's accumulator n_tile / 4 further on).
* **Epilogue**: fp32 accumulators (with silu_mul, ``silu(g) * u`` of them in fp32, as
  kernels/gemm_stream_k.py) rounded once to bf16 and stored straight from the fragment, two adjacent y
  columns per 4-byte store, batch rows >= M (and rows another warpgroup owns) masked.

PDL (DESIGN §4): the same contract as kernels/gemm_stream_k.py: ``launch_dependents`` at entry (one wave,
so a dependent cannot take an SM from one of our CTAs), the first stages' W loads before
``griddepcontrol.wait`` (weight traffic only; each stage barrier already expects the x bytes,
so no consumer starts early), x loaded and y stored only after it, every thread waits.
"""

from __future__ import annotations

import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Boolean, Float32, Int16, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import smem_pipeline, weight_blocks
from .compile_cache import CompileCache
from .gemm_contract import EPILOGUES
from .smem_pipeline import (EVICT_FIRST, SMEM_BUDGET, SMEM_MAX, barriers_ready, block_rows_knob,
                            first_rows_layout, on_off_knob, peers_done, pipeline_stages, release_stage, row_pieces_layout, tma_load,
                            tma_load_op, w_global_layout)

# PDL traits: the same as kernels/gemm_stream_k.py's (kernels/gemm.py checks that they agree).
PROLOGUE_INPUTS = ("weight",)
WAITS = True
TRIGGER = "early"

TUNING_KNOBS = ("batch_tile", "n_tile", "stages", "cluster", "x_group", "x_trim", "w_blocked", "w_block_rows",
                "static_stages", "wg_release")
BLOCK_K = 64               # one 128-byte swizzle atom of bf16 per row and stage
WG_ROWS = 64               # batch rows per consumer warpgroup (wgmma's M)
N_TILE_STEP = 16           # wgmma N steps of 8; CuTe DSL 4.8.1 needs an even number of 8-row atoms
# With W in 64 x 64 blocks (``w_blocked``) a W tile (n_tile rows, any multiple of 16 from any
# multiple of 16) need not sit inside whole blocks, so its stage is loaded as pieces of this
# many rows: each one contiguous 2 KB of a block, whichever block it falls in.
W_PIECE_ROWS = N_TILE_STEP
MAX_N_TILE = 256           # wgmma's largest N
FILL_SLACK = 0.03          # choose_tile: a larger tile may leave this much more of the waves idle
# When kernels/gemm.py's ``linear`` runs this kernel by default: plain shapes from WIDE_MIN_M
# batch rows whose tiles fill the SMs' waves to WIDE_MIN_FILL and whose batch tiles hold at
# least WIDE_MIN_ROW_FILL real rows. Measured on an H200 against the stream-K kernel
# (bench/gemm_notes.md §21, §22): at 128 rows 6-12% faster on down, qkv and o_proj (o_proj
# there now runs one whole-K unit per CTA on the stream-K kernel instead, faster still: §23, gemm.plan), at 240-256
# rows 6-18% on down and o_proj and 0-14% on qkv; at 160-224 rows slower (two 128-row batch
# tiles compute 256 rows whatever M is; stream-K's batch columns follow M in steps of 16);
# lm_head (640-1280 tiles, several waves) 4% faster at 128 rows with x shared in pairs and
# 2-3% at 256.
# In one wave a padded batch row costs tensor-core time hidden under the weight stream; over
# several waves it costs a share of whole extra tiles. So where the stream-K kernel would
# split K and the tiles fit one wave, WIDE_MIN_ROW_FILL_ONE_WAVE is enough: qkv at 208 / 224
# rows 4-10% faster than stream-K (§22), while down and o_proj there keep their whole-K
# 64-row units (faster than these tiles at 208-224) and lm_head loses 9-33% at 160-224.
# From WIDE_MIN_M rows, where a 128-row batch tile is 90% real rows; below 128 rows only as one
# 128-row batch tile: measured on an H200 at 116-124 rows (bench/gemm_notes.md §23, 3
# interleaved rounds), qkv (one tile of 128 x 80) 0-6% and lm_head 2-4% faster than stream-K,
# but down, whose tiles there are two 64-row batch tiles (the second moved back over the
# first), 2-8% slower.
WIDE_MIN_M = 116
# With W in 64 x 64 blocks, the default only where n_tile is a multiple of this. Measured on an
# H200 (bench/gemm_notes.md §34, 3 interleaved rounds, the same board), blocks against rows:
# lm_head's 256-row tiles 2-3% faster at 128 / 256 batch rows, qkv's 160-row tiles tied to 2%
# faster at 224 / 256, but qkv's 80-row tiles 7% slower at 128 and the 112-row tiles of down and
# o_proj 8-20% slower at 128 / 256 (an odd number of 16-row pieces per tile; why is not known),
# There the stream-K kernel takes blocked weights (as fast as these tiles on rows at down 128,
# 3-5% slower elsewhere, §33-§34), and a build keeps such weights row-major (gemm.reads_blocks).
BLOCKED_N_TILE_MULTIPLE = 32
# From this many k-blocks the default ring fills SMEM_MAX rather than SMEM_BUDGET. Measured on
# an H100 (bench/gemm_notes.md §41, 3-5 interleaved rounds, three runs): down (288 k-blocks) at
# 256 rows 7 stages of 30 KB 2.0-6.5% faster than 6, at 240 rows 2.0%; o_proj (128 k-blocks)
# -0.5 to +0.9%, qkv (112; 6 stages of 36 KB) 1% slower.
DEEP_PIPELINE_MIN_K_BLOCKS = 256
MAX_BATCH_TILE = 128       # the largest batch tile: up to this many rows, one batch tile holds every row
WIDE_MIN_ROW_FILL = 0.9
WIDE_MIN_ROW_FILL_ONE_WAVE = 0.8
WIDE_MIN_FILL = 0.9
# A tile re-reads its batch rows of x from L2 for every W tile: batch_tile / n_tile bytes of x
# per byte of W it streams. The tiles measured faster than stream-K have at most 1.6 (qkv's
# 128 x 80 at 128 rows). choose_tile ranks wave fill first, and on a grid other than 132 SMs
# (H100 PCIe: 114, H20: 78) that is met only by tiles 16-32 W rows wide for the Kimi shapes at
# 128-256 rows: at qkv 256 rows, 64 x 16 on 114 SMs. 128 x 16 tiles there (on 120 CTAs, with x
# shared in fours) ran 4.4x the default on an H200 (bench/gemm_notes.md §45). Beyond this
# ratio the default is the stream-K kernel, whose traffic does not depend on the SM count.
WIDE_MAX_X_PER_W = 2
# And W itself leaves L2 once per batch tile that does not share it (``w_reads``). Every tile
# default measured faster than stream-K reads it once (one batch tile, or W pairs); three
# 64-row batch tiles each streaming all of W ran slower wherever timed (§48): qkv's 64 x 256 at
# 192 rows 1.15-1.20x the stream-K kernel (§44, §46; L2 at 88% of its peak), the same tile at
# 192 rows of K = 4096, N = 11008 1.10x, and 64 x 48 at 192 rows of N = 9984, the tile wave
# fill alone picks there, 2.3x (H200; on an H100 97.7 µs, 49% of the floor). Twice is not measured.
WIDE_MAX_W_READS = 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def n_tile_step(epilogue: str | None) -> int:
    """What n_tile must be a multiple of: N_TILE_STEP, or with silu_mul twice that (each half,
    gate and up, is a box of whole N_TILE_STEP-row pieces)."""
    return 2 * N_TILE_STEP if epilogue == "silu_mul" else N_TILE_STEP


class WideGemmConfig:
    """Every static decision for one (M, K, N, epilogue, ctas[, batch_tile, n_tile, stages, cluster,
    x_group, x_trim, w_blocked, w_block_rows, static_stages, wg_release])."""

    def __init__(self, m: int, k: int, n: int, ctas: int, epilogue: str | None = None, *,
                 batch_tile: int | None = None, n_tile: int | None = None, stages: int | None = None,
                 cluster: int | None = None, x_group: int | None = None, x_trim: int | None = None,
                 w_blocked: int | None = None, w_block_rows: int | None = None, static_stages: int | None = None,
                 wg_release: int | None = None):
        if epilogue not in EPILOGUES:
            raise ValueError(f"wide decode GEMM: epilogue={epilogue!r} unsupported: one of {EPILOGUES}")
        step = n_tile_step(epilogue)
        if not (1 <= m and k > 0 and k % BLOCK_K == 0 and n > 0 and n % step == 0):
            raise ValueError(f"wide decode GEMM: M={m}, K={k}, N={n} unsupported (K a multiple of "
                             f"{BLOCK_K}, N of {step})")
        self.m, self.k, self.n, self.sms = int(m), int(k), int(n), int(ctas)
        self.epilogue = epilogue
        self.silu = epilogue == "silu_mul"
        self.n_out = self.n // 2 if self.silu else self.n        # y's columns
        if batch_tile is None or n_tile is None:
            best_bt, best_nt = self.choose_tile(self.m, self.n, self.sms, epilogue)
            batch_tile = best_bt if batch_tile is None else batch_tile
            n_tile = best_nt if n_tile is None else n_tile
        if batch_tile not in (WG_ROWS, MAX_BATCH_TILE):
            raise ValueError(f"batch_tile={batch_tile} unsupported: {WG_ROWS} or {MAX_BATCH_TILE}")
        if n_tile % step or not 0 < n_tile <= MAX_N_TILE or self.n % n_tile:
            raise ValueError(f"n_tile={n_tile} unsupported: a multiple of {step} up to "
                             f"{MAX_N_TILE} dividing N={self.n}"
                             + (" (silu_mul: half gate rows, half up rows)" if self.silu else ""))
        self.batch_tile, self.n_tile = int(batch_tile), int(n_tile)
        self.wgs = self.batch_tile // WG_ROWS
        self.batch_tiles = _ceil_div(self.m, self.batch_tile)
        self.n_tiles = self.n // self.n_tile
        self.tiles = self.batch_tiles * self.n_tiles
        self.ctas = min(self.tiles, self.sms)
        # Clusters of CTAs that share an operand: each loads its share of the shared box and
        # multicasts it into every CTA that reads it, so that operand leaves L2 once per group,
        # for a cluster that refills a stage only when all of its CTAs have released it. A
        # cluster is ``x_group`` neighbouring W tiles (sharing x) times ``cluster / x_group``
        # neighbouring batch tiles (sharing W); ``tile_coords`` numbers the tiles so that the
        # CTAs of a cluster always compute such a group.
        # * "w": pairs, the two batch tiles of one W tile: cuBLAS's 2 x 1 cluster at 256 rows.
        #   Measured on an H200 at 240-256 rows (bench/gemm_notes.md §21): qkv -5 to -14%,
        #   o_proj -1 to -10%, down +-3%. The default wherever the batch tiles and grid are even.
        # * "x": pairs (or fours) of neighbouring W tiles of one batch tile, so the x boxes,
        #   re-read for every W tile, leave L2 once per group. Measured (§22): -4% on lm_head at
        #   128 rows (640 tiles, 5 per CTA), but +1 to +5% wherever each CTA computes one tile
        #   (qkv at 64 and 128 rows, o_proj at 64); so by default only with one batch tile over
        #   several waves. Fours are cuBLAS's 4 x 1 cluster at qkv 192 rows (256 x 64 tiles).
        # * "w+x" (``cluster=4`` with an even number of batch tiles): 2 x 2 tiles, W shared by
        #   the two batch tiles and x by the two W tiles (at o_proj 256 rows, 245 MB of L2 reads
        #   instead of 373). Slower wherever measured (§42): clusters of four do not all
        #   co-reside at 128-132 CTAs, and with 112 CTAs the idle SMs cost more than the saved
        #   reads; so never a default.
        shares_w = self.ctas % 2 == 0 and self.batch_tiles % 2 == 0
        shares_x = self.ctas % 2 == 0 and self.batch_tiles == 1 and self.tiles % 2 == 0
        if cluster is None:
            cluster = 2 if shares_w or (shares_x and self.tiles > self.ctas) else 1
        if x_group is None:     # W pairs where the batch tiles pair up, the rest of the cluster x
            x_group = cluster // 2 if cluster > 1 and self.batch_tiles % 2 == 0 else cluster
            if cluster == 3:    # W in threes: x cannot be split three ways (a box of 64 rows)
                x_group = 1
        w_group = cluster // x_group if x_group and cluster % x_group == 0 else 0
        if not (cluster in (1, 2, 3, 4) and x_group in (1, 2, 4) and w_group in (1, 2, 3, 4)
                and self.batch_tiles % w_group == 0 and self.n_tiles % x_group == 0 and self.ctas % cluster == 0):
            raise ValueError(
                f"cluster={cluster}, x_group={x_group} unsupported here: a cluster (at most 4 CTAs) is "
                f"x_group (1, 2 or 4) neighbouring W tiles of {self.n_tiles} times 1 to 4 batch tiles "
                f"of {self.batch_tiles} (each count dividing its tiles), on a grid ({self.ctas} CTAs) "
                f"that is a multiple of it")
        self.cluster, self.x_group = int(cluster), int(x_group)
        # CTAs each x / W box is multicast into (the group sharing that operand, else 1). A CTA's
        # cluster rank is x_rank * w_multicast + w_rank (CuTe's (w, x) layout of the cluster).
        self.x_multicast, self.w_multicast = self.x_group, w_group
        # What the cluster shares, for the repr and tests: "w", "x", "w+x" or None.
        self.cluster_shares = "+".join(operand for operand, group in (("w", self.w_multicast), ("x", self.x_multicast))
                                       if group > 1) or None
        self.k_blocks = self.k // BLOCK_K
        self.threads = 128 * self.wgs + 32        # + one producer warp
        self.producer_warp = 4 * self.wgs
        # Below 48 rows (one batch tile) a warpgroup's x box holds x's rows rounded up to 16
        # (``x_trim``) instead of its 64: TMA zero-fills a box's rows past x, which costs
        # 8-26% at 32-40 rows (bench/gemm_notes.md §24). The buffer's other rows keep what
        # they held; the batch rows computed from them (>= M) are never stored. Whole 16-row
        # boxes: CuTe DSL 4.8.1 aborts building a TMA box of an odd number of 8-row swizzle
        # atoms, which is also why not with x shared in pairs (half a box per CTA).
        trimmable = _ceil_div(self.m, N_TILE_STEP) * N_TILE_STEP < WG_ROWS and self.x_multicast == 1
        self.x_trim = on_off_knob("x_trim", x_trim, trimmable, trimmable,
                                  f"below 48 rows ({self.m}) without x shared in pairs")
        self.x_box_rows = _ceil_div(self.m, N_TILE_STEP) * N_TILE_STEP if self.x_trim else WG_ROWS
        self.w_stage_bytes = self.n_tile * BLOCK_K * 2
        # W's memory order: row-major [N, K], or kernels/weight_blocks.py's 64 x 64 blocks
        # (``linear`` sets it from the weight's shape), loaded as ``w_boxes_of_stage`` says.
        self.w_blocked = on_off_knob("w_blocked", w_blocked, False, self.n % weight_blocks.BLOCK == 0,
                                     f"with W given as its blocks (kernels/weight_blocks.py; N={self.n} "
                                     f"a multiple of {weight_blocks.BLOCK})")
        # Rows per block: 64, or 16 as a measurement variant.
        self.w_block_rows = block_rows_knob(w_block_rows, self.w_blocked)
        # W shared by more than two batch tiles is loaded as whole boxes (each CTA every
        # w_multicast-th), not as one box that TMA's multicast partition splits (in two only).
        if self.w_multicast > 2 and not self.w_split_boxes:
            raise ValueError(f"cluster={self.cluster}, x_group={self.x_group} unsupported here: W shared "
                             f"by {self.w_multicast} batch tiles needs W in blocks (w_blocked=1)")
        self.w_box_rows, self.w_boxes, self.w_box_step = self.w_boxes_of_stage()
        # Shared memory per stage (64-row x buffers), and what TMA delivers into it: with
        # overlapping boxes (a pair's halves of an odd block count) the shared block twice.
        self.stage_bytes = self.wgs * WG_ROWS * BLOCK_K * 2 + self.w_stage_bytes
        self.w_tx_bytes = self.w_boxes * self.w_box_rows * BLOCK_K * 2
        self.stage_tx_bytes = self.wgs * self.x_box_rows * BLOCK_K * 2 + self.w_tx_bytes
        # A long K takes all the shared memory it can: a PDL dependent then finds no room on our
        # SMs until we exit, which costs less than the shallower ring did.
        long_k = self.k_blocks >= DEEP_PIPELINE_MIN_K_BLOCKS
        self.stages = pipeline_stages(stages, self.stage_bytes, SMEM_MAX if long_k else SMEM_BUDGET)
        # ``static_stages`` (a measurement knob, off by default): the consumers' and the
        # producer's k-block loops unrolled by the stage count, so each k-block's stage is a
        # constant: the consumers' wgmma descriptors, barrier addresses and release target and
        # the producer's buffer and barrier addresses (and with one tile per CTA its tile
        # coordinates) are folded at compile time instead of computed every k-block (at o_proj
        # 256 rows, 35 PTX instructions per consumer k-block instead of 94, 28 per producer
        # k-block instead of 76; bench/gemm_notes.md §56). Under Nsight Compute there (H100,
        # §55) this kernel issues 2.2x the instructions of cuBLAS's with the same tile and keeps
        # the tensor pipe 59% busy against its 69%. Only where every tile's k-blocks start at
        # stage 0: each CTA computes one tile, or a tile's k-blocks are whole rounds of stages
        # (lm_head: 112 k-blocks on 4 stages).
        self.one_tile_per_cta = self.tiles <= self.ctas
        self.static_stages = on_off_knob(
            "static_stages", static_stages, False, self.one_tile_per_cta or self.k_blocks % self.stages == 0,
            f"where every tile starts at stage 0: one tile per CTA ({self.tiles} tiles, {self.ctas} CTAs) or "
            f"k-blocks a multiple of the stages ({self.k_blocks} on {self.stages})")
        # ``wg_release`` (a measurement knob, off by default): a consumer warpgroup frees a stage
        # with one arrival per CTA it shares the stage with (from its first warp, one lane per
        # CTA), as CUTLASS's Hopper TMA pipeline does, instead of one from each of its four warps:
        # in a pair 4 arrivals per stage instead of 16, 2 of them remote instead of 8. A
        # warpgroup's wgmma are one operation for its four warps, so when one warp's wait_group
        # has seen a k-block's wgmma complete, none of them still reads that stage. A candidate
        # for the slower refills of §56 (bench/gemm_notes.md §57).
        self.wg_release = on_off_knob("wg_release", wg_release, False, True, "")

    def w_boxes_of_stage(self) -> tuple[int, int, int]:
        """How a stage's W (the tile's n_tile rows, one k-block) is loaded: (rows per box, boxes,
        rows from one box's start to the next's, in the stage buffer). In a pair sharing W the
        CTA of rank r loads boxes r, r + 2, ... and multicasts each to both (except one
        row-major box, which TMA's multicast partition halves). Where box p starts in W:
        ``w_box_row``.

        * silu_mul: the gate half and the up half of the tile are I = N / 2 rows apart in W, so
          each half is loaded on its own: one box of n_tile / 2 rows each (row-major, or
          16-row blocks, whose halves are whole blocks), or with 64-row blocks their pieces.
        * Row-major W: one box of the tile (in a pair, TMA's multicast partition halves it).
        * 64-row blocks: the tile's rows start at any multiple of 16, so they need not be whole
          blocks: W_PIECE_ROWS-row pieces, each contiguous 2 KB of one block.
        * 16-row blocks: the tile is whole blocks, so one box of all of them (4-D); in a pair,
          each CTA one box of half of them. With an odd block count (7 at 112 rows) the two
          halves overlap by one block, which both CTAs load: one box shape and tensor map,
          at 1/B more of the tile read from L2 (the second read of that block is an L2 hit)."""
        whole_tile = (self.n_tile, 1, self.n_tile)
        pieces = (W_PIECE_ROWS, self.n_tile // W_PIECE_ROWS, W_PIECE_ROWS)
        if self.silu:
            half = self.n_tile // 2
            return pieces if self.w_blocked and self.w_block_rows == weight_blocks.BLOCK else (half, 2, half)
        if not self.w_blocked:
            return whole_tile
        if self.w_block_rows == weight_blocks.BLOCK:
            return pieces
        blocks = self.n_tile // self.w_block_rows
        if self.w_multicast == 1 or blocks == 1:
            return whole_tile
        if self.w_multicast > 2:
            return pieces       # one 16-row block per box, every w_multicast-th box per CTA
        half = _ceil_div(blocks, 2) * self.w_block_rows
        if (self.n // self.w_block_rows) % (half // self.w_block_rows):
            return pieces       # a box of `half` rows must tile W's block rows (CuTe's local_tile)
        return half, 2, self.n_tile - half

    @property
    def releases_per_wg(self) -> int:
        """Arrivals with which a consumer warpgroup frees a stage in each CTA sharing it: one per
        warp, or one with ``wg_release``."""
        return 1 if self.wg_release else 4

    @property
    def w_split_boxes(self) -> bool:
        """Whether a stage's W is loaded as several boxes (each multicast whole in a W pair)
        rather than as one box of the whole tile (halved by TMA's multicast partition)."""
        return self.w_blocked or self.silu

    def w_box_row(self, n_blk, p: int):
        """First W row of box ``p`` of W tile ``n_blk`` (an int, or the kernel's Int32): the
        tile's rows n_blk * n_tile + p * w_box_step on, or with silu_mul, gate boxes then up
        boxes, each half from row n_blk * n_tile / 2 of its half of W."""
        if not self.silu:
            return n_blk * self.n_tile + p * self.w_box_step
        per_half = self.w_boxes // 2
        return (p // per_half) * self.n_out + n_blk * (self.n_tile // 2) + (p % per_half) * self.w_box_step

    @staticmethod
    def wave_fill(m: int, n: int, sms: int, batch_tile: int, n_tile: int) -> float:
        """Share of the grid's SM-waves that hold a tile: tiles / (waves x SMs)."""
        tiles = _ceil_div(m, batch_tile) * (n // n_tile)
        return tiles / (_ceil_div(tiles, sms) * sms)

    @staticmethod
    def row_fill(m: int, batch_tile: int) -> float:
        """Share of the batch tiles' rows that are real (< M)."""
        return m / (_ceil_div(m, batch_tile) * batch_tile)

    @classmethod
    def choose_tile(cls, m: int, n: int, sms: int, epilogue: str | None = None) -> tuple[int, int]:
        """(batch_tile, n_tile): among the shapes that fill the waves within FILL_SLACK of the
        best, the largest tile counting only batch rows < M (the fewest x and W re-reads from
        L2 per useful FLOP), then the least padding, then 128 batch rows."""
        step = n_tile_step(epilogue)
        candidates = [(bt, nt) for bt in (128, 64) for nt in range(MAX_N_TILE, 0, -step)
                      if n % nt == 0]
        if not candidates:
            raise ValueError(f"wide decode GEMM: no W tile divides N={n}")
        best = max(cls.wave_fill(m, n, sms, bt, nt) for bt, nt in candidates)
        good = [c for c in candidates if cls.wave_fill(m, n, sms, *c) >= best - FILL_SLACK]
        return max(good, key=lambda c: (c[0] * c[1] * cls.row_fill(m, c[0]), cls.row_fill(m, c[0]), c[0]))

    def key(self) -> tuple:
        """Everything the compiled kernel depends on."""
        return (self.m, self.k, self.n, self.epilogue, self.sms, *(getattr(self, knob) for knob in TUNING_KNOBS))

    @classmethod
    def from_key(cls, key: tuple) -> "WideGemmConfig":
        m, k, n, epilogue, sms, *tuning = key
        return cls(m, k, n, sms, epilogue, **dict(zip(TUNING_KNOBS, tuning)))

    def tiles_of(self, cta: int) -> list[int]:
        """The tiles CTA ``cta`` computes, in order (the kernel's persistent loop)."""
        return list(range(cta, self.tiles, self.ctas))

    def tile_coords(self, tile):
        """(W tile, batch tile) of tile number ``tile`` (an int, or the kernel's Int32). The
        numbers go in groups of ``cluster``, one group per cluster and step of the persistent
        loop (the grid is a multiple of the cluster, so a CTA's rank is its tile number modulo
        the cluster): rank r computes W tile ``x_multicast * g_w + r // w_multicast`` of batch
        tile ``w_multicast * g_b + r % w_multicast``, so the ranks sharing W hold one W tile
        and those sharing x one batch tile. Consecutive groups go through the batch tiles of
        one W group first, so the CTAs that read the same W run side by side and the second
        read hits L2. Without a cluster: W tile ``tile // batch_tiles``, batch tile ``tile %
        batch_tiles``."""
        rank, group = tile % self.cluster, tile // self.cluster
        batch_groups = self.batch_tiles // self.w_multicast
        return ((group // batch_groups) * self.x_multicast + rank // self.w_multicast,
                (group % batch_groups) * self.w_multicast + rank % self.w_multicast)

    @property
    def l2_read_bytes(self) -> tuple[int, int]:
        """(W, x) bytes the grid reads from L2: every tile reads its n_tile W rows and one x box
        per warpgroup over all of K, and a box multicast into a group leaves L2 once for the
        group (not counted: the block both halves of an odd 16-row block count load). At qkv
        192 rows on cuBLAS's 64 x 256 tile, W is 94% of it with x in fours and 57% with W in
        threes, 467 against 257 MB (bench/gemm_notes.md §46)."""
        w = self.w_reads * self.n * self.k * 2
        x = self.tiles * self.wgs * self.x_box_rows * self.k * 2 // self.x_multicast
        return w, x

    @property
    def w_reads(self) -> int:
        """How many times W leaves L2: once per batch tile, or per group of batch tiles that
        share it (default_applies bounds it)."""
        return self.batch_tiles // self.w_multicast

    def __repr__(self) -> str:
        w_l2, x_l2 = self.l2_read_bytes
        return (f"WideGemmConfig(m={self.m}, k={self.k}, n={self.n}, "
                + (f"epilogue={self.epilogue!r}, " if self.epilogue else "") + f"ctas={self.ctas}, "
                f"tile={self.batch_tile}x{self.n_tile}, tiles={self.batch_tiles}x{self.n_tiles}, "
                f"wave_fill={self.wave_fill(self.m, self.n, self.sms, self.batch_tile, self.n_tile):.2f}, "
                f"k_blocks={self.k_blocks}, stages={self.stages}, cluster={self.cluster}"
                + (f" ({self.cluster_shares})" if self.cluster_shares else "")
                + (", x_trim=1" if self.x_trim else "") + (", w_blocked=1" if self.w_blocked else "")
                + (f", w_block_rows={self.w_block_rows}" if self.w_block_rows != weight_blocks.BLOCK else "")
                + (", static_stages=1" if self.static_stages else "") + (", wg_release=1" if self.wg_release else "")
                + f", L2 reads W {w_l2 / 1e6:.0f} + x {x_l2 / 1e6:.0f} MB)")


def default_applies(m: int, k: int, n: int, epilogue: str | None, sms: int, *, against_split: bool = False,
                    w_blocked: bool = False) -> bool:
    """Whether ``linear`` runs this kernel by default for (M, K, N, epilogue) on ``sms`` SMs:
    plain shapes from WIDE_MIN_M rows whose tiles fill the grid's waves (one or several) and
    are mostly real batch rows, and that re-read at most WIDE_MAX_X_PER_W bytes of x per byte
    of W and W itself at most WIDE_MAX_W_READS times;
    ``against_split``: the stream-K kernel would split K here, so in
    one wave a lower row fill will do; ``w_blocked``: W is in blocks, so only where the tiles
    are a multiple of BLOCKED_N_TILE_MULTIPLE rows.

    Never with silu_mul: there the tiles are a knob (``wide=1``). Measured on two H200 boards
    at K = 7168, N = 36864 (bench/gemm_notes.md §39, 3 interleaved rounds each), they compute
    two 128-row batch tiles whatever M is (228-239 µs at 160-256 rows, where the stream-K kernel
    takes 171-238), are 3-5% slower at 128 rows, and at 248-256 rows on row-major W beat the
    stream-K kernel on blocks by 4.4% on one board and tie on the other, while no faster on
    W's 16-row pieces. A default there would keep gate_up's weight row-major at every captured
    size (gemm.reads_blocks), costing the small sizes the blocks' 2-7%."""
    if epilogue is not None or m < WIDE_MIN_M or n % N_TILE_STEP:
        return False
    batch_tile, n_tile = WideGemmConfig.choose_tile(m, n, sms)
    if m < MAX_BATCH_TILE and batch_tile != MAX_BATCH_TILE:
        return False
    if w_blocked and n_tile % BLOCKED_N_TILE_MULTIPLE:
        return False
    if batch_tile > WIDE_MAX_X_PER_W * n_tile:
        return False
    if WideGemmConfig(m, k, n, sms, batch_tile=batch_tile, n_tile=n_tile).w_reads > WIDE_MAX_W_READS:
        return False
    one_wave = _ceil_div(m, batch_tile) * (n // n_tile) <= sms
    min_row_fill = WIDE_MIN_ROW_FILL_ONE_WAVE if against_split and one_wave else WIDE_MIN_ROW_FILL
    return (WideGemmConfig.wave_fill(m, n, sms, batch_tile, n_tile) >= WIDE_MIN_FILL
            and WideGemmConfig.row_fill(m, batch_tile) >= min_row_fill)


class WideGemmKernel:
    """``y = x @ W^T`` (or with silu_mul ``silu(g) * u`` of its two halves) for one static
    WideGemmConfig."""

    def __init__(self, cfg: WideGemmConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, x_addr: Int64, w_addr: Int64, y_addr: Int64, stream: cuda.CUstream, use_pdl: Boolean):
        cfg = self.cfg
        gmem = cute.AddressSpace.gmem
        # A dynamic batch row count, as in kernels/gemm_stream_k.py (a static size-1 mode would be
        # dropped from the TMA coordinates); rows >= M are zero-filled by TMA, masked at stores.
        x_rows = Int32(cfg.m)
        mX = cute.make_tensor(cute.make_ptr(BFloat16, x_addr, gmem, assumed_align=16),
                              cute.make_layout((x_rows, cfg.k), stride=(cfg.k, 1)))
        mW = cute.make_tensor(cute.make_ptr(BFloat16, w_addr, gmem, assumed_align=16),
                              w_global_layout(cfg.n, cfg.k, cfg.w_blocked, cfg.w_block_rows))
        mY = cute.make_tensor(cute.make_ptr(BFloat16, y_addr, gmem, assumed_align=16),
                              cute.make_layout((x_rows, cfg.n_out), stride=(cfg.n_out, 1)))

        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (1, 1, 1), tiler_mn=(WG_ROWS, cfg.n_tile),
        )
        mma_tiler = (WG_ROWS, cfg.n_tile, BLOCK_K)
        # Per stage: one 64 x 64 x buffer per consumer warpgroup (A), one n_tile x 64 W buffer (B).
        sX_layout = sm90_utils.make_smem_layout_a(k_major, mma_tiler, BFloat16, cfg.stages * cfg.wgs)
        sW_layout = sm90_utils.make_smem_layout_b(k_major, mma_tiler, BFloat16, cfg.stages)
        # In a pair each CTA loads half of the shared operand's box rows and multicasts them to both.
        x_mcast, w_mcast = cfg.x_multicast, cfg.w_multicast
        sX_box_layout = first_rows_layout(sX_layout, cfg.x_box_rows)      # x_trim: fewer rows than the buffer
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(
            tma_load_op(x_mcast), mX, cute.slice_(sX_box_layout, (None, None, 0)), (cfg.x_box_rows, BLOCK_K),
            num_multicast=x_mcast)
        if const_expr(cfg.w_split_boxes):
            # One tensor map for every box of a stage (w_boxes_of_stage), each multicast whole
            # (half a 16-row piece would be one 8-row swizzle atom, which CuTe DSL 4.8.1
            # cannot make a box of).
            tma_w, mW_tma = cpasync.make_tiled_tma_atom(
                tma_load_op(w_mcast), mW, cute.slice_(self.w_boxes_layout(sW_layout), (None, None, 0)),
                (cfg.w_box_rows, BLOCK_K), num_multicast=1)
        else:
            tma_w, mW_tma = cpasync.make_tiled_tma_atom(
                tma_load_op(w_mcast), mW, cute.slice_(sW_layout, (None, None, 0)), (cfg.n_tile, BLOCK_K),
                num_multicast=w_mcast)

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, cfg.stages]
            empty: cute.struct.MemRange[Int64, cfg.stages]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sW_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_x, mX_tma, tma_w, mW_tma, mY, tiled_mma, sX_layout, sW_layout).launch(
            grid=[cfg.ctas, 1, 1], block=[cfg.threads, 1, 1],
            cluster=[cfg.cluster, 1, 1] if const_expr(cfg.cluster > 1) else None, stream=stream, use_pdl=use_pdl)

    def w_boxes_layout(self, sW_layout):
        """The W stage buffers as the blocked W's boxes fill them: (box rows, K, (box, stage))."""
        cfg = self.cfg
        return row_pieces_layout(sW_layout, cfg.w_box_rows, cfg.w_box_step, cfg.w_boxes)

    @cute.kernel
    def kernel(self, tma_x: cute.CopyAtom, mX_tma: cute.Tensor, tma_w: cute.CopyAtom, mW_tma: cute.Tensor,
               mY: cute.Tensor, tiled_mma: cute.TiledMma, sX_layout: cute.ComposedLayout,
               sW_layout: cute.ComposedLayout):
        cfg = self.cfg
        # Trigger early: the grid is a single wave, so dependents cannot displace our CTAs.
        cute.arch.griddepcontrol_launch_dependents()

        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if warp == cfg.producer_warp:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        sX_box = storage.sX.get_tensor(first_rows_layout(sX_layout, cfg.x_box_rows).outer, swizzle=sX_layout.inner)
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        # What the W loads fill: the stage buffers, or their boxes (w_boxes_of_stage).
        sW_load = sW
        if const_expr(cfg.w_split_boxes):
            sW_load = storage.sW.get_tensor(self.w_boxes_layout(sW_layout).outer, swizzle=sW_layout.inner)
        if warp == cfg.producer_warp:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(cfg.stages):
                    cute.arch.mbarrier_init(full + s, 1)
                    # One release per consumer warp (or warpgroup: wg_release) of each CTA of
                    # the cluster (both producers write into this stage).
                    cute.arch.mbarrier_init(empty + s, cfg.releases_per_wg * cfg.wgs * cfg.cluster)
            cute.arch.mbarrier_init_fence()
        barriers_ready(cfg.cluster)
        rank = cta % cfg.cluster

        # Tiles cta, cta + ctas, ...: this CTA's number of them.
        n_local = (cfg.tiles - 1 - cta) // cfg.ctas + 1
        if warp == cfg.producer_warp:
            self.producer(tma_x, mX_tma, tma_w, mW_tma, sX_box, sW_load, full, empty, cta, rank, n_local * cfg.k_blocks)
        else:
            cute.arch.griddepcontrol_wait()      # y is written only after the previous kernel
            self.consumer(tiled_mma, sX, sW, full, empty, mY, cta, n_local, tidx, warp, lane)
        peers_done(cfg.cluster)

    @cute.jit
    def tile_coords(self, cta: Int32, local: Int32):
        """(W tile, batch tile) of this CTA's ``local``-th tile (WideGemmConfig.tile_coords)."""
        return self.cfg.tile_coords(cta + local * self.cfg.ctas)

    def tile_and_k_block(self, i: Int32):
        """(this CTA's tile, k-block) of its ``i``-th producer iteration: with ``static_stages``
        and one tile per CTA, ``i`` itself is the k-block."""
        cfg = self.cfg
        if const_expr(cfg.static_stages and cfg.one_tile_per_cta):
            return 0, i
        local = i // cfg.k_blocks
        return local, i - local * cfg.k_blocks

    @cute.jit
    def x_rows(self, b_blk: Int32, w: cutlass.Constexpr):
        """(first batch row warpgroup ``w`` of batch tile ``b_blk`` owns, first row of its x box).
        The box is moved back to end at row M when it would reach past it (M >= 64): TMA's
        zero fill of rows past the end of x was measured to cost up to 40% at M = 160-200
        (bench/gemm_notes.md §21); the rows the moved box shares with the previous warpgroup's
        are computed twice and stored once."""
        cfg = self.cfg
        owned = b_blk * cfg.batch_tile + w * WG_ROWS
        start = owned
        if const_expr(cfg.m >= WG_ROWS and cfg.m % cfg.batch_tile != 0):
            start = cutlass.min(owned, cfg.m - WG_ROWS)
        return owned, start

    @cute.jit
    def producer(self, tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty, cta, rank, n_iters):
        """``sX``: the x buffers as TMA fills them (their first ``x_box_rows`` rows); ``sW``: the
        W buffers as TMA fills them (whole, or in pieces with W in blocks)."""
        cfg = self.cfg
        evict_first = Int64(EVICT_FIRST)

        # Before the PDL wait: W only, into the fresh stages, each barrier armed with the
        # whole stage so that it completes only once x has landed too.
        n_pre = cutlass.min(n_iters, cfg.stages)
        for i in cutlass.range(n_pre, unroll=1):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + i, cfg.stage_tx_bytes)
            self.load_w(tma_w, mW_tma, sW, cta, rank, i, i, full + i, evict_first)
        cute.arch.griddepcontrol_wait()
        for i in cutlass.range(n_pre, unroll=1):
            self.load_x(tma_x, mX_tma, sX, cta, rank, i, i, full + i)
        if const_expr(cfg.static_stages):
            self.refill_static(tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty, cta, rank, n_iters, evict_first)
        else:
            for i in cutlass.range(n_pre, n_iters, unroll=1):
                s = i % cfg.stages
                self.refill(tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty + s, cta, rank, i, s,
                            ((i // cfg.stages) % 2) ^ 1, evict_first)

    @cute.jit
    def refill_static(self, tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty, cta, rank, n_iters, evict_first):
        """The producer's refills after its first round with ``static_stages``: the same loads in
        the same order as the loop in ``producer``, in rounds of ``stages`` k-blocks with each
        stage a constant (its buffer and barrier addresses folded at compile time), then the one
        tile's k_blocks % stages left over (none with several tiles per CTA: each tile is whole
        rounds, so a round never straddles two)."""
        cfg = self.cfg
        for r in cutlass.range(1, n_iters // cfg.stages, unroll=1):
            for s in cutlass.range_constexpr(cfg.stages):
                self.refill(tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty + s, cta, rank, r * cfg.stages + s,
                            s, (r % 2) ^ 1, evict_first)
        rounds = cfg.k_blocks // cfg.stages
        for s in cutlass.range_constexpr(cfg.k_blocks % cfg.stages if rounds > 0 else 0):
            self.refill(tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty + s, cta, rank,
                        Int32(rounds * cfg.stages + s), s, Int32((rounds % 2) ^ 1), evict_first)

    @cute.jit
    def refill(self, tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty_s, cta, rank, i, s, phase, evict_first):
        """Iteration ``i`` into stage ``s`` once its consumers have freed it (its empty barrier
        ``empty_s`` reaching parity ``phase``): W, then x, both completing on the stage's
        ``full`` barrier."""
        cfg = self.cfg
        cute.arch.mbarrier_wait(empty_s, phase)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full + s, cfg.stage_tx_bytes)
        self.load_w(tma_w, mW_tma, sW, cta, rank, i, s, full + s, evict_first)
        self.load_x(tma_x, mX_tma, sX, cta, rank, i, s, full + s)

    @cute.jit
    def load_w(self, tma_w, mW_tma, sW, cta, rank, i: Int32, stage: Int32, bar, evict_first: Int64):
        """TMA of this CTA's iteration i's W (its tile's n_tile rows, its k-block) into ``sW``
        (the stage buffers, or their (box, stage) pieces): the boxes of ``w_boxes_of_stage``;
        sharing W in a pair, this CTA's (boxes r, r + 2, ..., or with one row-major box its
        half of the box's rows), multicast to both."""
        cfg = self.cfg
        local, kb = self.tile_and_k_block(i)
        n_blk, _ = self.tile_coords(cta, local)
        if const_expr(cfg.w_split_boxes):
            rows = cfg.w_block_rows
            for p in cutlass.range_constexpr(cfg.w_boxes):
                first = cfg.w_box_row(n_blk, p)
                # Blocked W's coordinates are ((row in block, block row), K); row-major W's (row, K).
                origin = (first, 0)
                if const_expr(cfg.w_blocked):
                    origin = ((first % rows, first // rows), 0)
                if p % cfg.w_multicast == self.w_rank(rank):
                    gW = cute.local_tile(cute.domain_offset(origin, mW_tma), (cfg.w_box_rows, BLOCK_K), (0, None))
                    tWsW, tWgW = cpasync.tma_partition(
                        tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                    tma_load(tma_w, tWgW[(None, kb)], tWsW[(None, (p, stage))], bar,
                             cfg.w_multicast, cache_policy=evict_first, mask=self.w_mask(rank))
        else:
            gW = cute.local_tile(cute.domain_offset((n_blk * cfg.n_tile, 0), mW_tma), (cfg.n_tile, BLOCK_K), (0, None))
            tWsW, tWgW = cpasync.tma_partition(
                tma_w, self.w_rank(rank), cute.make_layout(cfg.w_multicast), cute.group_modes(sW, 0, 2),
                cute.group_modes(gW, 0, 2))
            tma_load(tma_w, tWgW[(None, kb)], tWsW[(None, stage)], bar, cfg.w_multicast, cache_policy=evict_first,
                     mask=self.w_mask(rank))

    # A CTA's place in its cluster: rank = x_rank * w_multicast + w_rank (WideGemmConfig), so the
    # CTAs sharing its W are w_multicast consecutive ranks and those sharing its x are
    # w_multicast ranks apart.
    def w_rank(self, rank):
        """Which share of each W box this CTA loads (0 without W sharing)."""
        return rank % self.cfg.w_multicast

    def x_rank(self, rank):
        """Which share of each x box this CTA loads (0 without x sharing)."""
        return rank // self.cfg.w_multicast

    def w_mask(self, rank):
        """The cluster ranks this CTA's W loads land in: its W-sharing group."""
        cfg = self.cfg
        return Int16(Int32((1 << cfg.w_multicast) - 1) << (self.x_rank(rank) * cfg.w_multicast))

    def x_mask(self, rank):
        """The cluster ranks this CTA's x loads land in: its x-sharing group."""
        cfg = self.cfg
        group = sum(1 << (j * cfg.w_multicast) for j in range(cfg.x_multicast))
        return Int16(Int32(group) << self.w_rank(rank))

    @cute.jit
    def load_x(self, tma_x, mX_tma, sX, cta, rank, i: Int32, stage: Int32, bar):
        """TMA of iteration i's x boxes: 64 batch rows per consumer warpgroup (``x_rows``), its
        k-block; sharing x in a pair, this CTA's half of each box's rows, multicast to both."""
        cfg = self.cfg
        local, kb = self.tile_and_k_block(i)
        _, b_blk = self.tile_coords(cta, local)
        x_mcast = cfg.x_multicast
        for w in cutlass.range_constexpr(cfg.wgs):
            _, start = self.x_rows(b_blk, w)
            gX = cute.local_tile(cute.domain_offset((start, 0), mX_tma), (cfg.x_box_rows, BLOCK_K), (0, None))
            tXsX, tXgX = cpasync.tma_partition(
                tma_x, self.x_rank(rank), cute.make_layout(x_mcast), cute.group_modes(sX, 0, 2),
                cute.group_modes(gX, 0, 2))
            tma_load(tma_x, tXgX[(None, kb)], tXsX[(None, stage * cfg.wgs + w)], bar,
                     x_mcast, mask=self.x_mask(rank))

    @cute.jit
    def consumer(self, tiled_mma, sX, sW, full, empty, mY, cta, n_local, tidx, warp, lane):
        cfg = self.cfg
        wg = warp // 4
        wg_tid = tidx % 128
        thr_mma = tiled_mma.get_slice(wg_tid)
        tCsX = thr_mma.partition_A(sX)
        tCsW = thr_mma.partition_B(sW)
        tCrX = tiled_mma.make_fragment_A(tCsX)
        tCrW = tiled_mma.make_fragment_B(tCsW)
        # (batch row, W row) of each accumulator element within the warpgroup's 64 x n_tile.
        tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((WG_ROWS, cfg.n_tile)))
        acc = cute.make_rmem_tensor(tCcAcc.shape, Float32)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        for local in cutlass.range(n_local, unroll=1):
            acc.fill(0.0)
            i0 = local * cfg.k_blocks
            if const_expr(cfg.static_stages):
                self.k_blocks_static(tiled_mma, tCrX, tCrW, acc, full, empty, wg, warp, lane, local)
            else:
                for kb in cutlass.range(cfg.k_blocks, unroll=1):
                    i = i0 + kb
                    s = i % cfg.stages
                    self.k_block(tiled_mma, tCrX, tCrW, acc, wg, s, full + s, (i // cfg.stages) % 2)
                    # The previous k-block's wgmma are done: free its stage.
                    self.release(empty, (i - 1) % cfg.stages, warp, lane, kb > 0)
            warpgroup.wait_group(0)
            self.release(empty, (i0 + cfg.k_blocks - 1) % cfg.stages, warp, lane)
            n_blk, b_blk = self.tile_coords(cta, local)
            # y columns of this tile: its n_tile W rows, or with silu_mul its n_tile / 2 gate rows.
            col0 = n_blk * (cfg.n_tile // 2 if const_expr(cfg.silu) else cfg.n_tile)
            # wgmma's fp32 fragment is ((2 columns, 2 rows, n_tile / 8 column groups)): the
            # accumulator `half` further on is the same row, n_tile / 2 columns further (the up
            # row of a gate row with silu_mul, whose stores cover the first half only).
            half = cute.size(tCcAcc) // 2
            stored = half if const_expr(cfg.silu) else cute.size(tCcAcc)
            for w in cutlass.range_constexpr(cfg.wgs):
                if wg == w:
                    owned, start = self.x_rows(b_blk, w)
                    # The fragment holds two adjacent W rows (y columns) of one batch row in
                    # accumulators 2i and 2i + 1: one 4-byte store per pair.
                    for j in cutlass.range_constexpr(0, stored, 2):
                        row, col = tCcAcc[j]
                        m = start + row
                        if m >= owned and m < cfg.m:
                            lo, hi = acc[j], acc[j + 1]
                            if const_expr(cfg.silu):
                                lo, hi = silu_mul(lo, acc[j + half]), silu_mul(hi, acc[j + 1 + half])
                            store_bf16x2(mY.iterator + (m * cfg.n_out + col0 + col), lo, hi)

    @cute.jit
    def k_blocks_static(self, tiled_mma, tCrX, tCrW, acc, full, empty, wg, warp, lane, local):
        """The k-blocks of the CTA's ``local``-th tile with ``static_stages``: rounds of
        ``stages`` k-blocks, the stage of each a constant, then the k_blocks % stages left over
        (none with several tiles per CTA, so every tile starts at stage 0, in round
        ``local * rounds`` of the CTA's). The same wgmma, waits and releases in the same order as
        the loop in ``consumer``."""
        cfg = self.cfg
        rounds = cfg.k_blocks // cfg.stages
        first_round = local * rounds
        for r in cutlass.range(rounds, unroll=1):
            for s in cutlass.range_constexpr(cfg.stages):
                self.k_block_at_stage(tiled_mma, tCrX, tCrW, acc, full, empty, wg, warp, lane, s,
                                      (first_round + r) % 2, r > 0)
        for s in cutlass.range_constexpr(cfg.k_blocks % cfg.stages):
            self.k_block_at_stage(tiled_mma, tCrX, tCrW, acc, full, empty, wg, warp, lane, s, Int32(rounds % 2),
                                  Boolean(rounds > 0))

    @cute.jit
    def k_block(self, tiled_mma, tCrX, tCrW, acc, wg, s, full_s, phase):
        """Wait on stage ``s``'s barrier ``full_s`` (parity ``phase``) for its k-block, ``s`` a
        run-time index or with ``static_stages`` a constant, and issue that k-block's wgmma;
        returns with them in flight once the previous k-block's are done."""
        cfg = self.cfg
        cute.arch.mbarrier_wait(full_s, phase)
        warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(tCrX, mode=[2])):
            cute.gemm(tiled_mma, acc, tCrX[(None, None, kk, s * cfg.wgs + wg)], tCrW[(None, None, kk, s)], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(1)

    @cute.jit
    def k_block_at_stage(self, tiled_mma, tCrX, tCrW, acc, full, empty, wg, warp, lane, s: cutlass.Constexpr,
                         phase: Int32, not_first_round: Boolean):
        """One k-block from stage ``s`` (a constant) of the round whose barrier parity is
        ``phase``; then the previous k-block's stage is released (none before the first)."""
        cfg = self.cfg
        self.k_block(tiled_mma, tCrX, tCrW, acc, wg, s, full + s, phase)
        if const_expr(s > 0):
            self.release(empty, s - 1, warp, lane)
        else:
            self.release(empty, cfg.stages - 1, warp, lane, not_first_round)

    @cute.jit
    def release(self, empty, s, warp, lane, also=True):
        """Free stage ``s`` (if ``also``) in every CTA that shares it, arriving on its barrier in
        ``empty``: from lane 0 of each consumer warp, or with ``wg_release`` from the first
        ``cluster`` lanes of each warpgroup's first warp, lane r on rank r's barrier. (The
        barrier's address is computed under the condition, as the shipped loop always did.)"""
        cfg = self.cfg
        if const_expr(cfg.wg_release):
            if also and warp % 4 == 0 and lane < cfg.cluster:
                if const_expr(cfg.cluster > 1):
                    cute.arch.mbarrier_arrive(empty + s, lane)
                else:
                    cute.arch.mbarrier_arrive(empty + s)
        else:
            if also and lane == 0:
                release_stage(empty + s, cfg.cluster)


@cute.jit
def silu_mul(gate: Float32, up: Float32) -> Float32:
    """silu(gate) * up in fp32, the same expression as kernels/gemm_stream_k.py's epilogue."""
    return gate / (Float32(1.0) + cute.math.exp(-gate)) * up


def store_bf16x2(dst, lo: Float32, hi: Float32) -> None:
    """Round ``lo`` and ``hi`` to bf16 (nearest even, as ``.to(BFloat16)``) and store them as one
    4-byte word at global ``dst`` (4-byte aligned), ``lo`` at the lower address."""
    llvm.inline_asm(
        None,
        [dst.toint().ir_value(), Float32(lo).ir_value(), Float32(hi).ir_value()],
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $2, $1; st.global.b32 [$0], t; }",
        "l,f,f,~{memory}",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# ------------------------------------------------------------------------------------------------
# Compilation, the compile cache and the torch entry point.
# ------------------------------------------------------------------------------------------------
def compile_args() -> tuple:
    """Placeholder arguments of ``WideGemmKernel.__call__`` for ``cute.compile`` (x, W, y
    addresses, stream, use_pdl): also what bench/gemm_wide_apart.py compiles its variants with."""
    z = Int64(0)
    return (z, z, z, cuda.CUstream(0), Boolean(True))


def _build(*key, options: str = ""):
    kernel = WideGemmKernel(WideGemmConfig.from_key(key))
    if options:
        return cute.compile(kernel, *compile_args(), options=options)
    return cute.compile(kernel, *compile_args())


_CACHE = CompileCache("gemm_wide", _build, (sys.modules[__name__], smem_pipeline, weight_blocks))


def compile_cache() -> CompileCache:
    return _CACHE


def compile_wide(cfg: WideGemmConfig, options: str | None = None):
    """The compiled kernel of ``cfg``: from the compile cache, or afresh with ``options``
    (e.g. ``--keep-ptx --dump-dir D``). Works without a GPU when ``CUTE_DSL_ARCH=sm_90a``."""
    if options:
        return _build(*cfg.key(), options=options)
    return _CACHE.get(cfg.key())


def launch(cfg: WideGemmConfig, x, weight, out, stream, use_pdl: bool) -> None:
    """Run ``cfg`` on checked tensors (kernels/gemm.py's ``linear`` validates and chooses)."""
    fn = _CACHE.on_device(cfg.key(), x.device.index)
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), cuda.CUstream(stream.cuda_stream), bool(use_pdl))
