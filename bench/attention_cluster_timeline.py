"""Per-CTA timeline of the few-row cluster attention (kernels/decode_attention_cluster.py) inside
the decode step: where its time after the qkv GEMM goes.

    source .gpu/setup.sh && python3 bench/attention_cluster_timeline.py layer_specs/kimi_k3_dense_8l.yaml \\
        --batch 1 --replays 20 [--variant NAME:KNOB=V[@ROLE]]

Builds the step with the attention's timeline build (thread 0 of every CTA stamps
``%globaltimer`` at ``STAMPS``: entry, the PDL wait released, q loaded, its split's math done,
its partials pushed into the cluster, the cluster's partials received, the output stored; each
stamp takes the data it names as an operand) and replays it. Per layer and replay, every moment
is taken relative to the earliest release of that call's CTAs (about when the qkv GEMM ended);
the table gives, over layers and replays, the median of the earliest, median and latest CTA at
each moment. An entry long before the release means the CTA sat beside the qkv GEMM with its
cache loads in flight. ``--variant`` takes bench/step_ab.py's syntax (decode-GEMM knobs, e.g.
``cv:smem_carveout=100@attn.qkv``, or the attention's own: ``x:cluster.trigger_at=2``). The step is timed with and without the stamps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variant", default=None, help="bench/step_ab.py variant: GEMM knobs for the step")
    args = ap.parse_args()

    import torch

    from graphc.bench import _inputs, interleaved_rounds
    from graphc.graph import build_graph, weight_shapes
    from graphc.kernels import decode_attention_cluster as cluster
    from graphc.runtime import build
    from graphc.spec import load_spec
    from graphc.weights import Weights
    from step_ab import parse_variant, step_knobs
    from step_breakdown import role

    spec = load_spec(args.spec)
    weights = Weights.random(weight_shapes(build_graph(spec)), seed=0, device="cuda")
    role_of_weight = {t.data_ptr(): role(name.rsplit(".", 1)[0]) for name, t in weights.tensors.items()}
    _, knobs, roles, _, _ = parse_variant(args.variant) if args.variant else ("", {}, None, {}, {})
    impls = {"decode_attention": "cluster"}

    buffers: dict[int, torch.Tensor] = {}        # per attention call (its cache), stamps
    inner = {}                                   # the launch the stamped build wraps

    def timed(qkv, kv, seq_lens, cache_slots, out, **kwargs):
        stamps = buffers.get(kv.data_ptr())
        if stamps is None:      # at the warm-up before capture: no allocation inside the graph
            words = cluster.timeline_words(qkv.shape[0], kwargs["kv_heads"])
            stamps = buffers[kv.data_ptr()] = torch.zeros(words, dtype=torch.int64, device=qkv.device)
        inner["launch"](qkv, kv, seq_lens, cache_slots, out, timeline=stamps, **kwargs)

    with step_knobs(knobs, roles, role_of_weight):
        plain = build(spec, [args.batch], weights=weights, progress=None, implementations=impls)
        inner["launch"] = cluster.decode_attention      # with the variant's knobs, if any
        cluster.decode_attention = timed
        try:
            stamped = build(spec, [args.batch], weights=weights, progress=None, implementations=impls)
        finally:
            cluster.decode_attention = inner["launch"]
    tokens, seq_lens = _inputs(plain, args.batch, args.context)
    plain(tokens, seq_lens)
    stamped(tokens, seq_lens)
    times = interleaved_rounds({"plain": plain.graphs[args.batch].replay,
                                "stamped": stamped.graphs[args.batch].replay}, 3, per_pass=50)

    n = len(cluster.STAMPS) + 1
    moments: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cluster.STAMPS}
    lens = seq_lens[:args.batch].tolist()
    live = [min(L // cluster.CHUNK + 1, cluster.SPLITS) for L in lens]
    sms = set()
    graph = stamped.graphs[args.batch]
    for _ in range(args.replays):
        graph.replay()
        torch.cuda.synchronize()
        for stamps in buffers.values():
            ctas = stamps.view(-1, n).cpu().tolist()       # CTA (t, kv head, rank) in order
            per_row = len(ctas) // args.batch
            for t in range(args.batch):
                rows = ctas[t * per_row:(t + 1) * per_row]
                ref = min(r[1] for r in rows)
                for k, name in enumerate(cluster.STAMPS):
                    # Moments a dead split never reaches (q, math, push) only from the live ones.
                    vals = sorted((r[k] - ref) / 1e3 for i, r in enumerate(rows)
                                  if k not in (2, 3) or i % cluster.SPLITS < live[t])
                    moments[name].append((vals[0], vals[len(vals) // 2], vals[-1]))
                sms.update(r[n - 1] for r in rows)

    print(f"# {torch.cuda.get_device_name()}: {args.spec}, batch {args.batch}, context {args.context}, "
          f"{len(buffers)} attention calls x {args.replays} replays; GEMM knobs {args.variant or 'shipped'}")
    print(f"step: {statistics.median(times['plain']) * 1e6:.1f} us, with the stamps "
          f"{statistics.median(times['stamped']) * 1e6:.1f} us; CTAs on {len(sms)} SMs")
    print("moment (us after the call's earliest release)   first CTA   median CTA   last CTA")
    for name in cluster.STAMPS:
        cols = list(zip(*moments[name]))
        print(f"  {name:<44} {statistics.median(cols[0]):9.2f} {statistics.median(cols[1]):12.2f} "
              f"{statistics.median(cols[2]):10.2f}")


if __name__ == "__main__":
    main()
