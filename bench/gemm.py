"""Benchmark the decode GEMM (kernels/gemm.py) against cuBLAS (torch.matmul), DESIGN §7.

    source .gpu/setup.sh && python3 bench/gemm.py --out $OUT/gemm.json

Each measurement is one CUDA graph holding a chain of ``--chain`` calls that cycle through
enough copies of the weights (and inputs, outputs) that the chain's weights are several times
the L2, so no call finds its weights cached. The graph is replayed ``--replays`` times between
CUDA events; the time per call is the median replay time divided by the chain length.

Columns: ``pdl`` is our kernel as the decode step runs it (each call launched with the PDL
attribute, so its weight prologue overlaps the previous call's tail); ``nopdl`` the same
without the attribute (as after a predecessor that never lets it in early: cuBLAS, or a kernel
holding every SM to its end); ``cublas`` is ``torch.mm`` in the same kind of graph (for
silu_mul the GEMM alone; ``cublas+act`` adds the one Triton silu(gate) * up kernel that graphc's
unfused cuBLAS path runs; before session 21 it was torch's silu and mul, two kernels and a
copy of the strided gate). Both ratios to cuBLAS are printed: PDL chaining hides 2-3 µs per call at 32-64
rows (bench/gemm_notes.md §14).
The floor is max(N*K*2 bytes / HBM bandwidth, 2*M*N*K FLOP / matrix rate), by the rule of
``graphc bench`` (graphc/floor.py, graphc.bench.device_floor_bandwidth): on an H200 4.3 TB/s
and 790 TFLOP/s, fixed, with this board's device-to-device copy and read rate reported beside
them; on any other GPU its own measured copy rate and the byte term alone. ``--power`` samples the board's power and SM clock while ours, cuBLAS and each
variant run.
``variants`` times the legal alternatives to the default tuning (``bk``: K per stage 64/128;
``pf``: W iterations prefetched into L2 before the PDL wait), each checked against the
reference first; they decide
DEFAULT_BLOCK_K and DEFAULT_L2_PREFETCH. ``--tunings`` takes any knob of ``gemm.plan``: e.g.
``"wide=0;wide=1,cluster=1"`` times the stream-K kernel and the whole-K tiles without W
multicast beside the default (kernels/gemm_wide.py, bench/gemm_notes.md §21); ``--no-variants``
times neither. ``--rounds R`` times every configuration of a row R times round-robin and
reports medians: use it (3 or more) to decide between configurations, whose times otherwise
depend on their place in the row by up to 10-20% on a power-capped board (§22, §23).

Since session 26 ours reads its weights as a graphc build stores them: in 64 x 64 blocks
(kernels/weight_blocks.py) where the kernel that runs reads them (``gemm.reads_blocks``: the
stream-K kernel since session 26, 2-7% faster from them, bench/gemm_notes.md §33; the whole-K
tiles since session 27, §34), else row-major; cuBLAS reads row-major copies. ``--tunings
w_blocked=0`` times ours on row-major weights beside it, ``w_block_rows=16`` on 16-row blocks.

Runtime: ~3 compiles per (shape, M) (a few seconds each) plus ~1 s of timing; the default
16 rows take a few minutes. ``--no-variants`` halves that; ``--shapes tiny`` adds tiny.yaml;
``--shape NAME=K,N`` adds a shape of your own (e.g. ``qkv39=7168,9984``, §47). Each
``--tunings`` variant's line names the configuration it ran and, with clusters, how many the
grid launches against how many this GPU runs at once (bench/cluster_occupancy.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import math
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# Same target string as the tests (conftest.py), so both share the on-disk compile cache.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from graphc.bench import device_floor_bandwidth  # noqa: E402
from graphc.kernels import gemm, weight_blocks  # noqa: E402
from graphc.power import measure_power, nvidia_smi_id  # noqa: E402

BIG_SHAPES = [
    ("gate_up", 7168, 36864, "silu_mul"),
    ("down", 18432, 7168, None),
    ("qkv", 7168, 10240, None),
    ("o_proj", 8192, 7168, None),
    ("lm_head", 7168, 163840, None),     # Kimi's vocabulary: the largest GEMM of a step
]
TINY_SHAPES = [
    ("tiny.qkv", 1024, 1536, None),
    ("tiny.gate_up", 1024, 5632, "silu_mul"),
    ("tiny.down", 2816, 1024, None),
    ("tiny.o_proj", 1024, 1024, None),
]


def _capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                      # warm-up: compile, workspaces, cuBLAS handles
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


# Replays before timing, for at least this long: the board's clock and power state take
# milliseconds to settle after the row's set-up (random weights) or the previous graph, and
# with a 3-replay warm-up the first configuration timed in a row measured up to 20% slower
# than the same configuration timed again later in it (bench/gemm_notes.md §21, §22).
WARMUP_S = 0.05


def _time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Seconds per replay of a captured graph, after WARMUP_S of untimed replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for warm in range(1, 10001):
        graph.replay()
        if warm % 10 == 0:
            end.record()
            end.synchronize()
            if start.elapsed_time(end) * 1e-3 >= WARMUP_S:
                break
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return times


def time_interleaved(graphs: dict, replays: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per replay of each of ``graphs`` (label -> captured graph), timed in ``rounds``
    round-robin passes (a median of ``replays`` per pass), so that every
    configuration sees the board in every state the row goes through. Configurations timed
    one after another differed by up to 10-20% from their place in the row alone on a
    power-capped board (bench/gemm_notes.md §22); the median over rounds is what to compare."""
    passes = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, graph in graphs.items():
            passes[label].append(statistics.median(_time_graph(graph, replays)))
    return passes


def variant_tunings(base) -> list[tuple[str, dict]]:
    """The alternatives to a default GemmConfig that the benchmark times: the other K per
    stage, and no / twice the L2 prefetch before the PDL wait. (256-row tiles, ``row_wgs=2``,
    lost on every shape and M on 2026-11-30 and are no longer timed by default.)"""
    pf = base.l2_prefetch
    return [(f"bk{192 - base.block_k}", dict(block_k=192 - base.block_k)),
            (f"pf{0 if pf else 8}", dict(l2_prefetch=0 if pf else 8)),
            (f"pf{2 * pf or 16}", dict(l2_prefetch=2 * pf or 16))]


def parse_tunings(text: str) -> list[tuple[str, dict]]:
    """``"ctas=112;ctas=112,l2_prefetch=0"`` -> [(label, {knob: int})]: the ``--tunings`` option,
    explicit alternatives timed instead of ``variant_tunings``."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        tuning = {}
        for kv in item.split(","):
            knob, _, value = kv.partition("=")
            knobs = ("ctas", *gemm.LINEAR_KNOBS)
            if knob.strip() not in knobs or not value.strip().isdigit():
                raise SystemExit(f"--tunings: {kv!r} is not knob=integer with knob one of {', '.join(knobs)}")
            tuning[knob.strip()] = int(value)
        out.append((item.replace("=", "").replace(",", "_"), tuning))
    return out


def weight_order(tuning: dict, blocked_by_default: bool = False) -> tuple[dict, int]:
    """(the knobs ``linear`` takes, rows per block of the W copy to pass it: 0 for row-major).
    ``w_blocked`` and ``w_block_rows`` choose W's order, which ``linear`` reads off the weight's
    shape and refuses as knobs; ``w_block_rows`` implies blocks, and without either knob W is in
    blocks when ``blocked_by_default``."""
    knobs = {knob: v for knob, v in tuning.items() if knob not in ("w_blocked", "w_block_rows")}
    rows = tuning.get("w_block_rows", weight_blocks.BLOCK)
    blocked = tuning.get("w_blocked", blocked_by_default or rows != weight_blocks.BLOCK)
    return knobs, rows if blocked else 0


def reads_blocks_with(m: int, k: int, n: int, epilogue, knobs: dict) -> bool:
    """Whether the kernel these knobs select can read weights in blocks (``plan`` accepts
    w_blocked=1 with them). A variant without w_blocked reads them so when the default does and
    it can; otherwise row-major."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        gemm.plan(m, k, n, epilogue, **{"ctas": sms, **knobs, "w_blocked": 1})
    except ValueError:
        return False
    return True


def variants(m: int, k: int, n: int, epilogue, explicit=None, sms: int = gemm.DEFAULT_SMS
             ) -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """The tuning alternatives (``explicit`` or else ``variant_tunings``) legal for this shape,
    and {label: why not} for those ``gemm.plan`` refuses here (printed with the row, so that a
    knob that is never legal is not silently missing from the table)."""
    base = gemm.GemmConfig(m, k, n, epilogue, sms)
    legal, refused = [], {}
    for label, tuning in explicit or variant_tunings(base):
        try:      # (w_block_rows=16 implies blocks: order_of in bench_one)
            gemm.plan(m, k, n, epilogue, **{"ctas": sms, **tuning,
                                            **({"w_blocked": 1} if "w_block_rows" in tuning else {})})
        except ValueError as e:
            if explicit:            # (the default alternatives are simply those that apply)
                refused[label] = str(e)
            continue
        legal.append((label, tuning))
    return legal, refused


def variant_plan(m: int, k: int, n: int, epilogue, sms: int, tuning: dict, weight):
    """The configuration ``gemm.linear`` runs for ``tuning`` (``ctas`` and ``plan``'s knobs) on
    ``weight`` (row-major or blocks: its order is a knob too). A variant's knobs leave the rest
    to the defaults, which may move far: with ``ctas=120`` the tile is chosen for 120 SMs
    (bench/gemm_notes.md §45), so the table says what ran."""
    knobs = dict(tuning)
    ctas = knobs.pop("ctas", sms)
    return gemm.plan(m, k, n, epilogue, ctas, **knobs, **dict(gemm.weight_order_knobs(weight)))


def variant_config(m: int, k: int, n: int, epilogue, sms: int, tuning: dict, weight) -> str:
    """``variant_plan`` as ``gemm.plan`` prints it."""
    return repr(variant_plan(m, k, n, epilogue, sms, tuning, weight))


def cluster_residency(cfg, resident_clusters) -> str:
    """How the board runs ``cfg``'s clusters, for its variant's line: nothing without clusters;
    else how many the grid launches and how many run at once (``resident_clusters(cluster,
    smem, threads)``, the driver's count: ``resident_on_this_gpu``), naming a second wave where
    the grid launches more. That was the whole of a 1.35-1.67x (clusters of four, §42) and a
    1.5x (threes at qkv 192: 40 launched, 39 resident, §47), invisible in the config itself."""
    if cfg.cluster == 1:
        return ""
    launched = cfg.ctas // cfg.cluster
    # The ring decides how many CTAs share an SM (barriers add about 1% to it).
    resident = resident_clusters(cfg.cluster, cfg.stages * cfg.stage_bytes, cfg.threads)
    wave = ": the rest start as a second wave" if launched > resident else ""
    return f" [{launched} clusters of {cfg.cluster}; this GPU runs {resident} at once{wave}]"


@functools.lru_cache(maxsize=None)
def resident_on_this_gpu(cluster: int, smem: int, threads: int) -> int:
    """bench/cluster_occupancy.py's driver query, on the current GPU."""
    import cluster_occupancy      # bench/cluster_occupancy.py (cuda-bindings: on the GPU image)
    return cluster_occupancy.max_active_clusters(cluster_occupancy.probe_function(smem), cluster, smem, threads)


def bench_one(name: str, k: int, n: int, epilogue, m: int, args) -> dict:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    w_bytes = n * k * 2
    copies = max(2, math.ceil(4 * l2 / w_bytes))
    chain = max(args.chain, copies)
    n_out = n // 2 if epilogue == "silu_mul" else n
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    xs = [torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    outs = [torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    tmps = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

    # Ours reads the weights as a graphc build stores them: in 64 x 64 blocks (kernels/
    # weight_blocks.py, copies of their own, passed as 4-D weights) where the kernel that runs
    # reads them (gemm.reads_blocks), else row-major; cuBLAS reads the row-major copies. A
    # variant's w_blocked=0 / 1 chooses explicitly, and w_block_rows=16 (which implies blocks)
    # reads copies in 16-row blocks.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_blocked = int(gemm.reads_blocks(m, k, n, epilogue, sms))

    def order_of(tuning) -> tuple[dict, int]:
        """``weight_order``, blocks by default where the default reads them and these knobs can."""
        knobs, _ = weight_order(tuning)
        return weight_order(tuning, default_blocked and reads_blocks_with(m, k, n, epilogue, knobs))

    timed, refused = variants(m, k, n, epilogue, args.tunings, sms) if args.variants else ([], {})
    orders = {order_of({})[1]} | {order_of(t)[1] for _, t in timed}
    ws_in = {rows: [weight_blocks.to_blocks(w, rows) for w in ws] if rows else ws for rows in orders}

    def weights_and_knobs(tuning):
        knobs, rows = order_of(tuning)
        return ws_in[rows], knobs

    # Correctness first: a fast wrong kernel is not a result.
    gemm.linear(xs[0], weights_and_knobs({})[0][0], outs[0], epilogue=epilogue, use_pdl=False)
    ref = xs[0].float() @ ws[0].float().T
    if epilogue == "silu_mul":
        ref = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2:]
    err = ((outs[0].float() - ref).norm() / ref.norm()).item()

    def ours(use_pdl, tuning):
        w_in, knobs = weights_and_knobs(tuning)

        def run():
            for i in range(chain):
                j = i % copies
                gemm.linear(xs[j], w_in[j], outs[j], epilogue=epilogue, use_pdl=use_pdl, **knobs)
        return run

    def cublas(with_act):
        # With the activation: what graphc's cuBLAS path of the op runs (graphc/ops/linear.py),
        # the projection then one Triton silu·mul kernel.
        from graphc.kernels.silu_mul import silu_mul

        def run():
            for i in range(chain):
                j = i % copies
                if epilogue == "silu_mul":
                    torch.mm(xs[j], ws[j].t(), out=tmps[j])
                    if with_act:
                        silu_mul(tmps[j], outs[j])
                else:
                    torch.mm(xs[j], ws[j].t(), out=outs[j])
        return run

    fns = {"ours_pdl_s": ours(True, {}), "ours_nopdl_s": ours(False, {}), "cublas_s": cublas(False)}
    checked = {}
    for label, tuning in timed:
        var_out = torch.empty_like(outs[0])
        w_in, knobs = weights_and_knobs(tuning)
        gemm.linear(xs[0], w_in[0], var_out, epilogue=epilogue, use_pdl=False, **knobs)
        cfg = variant_plan(m, k, n, epilogue, sms, knobs, w_in[0])
        checked[label] = (tuning, ((var_out.float() - ref).norm() / ref.norm()).item(),
                          repr(cfg) + cluster_residency(cfg, resident_on_this_gpu))
        fns[f"variant {label}"] = ours(True, tuning)
    if epilogue == "silu_mul":
        fns["cublas_act_s"] = cublas(True)
    graphs = {label: _capture(fn) for label, fn in fns.items()}
    passes = {label: [t / chain for t in ts] for label, ts in time_interleaved(graphs, args.replays, args.rounds).items()}
    per_call = {label: statistics.median(ts) for label, ts in passes.items()}

    row = {
        "name": name, "m": m, "k": k, "n": n, "epilogue": epilogue, "weight_bytes": w_bytes,
        "weight_copies": copies, "chain": chain, "rel_err": err,
        "floor_bytes_s": w_bytes / args.floor["hbm_bytes_per_s"],
        "floor_flops_s": 2 * m * n * k / args.floor["flops_per_s"] if args.floor["flops_per_s"] else 0.0,
        **{label: t for label, t in per_call.items() if not label.startswith("variant ")},
        "variants": {label: {"tuning": tuning, "pdl_s": per_call[f"variant {label}"], "rel_err": var_err,
                             "rounds_s": passes[f"variant {label}"], "config": config}
                     for label, (tuning, var_err, config) in checked.items()},
        "refused_tunings": refused,
        "rounds_s": {label: ts for label, ts in passes.items() if not label.startswith("variant ")},
    }
    row["floor_s"] = max(row["floor_bytes_s"], row["floor_flops_s"])
    if args.power:
        # The board while each runs back to back: at 32-64 rows a GEMM can draw the 700 W
        # limit and be clocked down (bench/gemm_notes.md §17), which no tiling undoes.
        row["power"] = {}
        for label in ("ours_pdl_s", "cublas_s", *(f"variant {v}" for v in checked)):
            summary = measure_power(graphs[label].replay, nvidia_smi_id(torch.device("cuda")))
            row["power"][label] = summary.as_dict() if summary else None
    row["config"] = variant_config(m, k, n, epilogue, sms, {}, weights_and_knobs({})[0][0])
    row["weights_in_blocks"] = bool(default_blocked)
    return row


def parse_shape(text: str) -> tuple[str, int, int, str | None]:
    """``--shape``'s ``NAME=K,N[,silu_mul]`` -> a row as BIG_SHAPES holds it, the shape checked
    as the decode GEMM's contract checks it (K and N multiples of 64, ...)."""
    name, _, dims = text.partition("=")
    parts = dims.split(",")
    epilogue = parts.pop() if parts and parts[-1] == "silu_mul" else None
    if not name or len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is NAME=K,N or NAME=K,N,silu_mul")
    k, n = int(parts[0]), int(parts[1])
    try:
        gemm.check_shape(1, k, n, epilogue)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return name, k, n, epilogue


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before any GPU work: batch sizes the kernel takes, shape names
    that exist, and no ``--tunings`` beside ``--no-variants`` (which would drop them)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON file (default bench/results/gemm_<date>.json)")
    ap.add_argument("--m", default="1,8,64,256", help="batch sizes, comma-separated")
    ap.add_argument("--shapes", choices=["big", "tiny", "all"], default="big")
    ap.add_argument("--chain", type=int, default=8, help="calls per graph (at least the weight copies)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every configuration of a row this many times, round-robin, and report "
                         "the median (A/B decisions: 3 or more)")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="time only the default configuration (not the other block_k / row_wgs)")
    ap.add_argument("--only", help="shape names to run, comma-separated (default: all of --shapes)")
    ap.add_argument("--shape", action="append", type=parse_shape, default=[], metavar="NAME=K,N[,silu_mul]",
                    help="run this shape too (repeatable; --only may name it), e.g. qkv39=7168,9984: qkv "
                         "with 39 W tiles of 256 (bench/gemm_notes.md §47)")
    ap.add_argument("--power", action="store_true",
                    help="also sample board power and SM clock for 1.5 s of back-to-back replays of "
                         "ours, cuBLAS and each variant per row (graphc/power.py)")
    ap.add_argument("--tunings", type=parse_tunings, default=None,
                    help='time these alternatives instead of the default variants, e.g. '
                         '"ctas=112;ctas=112,l2_prefetch=0"')
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.replays < 1:
        ap.error(f"--rounds and --replays must be at least 1 (got {args.rounds}, {args.replays})")
    if args.tunings and not args.variants:
        ap.error("--no-variants times only the default configuration and would drop --tunings: "
                 "give one or the other")
    try:
        args.ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        ap.error(f"--m {args.m!r}: batch sizes are comma-separated integers")
    if bad := [m for m in args.ms if not 1 <= m <= gemm.MAX_M]:
        ap.error(f"--m: {bad} outside 1..{gemm.MAX_M}, the batch sizes the decode GEMM takes")
    # --shape's rows join the bundled ones, so --only can name them too (--only qkv39 runs it alone).
    args.shape_rows = {"big": BIG_SHAPES, "tiny": TINY_SHAPES, "all": BIG_SHAPES + TINY_SHAPES}[args.shapes] + args.shape
    if args.only:
        names, known = args.only.split(","), [row[0] for row in args.shape_rows]
        if unknown := [name for name in names if name not in known]:
            ap.error(f"--only: no shape {', '.join(unknown)} in --shapes {args.shapes} or --shape ({', '.join(known)})")
        args.shape_rows = [s for s in args.shape_rows if s[0] in names]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)

    props = torch.cuda.get_device_properties(0)
    shapes, ms = args.shape_rows, args.ms
    args.floor = floor = device_floor_bandwidth()
    copy_bw, read_bw = floor["copy_bytes_per_s"], floor["read_bytes_per_s"]
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB; "
          f"D2D copy {copy_bw / 1e12:.2f} TB/s, read {read_bw / 1e12:.2f} TB/s "
          f"(floor uses {floor['hbm_bytes_per_s'] / 1e12:.2f} TB/s: {floor['source']})")

    rows = []
    hdr = (f"{'shape':<13}{'M':>4} {'floor us':>9} {'pdl us':>8} {'%floor':>7} {'nopdl us':>9} "
           f"{'cublas us':>10} {'%floor':>7} {'pdl/cublas':>10} {'nopdl/cublas':>12} {'rel err':>8}  "
           f"variants (pdl us)")
    print(hdr)
    print("-" * len(hdr))
    for name, k, n, epi in shapes:
        for m in ms:
            r = bench_one(name, k, n, epi, m, args)
            torch.cuda.empty_cache()                # free this shape's weight copies
            rows.append(r)
            fl = r["floor_s"]
            var = " ".join(f"{label}:{v['pdl_s'] * 1e6:.2f}" + ("(BAD)" if v["rel_err"] > 1e-2 else "")
                           for label, v in r["variants"].items())
            print(f"{name:<13}{m:>4} {fl * 1e6:>9.2f} {r['ours_pdl_s'] * 1e6:>8.2f} "
                  f"{fl / r['ours_pdl_s']:>7.1%} {r['ours_nopdl_s'] * 1e6:>9.2f} "
                  f"{r['cublas_s'] * 1e6:>10.2f} {fl / r['cublas_s']:>7.1%} "
                  f"{r['ours_pdl_s'] / r['cublas_s']:>10.3f} {r['ours_nopdl_s'] / r['cublas_s']:>12.3f} "
                  f"{r['rel_err']:>8.1e}  {var}"
                  + (f"  (cublas+act {r['cublas_act_s'] * 1e6:.2f} us)" if "cublas_act_s" in r else ""),
                  flush=True)
            if args.tunings:                         # what each explicit variant ran
                for label, v in r["variants"].items():
                    print(f"{'':<17}{label}: {v['config']}", flush=True)
            for label, why in r["refused_tunings"].items():
                print(f"{'':<17}{label}: not timed, gemm.plan refuses it here: {why}", flush=True)
            for label, p in r.get("power", {}).items():
                if p:
                    print(f"{'':<17}{label.removesuffix('_s')}: {p['power_w']:.0f} W, SM {p['sm_mhz']:.0f} MHz, "
                          f"clock held by the power limit in {p['limited_share']:.0%} of {p['samples']} samples",
                          flush=True)

    import cutlass

    result = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cutlass_dsl": getattr(cutlass, "__version__", "unknown"),
        "host": platform.node(),
        "hbm_bytes_per_s_nominal": floor["hbm_bytes_per_s"],
        "floor_source": floor["source"],
        "d2d_copy_bytes_per_s_measured": copy_bw,
        "read_bytes_per_s_measured": read_bw,
        "bf16_flops_nominal": floor["flops_per_s"],
        "method": "CUDA graph of a chain of calls cycling weight copies > 4x L2; median of replays / chain",
        "rows": rows,
    }
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gemm_{_dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
