"""Per-program timeline of the Triton decode attention at few rows (kernels/decode_attention.py,
the default at one row until session 23, the fallback there where CuTe DSL is missing): where
the ~8 µs of a call go, against a 1 µs floor.

    source .gpu/setup.sh && python3 bench/attention_triton_timeline.py --rows 1 --replays 200

One CUDA graph holds three kernels in stream order (full edges, as in the step, where the
attention follows the qkv GEMM): a one-program kernel that stamps ``%globaltimer`` as it ends,
the attention compiled with ``TIMELINE=1`` (every program stamps its entry, q loaded, its keys
done, its partial published and counted, and, for the last of its (row, KV head), the combine
done: ``decode_attention.STAMPS``), and a one-program kernel that stamps its entry. Each replay
is read back; the table gives medians over replays of each moment, in µs after the first
kernel's end, over the live programs (the grid's splits past the cached tokens exit at once).
Kimi K3 attention: 64 heads, 8 KV heads, head dim 128, 1023 cached tokens per row. The same
graph with the shipped (untimed) kernel is timed too, to show what the stamps cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

HEADS, KV_HEADS, HEAD_DIM, MAX_CONTEXT, CACHED = 64, 8, 128, 2048, 1023


def stamp_kernels():
    import triton
    import triton.language as tl

    from graphc.kernels.decode_attention import globaltimer

    @triton.jit
    def stamp_now(words, i: tl.constexpr):
        tl.store(words + i, globaltimer(tl.program_id(0)))

    return stamp_now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--chunk", type=int, help="cached positions per program (default: the kernel's tiling)")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--kernel", default="", help="decode_attention keyword arguments, e.g. "
                    "num_stages=1,unroll_combine=1")
    args = ap.parse_args()
    import torch

    from graphc.kernels import decode_attention as da

    torch.manual_seed(0)
    dev = torch.device("cuda")
    T = args.rows
    chunk = args.chunk or da.default_tiling(T)[0]
    nsplit = -(-MAX_CONTEXT // chunk)
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev).to(torch.bfloat16)
    kv = torch.randn(T + 1, 2, KV_HEADS, MAX_CONTEXT, HEAD_DIM, device=dev).to(torch.bfloat16)
    lens = torch.full((T,), CACHED, dtype=torch.int32, device=dev)
    slots = torch.arange(T, dtype=torch.int32, device=dev)
    out = torch.empty(T, HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16)
    stamps = torch.zeros(T * KV_HEADS * nsplit, len(da.STAMPS), dtype=torch.int64, device=dev)
    edges = torch.zeros(2, dtype=torch.int64, device=dev)       # first kernel's end, last's entry
    stamp_now = stamp_kernels()

    knobs = {k: int(v) for k, v in (kv_.split("=") for kv_ in args.kernel.split(",") if kv_)}

    def call(timed: bool) -> None:
        da.decode_attention(qkv, kv, lens, slots, out, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                            chunk=chunk, stamps=stamps if timed else None, **knobs)

    graphs = {}
    for timed in (False, True):
        call(timed)                                            # compile and allocate outside capture
        stamp_now[(1,)](edges, 0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            stamp_now[(1,)](edges, 0)
            call(timed)
            stamp_now[(1,)](edges, 1)
        graphs[timed] = g

    live = -(-CACHED // chunk)
    moments = {name: [] for name in ("first entry", "last entry", *[f"{s} (median)" for s in da.STAMPS[1:]],
                                     *[f"{s} (last)" for s in da.STAMPS[1:]], "next kernel entry")}
    spans = {"q load": [], "keys": [], "publish + count": [], "combine": []}
    for _ in range(args.replays):
        stamps.zero_()
        graphs[True].replay()
        torch.cuda.synchronize()
        w = stamps.view(T, KV_HEADS, nsplit, -1)[:, :, :live].reshape(-1, len(da.STAMPS)).cpu().tolist()
        t0, t_next = edges.cpu().tolist()
        us = [[(x - t0) / 1e3 if x else None for x in row] for row in w]
        entry = [r[0] for r in us]
        moments["first entry"].append(min(entry))
        moments["last entry"].append(max(entry))
        for i, name in enumerate(da.STAMPS[1:], 1):
            got = [r[i] for r in us if r[i] is not None]
            moments[f"{name} (median)"].append(statistics.median(got))
            moments[f"{name} (last)"].append(max(got))
        moments["next kernel entry"].append((t_next - t0) / 1e3)
        spans["q load"] += [r[1] - r[0] for r in us]
        spans["keys"] += [r[2] - r[1] for r in us]
        spans["publish + count"] += [r[3] - r[2] for r in us if r[3] is not None]
        spans["combine"] += [r[4] - r[3] for r in us if r[4] is not None]

    def per_call_us(g) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(20):
            g.replay()
        start.record()
        for _ in range(args.replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / args.replays

    print(f"{torch.cuda.get_device_name()}: {T} row(s), chunk {chunk}, {knobs or 'default tiling'}, "
          f"{live} live splits per (row, KV head), "
          f"{T * KV_HEADS * live} live programs of {T * KV_HEADS * nsplit}; {args.replays} replays")
    print(f"graph of stamp -> attention -> stamp, µs per replay: shipped {per_call_us(graphs[False]):.2f}, "
          f"timed {per_call_us(graphs[True]):.2f}")
    print("µs after the first kernel's end (median over replays):")
    for name, values in moments.items():
        print(f"  {name:28s} {statistics.median(values):7.2f}")
    print("per program (median over programs and replays), µs:")
    for name, values in spans.items():
        print(f"  {name:28s} {statistics.median(values):7.2f}")


if __name__ == "__main__":
    main()
