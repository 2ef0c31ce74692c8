"""What the AttnRes <-> GEMM overlap saves: a chain AttnRes -> GEMM -> AttnRes -> GEMM ...

    source .gpu/setup.sh && python3 bench/chain.py --out $OUT/chain.json

Each link is the decode step's pattern: the AttnRes kernel (hidden 7168, nb = 4 saved blocks,
has_delta) reads the previous GEMM's output as its delta and writes the next GEMM's input; the
GEMM is a 7168 x 7168 projection (102.8 MB of weights, cycling over enough copies that no call
finds its weights in L2). Per batch size M, all in CUDA graphs of 24 links, captured first
and timed in ``--rounds`` round-robin passes (median):

* ``gemm``: the GEMMs alone (the same 24 calls, PDL edges between them);
* ``pdl``: the chain with PDL edges everywhere (AttnRes's pre-phase runs under the GEMM's
  tail, the GEMM's weight prologue under AttnRes);
* ``full``: the same kernels with full edges (no PDL attribute), and ``gemm_full`` the GEMMs
  alone with full edges, its baseline;
* ``cublas``: AttnRes (PDL) with torch.mm instead of our GEMM (full edges into cuBLAS).

Our GEMM reads its weights as a build stores them, in 64 x 64 blocks (kernels/weight_blocks.py;
a tuning with ``w_blocked=0``: row-major); cuBLAS reads row-major copies.

``added`` = (chain - GEMMs alone with the same kind of edges) / links: what each AttnRes
costs beyond the GEMMs' own time (issue 5's target: <= 1 us with PDL). ``--tunings`` (the syntax of ``bench/gemm.py``; default:
no / 16 W iterations prefetched into L2 before the GEMM's wait) repeats gemm / pdl / added with
the GEMM built with other knobs, e.g. ``stages=6`` to leave more shared memory for the AttnRes
CTAs that share its SMs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphc.kernels import gemm  # noqa: E402
from graphc.kernels.weight_blocks import to_blocks  # noqa: E402
from graphc.kernels.attn_res import attn_res  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import parse_tunings, time_interleaved  # noqa: E402  (bench/gemm.py)

D, NB, LINKS, EPS = 7168, 4, 24, 1e-6
DEFAULT_TUNINGS = "l2_prefetch=8;l2_prefetch=16"


def capture_graph(fn):
    """A CUDA graph of ``fn(stream)``, warmed up once on the capturing stream outside capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(stream)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn(stream)
    torch.cuda.synchronize()
    return graph


def chain_inputs(m: int) -> SimpleNamespace:
    """The chain's tensors at M rows: enough weight copies (> 4x L2) that no link finds its
    weights in L2, link i's AttnRes reading ys[i] and writing xs[i], its GEMM xs[i] -> ys[i+1]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, math.ceil(4 * l2 / (D * D * 2)))
    return SimpleNamespace(
        copies=copies,
        ws=[(torch.randn(D, D, generator=g, device="cuda") / D**0.5).to(bf) for _ in range(copies)],
        ys=[torch.randn(m, D, generator=g, device="cuda").to(bf) for _ in range(LINKS + 1)],
        # Written by each link's AttnRes; random too, so that the GEMMs-alone chain (no AttnRes)
        # multiplies real values, as the chains with AttnRes do (a power-capped board is
        # sensitive to what the tensor cores chew on).
        xs=[torch.randn(m, D, generator=g, device="cuda").to(bf) for _ in range(LINKS)],
        prefix=(4 * torch.randn(m, D, generator=g, device="cuda")).to(bf),
        blocks=(2 * torch.randn(m, NB, D, generator=g, device="cuda")).to(bf),
        key_norm=(1 + 0.2 * torch.randn(D, generator=g, device="cuda")).to(bf),
        query=(4 / math.sqrt(D) * torch.randn(D, generator=g, device="cuda")).to(bf),
        out_norm=(1 + 0.2 * torch.randn(D, generator=g, device="cuda")).to(bf),
    )


def bench(m: int, replays: int, tunings: list[tuple[str, dict]], rounds: int = 3) -> dict:
    """Every chain of one M captured first, then timed in ``rounds`` round-robin passes
    (bench/gemm.py's ``time_interleaved``: 50 ms of warm-up replays before each pass); each
    figure is the median over the passes, so no configuration gains from its place in the row."""
    t = chain_inputs(m)

    def res(i, stream, use_pdl):
        attn_res(t.ys[i], t.prefix, t.blocks, t.key_norm, t.query, t.out_norm, t.xs[i], nb=NB,
                 has_delta=True, write=-1, final=False, eps=EPS, out_eps=EPS, stream=stream,
                 use_pdl=use_pdl)

    # Ours reads its weights as a build stores them: in 64 x 64 blocks where the kernel that
    # runs reads them (kernels/weight_blocks.py; w_blocked=0 in a tuning: row-major); cuBLAS
    # reads the row-major copies.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocked_ws = [to_blocks(w) for w in t.ws]
    default_blocked = int(gemm.reads_blocks(m, D, D, None, sms))

    def chain(use_pdl, with_res=True, cublas=False, **tuning):
        in_blocks = tuning.pop("w_blocked", default_blocked) and not cublas
        weights = blocked_ws if in_blocks else t.ws

        def run(stream):
            for i in range(LINKS):
                if with_res:
                    res(i, stream, use_pdl)
                w = weights[i % t.copies]
                if cublas:
                    torch.mm(t.xs[i], w.t(), out=t.ys[i + 1])
                else:
                    gemm.linear(t.xs[i], w, t.ys[i + 1], stream=stream, use_pdl=use_pdl, **tuning)
        return run

    chains = {"gemm": chain(True, with_res=False), "pdl": chain(True), "full": chain(False),
              "gemm_full": chain(False, with_res=False),
              "cublas_gemm": chain(False, with_res=False, cublas=True), "cublas": chain(True, cublas=True)}
    # The same with other GEMM knobs (by default: what the L2 prefetch before the wait buys).
    for label, tuning in tunings:
        chains[f"{label}/gemm"] = chain(True, with_res=False, **tuning)
        chains[f"{label}/pdl"] = chain(True, **tuning)
    passes = time_interleaved({name: capture_graph(fn) for name, fn in chains.items()}, replays, rounds)
    per_link = {name: statistics.median(p) / LINKS for name, p in passes.items()}
    row = {"m": m, "links": LINKS, "weight_copies": t.copies, "rounds": rounds,
           "rounds_s": {name: [x / LINKS for x in p] for name, p in passes.items()}}
    for name in ("gemm", "gemm_full", "pdl", "full", "cublas_gemm", "cublas"):
        row[name + "_s"] = per_link[name]
    # Each chain against the GEMMs alone with the same edges: with full edges the GEMMs alone
    # lose their own overlap too, which is not what an AttnRes adds.
    row["pdl_added_s"] = row["pdl_s"] - row["gemm_s"]
    row["full_added_s"] = row["full_s"] - row["gemm_full_s"]
    row["cublas_added_s"] = row["cublas_s"] - row["cublas_gemm_s"]
    row["tunings"] = {}
    for label, _ in tunings:
        alone, linked = per_link[f"{label}/gemm"], per_link[f"{label}/pdl"]
        row["tunings"][label] = {"gemm_s": alone, "pdl_s": linked, "added_s": linked - alone}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,8,64")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="round-robin timing passes per M (median)")
    ap.add_argument("--tunings", type=parse_tunings, default=parse_tunings(DEFAULT_TUNINGS),
                    help=f"GEMM knob alternatives, bench/gemm.py syntax (default {DEFAULT_TUNINGS!r})")
    ap.add_argument("--out")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: per link (AttnRes nb={NB} + {D}x{D} GEMM), {LINKS} links per graph")
    hdr = (f"{'M':>4} {'gemm us':>8} {'pdl us':>8} {'added':>7} {'full us':>8} {'added':>7} "
           f"{'cuBLAS us':>9} {'+AttnRes':>9} {'added':>7}  GEMM tunings: gemm/pdl/added us")
    print(hdr)
    rows = []
    for m in (int(v) for v in args.m.split(",")):
        r = bench(m, args.replays, args.tunings, args.rounds)
        rows.append(r)
        print(f"{m:>4} {r['gemm_s'] * 1e6:8.2f} {r['pdl_s'] * 1e6:8.2f} {r['pdl_added_s'] * 1e6:7.2f} "
              f"{r['full_s'] * 1e6:8.2f} {r['full_added_s'] * 1e6:7.2f} {r['cublas_gemm_s'] * 1e6:9.2f} "
              f"{r['cublas_s'] * 1e6:9.2f} {r['cublas_added_s'] * 1e6:7.2f}  "
              + " ".join(f"{label}: {v['gemm_s'] * 1e6:.2f}/{v['pdl_s'] * 1e6:.2f}/+{v['added_s'] * 1e6:.2f}"
                         for label, v in r["tunings"].items()), flush=True)
        torch.cuda.empty_cache()
    result = {"gpu": props.name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "hidden": D, "nb": NB, "rows": rows}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"chain_{_dt.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
