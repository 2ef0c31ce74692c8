"""Benchmark: the AttnRes cluster kernel against the same op as PyTorch ops, both in CUDA graphs.

    python3 bench/attn_res.py --out $OUT/attn_res.json

Per configuration (hidden 7168, has_delta, not final, no block write; nb in {1, 8}, T in
{1, 8, 64, 256}) a chain of calls is captured into CUDA graphs (graphc: 100 calls a graph,
each launched with PDL, so call i+1's prologue overlaps call i; torch: 20 calls of
``attn_res_reference`` a graph). The calls rotate over enough input sets that the data of
one round of replays is at least 3x the L2 size (several graphs when one chain of 100 calls
is not enough), so the caches do not flatter graphc's columns. The PyTorch column uses at
most 5 graphs (100 input sets), which at 1-8 tokens fit in L2: it is flattered, i.e. the
comparison is conservative for graphc. Time per call = the median over replays of
(graph time / calls), measured with CUDA events after warm-up.

The floor is the HBM traffic, ((nb + 4) x T + 3) x D x 2 bytes (nb saved blocks, prefix read
and write, delta, output; the three weight vectors) at 4.3 TB/s (the device-to-device copy
rate measured on an H200 here).
Two graphc columns, because they answer different questions:
- "graphc PDL": calls launched with PDL, so call i+1's pre phase overlaps call i. This is the
  rate of a chain of independent calls, which the decode step never is (a GEMM sits between
  two AttnRes there); bench/chain.py measures AttnRes in its real neighbourhood.
- "graphc serial": the same chain launched without PDL, each call after the previous one
  completes: the like-for-like comparison with the PyTorch column, whose calls are serial too.
The PyTorch column includes one copy kernel per call (the reference returns a new tensor).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphc.kernels.attn_res import attn_res, compile_attn_res  # noqa: E402
from graphc.ops.attn_res_math import attn_res_reference  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
EPS = 1e-6


def floor_us(T: int, nb: int, D: int) -> float:
    """nb saved blocks, the delta and the prefix read, the prefix and the output written (T
    rows each), and the three weight vectors (norm, key norm, query): each input set has its
    own copies, so they come from HBM too."""
    return ((nb + 4) * T + 3) * D * 2 / HBM_BYTES_PER_S * 1e6


def make_set(T: int, D: int, nb: int, gen: torch.Generator) -> dict:
    dev = "cuda"
    bf = torch.bfloat16
    return dict(
        delta=torch.randn(T, D, generator=gen, device=dev).to(bf),
        prefix=(4 * torch.randn(T, D, generator=gen, device=dev)).to(bf),
        blocks=(2 * torch.randn(T, max(nb, 1), D, generator=gen, device=dev)).to(bf),
        key_norm=(1 + 0.2 * torch.randn(D, generator=gen, device=dev)).to(bf),
        query=(4 / math.sqrt(D) * torch.randn(D, generator=gen, device=dev)).to(bf),
        out_norm=(1 + 0.2 * torch.randn(D, generator=gen, device=dev)).to(bf),
        output=torch.empty(T, D, device=dev, dtype=bf),
    )


def call_graphc(s: dict, nb: int, stream, use_pdl: bool) -> None:
    attn_res(s["delta"], s["prefix"], s["blocks"], s["key_norm"], s["query"], s["out_norm"], s["output"],
             nb=nb, has_delta=True, write=-1, final=False, eps=EPS, out_eps=EPS, stream=stream, use_pdl=use_pdl)


def call_torch(s: dict, nb: int, stream, use_pdl: bool) -> None:
    s["output"].copy_(attn_res_reference(s["delta"], s["prefix"], s["blocks"], s["key_norm"], s["query"],
                                         s["out_norm"], nb=nb, has_delta=True, write=-1, final=False,
                                         eps=EPS, out_eps=EPS))


def time_chain(call, sets: list, nb: int, calls_per_graph: int, graphs: int, *, use_pdl: bool = True,
               replays: int = 30, warmup: int = 3) -> float:
    """Median microseconds per call over graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    captured = []
    with torch.cuda.stream(stream):
        for s in sets[: min(len(sets), 2)]:
            call(s, nb, stream, use_pdl)  # module load and allocator warm-up outside capture
        stream.synchronize()
        for g in range(graphs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for i in range(calls_per_graph):
                    call(sets[(g * calls_per_graph + i) % len(sets)], nb, stream, use_pdl)
            captured.append(graph)
    torch.cuda.synchronize()
    for _ in range(warmup):
        for graph in captured:
            graph.replay()
    torch.cuda.synchronize()
    events = []
    for _ in range(replays):
        for graph in captured:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events.append((start, end))
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) * 1e3 / calls_per_graph for s, e in events]
    del captured
    return statistics.median(per_call)


def plan_sets(T: int, D: int, nb: int, calls_per_graph: int, l2_bytes: int) -> tuple[int, int]:
    """(input sets, graphs): one round of replays touches >= 3x L2 where possible."""
    set_bytes = (T * (max(nb, 1) + 3) * D) * 2
    wanted = max(2, math.ceil(3 * l2_bytes / set_bytes))
    sets = min(wanted, 4000)
    graphs = max(1, math.ceil(sets / calls_per_graph))
    return sets, graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 256])
    parser.add_argument("--nb", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    args = parser.parse_args()

    D = args.hidden
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    header = (f"{'T':>5} {'nb':>3} {'graphc PDL us':>14} {'graphc serial us':>17} {'torch us':>9} "
              f"{'floor us':>9} {'x floor (PDL)':>14}")
    print(f"{props.name}, L2 {l2 / 2**20:.0f} MiB, hidden {D}")
    print(header)
    print("-" * len(header))
    for nb in args.nb:
        compile_attn_res(D, nb, True, -1, False, 0)
        for T in args.tokens:
            n_sets, graphs = plan_sets(T, D, nb, 100, l2)
            sets = [make_set(T, D, nb, gen) for _ in range(n_sets)]
            ours = time_chain(call_graphc, sets, nb, 100, graphs, replays=args.replays)
            serial = time_chain(call_graphc, sets, nb, 100, graphs, use_pdl=False, replays=args.replays)
            theirs = float("nan")
            if not args.no_torch:
                theirs = time_chain(call_torch, sets, nb, 20, max(1, min(graphs, 5)), replays=max(5, args.replays // 3))
            fl = floor_us(T, nb, D)
            rows.append(dict(T=T, nb=nb, graphc_us=ours, graphc_serial_us=serial, torch_graph_us=theirs,
                             floor_us=fl, ratio_to_floor=ours / fl, input_sets=n_sets, graphs=graphs))
            print(f"{T:>5} {nb:>3} {ours:>14.2f} {serial:>17.2f} {theirs:>9.2f} {fl:>9.2f} {ours / fl:>14.2f}",
                  flush=True)
            del sets
            torch.cuda.empty_cache()

    result = dict(
        gpu=props.name,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hidden=D, has_delta=True, final=False, hbm_bytes_per_s=HBM_BYTES_PER_S,
        torch=torch.__version__, rows=rows,
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
