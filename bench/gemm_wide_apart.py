"""The whole-K tiles' feed and tensor work timed apart: for one configuration of
kernels/gemm_wide.py, the shipped kernel beside three variants of it, each timed in a CUDA
graph the way bench/gemm.py times ours, and cuBLAS (bench/gemm_notes.md §57).

    source .gpu/setup.sh && python3 bench/gemm_wide_apart.py o_proj:256 qkv:256 o_proj:256:cluster=1

- ``shipped``: the kernel ``gemm.linear`` runs for the case (from the compile cache); its
  output is checked against torch first.
- ``feed``: the same producer warp, ring and barriers; the consumers wait for each stage to
  land and release it in the shipped order, with no wgmma (they store zeros). The rate at
  which this ring delivers W and x when nothing else holds it up.
- ``feed_w``: ``feed`` with no x loads (each stage armed with its W bytes only): what x's L2
  reads cost the W stream.
- ``tensor``: the shipped prologue fills one round of stages, then the consumers run the
  shipped k-block loop over those stages again and again without waiting for any refill: the
  tensor work and its issue alone.

If ``shipped`` is near ``feed``, the feed sets the pace and the question is why it streams W
more slowly than cuBLAS (``feed`` against cuBLAS, and ``feed_w`` against ``feed``); if
``shipped`` is well above max(``feed``, ``tensor``), the two halves overlap badly.
Only ``shipped`` computes y: the variants are timing probes and their outputs are not results.

Each argument is bench/gemm_ncu.py's ``shape:M[:knob=value,...]``, the knobs those of
``gemm.plan`` (``ctas``, ``static_stages=1``, ``stages=7``, ``cluster=1``, ``w_blocked=0`` ...);
the configuration must be the whole-K tiles (``wide=1`` forces them), without ``wg_release``.
W is in blocks where the shipped default reads blocks, as in bench/gemm.py. The variants are
subclasses compiled here (not cached), so the shipped kernel carries nothing. ``--out`` is
rewritten after every case.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def probe_classes() -> dict:
    """{probe name: WideGemmKernel subclass}, built on import of cutlass."""
    import cutlass.cute as cute
    from cutlass import Int32

    from graphc.kernels import gemm_wide as wide

    class Feed(wide.WideGemmKernel):
        """The shipped ring; each consumer k-block only waits for its stage."""

        @cute.jit
        def k_block(self, tiled_mma, tCrX, tCrW, acc, wg, s, full_s, phase):
            cute.arch.mbarrier_wait(full_s, phase)

    class FeedW(Feed):
        """``Feed`` without x: every stage armed with, and filled by, its W boxes only."""

        def __init__(self, cfg):
            cfg = copy.copy(cfg)
            cfg.stage_tx_bytes = cfg.w_tx_bytes
            super().__init__(cfg)

        @cute.jit
        def load_x(self, tma_x, mX_tma, sX, cta, rank, i, stage, bar):
            pass

    class Tensor(wide.WideGemmKernel):
        """One round of stages loaded; then the shipped k-blocks on them without refills. Every
        wait asks for the stage's first fill (parity 0), which later rounds find complete."""

        @cute.jit
        def refill(self, tma_x, mX_tma, tma_w, mW_tma, sX, sW, full, empty_s, cta, rank, i, s, phase, evict_first):
            pass

        @cute.jit
        def k_block(self, tiled_mma, tCrX, tCrW, acc, wg, s, full_s, phase):
            wide.WideGemmKernel.k_block(self, tiled_mma, tCrX, tCrW, acc, wg, s, full_s, Int32(0))

    return {"feed": Feed, "feed_w": FeedW, "tensor": Tensor}


def compile_probes(cfg, options: str | None = None) -> dict:
    """{probe name: compiled kernel} for a WideGemmConfig (``options`` as ``cute.compile``
    takes them, e.g. ``--keep-ptx --dump-dir D``)."""
    import cutlass.cute as cute

    from graphc.kernels import gemm_wide

    extra = {"options": options} if options else {}
    return {name: cute.compile(cls(cfg), *gemm_wide.compile_args(), **extra)
            for name, cls in probe_classes().items()}


def wide_config(name: str, m: int, tuning: dict, sms: int):
    """(the WideGemmConfig ``gemm.linear`` runs for the case on ``sms`` SMs, rows per W block or
    0 for row-major): W in blocks where the default reads them and the knobs allow, as
    bench/gemm.py does. Exits naming the problem if the case runs the stream-K kernel."""
    from gemm import weight_order
    from gemm_ncu import SHAPES

    from graphc.kernels import gemm, gemm_wide, weight_blocks

    k, n, epi = SHAPES[name]
    tuning = dict(tuning)
    ctas = tuning.pop("ctas", sms)

    knobs, _ = weight_order(tuning)         # plan's knobs; W's order is chosen here

    def variant(rows):
        return gemm.compiled_variant(m, k, n, epi, ctas, w_block_rows=rows, **knobs)

    blocks_by_default = gemm.reads_blocks(m, k, n, epi, ctas)
    if blocks_by_default:
        try:
            variant(weight_blocks.BLOCK)        # refused where these knobs cannot read blocks
        except ValueError:
            blocks_by_default = False
    rows = weight_order(tuning, blocks_by_default)[1]
    module, key = variant(rows)
    if module != gemm_wide.__name__:
        raise SystemExit(f"{name}:{m}: runs {module.rsplit('.', 1)[-1]}, not the whole-K tiles: add wide=1")
    cfg = gemm_wide.WideGemmConfig.from_key(key)
    if cfg.wg_release:
        # Its one release per warpgroup is safe because the warpgroup's shared wgmma keep its
        # four warps together; the feed probes have none, so a lagging warp could fall a ring
        # behind the releases and wait on the wrong phase. Time wg_release in bench/gemm.py.
        raise SystemExit(f"{name}:{m}: wg_release=1 is not probed: the feed probes have no wgmma to keep a "
                         f"warpgroup's warps together, which its releases rely on (bench/gemm.py times it)")
    return cfg, rows


def run_case(arg: str, rounds: int, replays: int, floor: dict) -> dict:
    import cuda.bindings.driver as cuda
    import torch
    from gemm import _capture, time_interleaved
    from gemm_ncu import SHAPES, parse_case

    from graphc.kernels import gemm_wide, weight_blocks

    name, m, tuning = parse_case(arg)
    k, n, epi = SHAPES[name]
    props = torch.cuda.get_device_properties(0)
    cfg, rows = wide_config(name, m, tuning, props.multi_processor_count)
    print(f"{arg}: {cfg!r}, W {'in %d-row blocks' % rows if rows else 'row-major'}", flush=True)
    fns = {"shipped": gemm_wide.compile_wide(cfg), **compile_probes(cfg)}

    # As bench/gemm.py: a chain cycling through enough weight copies that no call finds its
    # weights in L2.
    w_bytes = n * k * 2
    copies = max(2, math.ceil(4 * props.L2_cache_size / w_bytes))
    chain = max(8, copies)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    xs = [torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    ys = [torch.empty(m, cfg.n_out, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    w_in = [weight_blocks.to_blocks(w, rows) for w in ws] if rows else ws

    def launch(fn, j):
        fn(xs[j].data_ptr(), w_in[j].data_ptr(), ys[j].data_ptr(),
           cuda.CUstream(torch.cuda.current_stream().cuda_stream), True)

    ys[0].fill_(float("nan"))
    launch(fns["shipped"], 0)
    ref = xs[0].float() @ ws[0].float().T
    if epi == "silu_mul":
        ref = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2:]
    err = ((ys[0].float() - ref).norm() / ref.norm()).item()

    def chained(fn):
        return lambda: [launch(fn, i % copies) for i in range(chain)]

    projections = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)] if epi else ys

    def cublas():                               # (with silu_mul, the projection alone)
        for i in range(chain):
            torch.mm(xs[i % copies], ws[i % copies].t(), out=projections[i % copies])

    graphs = {label: _capture(chained(fn)) for label, fn in fns.items()}
    graphs["cublas"] = _capture(cublas)
    passes = time_interleaved(graphs, replays, rounds)
    us = {label: statistics.median(ts) / chain * 1e6 for label, ts in passes.items()}
    floor_us = w_bytes / floor["hbm_bytes_per_s"] * 1e6
    for label, t in us.items():
        note = f"  rel err {err:.1e}" + (" (BAD)" if err > 1e-2 else "") if label == "shipped" else ""
        print(f"  {label:<8}{t:>9.2f} us  {floor_us / t:>6.1%} of the floor  {t / us['cublas']:>6.3f}x cuBLAS{note}",
              flush=True)
    paced = max(us["feed"], us["tensor"])
    print(f"  shipped / max(feed, tensor) = {us['shipped'] / paced:.3f}; feed / feed_w = "
          f"{us['feed'] / us['feed_w']:.3f}", flush=True)
    return {"case": arg, "config": repr(cfg), "w_block_rows": rows, "rel_err": err, "floor_us": floor_us,
            "us": us, "rounds_us": {label: [t / chain * 1e6 for t in ts] for label, ts in passes.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", metavar="shape:M[:knobs]")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin passes over the five graphs (median)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args()
    import torch
    from gemm_ncu import parse_case

    from graphc.bench import device_floor_bandwidth

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for arg in args.cases:                       # every case checked before any GPU work
        name, m, tuning = parse_case(arg)
        wide_config(name, m, tuning, sms)
    floor = device_floor_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: floor at {floor['hbm_bytes_per_s'] / 1e12:.2f} TB/s ({floor['source']}), "
          f"copy {floor['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    rows = []
    for arg in args.cases:
        rows.append(run_case(arg, args.rounds, args.replays, floor))
        if args.out:                     # after every case: a later one that fails loses nothing
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(0), "floor": floor, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
