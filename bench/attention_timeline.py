"""Per-CTA timeline of the CuTe DSL decode attention alone: when each CTA's consumer started
and ended (``%globaltimer``) and on which SM, next to the same pipeline with an empty
consumer (it waits for each tile and releases it: the ring's own streaming rate). It answers
whether a slow call is a tail (a few CTAs ending late) or a rate (every CTA slower).
bench/decode_attention_notes.md, session 9.

    source .gpu/setup.sh && python3 bench/attention_timeline.py 32:1024:3 64:1024:1

Each argument is ``rows:chunk:stages``; every row holds 1023 cached tokens and appends one,
so with ``chunk`` >= 1024 each (row, KV head) is one live CTA and the kernel's split workspace
is unused: the timer words go there (three int32 per CTA: start, end, SM). The grid's further
splits (the cache holds 2048 positions) exit at once and write nothing; they are left out. The instrumented
kernels are subclasses compiled here (not cached), so the shipped kernel carries nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

HEADS, KV_HEADS, HEAD_DIM, MAX_CONTEXT, CACHED = 64, 8, 128, 2048, 1023
WORDS = 3                  # per CTA: consumer start, consumer end, SM


def kernel_classes():
    """(timed shipped kernel, timed stream-only kernel), built on import of cutlass."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from graphc.kernels import decode_attention_tma as tma

    @cute.jit
    def record(self, mWs, t, kvh, split, tidx, start, end):
        """Thread 0 writes the CTA's words into the (unused) split workspace."""
        if tidx == 0:
            cta = (t * self.cfg.kv_heads + kvh) * self.cfg.splits + split
            words = cute.make_tensor(cute.recast_ptr(mWs.iterator, dtype=Int32),
                                     cute.make_layout(WORDS * self.cfg.rows * self.cfg.kv_heads * self.cfg.splits))
            words[WORDS * cta] = start
            words[WORDS * cta + 1] = end
            words[WORDS * cta + 2] = cute.arch.smid()

    class Timed(tma.DecodeAttentionKernel):
        """The shipped consumer between two timer reads."""

        @cute.jit
        def consumer(self, tiled_mma_qk, tiled_mma_pv, mQKV, mOut, mWs, mCount, sQ, sK, sV, sP, sMax, sSum,
                     full, empty, flag, t, kvh, split, live, start, end, n_tiles, tidx):
            t0 = cute.arch.globaltimer_lo()
            tma.DecodeAttentionKernel.consumer(self, tiled_mma_qk, tiled_mma_pv, mQKV, mOut, mWs, mCount, sQ, sK,
                                               sV, sP, sMax, sSum, full, empty, flag, t, kvh, split, live, start,
                                               end, n_tiles, tidx)
            record(self, mWs, t, kvh, split, tidx, t0, cute.arch.globaltimer_lo())

    class StreamOnly(tma.DecodeAttentionKernel):
        """The same producer and ring; the consumer waits for each tile and frees it."""

        @cute.jit
        def consumer(self, tiled_mma_qk, tiled_mma_pv, mQKV, mOut, mWs, mCount, sQ, sK, sV, sP, sMax, sSum,
                     full, empty, flag, t, kvh, split, live, start, end, n_tiles, tidx):
            t0 = cute.arch.globaltimer_lo()
            cute.arch.griddepcontrol_wait()
            lane = cute.arch.lane_idx()
            for i in cutlass.range(n_tiles, unroll=1):
                s = i % self.cfg.stages
                cute.arch.mbarrier_wait(full + s, (i // self.cfg.stages) % 2)
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty + s)
            record(self, mWs, t, kvh, split, tidx, t0, cute.arch.globaltimer_lo())

    return Timed, StreamOnly


def config(rows: int, chunk: int, stages: int):
    from graphc.kernels.decode_attention_tma import AttentionConfig

    if chunk < CACHED + 1:
        raise SystemExit(f"chunk={chunk}: the timer words need one CTA per (row, KV head), chunk >= {CACHED + 1}")
    return AttentionConfig(rows, HEADS, KV_HEADS, HEAD_DIM, MAX_CONTEXT, chunk, stages)


def compile_variants(cfg) -> dict:
    import cutlass.cute as cute

    from graphc.kernels.decode_attention_tma import _compile_args

    timed, stream_only = kernel_classes()
    return {"kernel": cute.compile(timed(cfg), *_compile_args()),
            "stream_only": cute.compile(stream_only(cfg), *_compile_args())}


def summary(words, label: str) -> str:
    """Start / end / duration quantiles (µs from the first start) and ends per SM load, over
    the CTAs that wrote their words (splits past a row's last position exit without)."""
    import torch

    words = words[words[:, 1] != 0]
    start, end, sm = words[:, 0], words[:, 1], words[:, 2]
    t0 = (start - start.min()) % (1 << 32)               # globaltimer_lo wraps every 4.3 s
    t1 = (end - start.min()) % (1 << 32)
    starts, ends = t0.double() / 1000, t1.double() / 1000
    q = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    fmt = lambda x: " ".join(f"{v:.1f}" for v in torch.quantile(x, q).tolist())  # noqa: E731
    per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)
    lines = [f"{label}: {len(words)} CTAs, {int(per_sm[per_sm > 0].min())}-{int(per_sm.max())} per SM",
             f"   quantiles 0/10/50/90/100%: start {fmt(starts)} | end {fmt(ends)} | duration {fmt(ends - starts)}"]
    for n in sorted(set(per_sm[per_sm > 0].tolist())):
        mine = per_sm[sm] == n
        lines.append(f"   on SMs with {n} CTAs: {int(mine.sum())} CTAs, end median {ends[mine].median():.1f} "
                     f"max {ends[mine].max():.1f}, duration median {(ends - starts)[mine].median():.1f}")
    return "\n".join(lines)


def run(rows: int, chunk: int, stages: int) -> None:
    import cuda.bindings.driver as cuda
    import torch

    from graphc.bench import time_replays

    cfg = config(rows, chunk, stages)
    fns = compile_variants(cfg)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda").to(torch.bfloat16)
    caches = [torch.randn(rows + 1, 2, KV_HEADS, MAX_CONTEXT, HEAD_DIM, device="cuda").to(torch.bfloat16)
              for _ in range(2)]
    lens = torch.full((rows,), CACHED, device="cuda", dtype=torch.int32)
    slots = torch.arange(rows, device="cuda", dtype=torch.int32)
    out = torch.empty(rows, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    floor = rows * (CACHED + 1) * 2 * KV_HEADS * HEAD_DIM * 2 / 4.3e12
    n = rows * KV_HEADS * cfg.splits
    print(f"rows={rows} chunk={chunk} stages={stages} (floor {floor * 1e6:.1f} us)", flush=True)
    for name, fn in fns.items():
        ws = torch.zeros(max(rows * HEADS * cfg.splits * (2 + HEAD_DIM), WORDS * n), device="cuda")
        counters = torch.zeros(rows * KV_HEADS, device="cuda", dtype=torch.int32)

        def call(kv):
            fn(qkv.data_ptr(), kv.data_ptr(), lens.data_ptr(), slots.data_ptr(), out.data_ptr(), ws.data_ptr(),
               counters.data_ptr(), rows + 1, cuda.CUstream(torch.cuda.current_stream().cuda_stream), False)

        call(caches[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                for kv in caches:
                    call(kv)
        per_call = time_replays(graph.replay, 3, 20) / 10
        words = ws.view(torch.int32)[:WORDS * n].view(n, WORDS).cpu().long()
        print(summary(words, f"  {name}: {per_call * 1e6:.1f} us per call ({per_call / floor:.2f}x the floor)"),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="rows:chunk:stages, e.g. 32:1024:3")
    args = ap.parse_args()
    for c in args.configs:
        run(*(int(v) for v in c.split(":")))


if __name__ == "__main__":
    main()
