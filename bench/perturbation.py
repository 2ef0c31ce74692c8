"""How much one bf16 rounding difference moves the logits: the noise floor any kernel's
agreement with the reference executor has to be judged against (CPU, torch reference ops).

    python3 bench/perturbation.py layer_specs/tiny.yaml --repeat 8

Runs a few decode steps of the spec (seeded random weights, 8 rows) with the reference
executor to fill the KV cache, then one more step, once as is and once per listed node with
±1 ulp flipped on ``--fraction`` of the elements of that node's bf16 outputs (what a kernel
that rounds one accumulation differently does), and prints the logits' relative change and
how many rows keep their argmax. ``--repeat`` overrides the layer group's repeat count.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphc.graph import build_graph, weight_shapes  # noqa: E402
from graphc.plan import Plan  # noqa: E402
from graphc.schedule import build_schedule  # noqa: E402
from graphc.spec import load_spec  # noqa: E402
from graphc.weights import Weights  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--repeat", type=int, help="layers (the spec's single layer group repeated)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.3)
    ap.add_argument("--nodes", default="L00.attn_res.attn,L00.attn.attention,L00.mlp.gate_up,L00.mlp.down")
    args = ap.parse_args()

    path = args.spec
    if args.repeat:
        text = re.sub(r"repeat:\s*\d+", f"repeat: {args.repeat}", open(path).read(), count=1)
        path = os.path.join(tempfile.mkdtemp(), os.path.basename(args.spec))
        with open(path, "w") as f:
            f.write(text)
    spec = load_spec(path)
    graph = build_graph(spec)
    # Every kernel runs its torch reference below, whatever implementation the schedule names.
    plan = Plan(build_schedule(graph), args.rows, Weights.random(weight_shapes(graph), seed=0), "cpu")
    rows = args.rows
    gen = torch.Generator().manual_seed(0)

    def step(tokens, lens, perturb=None):
        plan.write_inputs(rows, tokens, lens, torch.arange(rows, dtype=torch.int32))
        for k, b in zip(plan.schedule.kernels, plan.bindings(rows)):
            k.op.reference(b.tensors, b.weights)
            if k.node == perturb:
                for role in k.op.writes:
                    t = b.tensors[role]
                    if t.dtype == torch.bfloat16 and role != "kv":     # not the KV cache state
                        flip = (torch.rand(t.shape, generator=gen) < args.fraction).to(torch.int16)
                        t.view(torch.int16).bitwise_xor_(flip)       # the last mantissa bit
        return plan.output(rows).float().clone()

    vocab = spec.model.vocab
    for s in range(6):                       # some cached context
        step(torch.randint(0, vocab, (rows,), generator=gen), torch.full((rows,), s, dtype=torch.int32))
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    lens = torch.full((rows,), 6, dtype=torch.int32)
    base = step(tokens, lens)
    print(f"{spec.model.name}: {len(spec.layers)} layers, {rows} rows, ±1 ulp on {args.fraction:.0%} "
          "of one node's outputs")
    for node in args.nodes.split(","):
        got = step(tokens, lens, perturb=node)
        rel = ((got - base).norm() / base.norm()).item()
        agree = (got.argmax(-1) == base.argmax(-1)).float().mean().item()
        print(f"  {node:22s} logits moved {rel:.2e} (relative), argmax kept on {agree:.0%} of rows")


if __name__ == "__main__":
    main()
