"""Few-row GQA decode attention for Hopper (sm_90a) in CuTe DSL: the cached K/V of a row wait in
registers for the PDL release, and the splits combine through distributed shared memory.
bench/decode_attention_notes.md, session 23.

Why a third attention kernel: at one row the Triton kernel's chain after the qkv GEMM (launch,
q, two 64-key blocks, publishing 8 partials to global memory, the last split's combine) took
8-9 us per layer against a 1 us byte floor. Here a CTA needs ~10 KB of shared memory and holds
its 128 positions of K and V in registers (64 per thread), loaded before the PDL wait: the CTAs
land on the SMs the qkv GEMM's CTAs leave during its tail (1-4 us before it completes;
bench/attention_cluster_timeline.py), so the cache is in registers by the release. After it only
q (from L2), the math on registers, one exchange inside the cluster and the store remain: the
last CTA ends ~2.7 us after the release (bench/decode_attention_notes.md, session 23).

Work
----
* One cluster of ``SPLITS`` = 8 CTAs per (row, KV head); grid (8, kv_heads, rows). CTA ``rank``
  takes positions [(8 i + rank) * 128, +128) in pass i = 0, 1, ... while they hold a position
  <= L (= seq_lens[t], the new token's). At context <= 1024 that is one pass, loaded before the
  PDL wait; longer rows take further passes after it (online softmax across passes).
* 8 warps. S^T = K Q^T with ``mma.sync.m16n8k16`` (bf16, fp32 accumulate): warp w takes
  positions 16 w .. 16 w + 15 of the pass (M), the query heads are N (8, zero-padded past the
  group), head_dim is K. The dot product does not care in which order head_dim is summed, so
  each thread loads its K rows and q as whole 16-byte runs and both operands use that same
  permutation of K.
* The softmax is per query head over the CTA's positions: a max over the thread's two
  positions, the warp (3 shuffles) and the 8 warps (shared memory), running max and sum per
  head in log2 units, like the other two kernels. p is split into bf16 hi + lo (16 bits of
  mantissa) and written as P^T to shared memory.
* O^T = V^T P^T: warp w takes head dims 16 w .. 16 w + 15 (M) over all 128 positions (K), the
  query heads as N. Its V^T operand is the thread's V words (two adjacent dims of one position),
  paired across positions with ``prmt``; the two dims of a word are the fragment's rows g and
  g + 8, a permutation of M undone when the result is stored.
* The new token: loaded from qkv after the wait into the registers of the position L, and
  appended to the cache by warp 0 of the CTA holding it, whose load goes out beside q's (generic
  stores; no load in this launch reads it back from the cache).

Combine (distributed shared memory)
-----------------------------------
Warp w of every live CTA holds its split's O for dims 16 w .. 16 w + 15 of all query heads: it
sends them (and the split's max and sum per head) with ``st.async`` into CTA w's shared memory,
completing on CTA w's mbarrier (armed for the live splits' bytes). CTA w then folds the live
splits in split order, so the bits do not depend on arrival order, and stores its 16 dims of
every head. Dead CTAs (no position <= L) send nothing but still combine their dims. A cluster
barrier after the barrier initialisation (before the first push) and another before exit keep
every CTA's shared memory alive while peers write to it; the second one's arrive is relaxed,
since each CTA's mbarrier already proves that everything sent to it landed (a release arrive
waited 1.6 us for the pushes to land while o_proj's weights streamed).

PDL (DESIGN §4)
---------------
* Before ``griddepcontrol.wait``: only the lengths, the slots (inputs) and the cached K/V at
  positions < L (written by earlier steps; ``PROLOGUE_INPUTS``), read with ``ld.global.cg``.
* ``launch_dependents`` right after the wait (``TRIGGER = "late"``): the kernel after attention
  may launch only once qkv is complete, so the scheduler still knows everything before
  attention complete when that kernel launches, and no AttnRes loses its PDL edge
  (decode_attention_notes.md, session 17: an early trigger here cost those edges). Triggering
  later (``trigger_at``: once the partials are received, or at exit) shortens attention by
  ~1.2 us but delays o_proj's weight prologue by more: the step is 16-22 us slower (session 23).
* After the wait: q and the new k, v (``ld.global.cg``), the append, the exchange, the output.
"""

from __future__ import annotations

import math
import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

from .compile_cache import CompileCache

# PDL traits of this kernel, read by graphc.ops.attention (DESIGN §4).
PROLOGUE_INPUTS = ("kv", "seq_lens", "cache_slots")
WAITS = True
TRIGGER = "late"

SPLITS = 8               # CTAs per cluster: the splits of one (row, KV head)
CHUNK = 128              # positions per CTA per pass
WARPS = 8
THREADS = 32 * WARPS
HEAD_DIM = 128           # = WARPS x 16 dims in O^T = V^T P^T
MMA_N = 8                # query heads per mma (the group, zero-padded)
P_STRIDE = CHUNK + 8     # bf16 per P^T row in shared memory: +8 spreads a warp's B loads over all banks
RECV_O = SPLITS * 128    # floats a CTA receives: 8 splits x (16 dims x 8 heads)
RECV_ML = SPLITS * 32    # 8 splits x 4 lanes x (2 maxima, 2 sums)
SEND_BYTES = 4 * (128 + 16)   # what one split sends one CTA
LOG2E = 1.4426950408889634
# The moments a timeline build stamps per CTA (then its SM id). "received" follows the mbarrier
# wait and "math done" the CTA barrier after the math, so they are what they say; "q loaded"
# passes q to the timer's asm as an operand the asm does not use, which ptxas need not wait
# for: read it as "q's loads issued".
STAMPS = ("entry", "released", "q loaded", "math done", "peers ready", "pushes issued", "arrived",
          "received", "end")
# Where the kernel triggers its dependents (``trigger_at``): right after its wait, once the
# cluster's partials are received, or at exit (no explicit trigger). All count as "late".
TRIGGER_POINTS = ("wait", "received", "exit")


def check_shape(heads: int, kv_heads: int, head_dim: int, max_context: int) -> None:
    """Raise ValueError naming the rule a shape breaks."""
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    if heads // kv_heads > MMA_N:
        raise ValueError(f"at most {MMA_N} query heads per KV head, got {heads // kv_heads}")
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} unsupported: {HEAD_DIM} only")
    if max_context % 64 or max_context <= 0:
        raise ValueError(f"max_context={max_context} must be a positive multiple of 64")


class ClusterAttentionConfig:
    """Static parameters of one compiled kernel."""

    def __init__(self, rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int,
                 timeline: bool = False, trigger_at: int = 0):
        check_shape(heads, kv_heads, head_dim, max_context)
        if rows <= 0:
            raise ValueError(f"rows={rows} must be positive")
        self.rows, self.heads, self.kv_heads, self.head_dim = rows, heads, kv_heads, head_dim
        self.max_context = max_context
        self.group = heads // kv_heads
        self.qkv_cols = (heads + 2 * kv_heads) * head_dim
        self.scale_log2 = LOG2E / math.sqrt(head_dim)   # p = 2^(s * scale * log2 e - m)
        # bench/attention_cluster_timeline.py: thread 0 of every CTA stamps %globaltimer at
        # the moments of STAMPS (the shipped kernel compiles them out).
        self.timeline = bool(timeline)
        if trigger_at not in range(len(TRIGGER_POINTS)):
            raise ValueError(f"trigger_at={trigger_at} unsupported: 0..{len(TRIGGER_POINTS) - 1} ({', '.join(TRIGGER_POINTS)})")
        self.trigger_at = int(trigger_at)

    def key(self) -> tuple:
        return (self.rows, self.heads, self.kv_heads, self.head_dim, self.max_context, self.timeline,
                self.trigger_at)

    def __repr__(self) -> str:
        return (f"ClusterAttentionConfig(rows={self.rows}, heads={self.heads}/{self.kv_heads}, "
                f"head_dim={self.head_dim}, max_context={self.max_context}"
                + (", timeline" if self.timeline else "") + ")")


def compiled_variant(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int) -> tuple[str, tuple]:
    """(kernel module, compile-cache key) of the kernel ``decode_attention`` loads for a call of
    ``rows`` rows (graphc/compile_ahead.py compiles it ahead)."""
    return __name__, ClusterAttentionConfig(rows, heads, kv_heads, head_dim, max_context).key()


# ------------------------------------------------------------------------------------------------
# Register-level helpers (plain Python: unrolled when the kernel is traced).
# ------------------------------------------------------------------------------------------------
def _load_v4(addr: Int64, pred):
    """16 bytes at global ``addr`` through L2 (ld.global.cg: data another kernel of the step may
    have written, never a stale L1 line) as 4 words, or zeros where ``pred`` is false."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, {$r1}, 0;\n\t"
        "mov.b32 {$w0}, 0;\n\tmov.b32 {$w1}, 0;\n\tmov.b32 {$w2}, 0;\n\tmov.b32 {$w3}, 0;\n\t"
        "@p ld.global.cg.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];\n\t}",
        write_only_types=[Int32, Int32, Int32, Int32],
        read_only_args=[addr, Int32(pred)],
    )


def _load_b32(addr: Int64, pred):
    """One word at global ``addr`` through L2, or zero where ``pred`` is false."""
    return cute.arch.inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, {$r1}, 0;\n\tmov.b32 {$w0}, 0;\n\t"
        "@p ld.global.cg.u32 {$w0}, [{$r0}];\n\t}",
        write_only_types=[Int32],
        read_only_args=[addr, Int32(pred)],
    )


def _store_v4(addr: Int64, words) -> None:
    cute.arch.inline_ptx(
        "st.global.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
        read_only_args=[addr, *words],
    )


def _globaltimer_after(after) -> Int64:
    """%globaltimer once ``after`` holds its value: the asm takes it as an operand."""
    is_float = isinstance(after, Float32)
    return Int64(llvm.inline_asm(Int64.mlir_type, [(Float32(after) if is_float else Int32(after)).ir_value()],
                                 "mov.u64 $0, %globaltimer;", "=l,f" if is_float else "=l,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _store_u64(addr: Int64, value) -> None:
    cute.arch.inline_ptx("st.global.u64 [{$r0}], {$r1};", read_only_args=[addr, Int64(value)])


def _mma(acc, a, b):
    """acc + A B for one m16n8k16 tile: bf16 operands (4 and 2 words in mma.sync's fragment
    layout), fp32 accumulators (4)."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, "
        "{ {$r0}, {$r1}, {$r2}, {$r3} }, { {$r4}, {$r5} }, { {$r6}, {$r7}, {$r8}, {$r9} };",
        write_only_types=[Float32] * 4,
        read_only_args=[*a, *b, *acc],
    )


def _pair(lo_word, hi_word, upper: bool):
    """The word (x.half, y.half) of two words holding two bf16 each: the low halves when not
    ``upper``, else the high halves (prmt)."""
    selector = 0x7632 if upper else 0x5410
    return cute.arch.inline_ptx(
        f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector:#x};",
        write_only_types=[Int32],
        read_only_args=[lo_word, hi_word],
    )


def _bits(x):
    """The 32 bits of a float, as an integer (for st.async)."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[x])


def _exp2(x):
    return cute.arch.inline_ptx("ex2.approx.ftz.f32 {$w0}, {$r0};", write_only_types=[Float32],
                                read_only_args=[x])


def _max_over_rows(x):
    """Max over the 8 lanes of a warp that share lane % 4 (the fragment's rows g = lane / 4)."""
    for offset in (4, 8, 16):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset))
    return x


def _sum_over_rows(x):
    for offset in (4, 8, 16):
        x = x + cute.arch.shuffle_sync_bfly(x, offset)
    return x


# ------------------------------------------------------------------------------------------------
# The kernel.
# ------------------------------------------------------------------------------------------------
class ClusterAttentionKernel:
    def __init__(self, cfg: ClusterAttentionConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, qkv: Int64, kv: Int64, lens: Int64, slots: Int64, out: Int64, stamps: Int64,
                 stream: cuda.CUstream, use_pdl: Boolean):
        cfg = self.cfg
        self.kernel(qkv, kv, lens, slots, out, stamps).launch(
            grid=[SPLITS, cfg.kv_heads, cfg.rows], block=[THREADS, 1, 1], cluster=[SPLITS, 1, 1],
            stream=stream, use_pdl=use_pdl)

    # --------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qkv: Int64, kv: Int64, lens: Int64, slots: Int64, out: Int64, stamps: Int64):
        cfg = self.cfg
        rank, kvh, t = cute.arch.block_idx()       # cluster (8, 1, 1): rank in cluster = x
        tidx, _, _ = cute.arch.thread_idx()
        stamp_at = stamps + ((t * cfg.kv_heads + kvh) * SPLITS + rank).to(Int64) * (8 * (len(STAMPS) + 1))
        self.stamp(stamp_at, 0, tidx, Int32(0))
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4          # the fragments' row (and B's column)
        c = lane % 4           # the fragments' column pair

        smem = cutlass.memory.SmemAllocator()
        # P^T (hi rows, then lo rows) as words for the mma's B operand and as bf16 for its writes.
        sPw = smem.allocate_tensor(Int32, cute.make_layout(MMA_N * P_STRIDE), byte_alignment=16)
        sP = cute.make_tensor(cute.recast_ptr(sPw.iterator, dtype=BFloat16), cute.make_layout(2 * MMA_N * P_STRIDE))
        sMax = smem.allocate_tensor(Float32, cute.make_layout(WARPS * MMA_N), byte_alignment=16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout(WARPS * MMA_N), byte_alignment=16)
        recvO = smem.allocate_tensor(Float32, cute.make_layout(RECV_O), byte_alignment=16)
        recvML = smem.allocate_tensor(Float32, cute.make_layout(RECV_ML), byte_alignment=16)
        bar = smem.allocate_array(cutlass.Int64, 1)

        # Inputs, complete before the step: readable before the wait.
        L = cute.make_tensor(cute.make_ptr(Int32, lens, cute.AddressSpace.gmem, assumed_align=4),
                             cute.make_layout(cfg.rows))[t]
        slot = cute.make_tensor(cute.make_ptr(Int32, slots, cute.AddressSpace.gmem, assumed_align=4),
                                cute.make_layout(cfg.rows))[t]
        n_live = cutlass.min(L // CHUNK + 1, SPLITS)      # splits holding a position <= L
        live = rank < n_live
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
            cute.arch.mbarrier_arrive_and_expect_tx(bar, n_live * SEND_BYTES)
            cute.arch.mbarrier_init_fence()
        # Peers push only after every CTA armed its barrier: arrive now, wait before the push.
        cute.arch.cluster_arrive_relaxed()

        k_row = ((slot * 2 * cfg.kv_heads + kvh) * cfg.max_context).to(Int64)   # cache row of K position 0
        v_row = k_row + cfg.kv_heads * cfg.max_context
        kw = cute.make_rmem_tensor(32, Int32)      # K: rows g, g + 8 of the warp's 16 positions
        vw = cute.make_rmem_tensor(32, Int32)      # V: 4 positions x 8 k-steps, dims 16 w + 2 g, +1
        qw = cute.make_rmem_tensor(16, Int32)
        if live:
            self.load_kv(kw, vw, kv, k_row, v_row, rank * CHUNK, L, warp, g, c)

        cute.arch.griddepcontrol_wait()
        if const_expr(cfg.trigger_at == 0):
            cute.arch.griddepcontrol_launch_dependents()
        self.stamp(stamp_at, 1, tidx, Int32(0))

        m_run = cute.make_rmem_tensor(2, Float32)   # heads 2c, 2c + 1 (log2 units)
        l_run = cute.make_rmem_tensor(2, Float32)   # this thread's share of their sums
        acc_o = cute.make_rmem_tensor(4, Float32)   # O^T rows 16 w + 2g (+1) x heads 2c, 2c + 1
        if live:
            q_at = qkv + (t * cfg.qkv_cols + kvh * cfg.group * HEAD_DIM).to(Int64) * 2
            for j in cutlass.range_constexpr(4):
                words = _load_v4(q_at + (g * HEAD_DIM + 32 * j + 8 * c) * 2, g < cfg.group)
                for m in cutlass.range_constexpr(4):
                    qw[4 * j + m] = words[m]
            new_at = qkv + (t * cfg.qkv_cols + (cfg.heads + kvh) * HEAD_DIM).to(Int64) * 2
            if rank == (L // CHUNK) % SPLITS:
                if warp == 0:
                    # The CTA whose pass holds L appends the new k (lanes 0..15) and v (16..31),
                    # 16 bytes a lane. Loaded beside q, so the store's wait overlaps q's.
                    is_v = Int64(lane // 16)
                    src = new_at + is_v * (cfg.kv_heads * HEAD_DIM * 2)
                    dst = kv + (k_row + is_v * (cfg.kv_heads * cfg.max_context) + L) * (2 * HEAD_DIM)
                    _store_v4(dst + (lane % 16) * 16, _load_v4(src + (lane % 16) * 16, True))
            self.stamp(stamp_at, 2, tidx, qw[12])
            self.take_new_token(kw, vw, new_at, rank * CHUNK, L, warp, g, c)
            m_run.fill(-Float32.inf)
            l_run.fill(0.0)
            acc_o.fill(0.0)
            passes = (L - rank * CHUNK) // (SPLITS * CHUNK) + 1
            for i in cutlass.range(passes, unroll=1):
                start = (SPLITS * i + rank) * CHUNK
                if i > 0:
                    cute.arch.barrier()      # the previous pass's maxima and P^T are read
                    self.load_kv(kw, vw, kv, k_row, v_row, start, L, warp, g, c)
                    self.take_new_token(kw, vw, new_at, start, L, warp, g, c)
                self.one_pass(kw, vw, qw, sP, sPw, sMax, m_run, l_run, acc_o, start, L, warp, g, c)
            # Each head's sum: over the warp's rows, then over the warps.
            for u in cutlass.range_constexpr(2):
                total = _sum_over_rows(l_run[u])
                if lane < 4:
                    sSum[warp * MMA_N + 2 * c + u] = total
            cute.arch.barrier()
            for u in cutlass.range_constexpr(2):
                total = sSum[2 * c + u]
                for w in cutlass.range_constexpr(1, WARPS):
                    total = total + sSum[w * MMA_N + 2 * c + u]
                l_run[u] = total
            self.stamp(stamp_at, 3, tidx, l_run[0])

        cute.arch.cluster_wait()
        self.stamp(stamp_at, 4, tidx, Int32(0))
        if live:
            # Warp w's dims go to CTA w, 16 bytes per thread: O[2c][2g], O[2c][2g + 1],
            # O[2c + 1][2g], O[2c + 1][2g + 1] (receive layout: split, dim pair, head, dim parity).
            o_words = tuple(_bits(v) for v in (acc_o[0], acc_o[2], acc_o[1], acc_o[3]))
            o_at = recvO.iterator + cute.assume(rank * 128 + g * 16 + 4 * c, divby=4)
            cute.arch.store_async_dsmem(o_at, o_words, bar, warp)
            if lane < 4:
                ml = tuple(_bits(v) for v in (m_run[0], m_run[1], l_run[0], l_run[1]))
                ml_at = recvML.iterator + cute.assume(rank * 32 + 4 * c, divby=4)
                cute.arch.store_async_dsmem(ml_at, ml, bar, warp)
        self.stamp(stamp_at, 5, tidx, Int32(0))
        # This CTA writes no peer memory after this point; the matching wait ends the kernel.
        # Relaxed: each CTA's own mbarrier already proves that every push into it landed before
        # it leaves. A release here waits for this CTA's pushes to land, which took 1.6 us
        # while o_proj's weight prologue streams (bench/decode_attention_notes.md, session 23).
        cute.arch.cluster_arrive_relaxed()
        self.stamp(stamp_at, 6, tidx, Int32(0))

        if tidx < MMA_N * 16:
            cute.arch.mbarrier_wait(bar, 0)
            self.stamp(stamp_at, 7, tidx, recvO[0])
        if const_expr(cfg.trigger_at == 1):
            cute.arch.griddepcontrol_launch_dependents()
        if tidx < MMA_N * 16:
            # This CTA's output: head h, dim 16 rank + d, the live splits folded in split order.
            h = tidx // 16
            d = tidx % 16
            m_at = (h // 2) * 4 + h % 2        # the max of head h in a split's 32 floats; the sum is at +2
            o_at = (d // 2) * 16 + h * 2 + d % 2
            top = -Float32.inf
            for s in cutlass.range_constexpr(SPLITS):
                top = cute.arch.fmax(top, Float32(cutlass.select_(s < n_live, recvML[s * 32 + m_at], -Float32.inf)))
            num = Float32(0.0)
            den = Float32(0.0)
            for s in cutlass.range_constexpr(SPLITS):
                # A split that sent nothing left its slots unwritten: select, never multiply.
                w = _exp2(Float32(cutlass.select_(s < n_live, recvML[s * 32 + m_at], -Float32.inf)) - top)
                den = den + Float32(cutlass.select_(s < n_live, w * recvML[s * 32 + m_at + 2], Float32(0.0)))
                num = num + Float32(cutlass.select_(s < n_live, w * recvO[s * 128 + o_at], Float32(0.0)))
            if h < cfg.group:
                mOut = cute.make_tensor(cute.make_ptr(BFloat16, out, cute.AddressSpace.gmem, assumed_align=16),
                                        cute.make_layout((cfg.rows, cfg.heads * HEAD_DIM),
                                                         stride=(cfg.heads * HEAD_DIM, 1)))
                mOut[t, (kvh * cfg.group + h) * HEAD_DIM + 16 * rank + d] = (num / den).to(BFloat16)
            self.stamp(stamp_at, 8, tidx, num)
        cute.arch.cluster_wait()
        if const_expr(cfg.timeline):
            if tidx == 0:
                _store_u64(stamp_at + 8 * len(STAMPS), Int64(cute.arch.smid()))

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def stamp(self, at: Int64, i: cutlass.Constexpr, tidx, after):
        """Timeline builds only: thread 0 stores %globaltimer as moment ``i``, once ``after``
        (a register the moment waits for) holds its value."""
        if const_expr(self.cfg.timeline):
            if tidx == 0:
                _store_u64(at + 8 * i, _globaltimer_after(after))

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def load_kv(self, kw, vw, kv: Int64, k_row: Int64, v_row: Int64, start, L, warp, g, c):
        """This thread's K and V words for the positions start .. start + 127: cached positions
        (< L) from the cache, zeros elsewhere (the new token comes from take_new_token; never-
        written rows past it could hold NaN, and P = 0 times NaN is NaN)."""
        for half in cutlass.range_constexpr(2):
            pos = start + 16 * warp + g + 8 * half
            at = kv + (k_row + pos) * (2 * HEAD_DIM)
            for j in cutlass.range_constexpr(4):
                words = _load_v4(at + (32 * j + 8 * c) * 2, pos < L)
                for m in cutlass.range_constexpr(4):
                    kw[16 * half + 4 * j + m] = words[m]
        for kk in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(4):
                pos = start + 16 * kk + 2 * c + (e % 2) + 8 * (e // 2)
                vw[4 * kk + e] = _load_b32(kv + (v_row + pos) * (2 * HEAD_DIM) + (16 * warp + 2 * g) * 2, pos < L)

    @cute.jit
    def take_new_token(self, kw, vw, new_at: Int64, start, L, warp, g, c):
        """Put the new token's k, v (from qkv, after the wait) into the registers of position L
        when it lies in start .. start + 127."""
        if L >= start and L < start + CHUNK:
            for half in cutlass.range_constexpr(2):
                pos = start + 16 * warp + g + 8 * half
                if pos == L:
                    for j in cutlass.range_constexpr(4):
                        words = _load_v4(new_at + (32 * j + 8 * c) * 2, True)
                        for m in cutlass.range_constexpr(4):
                            kw[16 * half + 4 * j + m] = words[m]
            v_at = new_at + (self.cfg.kv_heads * HEAD_DIM + 16 * warp + 2 * g) * 2
            for kk in cutlass.range_constexpr(8):
                for e in cutlass.range_constexpr(4):
                    pos = start + 16 * kk + 2 * c + (e % 2) + 8 * (e // 2)
                    if pos == L:
                        vw[4 * kk + e] = _load_b32(v_at, True)

    @cute.jit
    def one_pass(self, kw, vw, qw, sP, sPw, sMax, m_run, l_run, acc_o, start, L, warp, g, c):
        """Fold the positions start .. start + 127 into the running max, sum and O^T."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        # S^T for the warp's 16 positions x 8 heads, in two independent chains over head_dim.
        acc = [[Float32(0.0)] * 4, [Float32(0.0)] * 4]
        for kk in cutlass.range_constexpr(8):
            a = (kw[2 * kk], kw[16 + 2 * kk], kw[2 * kk + 1], kw[16 + 2 * kk + 1])
            acc[kk % 2] = list(_mma(acc[kk % 2], a, (qw[2 * kk], qw[2 * kk + 1])))
        # s[j]: position 16 w + g + 8 (j // 2), head 2c + j % 2; log2 units, -inf past L.
        s = []
        for j in cutlass.range_constexpr(4):
            x = (acc[0][j] + acc[1][j]) * cfg.scale_log2
            pos = start + 16 * warp + g + 8 * (j // 2)
            s.append(Float32(cutlass.select_(pos <= L, x, -Float32.inf)))
        for u in cutlass.range_constexpr(2):
            top = _max_over_rows(cute.arch.fmax(s[u], s[u + 2]))
            if lane < 4:
                sMax[warp * MMA_N + 2 * c + u] = top
        cute.arch.barrier()
        alpha = [Float32(0.0)] * 2
        m_new = [Float32(0.0)] * 2
        for u in cutlass.range_constexpr(2):
            top = sMax[2 * c + u]
            for w in cutlass.range_constexpr(1, WARPS):
                top = cute.arch.fmax(top, sMax[w * MMA_N + 2 * c + u])
            m_new[u] = cute.arch.fmax(m_run[u], top)
            alpha[u] = _exp2(m_run[u] - m_new[u])
            m_run[u] = m_new[u]
            l_run[u] = l_run[u] * alpha[u]
        for j in cutlass.range_constexpr(4):
            u = j % 2
            p = _exp2(s[j] - m_new[u])
            l_run[u] = l_run[u] + p
            pos = 16 * warp + g + 8 * (j // 2)
            head = 2 * c + u
            hi = p.to(BFloat16)
            sP[head * P_STRIDE + pos] = hi
            # p - hi is exact in fp32; its bf16 rounding keeps 16 bits of p in all
            sP[(MMA_N + head) * P_STRIDE + pos] = (p - hi.to(Float32)).to(BFloat16)
        cute.arch.barrier()
        # O^T rows 16 w + 2g (+1) x heads 2c, 2c + 1, over the pass's 128 positions.
        hi_acc = [Float32(0.0)] * 4
        lo_acc = [Float32(0.0)] * 4
        for kk in cutlass.range_constexpr(8):
            a = (_pair(vw[4 * kk], vw[4 * kk + 1], False), _pair(vw[4 * kk], vw[4 * kk + 1], True),
                 _pair(vw[4 * kk + 2], vw[4 * kk + 3], False), _pair(vw[4 * kk + 2], vw[4 * kk + 3], True))
            word = g * (P_STRIDE // 2) + 8 * kk + c
            hi_acc = list(_mma(hi_acc, a, (sPw[word], sPw[word + 4])))
            lo_word = word + MMA_N * (P_STRIDE // 2)
            lo_acc = list(_mma(lo_acc, a, (sPw[lo_word], sPw[lo_word + 4])))
        for j in cutlass.range_constexpr(4):
            acc_o[j] = acc_o[j] * alpha[j % 2] + (hi_acc[j] + lo_acc[j])


# ------------------------------------------------------------------------------------------------
# Compilation and the torch entry point.
# ------------------------------------------------------------------------------------------------
def _compile_args():
    z = Int64(0)
    return (z, z, z, z, z, z, cuda.CUstream(0), Boolean(True))


def _build(*key, options: str = ""):
    kernel = ClusterAttentionKernel(ClusterAttentionConfig(*key))
    if options:
        return cute.compile(kernel, *_compile_args(), options=options)
    return cute.compile(kernel, *_compile_args())


_CACHE = CompileCache("attention_cluster", _build, sys.modules[__name__])


def compile_cache() -> CompileCache:
    return _CACHE


def compile_attention(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int, *,
                      timeline: bool = False, options: str | None = None):
    """The compiled kernel for one static configuration (from the compile cache unless
    ``options`` are given, e.g. ``--keep-ptx --dump-dir D``). Works without a GPU when
    ``CUTE_DSL_ARCH=sm_90a``."""
    cfg = ClusterAttentionConfig(rows, heads, kv_heads, head_dim, max_context, timeline)
    if options:
        return _build(*cfg.key(), options=options)
    return _CACHE.get(cfg.key())


def decode_attention(qkv, kv, seq_lens, cache_slots, out, *, heads: int, kv_heads: int, head_dim: int,
                     stream=None, use_pdl: bool = True, timeline=None, trigger_at: int = 0,
                     workspaces=None) -> None:
    """Append each row's K/V at ``seq_lens[t]`` of slot ``cache_slots[t]`` and attend over
    positions ``0..=seq_lens[t]`` (graphc.ops.attention's contract, contiguous tensors only).
    Launched with the PDL attribute when ``use_pdl``; needs no workspace, so it is capturable
    from its first call. ``workspaces`` is taken and unused, so that graphc.ops.attention
    calls this and the TMA kernel alike. ``timeline`` (bench only): an int64 tensor of at
    least timeline_words(rows, kv_heads) elements; the kernel compiled with stamps writes them
    there."""
    import torch

    from .decode_attention_tma import validate

    check_shape(heads, kv_heads, head_dim, kv.shape[3] if kv.dim() == 5 else 64)
    validate(qkv, kv, seq_lens, cache_slots, out, heads, kv_heads, head_dim)
    cfg = ClusterAttentionConfig(qkv.shape[0], heads, kv_heads, head_dim, kv.shape[3], timeline is not None,
                                 trigger_at)
    if timeline is not None and timeline.numel() < timeline_words(cfg.rows, kv_heads):
        raise ValueError(f"timeline needs {timeline_words(cfg.rows, kv_heads)} int64 words")
    fn = _CACHE.on_device(cfg.key(), qkv.device.index)
    if stream is None:
        stream = torch.cuda.current_stream(qkv.device)
    fn(qkv.data_ptr(), kv.data_ptr(), seq_lens.data_ptr(), cache_slots.data_ptr(), out.data_ptr(),
       0 if timeline is None else timeline.data_ptr(), cuda.CUstream(stream.cuda_stream), bool(use_pdl))


def timeline_words(rows: int, kv_heads: int) -> int:
    """int64 words a timeline build writes: per CTA, STAMPS then its SM id."""
    return rows * kv_heads * SPLITS * (len(STAMPS) + 1)
