"""Where a decode step loses against its HBM floor: each kernel alone, and inside the step.

    python3 bench/step_breakdown.py layer_specs/kimi_k3_dense_8l.yaml --batch-sizes 32,64

Builds the step, times the captured graph (``graphc.bench.bench_step``), then profiles
every kernel alone (``DecodeStep.profile``: each kernel 10x in its own CUDA graph, no
neighbours, no PDL overlap) and groups the kernels by role (``L03.mlp.down`` -> ``mlp.down``). Per role: the
summed time, the summed floor (the op's own ``bytes_moved`` / 4.3 TB/s), their ratio and the
time lost above the floor. The ``in step`` column is the same role inside the replayed graph
(kernel timestamps from the profiler, CUPTI): each kernel's end minus the previous kernel's end,
the time it adds to the step with its neighbours, PDL overlap and cache state as they really
are. The last lines compare the sum of isolated kernels with the step: what launch gaps cost
(step > sum) or what PDL overlap wins (step < sum).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphc.floor import H200_HBM_BYTES_PER_S  # noqa: E402


def role(node: str) -> str:
    """The node's name without its layer prefix: the same op in every layer is one role."""
    return re.sub(r"^L\d+\.", "", node)


def kernel_spans(events: list[dict], nodes: list[str]) -> dict[str, float]:
    """Per node, the median over replays of (its kernel's end - the previous kernel's end): what
    it adds to the step. ``events`` are the profiler's kernel records ({"ts", "dur"}, µs) of
    whole replays of a step whose kernels, in schedule order, are ``nodes``; they are matched
    by start order (a dependent never starts before its predecessor, even with PDL)."""
    import statistics

    if not events or len(events) % len(nodes):
        raise RuntimeError(f"the profiler saw {len(events)} kernels, not whole replays of a "
                           f"{len(nodes)}-kernel step; cannot attribute them")
    events = sorted(events, key=lambda e: e["ts"])
    spans: dict[str, list[float]] = {}
    for r in range(0, len(events), len(nodes)):
        replay = events[r:r + len(nodes)]
        prev_end = replay[0]["ts"]
        for node, e in zip(nodes, replay):
            spans.setdefault(node, []).append(e["ts"] + e["dur"] - prev_end)
            prev_end = e["ts"] + e["dur"]
    return {node: statistics.median(v) for node, v in spans.items()}


def in_step_spans(step, batch: int, replays: int = 10) -> dict[str, float]:
    """``kernel_spans`` of ``replays`` replays of the captured graph, from CUPTI timestamps
    (torch.profiler)."""
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
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]
    return kernel_spans(events, [k.node for k in step.plan.kernels_of(step.schedules[batch])])


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
    from graphc.floor import kernel_bytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", help="write the profiles and tables as JSON here")
    args = ap.parse_args()

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    step = graphc.build(args.spec, batch_sizes=sizes, progress=None)
    results = []
    for timed in bench_step(step.spec, sizes, args.context, step=step):     # as `graphc bench`
        b = timed["batch"]
        spans = in_step_spans(step, b)           # before profile(), which rewrites the inputs
        prof = step.profile(b, context=args.context)
        floors = {node: n / H200_HBM_BYTES_PER_S * 1e6
                  for node, n in kernel_bytes(step.schedules[b], b, args.context).items()}
        rows = breakdown(prof, floors, spans)
        print(format_breakdown(rows, timed["step_us"], timed["floor_us"], b), flush=True)
        print()
        results.append({"batch": b, "step_us": timed["step_us"], "profile": prof, "roles": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
