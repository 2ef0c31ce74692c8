"""AttnRes as one CuTe DSL cluster kernel for Hopper (sm_90a). DESIGN.md §2-§4.

One cluster of ``C`` CTAs per token (grid ``(C, T)``); CTA ``rank`` owns the columns
``[rank * threads * 8, (rank + 1) * threads * 8)`` and each thread holds 8 contiguous columns
(one 16-byte vector) of every source. Cluster-wide sums travel through distributed shared
memory: every CTA pushes its partial sums into every peer's receive buffer with ``st.async``
(which credits the peer's mbarrier with the bytes it wrote) and waits on its own mbarrier,
armed with the bytes it expects. Each exchange round has its own buffers and barrier, so no
round waits for a buffer to drain:

* round 0 (``pre``, nb > 0): per saved block, sum(v^2) and sum(v * W);
* round 1 (``post``): sum(new^2), and when nb > 0 sum(new * W); when also not final,
  sum(M * new) and sum(M^2), where M = sum_b e_b v_b is the unnormalised saved-block mixture,
  so mean(mix^2) of the mixture follows without another round;
* round 2 (``post``, final and nb > 0): sum(bf16(mix)^2), since the final norm squares the
  *rounded* mixture.

Every CTA sums the C partials of a value in rank order, so all CTAs of a cluster compute
bitwise-identical totals (and therefore identical softmax weights).

PDL (DESIGN §4): ``griddepcontrol.launch_dependents`` at entry (``TRIGGER = "early"``); ``pre``
reads only the saved blocks and the three weight vectors (``PROLOGUE_INPUTS``) and runs round 0
and the saved-block softmax partials; ``griddepcontrol.wait`` comes right before the first
read of delta/prefix, on every path (nb == 0 too), so the kernel always waits before it exits.
Everything written during the step (blocks, prefix, delta) is loaded with ``ld.global.cg``
(served by L2, never by a stale L1 line); the weights with ``ld.global.nc``. During ``pre`` the
delta/prefix lines are only *prefetched* into L2 (``prefetch.global.L2``, no data read; L2 is
coherent, see ``_prefetch_l2``), which takes their HBM latency off the post phase.

Registers: the saved blocks are needed twice, for round 0 and, after it, for the mixture; in
between they wait in this thread's own shared-memory slots (16 B per block), not registers,
so a thread needs <= 64 registers at any nb and 8 CTAs fit on an SM (PDL lets the next call's
CTAs share the SM with this call's).

Rounding follows ``graphc.ops.attn_res_math.attn_res_reference``: ``new = bf16(prefix + delta)``
(fp32 add, then round), the prefix/aux/block copies are that bf16 value, with ``final`` the
mixture is rounded to bf16 before its norm, and the output is rounded once. Everything else is
fp32; only the order of fp32 sums differs from torch's.

Static (one compiled variant each): hidden, nb, has_delta, final. Runtime (shared by every
variant): the tensors as 16-byte-aligned addresses, T, the number of block slots NB, the write
slot (-1: none), the number of aux streams (0-2), eps, out_eps, the stream, and whether the
launch carries the PDL attribute.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
from functools import lru_cache

# CuTe DSL picks its target when it is first imported; without a GPU it would pick sm_100a.
# This kernel is Hopper code (cluster + st.async + griddepcontrol); an H100/H200 is sm_90a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Boolean, Float32, Int32, Int64, const_expr  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import T as _T, dsl_user_op  # noqa: E402

from graphc.ops.attn_res_math import (  # noqa: E402
    COLUMNS_PER_THREAD,
    MAX_SAVED_BLOCKS,
    SUPPORTED_HIDDEN_RULE,
    cluster_shape as _cluster_shape_uncached,
)

from .compile_cache import CompileCache  # noqa: E402

# PDL traits of this op, read by the scheduler (DESIGN §4).
PROLOGUE_INPUTS = ("blocks", "key_norm", "query", "out_norm")
TRIGGER = "early"
WAITS = True

MAX_TOKENS = 512
cluster_shape = lru_cache(maxsize=None)(_cluster_shape_uncached)  # called on every launch
MAX_AUX = 2
WARP = 32


# ------------------------------------------------------------------------------------------------
# Register-level helpers. Plain Python (no @cute.jit): they hold no runtime control flow and are
# unrolled when the kernel is traced.
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def _as_f32(bits, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(_T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _as_i32(value, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(_T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _unpack_bf16x8(words):
    """4 words of bf16 pairs (low half = lower column) -> 8 fp32 values, exactly."""
    out = []
    for j in range(4):
        out.append(_as_f32(words[j] << 16))
        out.append(_as_f32(words[j] & Int32(-65536)))
    return out


def _unpack_bf16x8_late(words):
    """As _unpack_bf16x8, but opaque to common-subexpression elimination. A source unpacked
    before an exchange and again after it then keeps only its 4 packed words live across the
    exchange (4 registers instead of 8): 96 instead of 122 registers at nb = 8."""
    out = []
    for j in range(4):
        lo, hi = cute.arch.inline_ptx(
            "shl.b32 {$w0}, {$r0}, 16;\n\tand.b32 {$w1}, {$r0}, -65536;",
            write_only_types=[Float32, Float32],
            read_only_args=[words[j]],
        )
        out.append(lo)
        out.append(hi)
    return out


def _pack_bf16x8(values):
    """8 fp32 values -> 4 words of bf16 pairs, round to nearest even (torch's .to(bfloat16);
    no .satfinite, so overflow gives inf as in torch)."""
    words = []
    for j in range(4):
        # cvt.rn.bf16x2.f32 d, a, b puts bf16(a) in the upper half and bf16(b) in the lower.
        words.append(
            cute.arch.inline_ptx(
                "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};",
                write_only_types=[Int32],
                read_only_args=[values[2 * j + 1], values[2 * j]],
            )
        )
    return words


def _load_mutable(ptr):
    """16 bytes of data written during the step. ld.global.cg caches in L2 only, so a kernel
    that overlaps its predecessor (PDL) never reads a stale L1 line."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Int32, Int32, Int32, Int32],
        read_only_args=[ptr],
    )


def _load_const(ptr):
    """16 bytes of a weight vector, read-only for the whole step: the non-coherent path."""
    return cute.arch.inline_ptx(
        "ld.global.nc.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Int32, Int32, Int32, Int32],
        read_only_args=[ptr],
    )


def _prefetch_l2(base, offset):
    """Warm L2 with the line of bf16 element ``base[offset]`` that we load after
    griddepcontrol.wait. Not a read of the data: L2 is the GPU's point of coherence, so a line
    an earlier kernel rewrites afterwards is updated in place, and the ld.global.cg after the
    wait still sees the final value. The address is formed inside the asm so that the compiler
    does not keep it live (in registers) until the load."""
    cute.arch.inline_ptx(
        "{\n\t.reg .b64 pfaddr;\n\tshl.b64 pfaddr, {$r1}, 1;\n\tadd.s64 pfaddr, pfaddr, {$r0};\n\t"
        "prefetch.global.L2 [pfaddr];\n\t}",
        read_only_args=[Int64(base), Int64(offset)],
    )


def _store16(ptr, words):
    cute.arch.inline_ptx(
        "st.global.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
        read_only_args=[ptr, words[0], words[1], words[2], words[3]],
    )


def _dot8(a, b):
    """sum_i a[i] * b[i] over 8 values, in two interleaved chains."""
    s0 = a[0] * b[0]
    s1 = a[1] * b[1]
    for i in range(2, 8, 2):
        s0 = s0 + a[i] * b[i]
        s1 = s1 + a[i + 1] * b[i + 1]
    return s0 + s1


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _warp_reduce_scatter(values, lane):
    """Warp-wide sums of ``len(values)`` per-lane values: lane l returns the sum of value
    ``l % kpad`` (kpad = the next power of two >= len(values)).

    Each halving step trades half of the vector with the lane ``half`` away (the lane whose
    bit ``half`` is set keeps the upper half), so kpad values are reduce-scattered over kpad
    lanes with kpad - 1 shuffles instead of 5 per value; a butterfly over the remaining lane
    bits completes the warp sum.
    """
    count = len(values)
    kpad = _pow2_at_least(count)
    vals = list(values) + [Float32(0.0)] * (kpad - count)
    half = kpad // 2
    while half >= 1:
        upper = (lane & half) != 0
        merged = []
        for i in range(half):
            send = Float32(cutlass.select_(upper, vals[i], vals[half + i]))
            keep = Float32(cutlass.select_(upper, vals[half + i], vals[i]))
            merged.append(keep + cute.arch.shuffle_sync_bfly(send, offset=half))
        vals = merged
        half //= 2
    total = vals[0]
    offset = kpad
    while offset < WARP:
        total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
        offset *= 2
    return total


# ------------------------------------------------------------------------------------------------
# The kernel.
# ------------------------------------------------------------------------------------------------
class AttnResKernel:
    """One static configuration (hidden, nb, has_delta, final) of the AttnRes cluster kernel."""

    def __init__(self, hidden: int, nb: int, has_delta: bool, final: bool):
        shape = cluster_shape(hidden)
        if shape is None:
            raise ValueError(f"hidden={hidden} unsupported: {SUPPORTED_HIDDEN_RULE}")
        self.hidden = hidden
        self.ctas, self.threads = shape
        self.warps = self.threads // WARP
        self.nb, self.has_delta, self.final = nb, has_delta, final
        # Values summed per exchange round (see the module docstring); 0 = no such round.
        self.counts = (
            2 * nb,
            1 if nb == 0 else (2 if final else 4),
            1 if (final and nb > 0) else 0,
        )
        rounds = [r for r, c in enumerate(self.counts) if c > 0]
        self.first_round, self.last_round = rounds[0], rounds[-1]

    # --------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        delta: Int64,
        prefix: Int64,
        blocks: Int64,
        key_norm: Int64,
        query: Int64,
        out_norm: Int64,
        output: Int64,
        aux0: Int64,
        aux1: Int64,
        aux_count: Int32,
        tokens: Int32,
        slots: Int32,
        write: Int32,
        eps: Float32,
        out_eps: Float32,
        stream: cuda.CUstream,
        use_pdl: Boolean,
    ):
        self.kernel(
            delta, prefix, blocks, key_norm, query, out_norm, output, aux0, aux1, aux_count,
            slots, write, eps, out_eps,
        ).launch(
            grid=[self.ctas, tokens, 1],
            block=[self.threads, 1, 1],
            cluster=[self.ctas, 1, 1] if const_expr(self.ctas > 1) else None,
            stream=stream,
            use_pdl=use_pdl,
        )

    # --------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        delta: Int64,
        prefix: Int64,
        blocks: Int64,
        key_norm: Int64,
        query: Int64,
        out_norm: Int64,
        output: Int64,
        aux0: Int64,
        aux1: Int64,
        aux_count: Int32,
        slots: Int32,
        write: Int32,
        eps: Float32,
        out_eps: Float32,
    ):
        # Let the next kernel in the stream launch now; it waits before it reads our outputs.
        cute.arch.griddepcontrol_launch_dependents()

        tid, _, _ = cute.arch.thread_idx()
        _, token, _ = cute.arch.block_idx()
        rank = Int32(0)
        if const_expr(self.ctas > 1):
            rank = cute.arch.block_idx_in_cluster()
        bufs = self.setup()
        if const_expr(self.ctas > 1):
            # Peers may push only once every CTA has armed its barriers: arrive now, wait just
            # before the first push, so the global loads below hide the latency.
            cute.arch.cluster_arrive_relaxed()

        D = self.hidden
        col = (rank * self.threads + tid) * COLUMNS_PER_THREAD  # this thread's first column
        row = Int64(token) * D + col                             # element offset in a [T, D] row

        # ---------------- pre: only inputs complete at launch (saved blocks, weights) --------
        gamma_words = _load_const(self._ptr(out_norm, col))
        if const_expr(self.nb == 0):
            self.prefetch_post_rows(delta, prefix, row)
        W = [Float32(0.0)] * 8
        mixture = [Float32(0.0)] * 8  # M = sum_b e_b v_b
        top = Float32(0.0)            # max saved-block logit
        exp_sum = Float32(0.0)        # sum_b e_b, e_b = exp(logit_b - top)
        if const_expr(self.nb > 0):
            saved_words = []
            for b in cutlass.range_constexpr(self.nb):
                saved_at = (Int64(token) * Int64(slots) + b) * D + col   # &blocks[token, b, col]
                saved_words.append(_load_mutable(self._ptr(blocks, saved_at)))
            self.prefetch_post_rows(delta, prefix, row)
            kn = _unpack_bf16x8(_load_const(self._ptr(key_norm, col)))
            qv = _unpack_bf16x8(_load_const(self._ptr(query, col)))
            W = [kn[i] * qv[i] for i in range(8)]  # folded key-norm weight: fp32, not rounded
            # The saved blocks are needed again after the exchange (for the mixture): park them
            # in this thread's own shared-memory slots instead of registers, so that the next
            # kernel's CTAs (PDL) and more CTAs of this one fit on an SM.
            stash = bufs[4]
            for b in cutlass.range_constexpr(self.nb):
                for j in cutlass.range_constexpr(4):
                    stash[(b * self.threads + tid) * 4 + j] = saved_words[b][j]
            saved = [_unpack_bf16x8(w) for w in saved_words]
            partials = [_dot8(v, v) for v in saved] + [_dot8(v, W) for v in saved]
            totals = self.exchange(partials, bufs, 0, rank, tid)
            logits = [totals[self.nb + b] * self.rstd(totals[b], eps) for b in range(self.nb)]
            top = logits[0]
            for b in cutlass.range_constexpr(1, self.nb):
                top = cute.arch.fmax(top, logits[b])
            for b in cutlass.range_constexpr(self.nb):
                e = cute.math.exp(logits[b] - top)
                exp_sum = exp_sum + e
                v = _unpack_bf16x8([stash[(b * self.threads + tid) * 4 + j] for j in range(4)])
                for i in cutlass.range_constexpr(8):
                    mixture[i] = mixture[i] + e * v[i]

        # ---------------- wait: from here on we read what earlier kernels wrote -------------
        cute.arch.griddepcontrol_wait()

        # ---------------- post ----------------------------------------------------------------
        new_words = _load_mutable(self._ptr(delta, row))  # replace: bf16(delta) == delta
        if const_expr(self.has_delta):
            old = _unpack_bf16x8(_load_mutable(self._ptr(prefix, row)))
            inc = _unpack_bf16x8(new_words)
            new_words = _pack_bf16x8([old[i] + inc[i] for i in range(8)])
        new = _unpack_bf16x8(new_words)

        # prefix, aux copies and block slot get bf16(new) exactly; stored before the exchange
        # so the stores drain while it runs.
        _store16(self._ptr(prefix, row), new_words)
        if aux_count > 0:
            _store16(self._ptr(aux0, row), new_words)
        if aux_count > 1:
            _store16(self._ptr(aux1, row), new_words)
        if write >= 0:
            written_at = (Int64(token) * Int64(slots) + Int64(write)) * D + col
            _store16(self._ptr(blocks, written_at), new_words)

        partials = [_dot8(new, new)]
        if const_expr(self.nb > 0):
            partials.append(_dot8(new, W))
            if const_expr(not self.final):
                partials.append(_dot8(mixture, new))
                partials.append(_dot8(mixture, mixture))
        totals = self.exchange(partials, bufs, 1, rank, tid)

        gamma = _unpack_bf16x8_late(gamma_words)
        result = [Float32(0.0)] * 8
        if const_expr(self.nb == 0):
            # mix = new, already bf16, so final's rounding of the mixture changes nothing.
            scale = self.rstd(totals[0], out_eps)
            result = [new[i] * scale * gamma[i] for i in range(8)]
        else:
            new_sq, new_dot = totals[0], totals[1]
            logit = new_dot * self.rstd(new_sq, eps)
            peak = cute.arch.fmax(top, logit)
            alpha = cute.math.exp(top - peak)  # rescales the saved-block terms to the new max
            e_new = cute.math.exp(logit - peak)
            denominator = alpha * exp_sum + e_new
            if const_expr(self.final):
                inverse = Float32(1.0) / denominator
                ca, cn = alpha * inverse, e_new * inverse
                mix_words = _pack_bf16x8([ca * mixture[i] + cn * new[i] for i in range(8)])
                mix = _unpack_bf16x8(mix_words)  # bf16(mix), as the reference rounds it
                totals2 = self.exchange([_dot8(mix, mix)], bufs, 2, rank, tid)
                scale = self.rstd(totals2[0], out_eps)
                result = [mix[i] * scale * gamma[i] for i in range(8)]
            else:
                # mix = (alpha M + e_new new) / den, hence
                #   sum(mix^2) = (alpha^2 sum(M^2) + 2 alpha e_new sum(M new) + e_new^2 sum(new^2)) / den^2
                #   mix * rsqrt(mean(mix^2) + out_eps) = (alpha M + e_new new) * rsqrt(quad / D + out_eps den^2)
                mix_new, mix_sq = totals[2], totals[3]
                quad = alpha * alpha * mix_sq + Float32(2.0) * alpha * e_new * mix_new + e_new * e_new * new_sq
                scale = cute.math.rsqrt(quad * Float32(1.0 / D) + out_eps * denominator * denominator)
                ca, cn = alpha * scale, e_new * scale
                result = [(ca * mixture[i] + cn * new[i]) * gamma[i] for i in range(8)]
        _store16(self._ptr(output, row), _pack_bf16x8(result))

        if const_expr(self.ctas > 1):
            # Pairs with the arrive after this CTA's last push: no CTA exits while a peer may
            # still write into its shared memory.
            cute.arch.cluster_wait()

    # --------------------------------------------------------------------------------------------
    def prefetch_post_rows(self, delta, prefix, row):
        """Start bringing this thread's delta (and prefix) into L2 while the pre phase runs;
        their values are loaded only after griddepcontrol.wait (see _prefetch_l2)."""
        _prefetch_l2(delta, row)
        if const_expr(self.has_delta):
            _prefetch_l2(prefix, row)

    def _ptr(self, base: Int64, offset):
        """&base[offset] of a bf16 tensor; every access is a 16-byte vector."""
        return cute.make_ptr(cutlass.BFloat16, base, cute.AddressSpace.gmem, assumed_align=16) + offset

    def rstd(self, sum_sq, eps):
        """rsqrt(mean of squares + eps) over the full hidden row."""
        return cute.math.rsqrt(sum_sq * Float32(1.0 / self.hidden) + eps)

    @cute.jit
    def setup(self):
        """Shared memory per exchange round r with c = counts[r] > 0 values: warp partials
        [warps * c], totals [c], and when ctas > 1 a receive buffer [ctas * c] (rank-major)
        and an mbarrier armed for ctas * c * 4 bytes."""
        smem = cutlass.memory.SmemAllocator()
        warp_bufs, recv_bufs, total_bufs = [None] * 3, [None] * 3, [None] * 3
        for r in cutlass.range_constexpr(3):
            count = self.counts[r]
            if const_expr(count > 0):
                warp_bufs[r] = smem.allocate_tensor(Float32, cute.make_layout(self.warps * count), byte_alignment=16)
                total_bufs[r] = smem.allocate_tensor(Float32, cute.make_layout(count), byte_alignment=16)
                if const_expr(self.ctas > 1):
                    recv_bufs[r] = smem.allocate_tensor(Float32, cute.make_layout(self.ctas * count), byte_alignment=16)
        stash = None
        if const_expr(self.nb > 0):
            stash = smem.allocate_tensor(Int32, cute.make_layout(self.nb * self.threads * 4), byte_alignment=16)
        bars = None
        if const_expr(self.ctas > 1):
            bars = smem.allocate_array(Int64, 3)
            if cute.arch.thread_idx()[0] == 0:
                for r in cutlass.range_constexpr(3):
                    if const_expr(self.counts[r] > 0):
                        cute.arch.mbarrier_init(bars + r, 1)
                        # One fp32 per value from every CTA of the cluster, this one included.
                        cute.arch.mbarrier_arrive_and_expect_tx(bars + r, 4 * self.ctas * self.counts[r])
                cute.arch.mbarrier_init_fence()
        return warp_bufs, recv_bufs, total_bufs, bars, stash

    @cute.jit
    def exchange(self, values, bufs, r: cutlass.Constexpr, rank, tid):
        """Cluster-wide sums of the per-thread ``values`` (round ``r``). Every thread of every
        CTA of the cluster gets the same totals, summed in the same order."""
        warp_bufs, recv_bufs, total_bufs, bars, _ = bufs
        warp_buf, recv, total = warp_bufs[r], recv_bufs[r], total_bufs[r]
        count = len(values)
        assert count == self.counts[r], (r, count, self.counts)  # buffers and tx bytes sized by counts
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        warp_sum = _warp_reduce_scatter(values, lane)  # lane k < count: warp sum of value k
        if lane < count:
            warp_buf[warp * count + lane] = warp_sum
        cute.arch.barrier()

        if const_expr(self.ctas > 1):
            if const_expr(r == self.first_round):
                cute.arch.cluster_wait()  # every CTA of the cluster has armed its barriers
            if tid < count:
                part = warp_buf[tid]
                for w in cutlass.range_constexpr(1, self.warps):
                    part = part + warp_buf[w * count + tid]
                bits = _as_i32(part)
                for peer in cutlass.range_constexpr(self.ctas):
                    cute.arch.store_async_dsmem(recv.iterator + (rank * count + tid), bits, bars + r, peer)
            if const_expr(r == self.last_round):
                # This CTA writes no peer memory after this point; the matching wait is the
                # last instruction of the kernel.
                cute.arch.cluster_arrive()
            if tid < count:
                cute.arch.mbarrier_wait(bars + r, 0)
                acc = recv[tid]
                for c in cutlass.range_constexpr(1, self.ctas):
                    acc = acc + recv[c * count + tid]
                total[tid] = acc
        else:
            if tid < count:
                part = warp_buf[tid]
                for w in cutlass.range_constexpr(1, self.warps):
                    part = part + warp_buf[w * count + tid]
                total[tid] = part
        cute.arch.barrier()
        return [total[k] for k in range(count)]


# ------------------------------------------------------------------------------------------------
# Compilation and the compile cache.
# ------------------------------------------------------------------------------------------------
def _compile_args():
    z = Int64(0)
    return (
        z, z, z, z, z, z, z, z, z,                 # delta .. aux1 addresses
        Int32(0), Int32(1), Int32(1), Int32(-1),   # aux_count, tokens, slots, write
        Float32(1e-6), Float32(1e-6),              # eps, out_eps
        cuda.CUstream(0), Boolean(True),           # stream, use_pdl
    )


def static_key(hidden: int, nb: int, has_delta: bool, final: bool) -> tuple:
    """The compile-cache key of a configuration; raises ValueError for unsupported ones."""
    if cluster_shape(int(hidden)) is None:
        raise ValueError(f"hidden={hidden} unsupported: {SUPPORTED_HIDDEN_RULE}")
    if not 0 <= int(nb) <= MAX_SAVED_BLOCKS:
        raise ValueError(f"nb={nb} out of range: 0 <= nb <= {MAX_SAVED_BLOCKS}")
    return (int(hidden), int(nb), bool(has_delta), bool(final))


def compiled_variant(hidden: int, nb: int, has_delta: bool, final: bool) -> tuple[str, tuple]:
    """(kernel module, compile-cache key) of the kernel ``attn_res`` loads for this
    configuration (graphc/compile_ahead.py compiles it ahead)."""
    return __name__, static_key(hidden, nb, has_delta, final)


def _build(hidden: int, nb: int, has_delta: bool, final: bool, options: str = ""):
    kernel = AttnResKernel(hidden, nb, has_delta, final)
    if options:
        return cute.compile(kernel, *_compile_args(), options=options)
    return cute.compile(kernel, *_compile_args())


def _generating_source() -> str:
    """Source text that decides the generated code: this module and the math module whose
    cluster_shape picks the CTA and thread counts."""
    import inspect

    from graphc.ops import attn_res_math

    return inspect.getsource(sys.modules[__name__]) + inspect.getsource(attn_res_math)


_CACHE = CompileCache("attn_res", _build, _generating_source())


def compile_cache() -> CompileCache:
    return _CACHE


def compile_attn_res(hidden: int, nb: int, has_delta: bool, write: int = -1, final: bool = False,
                     aux_count: int = 0):
    """The compiled kernel of one configuration, cached in process and on disk
    (``kernels/compile_cache.py``). Works without a GPU when ``CUTE_DSL_ARCH=sm_90a``.

    ``write`` and ``aux_count`` are runtime arguments of the kernel: every write slot (and -1)
    and every aux count share one compiled variant; they are checked and otherwise ignored.
    """
    if not -1 <= int(write):
        raise ValueError(f"write={write} must be -1 (no block write) or a slot index >= 0")
    if not 0 <= int(aux_count) <= MAX_AUX:
        raise ValueError(f"aux count {aux_count} out of range: at most {MAX_AUX} aux streams")
    return _CACHE.get(static_key(hidden, nb, has_delta, final))


def attn_res_ptx(hidden: int, nb: int, has_delta: bool, write: int = -1, final: bool = False,
                 aux_count: int = 0) -> str:
    """PTX text of one configuration (compiled afresh with --keep-ptx; not cached)."""
    del write, aux_count  # runtime arguments
    key = static_key(hidden, nb, has_delta, final)
    with tempfile.TemporaryDirectory() as dump_dir:
        return _build(*key, options=f"--keep-ptx --dump-dir {dump_dir}").__ptx__


# ------------------------------------------------------------------------------------------------
# Launching with little Python overhead.
# ------------------------------------------------------------------------------------------------
class _Launcher:
    """Calls one compiled variant with a preallocated ctypes argument block.

    The DSL's generic call path wraps every argument in a DSL numeric and marshals it anew
    (about 100 us for our 17 arguments). The argument layout of ``AttnResKernel.__call__`` is
    fixed, so after checking once that the DSL marshals it as expected (9 x int64, 4 x int32,
    2 x float, the stream handle, a bool), later calls only update the ctypes values in place
    and hand their addresses to the device executor. Any surprise in that check keeps the
    generic path. The first call of a variant always takes the generic path (it loads the
    module onto the device). The launcher holds only the cache key: the compiled function and
    its per-device executors stay the cache's (after ``clear_memory`` a call reloads them, so a
    warm-up must come before the next capture).
    """

    _KINDS = (ctypes.c_int64,) * 9 + (ctypes.c_int32,) * 4 + (ctypes.c_float,) * 2 + (ctypes.c_void_p, ctypes.c_bool)
    _STREAM = 15

    def __init__(self, key: tuple):
        self.key = key
        self.fast: bool | None = None
        self._tls = threading.local()

    def _layout_matches(self, args) -> bool:
        fn = _CACHE.get(self.key)
        try:
            exe, _ = fn.generate_execution_args(*args)
        except Exception:
            return False
        if len(exe) != len(self._KINDS):
            return False
        for i, kind in enumerate(self._KINDS):
            if i == self._STREAM:
                continue  # the stream adapter passes the address of the handle
            value = getattr(exe[i], "_cutlass_keepalive", None)
            if type(value) is not kind:
                return False
        return hasattr(fn, "to")

    def _block(self):
        block = getattr(self._tls, "block", None)
        if block is None:
            values = [kind() for kind in self._KINDS]
            block = (values, [ctypes.addressof(v) for v in values])
            self._tls.block = block
        return block

    def __call__(self, device: int, args: list) -> None:
        """``args``: the 17 arguments of AttnResKernel.__call__, the stream as its raw handle."""
        if self.fast:
            executor = _CACHE.on_device(self.key, device)
            values, addresses = self._block()
            for value, arg in zip(values, args):
                value.value = arg
            executor.run_compiled_program(addresses)
            return
        args = list(args)
        args[self._STREAM] = cuda.CUstream(args[self._STREAM])
        if self.fast is None:
            self.fast = self._layout_matches(args)
        # One executor per device (CompileCache.on_device), created (module loaded) by this
        # first call, outside any capture: the function's own default executor stays bound to
        # the first GPU it ran on.
        _CACHE.on_device(self.key, device)(*args)


_LAUNCHERS: dict[tuple, _Launcher] = {}


def _launcher(key: tuple) -> _Launcher:
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = _Launcher(key)
    return launcher


# ------------------------------------------------------------------------------------------------
# Torch entry point.
# ------------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, shape: tuple, device) -> None:
    import torch

    if (type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.shape == shape
            and t.is_contiguous() and not t.data_ptr() % 16 and t.device == device):
        return  # the common case, in one pass
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (the kernel moves 8 bf16 at a time)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, prefix on {device}: all tensors share one device")


def validate(delta, prefix, blocks, key_norm, query, out_norm, output, *, nb: int, has_delta: bool,
             write: int, final: bool, aux: tuple = ()) -> tuple[int, int, int]:
    """Check an ``attn_res`` call; returns (T, NB, D). Raises ValueError naming the rule."""
    import torch

    del has_delta, final  # any combination is supported
    if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2:
        raise ValueError("prefix must be a 2-D [T, D] tensor")
    T, D = prefix.shape
    if cluster_shape(D) is None:
        raise ValueError(f"hidden={D} unsupported: {SUPPORTED_HIDDEN_RULE}")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"T={T} tokens out of range: 1 <= T <= {MAX_TOKENS}")
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3:
        raise ValueError("blocks must be a 3-D [T, NB, D] tensor")
    NB = blocks.shape[1]
    if NB < 1:
        raise ValueError("blocks must have at least one slot (NB >= 1)")
    if not 0 <= nb <= min(MAX_SAVED_BLOCKS, NB):
        raise ValueError(f"nb={nb} out of range: 0 <= nb <= min({MAX_SAVED_BLOCKS}, NB={NB})")
    if not (write == -1 or 0 <= write < NB):
        raise ValueError(f"write={write} must be -1 (no block write) or a slot index 0 <= write < NB={NB}")
    if 0 <= write < nb:
        raise ValueError(
            f"write={write} < nb={nb}: the kernel reads the saved blocks before it writes the "
            "slot, so the written slot must not be one of the nb saved blocks (write >= nb)"
        )
    if not isinstance(aux, (tuple, list)) or len(aux) > MAX_AUX:
        raise ValueError(f"aux must be a tuple of at most {MAX_AUX} tensors")
    device = prefix.device
    _check_tensor("prefix", prefix, (T, D), device)
    _check_tensor("delta", delta, (T, D), device)
    _check_tensor("blocks", blocks, (T, NB, D), device)
    _check_tensor("key_norm", key_norm, (D,), device)
    _check_tensor("query", query, (D,), device)
    _check_tensor("out_norm", out_norm, (D,), device)
    _check_tensor("output", output, (T, D), device)
    for i, a in enumerate(aux):
        _check_tensor(f"aux[{i}]", a, (T, D), device)
    if device.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device, got {device}")
    return T, NB, D


def attn_res(delta, prefix, blocks, key_norm, query, out_norm, output, *, nb: int, has_delta: bool,
             write: int, final: bool, eps: float, out_eps: float, aux: tuple = (),
             stream=None, use_pdl: bool = True) -> None:
    """One AttnRes call (DESIGN §2) on the GPU: updates ``prefix``, every ``aux`` stream and
    ``blocks[:, write]`` in place and writes the normalised ``output``.

    Launches on ``stream`` (a torch.cuda.Stream; None: the current stream), with the PDL
    launch attribute when ``use_pdl`` (a programmatic edge to the previous kernel in the
    stream). Capturable in a CUDA graph; call it once outside capture first (the first call
    loads the module)."""
    import torch

    T, NB, D = validate(delta, prefix, blocks, key_norm, query, out_norm, output, nb=nb,
                        has_delta=has_delta, write=write, final=final, aux=aux)
    launcher = _launcher(static_key(D, nb, has_delta, final))
    if stream is None:
        stream = torch.cuda.current_stream(prefix.device)
    aux0 = aux[0].data_ptr() if len(aux) > 0 else 0
    aux1 = aux[1].data_ptr() if len(aux) > 1 else 0
    launcher(prefix.device.index, [
        delta.data_ptr(), prefix.data_ptr(), blocks.data_ptr(), key_norm.data_ptr(),
        query.data_ptr(), out_norm.data_ptr(), output.data_ptr(), aux0, aux1, len(aux),
        T, NB, int(write), float(eps), float(out_eps), stream.cuda_stream, bool(use_pdl),
    ])
