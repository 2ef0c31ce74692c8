"""Per-CTA timeline of decode-GEMM nodes *inside the captured decode step*, next to the same
kernel alone: where the GEMM's extra time in the step goes (CTAs that start late after a
predecessor that fills the SMs, slower streaming beside co-running kernels, or the tail).
bench/gemm_notes.md §12.

    source .gpu/setup.sh && python3 bench/step_timeline.py --batch 64 qkv o_proj
    # CPU, to put the instrumented kernels in the disk cache first:
    CUTE_DSL_ARCH=sm_90a python3 bench/step_timeline.py --precompile --batch 64 qkv o_proj

Each named shape (bench/gemm.py's names) runs on the decode GEMM at this batch size, its
crossover raised if needed, with the instrumented kernel of bench/gemm_timeline.py; the step
is captured, replayed, and the last layer's call (the layers share the timer words) is
printed in µs from its first CTA's entry, then the same configuration run alone.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_timeline import ROOT, bench_shapes, instrumented_module, report, timeline, weight_order  # noqa: E402


def route_to_instrumented(g, targets: set[tuple]) -> None:
    """Make graphc's decode-GEMM launches of ``targets`` ((M, K, N, epilogue)) run the
    instrumented module ``g`` (graphc.ops.linear imports ``linear`` at each launch)."""
    import graphc.kernels.gemm as shipped
    from graphc.kernels.weight_blocks import matrix_shape

    plain = shipped.linear

    def linear(x, weight, out, *, epilogue=None, **kw):
        n, k = matrix_shape(weight)          # the weight may be stored in blocks (4-D)
        key = (x.shape[0], k, n, epilogue)
        return (g.linear if key in targets else plain)(x, weight, out, epilogue=epilogue, **kw)

    shipped.linear = linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="+", help="bench/gemm.py shape names (gate_up, down, qkv, o_proj)")
    ap.add_argument("--spec", default=os.path.join(ROOT, "layer_specs", "kimi_k3_dense_8l.yaml"))
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--precompile", action="store_true", help="only compile the instrumented kernels")
    args = ap.parse_args()
    shapes = bench_shapes()
    unknown = [s for s in args.shapes if s not in shapes]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}: one of {', '.join(shapes)}")
    g = instrumented_module()
    if args.precompile:
        for name in args.shapes:
            k, n, e = shapes[name]
            # (the step stores these weights in blocks where this kernel reads them)
            blocked = {"w_blocked": 1} if g.reads_blocks(args.batch, k, n, e, 132) else {}
            g.compile_cache().get(g.GemmConfig(args.batch, k, n, e, 132, **blocked).key())
            print(f"compiled {name}:{args.batch}")
        return

    import torch

    import graphc.ops.linear as linear_op
    from graphc.bench import bench_step
    from graphc.runtime import build

    b = args.batch
    targets = set()
    for name in args.shapes:
        k, n, e = shapes[name]
        rows = linear_op.decode_gemm_rows(k, n, e)
        if not linear_op.decode_gemm_default(k, n, e, b):
            print(f"{name}: decode GEMM at {b} rows for this run (by default it runs at {rows})")
            linear_op.DECODE_GEMM_ROWS[(k, n, e)] = rows + ((b, b),)
        targets.add((b, k, n, e))
    route_to_instrumented(g, targets)
    step = build(args.spec, [b], device="cuda", progress=None)
    timed = bench_step(step.spec, [b], min(args.context, step.spec.model.max_context), step=step)[0]
    print(f"step at batch {b}: {timed['step_us']:.1f} us (instrumented kernels on {', '.join(args.shapes)})")
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    in_step = {}
    for name in args.shapes:
        k, n, e = shapes[name]
        _, order = weight_order(g, {}, b, k, n, e, sms)      # the order the build stored them in
        in_step[name] = report(g, g.GemmConfig(b, k, n, e, sms, **order),
                               f"IN THE STEP (last layer) {name}:{b}", workspaces=step.plan.workspaces)
    del step
    torch.cuda.empty_cache()
    alone = {}
    for name in args.shapes:
        print()
        alone[name] = timeline(g, name, b)
    print()
    print("summary (us): PDL wait passed -> last CTA's end; per-CTA streaming (wait -> last k-block) "
          "median / max; CTAs that entered after the first wait release")
    for name in args.shapes:
        for where, r in (("step ", in_step[name]), ("alone", alone[name])):
            print(f"  {name + ':' + str(b):10s} {where}  wait->end {r['wait_to_end']:7.2f}  streaming "
                  f"{r['streaming_median']:7.2f} / {r['streaming_max']:7.2f}  late entries {r['entries_after_wait']:3d}")


if __name__ == "__main__":
    main()
