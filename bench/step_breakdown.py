"""Where a decode step loses against its HBM floor: each kernel alone, and inside the step.

    python3 bench/step_breakdown.py layer_specs/kimi_k3_dense_8l.yaml --batch-sizes 32,64
    python3 bench/step_breakdown.py SPEC --batch-sizes 32 --timeline-dir out/ &&
        graphc viz SPEC --profile out/step_timeline_b32.json --out step32.html
    python3 bench/step_breakdown.py SPEC --batch-sizes 1 --implementation decode_attention=triton

Builds the step, times the captured graph (``graphc.bench.bench_step``), then profiles
every kernel alone (``DecodeStep.profile``: each kernel 10x in its own CUDA graph, no
neighbours, no PDL overlap; its repeats find inputs that fit in L2, such as AttnRes's, already
there, so small kernels time faster alone than in the step) and groups the kernels by role (``L03.mlp.down`` -> ``mlp.down``). Per role: the
summed time, the summed floor (the op's own ``bytes_moved`` / 4.3 TB/s), their ratio and the
time lost above the floor. The ``in step`` column is the same role inside the replayed graph
(kernel timestamps from the profiler, CUPTI): each kernel's end minus the previous kernel's end,
the time it adds to the step with its neighbours, PDL overlap and cache state as they really
are; ``--timeline-dir`` writes the replayed step as a profile with start times, which
``graphc viz`` draws with its PDL overlap. The last lines compare the sum of isolated kernels with the step: what launch gaps cost
(step > sum) or what PDL overlap wins (step < sum).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def role(node: str) -> str:
    """The node's name without its layer prefix: the same op in every layer is one role."""
    return re.sub(r"^L\d+\.", "", node)


def _replays(events: list[dict], nodes: list[str]) -> list[list[tuple[str, dict]]]:
    """The profiler's kernel records ({"ts", "dur"}, µs) of whole replays of a step whose
    kernels, in schedule order, are ``nodes``, as one [(node, record)] list per replay. Matched
    by start order: a dependent never starts before its predecessor, even with PDL."""
    if not events or len(events) % len(nodes):
        raise RuntimeError(f"the profiler saw {len(events)} kernels, not whole replays of a "
                           f"{len(nodes)}-kernel step; cannot attribute them")
    events = sorted(events, key=lambda e: e["ts"])
    return [list(zip(nodes, events[r:r + len(nodes)])) for r in range(0, len(events), len(nodes))]


def kernel_spans(events: list[dict], nodes: list[str]) -> dict[str, float]:
    """Per node, the median over replays of (its kernel's end - the previous kernel's end): what
    it adds to the step."""
    spans: dict[str, list[float]] = {}
    for replay in _replays(events, nodes):
        prev_end = replay[0][1]["ts"]
        for node, e in replay:
            spans.setdefault(node, []).append(e["ts"] + e["dur"] - prev_end)
            prev_end = e["ts"] + e["dur"]
    return {node: statistics.median(v) for node, v in spans.items()}


def step_timeline(events: list[dict], nodes: list[str], implementations: dict, gpu: str,
                  batch: int) -> dict:
    """The replayed step as a profile ``graphc viz --profile`` draws to scale: per node the
    median over replays of its start (from the replay's first kernel start) and duration, so
    PDL overlap shows as it ran."""
    replays = _replays(events, nodes)
    starts: dict[str, list[float]] = {}
    durations: dict[str, list[float]] = {}
    for replay in replays:
        for node, e in replay:
            starts.setdefault(node, []).append(e["ts"] - replay[0][1]["ts"])
            durations.setdefault(node, []).append(e["dur"])
    return {"gpu": gpu, "batch": batch,
            "method": f"inside the replayed CUDA graph (profiler timestamps, median of {len(replays)} "
                      "replays)",
            "implementations": implementations,
            "kernels": [{"node": n, "start_us": statistics.median(starts[n]),
                         "duration_us": statistics.median(durations[n])} for n in nodes]}


def replay_kernel_events(step, batch: int, replays: int = 10) -> tuple[list[dict], list[str]]:
    """The profiler's kernel records (CUPTI timestamps, torch.profiler) of ``replays`` replays
    of the captured graph, and the schedule's nodes in launch order."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    graph = step.graphs[batch]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        # Read the trace back by name: the exporter may replace the file rather than write
        # into it, so a handle opened before the export can see an empty file.
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    return events, [k.node for k in step.plan.kernels_of(step.schedules[batch])]


def breakdown(profile: dict, floors_us: dict[str, float], spans_us: dict[str, float] | None = None) -> list[dict]:
    """Rows per role, in first-seen order: count, time alone, time in the step (when
    ``spans_us`` is given), floor, loss (µs)."""
    rows: dict[str, dict] = {}
    for k in profile["kernels"]:
        r = rows.setdefault(role(k["node"]), {"role": role(k["node"]), "count": 0, "us": 0.0, "floor_us": 0.0,
                                               "in_step_us": 0.0 if spans_us else None,
                                               "impl": profile["implementations"][k["node"]]})
        r["count"] += 1
        r["us"] += k["duration_us"]
        r["floor_us"] += floors_us[k["node"]]
        if spans_us:
            r["in_step_us"] += spans_us[k["node"]]
    for r in rows.values():
        r["loss_us"] = r["us"] - r["floor_us"]
    return list(rows.values())


def format_breakdown(rows: list[dict], step_us: float, step_floor_us: float, batch: int) -> str:
    lines = [f"batch {batch}: step {step_us:.0f} us, floor {step_floor_us:.0f} us "
             f"({step_us / step_floor_us:.3f}x)",
             f"{'role':22s} {'impl':>8s} {'n':>3s} {'time us':>9s} {'floor us':>9s} {'ratio':>6s} {'lost us':>8s}"
             f" {'in step us':>10s}"]
    for r in sorted(rows, key=lambda r: -r["loss_us"]):
        ratio = r["us"] / r["floor_us"] if r["floor_us"] else float("nan")
        in_step = f"{r['in_step_us']:10.1f}" if r.get("in_step_us") is not None else f"{'':>10s}"
        lines.append(f"{r['role']:22s} {r['impl']:>8s} {r['count']:3d} "
                     f"{r['us']:9.1f} {r['floor_us']:9.1f} {ratio:6.2f} {r['loss_us']:8.1f} {in_step}")
    alone = sum(r["us"] for r in rows)
    lines.append(f"{'sum of kernels alone':22s} {'':>8s} {'':>3s} {alone:9.1f} "
                 f"{sum(r['floor_us'] for r in rows):9.1f}")
    lines.append(f"step - sum alone: {step_us - alone:+.1f} us "
                 "(negative: PDL overlap wins more than the launches cost)")
    return "\n".join(lines)


def main() -> None:
    import torch

    import graphc
    from graphc.bench import bench_step
    from graphc.floor import kernel_floor_s

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", help="write the profiles and tables as JSON here")
    ap.add_argument("--timeline-dir", help="write each batch size's replayed step here as a profile "
                                           "(step_timeline_b<B>.json) for graphc viz --profile")
    ap.add_argument("--implementation", action="append", default=[], metavar="KIND=NAME",
                    help="build op kind KIND with implementation NAME (graphc.build's implementations)")
    args = ap.parse_args()
    implementations = dict(item.split("=", 1) for item in args.implementation)

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.timeline_dir:
        os.makedirs(args.timeline_dir, exist_ok=True)
    step = graphc.build(args.spec, batch_sizes=sizes, progress=None, implementations=implementations or None)
    results = []
    for timed in bench_step(step.spec, sizes, args.context, step=step):     # as `graphc bench`
        b = timed["batch"]
        # The replayed step first: profile() rewrites the inputs.
        events, nodes = replay_kernel_events(step, b)
        spans = kernel_spans(events, nodes)
        if args.timeline_dir:
            timeline = step_timeline(events, nodes, step.schedules[b].implementations(),
                                     torch.cuda.get_device_name(), b)
            with open(os.path.join(args.timeline_dir, f"step_timeline_b{b}.json"), "w") as f:
                json.dump(timeline, f, indent=1)
        prof = step.profile(b, context=args.context)
        floors = {node: t * 1e6 for node, t in kernel_floor_s(step.schedules[b], b, args.context).items()}
        rows = breakdown(prof, floors, spans)
        print(format_breakdown(rows, timed["step_us"], timed["floor_us"], b), flush=True)
        print()
        results.append({"batch": b, "step_us": timed["step_us"], "profile": prof, "roles": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
