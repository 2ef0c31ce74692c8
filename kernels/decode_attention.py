"""Split-KV GQA decode attention in Triton: reads only each sequence's cached tokens.

A library-style kernel (no PDL wait), entered through full edges, that triggers its
dependents at entry (``griddepcontrol.launch_dependents``, Triton's ``gdc_launch_dependents``):
the next kernel, the o_proj decode GEMM, streams its weights while attention runs. (Entering
attention through a PDL edge as well was measured slower: bench/decode_attention_notes.md
v7.) It was graphc's first attention kernel, and the default at one row until session 23; it is
now what runs where CuTe DSL is missing (or for shapes the CuTe DSL kernels refuse), while the
step uses ``decode_attention_cluster`` at one row and ``decode_attention_tma`` from 2 rows
(graphc.ops.attention). Like them, its cost follows the real context length, not the cache's
``max_context``.

One kernel, grid (rows, kv heads, splits): each program takes one KV head's query group over
``chunk`` cached positions with an online softmax and writes (max, sum, acc) partials; split 0
also folds in the new token (straight from qkv) and appends its K/V at position seq_len, a
position no other program reads. The last split of a (row, KV head) to finish combines the
partials and writes the output (an arrival counter; no second kernel, no second launch gap).

Both products run on tensor cores: q @ K^T in bf16 (exact products, fp32 sums), and p @ V
with the fp32 probabilities split into two bf16 terms, p = hi + lo (``pv="bf16x2"``): two
MMAs whose sum carries 16 bits of p's mantissa (relative 2^-17), so the result matches the
fp32 reference up to summation order, as DESIGN's fp32 attention asks. Rounding p to one bf16
(``"bf16"``, relative 2^-9, FlashAttention's choice) moved an 8-layer model's logits as much as
flipping one ulp of every op's output (bench/decode_attention_notes.md v10). The exact fp32
p @ V on CUDA cores (``"fp32"``) was compute-bound: 147 us at 64 rows against 89 on tensor
cores (context 1024, floor 62 us); combining the splits in the kernel then took it to 73 us.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .workspaces import Workspaces, workspace

# How p @ V is computed: "bf16x2" (p = hi + lo, two bf16 MMAs, 2^-17 relative), "bf16" (p rounded
# to bf16, one MMA, 2^-9) or "fp32" (exact FMAs on CUDA cores). Benchmarks compare them.
PV_MODES = {"fp32": 0, "bf16": 1, "bf16x2": 2}
DEFAULT_PV = "bf16x2"


def default_tiling(rows: int) -> tuple[int, int, int]:
    """(chunk, block_n, num_stages): cached positions per program, keys per loop step and
    pipeline depth. Measured on an H200 with p @ V as bf16x2 (bench/decode_attention.py,
    context 1024, bench/results/decode_attention_sweep_bf16x2_*): few rows want more
    programs in flight, many rows want long chunks (fewer partials to combine, and at 32+
    rows 256-1024 programs that fill the SMs in one or two rounds)."""
    if rows <= 2:
        return 128, 64, 3      # 7.9 us at 1 row
    if rows <= 16:
        return 512, 64, 3      # 14.4 us at 8 rows
    if rows <= 48:
        return 1024, 64, 4     # 38.7 us at 32 rows (512/64/2: 47.3)
    return 1024, 32, 4         # 70.7 us at 64 rows (512/64/2: 77.5; floor 62.4)


# bench/attention_triton_timeline.py compiles the kernel with TIMELINE=1: each program then
# writes these %globaltimer stamps (ns) into ``stamps`` (the shipped build compiles them out).
STAMPS = ("entry", "q loaded", "keys done", "arrived", "combined")


@triton.jit
def globaltimer(after):
    """%globaltimer once ``after`` (a scalar the timed step produced) is available: the asm
    takes it as an operand, so it cannot run before the loads behind it complete."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _split_kv(qkv, kv, seq_lens, slots, m_ws, l_ws, acc_ws, counters, out, stamps, stride_t, stride_slot,
              stride_pos, stride_kind, stride_head, stride_out, scale,
              H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
              HD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
              NP: tl.constexpr, PV: tl.constexpr, GC: tl.constexpr, COMBINE_SPLITS: tl.constexpr,
              TIMELINE: tl.constexpr = 0, NSTAMPS: tl.constexpr = len(STAMPS)):
    # Let a PDL-launched successor (the o_proj decode GEMM) start streaming its weights now: it
    # reads our output only after its own griddepcontrol.wait, which waits for this grid to
    # complete. Fires once every program has executed it, so the successor never takes an SM
    # from a program of ours that has not started.
    tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    if TIMELINE:
        stamp = stamps + ((t * KV + kvh) * NSPLIT + s).to(tl.int64) * NSTAMPS
        tl.store(stamp, globaltimer(s))
    L = tl.load(seq_lens + t)
    slot = tl.load(slots + t).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    gmask = g < G
    row = qkv + t.to(tl.int64) * stride_t
    q = tl.load(row + (kvh * G + g)[:, None] * HD + d[None, :], mask=gmask[:, None], other=0.0)
    if TIMELINE:
        tl.store(stamp + 1, globaltimer(tl.sum(tl.sum(q.to(tl.float32), 1), 0).to(tl.int32) + L))
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    base = kv + slot * stride_slot + kvh * stride_head
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < end
        k = tl.load(base + pos[:, None] * stride_pos + d[None, :], mask=pm[:, None], other=0.0)
        v = tl.load(base + stride_kind + pos[:, None] * stride_pos + d[None, :], mask=pm[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(pm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if PV == 0:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            # Tensor cores: p in [0, 1] as bf16 hi (+ the bf16 remainder lo, which the first
            # rounding left behind: p - hi is exact in fp32). v is bf16 already, so each
            # product is exact and the fp32 accumulation is the only other rounding.
            hi = p.to(tl.bfloat16)
            pv = tl.dot(hi, v)
            if PV == 2:
                pv = tl.dot((p - hi.to(tl.float32)).to(tl.bfloat16), v, pv)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if TIMELINE:
        tl.store(stamp + 2, globaltimer(tl.sum(tl.sum(acc, 1), 0).to(tl.int32)))
    if s == 0:
        kn = tl.load(row + (H + kvh) * HD + d)
        vn = tl.load(row + (H + KV + kvh) * HD + d)
        sn = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale
        m_new = tl.maximum(m, sn)
        alpha = tl.exp(m - m_new)
        pn = tl.exp(sn - m_new)
        l = l * alpha + pn
        acc = acc * alpha[:, None] + pn[:, None] * vn.to(tl.float32)[None, :]
        m = m_new
        tl.store(base + L.to(tl.int64) * stride_pos + d, kn)
        tl.store(base + stride_kind + L.to(tl.int64) * stride_pos + d, vn)
    heads = t * H + kvh * G + g
    out_ptrs = out + t.to(tl.int64) * stride_out + (kvh * G + g)[:, None] * HD + d[None, :]
    # Splits that hold cached positions (NSPLIT covers max_context, the rest are empty); split
    # 0 always takes part (it holds the new token). Every program of this (row, head) computes
    # the same count, so the empty ones simply stop here: no partial, no arrival.
    live = tl.maximum(tl.cdiv(L, CHUNK), 1)
    if NSPLIT == 1:
        tl.store(out_ptrs, (acc / l[:, None]).to(tl.bfloat16), mask=gmask[:, None])
    elif s < live:
        tl.store(m_ws + heads * NSPLIT + s, m, mask=gmask)
        tl.store(l_ws + heads * NSPLIT + s, l, mask=gmask)
        tl.store(acc_ws + (heads * NSPLIT + s)[:, None] * HD + d[None, :], acc, mask=gmask[:, None])
        # The last live split of this (row, KV head) to finish combines all of them: the
        # counter's acq_rel add orders the other programs' partial stores before our loads,
        # which go to L2 (.cg) so no stale L1 line is read. The sum runs over splits in index
        # order, so the bits do not depend on which program came last. It resets the counter,
        # leaving the workspace as it found it for the next launch (and graph replay).
        tl.debug_barrier()          # every thread's partial stores precede the release
        done = tl.atomic_add(counters + t * KV + kvh, 1, sem="acq_rel")
        if TIMELINE:
            tl.store(stamp + 3, globaltimer(done))
        if done == live - 1:
            tl.debug_barrier()      # ... and the acquire precedes every thread's loads
            # COMBINE_SPLITS partials per load, [query heads, splits, head dim] at once: one L2
            # round trip per group of live splits. One split per loop step cost a round trip
            # each, ~0.3 µs (2.6 of a one-row call's ~9 µs; bench/decode_attention_notes.md,
            # session 19). The splits' fp32 sum is grouped differently from one at a time
            # (within one bf16 ulp; still a fixed order, so the bits do not depend on who came
            # last). The query heads are not padded to GP here (no MMA), which keeps the tile
            # in registers.
            gc = tl.arange(0, GC)
            cmask = gc < G
            hc = t * H + kvh * G + gc
            sp = tl.arange(0, NP)
            top = tl.max(tl.load(m_ws + hc[:, None] * NSPLIT + sp[None, :],
                                 mask=cmask[:, None] & (sp[None, :] < live), other=float("-inf"),
                                 cache_modifier=".cg"), 1)
            jj = tl.arange(0, COMBINE_SPLITS)
            o = tl.zeros([GC, HD], tl.float32)
            total = tl.zeros([GC], tl.float32)
            for j0 in range(0, live, COMBINE_SPLITS):
                js = j0 + jj
                on = cmask[:, None] & (js[None, :] < live)
                ws_slot = hc[:, None] * NSPLIT + js[None, :]
                mj = tl.load(m_ws + ws_slot, mask=on, other=float("-inf"), cache_modifier=".cg")
                lj = tl.load(l_ws + ws_slot, mask=on, other=0.0, cache_modifier=".cg")
                aj = tl.load(acc_ws + ws_slot[:, :, None] * HD + d[None, None, :], mask=on[:, :, None],
                             other=0.0, cache_modifier=".cg")
                w = tl.where(on, tl.exp(mj - top[:, None]), 0.0)
                total += tl.sum(w * lj, 1)
                o += tl.sum(w[:, :, None] * aj, 1)
            tl.store(out + t.to(tl.int64) * stride_out + (kvh * G + gc)[:, None] * HD + d[None, :],
                     (o / total[:, None]).to(tl.bfloat16), mask=cmask[:, None])
            tl.store(counters + t * KV + kvh, 0)
            if TIMELINE:
                tl.store(stamp + 4, globaltimer(tl.sum(tl.sum(o, 1), 0).to(tl.int32)))


def decode_attention(qkv, kv, seq_lens, cache_slots, out, *, heads: int, kv_heads: int,
                     head_dim: int, chunk: int | None = None, block_n: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None, pv: str = DEFAULT_PV,
                     combine_splits: int = 16, stamps: torch.Tensor | None = None,
                     workspaces: Workspaces | None = None) -> None:
    """Append each row's K/V at ``seq_lens[t]`` of slot ``cache_slots[t]`` and attend over
    positions ``0..=seq_lens[t]``. Shapes as in graphc.ops.attention (kv: [slots, 2, kv_heads,
    max_context, head_dim], any strides). The tiling arguments default to
    ``default_tiling(rows)``; ``pv`` is one of ``PV_MODES``; ``combine_splits`` (a power of
    two) is how many splits' partials the combining program loads at once (1: one at a time,
    as before session 19; the sum's grouping, not its result beyond an ulp, differs). Executes ``griddepcontrol.launch_dependents`` at entry, so a successor
    launched with the PDL attribute overlaps this kernel. ``stamps`` (int64, ``len(STAMPS)`` per program, for
    bench/attention_triton_timeline.py): compile the timed variant and write ``STAMPS`` there.
    ``workspaces``: whose split-KV partials and counters it uses (kernels/workspaces.py; default
    the process's shared ones); the first call of a shape allocates them, outside capture."""
    if pv not in PV_MODES:
        raise ValueError(f"pv={pv!r} unsupported: one of {', '.join(PV_MODES)}")
    if combine_splits < 1 or combine_splits & (combine_splits - 1):
        raise ValueError(f"combine_splits={combine_splits} unsupported: a power of two")
    T, C = qkv.shape[0], kv.shape[3]
    tiled = default_tiling(T)
    chunk = chunk or tiled[0]
    block_n = block_n or tiled[1]
    num_stages = num_stages or tiled[2]
    G = heads // kv_heads
    nsplit = math.ceil(C / chunk)

    def make():
        n = T * heads * nsplit
        return (torch.empty(n, device=qkv.device), torch.empty(n, device=qkv.device),
                torch.empty(n * head_dim, device=qkv.device),
                torch.zeros(T * kv_heads, device=qkv.device, dtype=torch.int32))

    m_ws, l_ws, acc_ws, counters = workspace(
        workspaces, ("attention_triton", qkv.device.index, T, heads, kv_heads, nsplit, head_dim), make,
        lambda: f"decode_attention at {T} rows")
    # Any strides work (kv is [slots, 2, kv_heads, max_context, head_dim] logically); graphc's
    # cache is head-major and contiguous, so a program reads one contiguous run per K and V.
    _split_kv[(T, kv_heads, nsplit)](
        qkv, kv, seq_lens, cache_slots, m_ws, l_ws, acc_ws, counters, out,
        counters if stamps is None else stamps, qkv.stride(0),
        kv.stride(0), kv.stride(3), kv.stride(1), kv.stride(2), out.stride(0),
        1.0 / math.sqrt(head_dim),
        H=heads, KV=kv_heads, G=G, GP=max(16, triton.next_power_of_2(G)), HD=head_dim,
        CHUNK=chunk, BLOCK_N=block_n, NSPLIT=nsplit, NP=triton.next_power_of_2(nsplit),
        PV=PV_MODES[pv], GC=triton.next_power_of_2(G),
        COMBINE_SPLITS=min(combine_splits, triton.next_power_of_2(nsplit)),
        TIMELINE=int(stamps is not None), num_warps=num_warps, num_stages=num_stages)
