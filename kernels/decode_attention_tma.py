"""Split-KV GQA decode attention for Hopper (sm_90a) in CuTe DSL: a TMA producer warp keeps the
KV cache streaming while a wgmma warpgroup does the math. bench/decode_attention_notes.md v14-v16.

Why a second attention kernel: the Triton kernel (``decode_attention.py``) can only be entered
through a full edge (v7: its PDL wait made the step slower). Here the loads are decoupled from
the math, and the cached K/V (written by earlier steps, never by this step's predecessors) are
loaded *before* ``griddepcontrol.wait``, so under PDL the cache starts streaming during the qkv
GEMM's tail. Alone it runs about as fast as the Triton kernel at 32-64 rows; inside the step it
is 15-57 us faster from 4 rows up, 10-25 us at 2-3 rows (graphc.ops.attention.TMA_MIN_BATCH).

Work and math
-------------
* Grid (splits, kv_heads, rows); a CTA takes one KV head's query group over ``chunk`` cache
  positions. Splits past the row's length exit at once (they hold no position).
* A *tile* is 64 positions: one TMA box of K and one of V (64 x head_dim, 128-byte swizzle)
  per pipeline stage, completing on the stage's mbarrier. The producer warp fills ``stages``
  stages; the consumer warpgroup frees them.
* The query heads are wgmma's N (8 for G = 8; N is allowed in steps of 8), so no tensor-core
  work is spent on padding rows: S^T = K Q^T (M = the tile's 64 positions, K = head_dim; Q^T
  in shared memory), then O^T = V^T P^T (M = head_dim in 64-row blocks, K = the positions; V^T
  is the loaded tile in its MN-major view). Each query's softmax runs over the tile's
  positions, which are the warpgroup's rows: a max over the thread's two rows, the warp's
  lanes, then the four warps (one shared-memory exchange per tile); running max and sum per
  query, in log2 units. p is split into two bf16 terms p = hi + lo written to P^T in shared
  memory, and O^T accumulates both products: 16 bits of p's mantissa, so only the fp32
  summation order differs from the reference (as the Triton kernel).
* The new token: the CTA whose split holds position L (= seq_lens[t]) first copies k, v from
  qkv into the cache at L (generic stores; after the wait, qkv is the predecessor's output),
  fences them to the async proxy, and only then loads the tile holding L by TMA; the cache
  then includes the token like any other position. Positions past L in that tile are masked
  (S = -inf) and their V rows zeroed in shared memory (P = 0 times a never-written row could be
  NaN).
* A row with more than one live split: each split writes (max, sum, acc) partials; the last to
  arrive (an arrival counter, reset by it) combines them in split order, so the result does not
  depend on arrival order.

PDL (DESIGN §4)
---------------
* ``griddepcontrol.launch_dependents`` right after the wait, in both roles (``TRIGGER =
  "late"``): the kernel after attention launches once qkv is complete, so the scheduler still
  knows everything before attention complete when it launches, and the AttnRes after o_proj
  keeps its PDL edge at block starts. Until session 23 this kernel triggered at entry, so that
  the o_proj decode GEMM could launch during attention; but at 2+ rows o_proj's CTAs hardly fit
  beside attention's, and the later trigger made the step faster: 8 layers at 8 rows
  2602.3-2604.7 us against 2619.4-2624.0, 93 layers 24641.9-24643.2 against 24676.8-24676.9,
  outputs bitwise equal (bench/decode_attention_notes.md, session 23).
* Before the wait: only reads of data no kernel of this step writes before us: ``seq_lens`` and
  ``cache_slots`` (inputs) and the cached K/V at positions < L (``PROLOGUE_INPUTS``).
* After the wait: q, the new k/v (qkv), the append, the workspace, counters and the output. The
  consumer warpgroup waits before it reads q; the producer before the append and the tile
  holding L. A split that holds no position exits without waiting; split 0 of every (row, KV
  head) holds position 0 and always waits, so the grid still completes only after its
  predecessor.
"""

from __future__ import annotations

import math
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

from .compile_cache import CompileCache
from .workspaces import Workspaces, workspace

# PDL traits of this kernel, read by graphc.ops.attention (DESIGN §4).
PROLOGUE_INPUTS = ("kv", "seq_lens", "cache_slots")
WAITS = True
TRIGGER = "late"

TILE = 64                  # cache positions per pipeline stage (wgmma M of S^T, K of O^T)
MMA_M = 64                 # wgmma rows: positions in S^T, head_dim rows in O^T
MAX_GROUP = 32             # query heads per KV head (wgmma N, in steps of 8; 8 per thread at most)
CONSUMER_THREADS = 128     # one warpgroup
PRODUCER_WARP = 4
THREADS = CONSUMER_THREADS + 32
HEAD_DIMS = (128, 256)     # whole multiples of the warpgroup: each thread owns columns tidx + 128 k
SMEM_MAX = 227 * 1024
LOG2E = 1.4426950408889634


def default_stages(rows: int) -> int:
    """Pipeline stages (32 KB each): at 48+ rows one, so that all of 64 rows' 512 CTAs (~41 KB
    of shared memory each) are resident at once; below, three (two CTAs per SM, each loading
    ahead while it computes). Measured in one process, bench/decode_attention_notes.md v16."""
    return 1 if rows >= 48 else 3


def default_chunk(rows: int) -> int:
    """Cache positions per CTA: few rows want more CTAs in flight, many rows long chunks (one
    split per row at context <= chunk: no combine). Measured inside the step, one process
    (bench/decode_attention_notes.md v16): 256 best at 1, 4 and 8 rows, 1024 at 16."""
    return 256 if rows <= 12 else 1024


class AttentionConfig:
    """Static parameters of one compiled kernel."""

    def __init__(self, rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int,
                 chunk: int, stages: int):
        check_shape(heads, kv_heads, head_dim, max_context)
        if chunk % TILE or chunk <= 0:
            raise ValueError(f"chunk={chunk} must be a positive multiple of {TILE}")
        if not 1 <= stages <= 8:
            raise ValueError(f"stages={stages} must be in 1..8")
        self.rows, self.heads, self.kv_heads, self.head_dim = rows, heads, kv_heads, head_dim
        self.max_context, self.chunk, self.stages = max_context, min(chunk, max_context), stages
        self.group = heads // kv_heads
        self.n_q = -(-self.group // 8) * 8       # P V's wgmma N: the query heads, in steps of 8
        self.splits = -(-max_context // self.chunk)
        self.qkv_cols = (heads + 2 * kv_heads) * head_dim
        self.tile_bytes = TILE * head_dim * 2
        smem = 2 * stages * self.tile_bytes + self.n_q * head_dim * 2 + 4 * self.n_q * TILE * 2 + 3072
        if smem > SMEM_MAX:
            raise ValueError(f"stages={stages} at head_dim {head_dim} needs {smem} bytes of shared "
                             f"memory (at most {SMEM_MAX})")
        # softmax in log2 units: p = 2^(s * scale * log2 e - m)
        self.scale_log2 = LOG2E / math.sqrt(head_dim)

    def key(self) -> tuple:
        return (self.rows, self.heads, self.kv_heads, self.head_dim, self.max_context, self.chunk,
                self.stages)

    def __repr__(self) -> str:
        return (f"AttentionConfig(rows={self.rows}, heads={self.heads}/{self.kv_heads}, "
                f"head_dim={self.head_dim}, max_context={self.max_context}, chunk={self.chunk}, "
                f"stages={self.stages})")


def config(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int,
           chunk: int | None = None, stages: int | None = None) -> AttentionConfig:
    """The kernel a call of ``rows`` rows runs: the default chunk and stages unless given."""
    return AttentionConfig(rows, heads, kv_heads, head_dim, max_context, chunk or default_chunk(rows),
                           stages or default_stages(rows))


def compiled_variant(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int) -> tuple[str, tuple]:
    """(kernel module, compile-cache key) of the kernel ``decode_attention`` loads for a call of
    ``rows`` rows with the default tiling (graphc/compile_ahead.py compiles it ahead)."""
    return __name__, config(rows, heads, kv_heads, head_dim, max_context).key()


def check_shape(heads: int, kv_heads: int, head_dim: int, max_context: int) -> None:
    """Raise ValueError naming the rule a shape breaks."""
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    if heads // kv_heads > MAX_GROUP:
        raise ValueError(f"at most {MAX_GROUP} query heads per KV head, got {heads // kv_heads}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} unsupported: one of {HEAD_DIMS}")
    if max_context % TILE or max_context <= 0:
        raise ValueError(f"max_context={max_context} must be a positive multiple of {TILE}")


class DecodeAttentionKernel:
    def __init__(self, cfg: AttentionConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, qkv_addr: Int64, kv_addr: Int64, lens_addr: Int64, slots_addr: Int64,
                 out_addr: Int64, ws_addr: Int64, count_addr: Int64, cache_slots: Int32,
                 stream: cuda.CUstream, use_pdl: Boolean):
        cfg = self.cfg
        gmem = cute.AddressSpace.gmem
        hd = cfg.head_dim
        # The cache [slots, 2, kv_heads, max_context, head_dim] as rows of head_dim: a 64-row
        # block is one tile of one (slot, K/V, head), since max_context is a multiple of 64.
        cache_rows = cache_slots * (2 * cfg.kv_heads * cfg.max_context)
        mKV = cute.make_tensor(cute.make_ptr(BFloat16, kv_addr, gmem, assumed_align=16),
                               cute.make_layout((cache_rows, hd), stride=(hd, 1)))
        rows = Int32(cfg.rows)
        mQKV = cute.make_tensor(cute.make_ptr(BFloat16, qkv_addr, gmem, assumed_align=16),
                                cute.make_layout((rows, cfg.qkv_cols), stride=(cfg.qkv_cols, 1)))
        mOut = cute.make_tensor(cute.make_ptr(BFloat16, out_addr, gmem, assumed_align=16),
                                cute.make_layout((rows, cfg.heads * hd), stride=(cfg.heads * hd, 1)))
        mLens = cute.make_tensor(cute.make_ptr(Int32, lens_addr, gmem, assumed_align=4),
                                 cute.make_layout(rows))
        mSlots = cute.make_tensor(cute.make_ptr(Int32, slots_addr, gmem, assumed_align=4),
                                  cute.make_layout(rows))
        # Workspace: m, l [rows * heads * splits] then acc [rows * heads * splits * head_dim].
        partials = cfg.rows * cfg.heads * cfg.splits
        mWs = cute.make_tensor(cute.make_ptr(Float32, ws_addr, gmem, assumed_align=16),
                               cute.make_layout(partials * (2 + hd)))
        mCount = cute.make_tensor(cute.make_ptr(Int32, count_addr, gmem, assumed_align=4),
                                  cute.make_layout(cfg.rows * cfg.kv_heads))

        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        # S^T = K Q^T: A = the K tile (64 positions as wgmma's M, head_dim contiguous), B = Q^T
        # (the query heads as N, head_dim contiguous); both from shared memory.
        qk_tiler = (TILE, cfg.n_q, hd)
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (1, 1, 1), tiler_mn=(TILE, cfg.n_q))
        # O^T = V^T P^T: A = V in its MN-major view (head_dim rows, contiguous), B = P^T (the
        # query heads, N = 8 for G = 8, positions contiguous) from shared memory.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.K,
            Float32, (1, 1, 1), tiler_mn=(MMA_M, cfg.n_q))
        sQ_layout = sm90_utils.make_smem_layout_b(k_major, qk_tiler, BFloat16, 1)
        # K and V tiles share one layout (positions x head_dim, K-major: S^T's A operand).
        sKV_layout = sm90_utils.make_smem_layout_a(k_major, qk_tiler, BFloat16, cfg.stages)
        # P^T buffers: (tile parity, hi / lo) -> 4 of (n_q x 64 positions).
        sP_layout = sm90_utils.make_smem_layout_b(k_major, (MMA_M, cfg.n_q, TILE), BFloat16, 4)
        tma_kv, mKV_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV, cute.slice_(sKV_layout, (None, None, 0)), (TILE, hd))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sKV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            # Per tile parity and consumer warp: each query's max over the warp's positions.
            warp_max: cute.struct.MemRange[Float32, 2 * 4 * cfg.n_q]
            warp_sum: cute.struct.MemRange[Float32, 4 * cfg.n_q]     # the final sums, per warp
            full: cute.struct.MemRange[Int64, cfg.stages]
            empty: cute.struct.MemRange[Int64, cfg.stages]
            flag: cute.struct.MemRange[Int32, 4]

        self.shared_storage = SharedStorage
        self.kernel(tma_kv, mKV_tma, mKV, mQKV, mOut, mLens, mSlots, mWs, mCount, tiled_mma_qk,
                    tiled_mma_pv, sQ_layout, sKV_layout, sP_layout).launch(
            grid=[cfg.splits, cfg.kv_heads, cfg.rows], block=[THREADS, 1, 1], stream=stream,
            use_pdl=use_pdl)

    # --------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor, mKV: cute.Tensor, mQKV: cute.Tensor, mOut: cute.Tensor,
               mLens: cute.Tensor, mSlots: cute.Tensor, mWs: cute.Tensor, mCount: cute.Tensor,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout):
        cfg = self.cfg
        split, kvh, t = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        # seq_lens is an input (complete before the step), so it may be read before the wait.
        L = mLens[t]
        start = split * cfg.chunk
        # Positions 0..=L (L is the new token's); the splits holding one of them are live.
        live = (L + cfg.chunk) // cfg.chunk
        if split < live:
            end = cutlass.min(start + cfg.chunk, L + 1)
            n_tiles = (end - start + TILE - 1) // TILE
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            full = storage.full.data_ptr()
            empty = storage.empty.data_ptr()
            sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
            sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
            sMax = cute.make_tensor(storage.warp_max.data_ptr(), cute.make_layout((cfg.n_q, 4, 2)))
            sSum = cute.make_tensor(storage.warp_sum.data_ptr(), cute.make_layout((cfg.n_q, 4)))
            if warp == PRODUCER_WARP:
                cpasync.prefetch_descriptor(tma_kv)
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(cfg.stages):
                        cute.arch.mbarrier_init(full + s, 1)
                        cute.arch.mbarrier_init(empty + s, 4)     # one release per consumer warp
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            holds_new = split == live - 1
            if warp == PRODUCER_WARP:
                self.producer(tma_kv, mKV_tma, mKV, mQKV, mSlots, sK, sV, full, empty, t, kvh, L, start,
                              n_tiles, holds_new)
            elif warp < PRODUCER_WARP:
                self.consumer(tiled_mma_qk, tiled_mma_pv, mQKV, mOut, mWs, mCount, sQ, sK, sV, sP, sMax,
                              sSum, full, empty, storage.flag.data_ptr(), t, kvh, split, live, start, end, n_tiles,
                              tidx)

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def producer(self, tma_kv, mKV_tma, mKV, mQKV, mSlots, sK, sV, full, empty, t, kvh, L, start, n_tiles,
                 holds_new):
        cfg = self.cfg
        hd = cfg.head_dim
        lane = cute.arch.lane_idx()
        gKV = cute.local_tile(mKV_tma, (TILE, hd), (None, None))
        tKsK, tKgKV = cpasync.tma_partition(
            tma_kv, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gKV, 0, 2))
        tVsV, _ = cpasync.tma_partition(
            tma_kv, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gKV, 0, 2))
        slot = mSlots[t]
        # Row blocks of this (slot, head)'s K and V at the split's first position.
        k_block = ((slot * 2 * cfg.kv_heads + kvh) * cfg.max_context + start) // TILE
        v_block = k_block + cfg.kv_heads * cfg.max_context // TILE

        # Before the wait: the cached tiles, except the one holding the new token.
        n_pre = cutlass.min(n_tiles, cfg.stages)
        if holds_new and n_pre == n_tiles:
            n_pre = n_tiles - 1
        for i in cutlass.range(n_pre, unroll=1):
            self.load_tile(tma_kv, tKgKV, tKsK, tVsV, k_block + i, v_block + i, i, full + i)

        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if holds_new:
            # Append the new k, v at position L, then order those generic-proxy stores before
            # the TMA (async proxy) load of the tile that holds them.
            # Element offsets in 64 bits: a cache of 513 slots at Kimi's shape has 2^31 elements.
            row_k = Int64((slot * 2 * cfg.kv_heads + kvh) * cfg.max_context + L)
            row_v = row_k + cfg.kv_heads * cfg.max_context
            k_col = (cfg.heads + kvh) * hd
            v_col = (cfg.heads + cfg.kv_heads + kvh) * hd
            for c in cutlass.range_constexpr(0, hd, 32):
                self.cache_store(mKV, row_k * hd + c + lane, self.qkv_load(mQKV, t, k_col + c + lane))
                self.cache_store(mKV, row_v * hd + c + lane, self.qkv_load(mQKV, t, v_col + c + lane))
            cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()

        for i in cutlass.range(n_pre, n_tiles, unroll=1):
            s = i % cfg.stages
            if i >= cfg.stages:
                cute.arch.mbarrier_wait(empty + s, ((i // cfg.stages) % 2) ^ 1)
            self.load_tile(tma_kv, tKgKV, tKsK, tVsV, k_block + i, v_block + i, s, full + s)

    @cute.jit
    def cache_store(self, mKV, offset: Int64, value: BFloat16):
        """One cache element at a 64-bit element offset."""
        cute.make_tensor(mKV.iterator + offset, cute.make_layout(1))[0] = value

    @cute.jit
    def load_tile(self, tma_kv, tKgKV, tKsK, tVsV, k_block, v_block, stage, bar):
        """TMA of one tile's K and V (64 positions each) into ``stage``, completing on ``bar``."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * self.cfg.tile_bytes)
        cute.copy(tma_kv, tKgKV[(None, k_block, 0)], tKsK[(None, stage)], tma_bar_ptr=bar)
        cute.copy(tma_kv, tKgKV[(None, v_block, 0)], tVsV[(None, stage)], tma_bar_ptr=bar)

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(self, tiled_mma_qk, tiled_mma_pv, mQKV, mOut, mWs, mCount, sQ, sK, sV, sP, sMax, sSum,
                 full, empty, flag, t, kvh, split, live, start, end, n_tiles, tidx):
        """Per tile: S^T = K Q^T, the softmax over the tile's positions (the warpgroup's rows,
        one shared-memory exchange of per-warp maxima), P^T = hi + lo to shared memory, and
        O^T = alpha O^T + V^T P^T. Thread layout of both accumulators (wgmma's fragment): row
        16 w + lane / 4 + 8 i, column 2 (lane % 4) + e + 8 b for element e + 2 i + 4 b (+ 4 nb
        per further 64-row block of O^T), so a thread's queries are the same in S^T and O^T:
        u = e + 2 b indexes them (``qpt`` per thread)."""
        cfg = self.cfg
        hd = cfg.head_dim
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        qpt = cfg.n_q // 4                    # queries per thread: 2 per block of 8
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        tSrK = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sK))
        tSrQ = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sQ))
        # V^T as O^T's A operand: (head_dim, positions) over the same bytes as the loaded tile.
        sVt = cute.composition(sV, cute.make_ordered_layout((hd, TILE, cfg.stages), order=(1, 0, 2)))
        tOrVt = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(sVt))
        tOrP = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sP))
        tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE, cfg.n_q)))   # (position, query)
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((hd, cfg.n_q)))     # (dim, query)
        acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
        acc_o = cute.make_rmem_tensor(tOcO.shape, Float32)
        m_run = cute.make_rmem_tensor(qpt, Float32)        # running max per query (log2 units)
        l_run = cute.make_rmem_tensor(qpt, Float32)        # this thread's share of the sum
        m_new = cute.make_rmem_tensor(qpt, Float32)
        alpha = cute.make_rmem_tensor(qpt, Float32)
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)

        # Q^T: the group's query heads as rows 0..G-1 of the B operand (zeros up to n_q). q
        # comes from the predecessor: after the wait, through L2.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        q_col = kvh * cfg.group * hd
        for r in cutlass.range_constexpr(cfg.n_q):
            for c in cutlass.range_constexpr(0, hd, CONSUMER_THREADS):
                if const_expr(r < cfg.group):
                    sQ[(r, c + tidx, 0)] = self.qkv_load(mQKV, t, q_col + r * hd + c + tidx)
                else:
                    sQ[(r, c + tidx, 0)] = BFloat16(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)

        m_run.fill(-Float32.inf)
        l_run.fill(0.0)
        acc_o.fill(0.0)
        for i in cutlass.range(n_tiles, unroll=1):
            s = i % cfg.stages
            par = i % 2
            cute.arch.mbarrier_wait(full + s, (i // cfg.stages) % 2)
            valid = end - (start + i * TILE)       # positions of this tile that exist (>= 64: all)
            if valid < TILE:
                # Zero V's rows past the last position (P is 0 there, but 0 x NaN is NaN);
                # ordered before the P V wgmma by the fence and barrier below.
                for r in cutlass.range(valid, TILE, unroll=1):
                    for c in cutlass.range_constexpr(0, hd, CONSUMER_THREADS):
                        sV[(r, c + tidx, s)] = BFloat16(0.0)
            acc_s.fill(0.0)
            warpgroup.fence()
            for kk in cutlass.range_constexpr(cute.size(tSrK, mode=[2])):
                cute.gemm(tiled_mma_qk, acc_s, tSrK[(None, None, kk, s)], tSrQ[(None, None, kk, 0)], acc_s)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # Scores in log2 units, masked past the last position; each query's max over this
            # thread's two positions, then over the warp's 16 (lanes 4 apart share queries).
            for j in cutlass.range_constexpr(cute.size(acc_s)):
                x = acc_s[j] * cfg.scale_log2
                if tScS[j][0] >= valid:
                    x = -Float32.inf
                acc_s[j] = x
            for u in cutlass.range_constexpr(qpt):
                j0 = (u % 2) + 4 * (u // 2)
                top = cute.arch.fmax(acc_s[j0], acc_s[j0 + 2])
                for offset in (4, 8, 16):
                    top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset))
                if lane < 4:
                    sMax[(2 * lane + (u % 2) + 8 * (u // 2), warp, par)] = top
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
            for u in cutlass.range_constexpr(qpt):
                q = 2 * (lane % 4) + (u % 2) + 8 * (u // 2)
                top = cute.arch.fmax(cute.arch.fmax(sMax[(q, 0, par)], sMax[(q, 1, par)]),
                                     cute.arch.fmax(sMax[(q, 2, par)], sMax[(q, 3, par)]))
                m_new[u] = cute.arch.fmax(m_run[u], top)
                alpha[u] = exp2(m_run[u] - m_new[u])
                m_run[u] = m_new[u]
                l_run[u] = l_run[u] * alpha[u]
            for j in cutlass.range_constexpr(cute.size(acc_s)):
                u = (j % 2) + 2 * (j // 4)
                p = exp2(acc_s[j] - m_new[u])
                l_run[u] = l_run[u] + p
                pos, q = tScS[j]
                hi = p.to(BFloat16)
                sP[(q, pos, 2 * par)] = hi
                # p - hi is exact in fp32; its bf16 rounding keeps 16 bits of p in all
                sP[(q, pos, 2 * par + 1)] = (p - hi.to(Float32)).to(BFloat16)
            for j in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[j] = acc_o[j] * alpha[(j % 2) + 2 * ((j // 4) % (cfg.n_q // 8))]
            # P^T (and V's zeroed rows) are generic-proxy writes: make them visible to the
            # wgmma (async proxy) of every warp. P^T and the maxima alternate by tile parity,
            # so a fast warp's next writes never meet a slow warp's reads.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
            warpgroup.fence()
            for b in cutlass.range_constexpr(2):      # p = hi + lo: two products
                for kk in cutlass.range_constexpr(cute.size(tOrVt, mode=[2])):
                    cute.gemm(tiled_mma_pv, acc_o, tOrVt[(None, None, kk, s)], tOrP[(None, None, kk, 2 * par + b)],
                              acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + s)

        # Each query's sum: over the warp's lanes, then over the four warps.
        for u in cutlass.range_constexpr(qpt):
            x = l_run[u]
            for offset in (4, 8, 16):
                x = x + cute.arch.shuffle_sync_bfly(x, offset)
            if lane < 4:
                sSum[(2 * lane + (u % 2) + 8 * (u // 2), warp)] = x
        cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
        for u in cutlass.range_constexpr(qpt):
            q = 2 * (lane % 4) + (u % 2) + 8 * (u // 2)
            l_run[u] = (sSum[(q, 0)] + sSum[(q, 1)]) + (sSum[(q, 2)] + sSum[(q, 3)])
        if live == 1:
            self.store_out(mOut, acc_o, tOcO, t, kvh, l_run)
        else:
            self.combine(mOut, mWs, mCount, flag, acc_o, tOcO, t, kvh, split, live, m_run, l_run, tidx, lane)

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def store_out(self, mOut, acc_o, tOcO, t, kvh, l_q):
        """out = O / l in bf16 for the real queries (O^T's element j is (dim, query) tOcO[j])."""
        cfg = self.cfg
        for j in cutlass.range_constexpr(cute.size(acc_o)):
            d, q = tOcO[j]
            if q < cfg.group:
                u = (j % 2) + 2 * ((j // 4) % (cfg.n_q // 8))
                mOut[t, (kvh * cfg.group + q) * cfg.head_dim + d] = (acc_o[j] / l_q[u]).to(BFloat16)

    @cute.jit
    def combine(self, mOut, mWs, mCount, flag, acc_o, tOcO, t, kvh, split, live, m_q, l_q, tidx, lane):
        """Publish this split's partial; the last live split to arrive sums them in split order
        (so the bits do not depend on which split came last) and writes the output."""
        cfg = self.cfg
        hd = cfg.head_dim
        qpt = cfg.n_q // 4
        partials = cfg.rows * cfg.heads * cfg.splits
        head0 = t * cfg.heads + kvh * cfg.group
        for j in cutlass.range_constexpr(cute.size(acc_o)):
            d, q = tOcO[j]
            if q < cfg.group:
                mWs[2 * partials + ((head0 + q) * cfg.splits + split) * hd + d] = acc_o[j]
        if tidx < 4:      # warp 0's lanes 0..3 hold every query's max and sum once
            for u in cutlass.range_constexpr(qpt):
                q = 2 * lane + (u % 2) + 8 * (u // 2)
                if q < cfg.group:
                    mWs[(head0 + q) * cfg.splits + split] = m_q[u]
                    mWs[partials + (head0 + q) * cfg.splits + split] = l_q[u]
        # Release every thread's stores with one fence + atomic after the barrier (CUTLASS's
        # semaphore pattern); the fence after the atomic makes it an acquire for the last one.
        cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            flag[0] = cute.arch.atomic_add((mCount.iterator + (t * cfg.kv_heads + kvh)).llvm_ptr,
                                           Int32(1), sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
        if flag[0] == live - 1:
            if tidx == 0:
                mCount[t * cfg.kv_heads + kvh] = Int32(0)     # for the next launch
            # Padding queries (>= group) read the last real query's partials (in bounds) and
            # store nothing, so every thread runs the same code.
            base = cute.make_rmem_tensor(qpt, Int32)
            top = cute.make_rmem_tensor(qpt, Float32)
            total = cute.make_rmem_tensor(qpt, Float32)
            w = cute.make_rmem_tensor(qpt, Float32)
            for u in cutlass.range_constexpr(qpt):
                q = 2 * (lane % 4) + (u % 2) + 8 * (u // 2)
                base[u] = (head0 + cutlass.min(q, cfg.group - 1)) * cfg.splits
            top.fill(-Float32.inf)
            total.fill(0.0)
            for k in cutlass.range(live, unroll=1):
                for u in cutlass.range_constexpr(qpt):
                    top[u] = cute.arch.fmax(top[u], self.ws_load(mWs, base[u] + k))
            acc_o.fill(0.0)
            for k in cutlass.range(live, unroll=1):
                parts = [self.ws_load(mWs, 2 * partials + (base[(j % 2) + 2 * ((j // 4) % (cfg.n_q // 8))] + k) * hd
                                      + tOcO[j][0]) for j in range(cute.size(acc_o))]
                for u in cutlass.range_constexpr(qpt):
                    w[u] = exp2(self.ws_load(mWs, base[u] + k) - top[u])
                    total[u] = total[u] + w[u] * self.ws_load(mWs, partials + base[u] + k)
                for j in cutlass.range_constexpr(cute.size(acc_o)):
                    acc_o[j] = acc_o[j] + w[(j % 2) + 2 * ((j // 4) % (cfg.n_q // 8))] * parts[j]
            self.store_out(mOut, acc_o, tOcO, t, kvh, total)

    @cute.jit
    def qkv_load(self, mQKV, t, col) -> BFloat16:
        """One element of qkv (the predecessor's output) through L2 (ld.cg): under PDL an L1 line
        of it could be stale (the scheduler's bypasses_l1 rule)."""
        ptr = cute.recast_ptr(mQKV.iterator + (t * self.cfg.qkv_cols + col), dtype=Int16)
        bits = cute.arch.load(ptr.llvm_ptr, Int16, cop="cg")     # (no bf16 ld.cg in the DSL)
        return BFloat16(llvm.bitcast(BFloat16.mlir_type, bits.ir_value()))

    @cute.jit
    def ws_load(self, mWs, index) -> Float32:
        """A workspace float written by another CTA: through L2 (ld.cg), never a stale L1 line."""
        return cute.arch.load((mWs.iterator + index).llvm_ptr, Float32, cop="cg")


def exp2(x: Float32) -> Float32:
    """2^x (``ex2.approx.ftz``; 2^-inf = 0). Without cute.arch.exp2's side-effect flag, so the
    compiler may schedule it like any arithmetic."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value()], "ex2.approx.ftz.f32 $0, $1;",
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


# ------------------------------------------------------------------------------------------------
# Compilation, workspace and the torch entry point.
# ------------------------------------------------------------------------------------------------
def _compile_args():
    z = Int64(0)
    return (z, z, z, z, z, z, z, Int32(1), cuda.CUstream(0), Boolean(True))


def _build(*key, options: str = ""):
    kernel = DecodeAttentionKernel(AttentionConfig(*key))
    if options:
        return cute.compile(kernel, *_compile_args(), options=options)
    return cute.compile(kernel, *_compile_args())


_CACHE = CompileCache("attention", _build, sys.modules[__name__])


def compile_cache() -> CompileCache:
    return _CACHE


def compile_attention(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int, *,
                      chunk: int | None = None, stages: int | None = None, options: str | None = None):
    """The compiled kernel for one static configuration (from the compile cache unless
    ``options`` are given, e.g. ``--keep-ptx --dump-dir D``). Works without a GPU when
    ``CUTE_DSL_ARCH=sm_90a``."""
    cfg = config(rows, heads, kv_heads, head_dim, max_context, chunk, stages)
    if options:
        return _build(*cfg.key(), options=options)
    return _CACHE.get(cfg.key())


def _workspace(cfg: AttentionConfig, device, workspaces: Workspaces | None = None):
    """(partials, counters) for one configuration on one device, from ``workspaces`` (default:
    the process's shared ones; kernels/workspaces.py), allocated at the first call. Counters
    start at zero and every launch leaves them at zero (the combining split resets its
    counter); two launches that share them are ordered because both touch them only after
    their PDL wait, when they run on one stream."""
    import torch

    def make():
        partials = cfg.rows * cfg.heads * cfg.splits * (2 + cfg.head_dim)
        return (torch.empty(partials, dtype=torch.float32, device=device),
                torch.zeros(cfg.rows * cfg.kv_heads, dtype=torch.int32, device=device))

    return workspace(workspaces, ("attention_tma", device.index, cfg.key()), make,
                     lambda: f"decode attention: {cfg}")


def validate(qkv, kv, seq_lens, cache_slots, out, heads: int, kv_heads: int, head_dim: int) -> None:
    """Raise ValueError naming what a call gets wrong (shapes, dtypes, layout, device)."""
    import torch

    check_shape(heads, kv_heads, head_dim, kv.shape[3] if kv.dim() == 5 else TILE)
    T = qkv.shape[0]
    want = {"qkv": (qkv, (T, (heads + 2 * kv_heads) * head_dim), torch.bfloat16),
            "out": (out, (T, heads * head_dim), torch.bfloat16),
            "seq_lens": (seq_lens, (T,), torch.int32),
            "cache_slots": (cache_slots, (T,), torch.int32)}
    if kv.dim() != 5 or tuple(kv.shape[1:3]) != (2, kv_heads) or kv.shape[4] != head_dim:
        raise ValueError(f"kv must be [slots, 2, {kv_heads}, max_context, {head_dim}], got {list(kv.shape)}")
    want["kv"] = (kv, tuple(kv.shape), torch.bfloat16)
    for name, (x, shape, dtype) in want.items():
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} {list(shape)}, got {x.dtype} {list(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the TMA kernel reads graphc's head-major "
                             "cache; the Triton kernel takes any strides)")
    for name, (x, _, _) in want.items():
        if x.device.type != "cuda" or x.device != qkv.device:
            raise ValueError(f"{name} is on {x.device}: every tensor must be on one CUDA device")
    if kv.data_ptr() % 16 or qkv.data_ptr() % 16 or out.data_ptr() % 16:
        raise ValueError("qkv, kv and out must be 16-byte aligned (TMA and vector stores need it)")


def decode_attention(qkv, kv, seq_lens, cache_slots, out, *, heads: int, kv_heads: int, head_dim: int,
                     chunk: int | None = None, stages: int | None = None, stream=None,
                     use_pdl: bool = True, workspaces: Workspaces | None = None) -> None:
    """Append each row's K/V at ``seq_lens[t]`` of slot ``cache_slots[t]`` and attend over
    positions ``0..=seq_lens[t]`` (graphc.ops.attention's contract, contiguous tensors only).
    Launched with the PDL attribute when ``use_pdl``; capturable once called outside capture
    for the shape (that call allocates the workspace, from ``workspaces``: default the
    process's shared ones, kernels/workspaces.py)."""
    import torch

    validate(qkv, kv, seq_lens, cache_slots, out, heads, kv_heads, head_dim)
    cfg = config(qkv.shape[0], heads, kv_heads, head_dim, kv.shape[3], chunk, stages)
    fn = _CACHE.on_device(cfg.key(), qkv.device.index)
    partials, counters = _workspace(cfg, qkv.device, workspaces)
    if stream is None:
        stream = torch.cuda.current_stream(qkv.device)
    fn(qkv.data_ptr(), kv.data_ptr(), seq_lens.data_ptr(), cache_slots.data_ptr(), out.data_ptr(),
       partials.data_ptr(), counters.data_ptr(), int(kv.shape[0]), cuda.CUstream(stream.cuda_stream),
       bool(use_pdl))
