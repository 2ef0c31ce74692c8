"""How far apart are two *correct* implementations of the 8-layer step?

Runs the reference executor (torch ops everywhere) beside variants that swap in one validated
kernel at a time, and the captured graphc step, over four decode steps, and prints the logits'
relative difference to the all-torch reference. A random-weight model carries one-ulp bf16
differences forward, so this is the yardstick for the end-to-end tolerance.

    python3 bench/noise_floor.py [--spec layer_specs/kimi_k3_dense_8l.yaml] [--batch 5]
"""
import argparse

import torch

import graphc
from graphc.plan import Plan
from graphc.capture import launch_all
from graphc.schedule import build_schedule

TORCH = {"attn_res": "torch", "decode_attention": "torch", "linear": "cublas"}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--spec", default="layer_specs/kimi_k3_dense_8l.yaml")
p.add_argument("--batch", type=int, default=5)
a = p.parse_args()
step = graphc.build(a.spec, [a.batch], progress=None)
rows = step.plan.weights.row_major()     # for the cuBLAS linears (the step's GEMMs read blocks)
variants = {name: Plan(build_schedule(step.schedule.graph, TORCH | swap, use_pdl), a.batch,
                       step.plan.weights if swap.get("linear") == "cute" else rows, "cuda")
            for name, swap, use_pdl in [
                ("reference", {}, True), ("triton attention", {"decode_attention": "triton"}, True),
                ("cute attn_res", {"attn_res": "cute"}, True), ("cute attn_res no-PDL", {"attn_res": "cute"}, False),
                ("decode GEMM (silu*mul fused)", {"linear": "cute"}, True),
                ("all graphc kernels eager", {"decode_attention": "triton", "attn_res": "cute", "linear": "cute"}, True)]}
for plan in variants.values():      # compile/warm up outside timing, as capture does
    launch_all(plan, a.batch, torch.cuda.current_stream())
gen = torch.Generator().manual_seed(0)
start = torch.randint(0, 40, (a.batch,), generator=gen, dtype=torch.int32).cuda()
for s in range(4):
    tokens = torch.randint(0, step.spec.model.vocab, (a.batch,), generator=gen).cuda()
    out = {}
    for name, plan in variants.items():
        plan.write_inputs(a.batch, tokens, start + s, torch.arange(a.batch, dtype=torch.int32).cuda())
        launch_all(plan, a.batch, torch.cuda.current_stream())
        out[name] = plan.output(a.batch).float().clone()
    out["graphc step"] = step(tokens, start + s).float().clone()
    ref = out["reference"]
    print(f"step {s}:\n  " + "\n  ".join(
        f"{n} {((o - ref).norm() / ref.norm()).item():.2e}/{(o.argmax(-1) == ref.argmax(-1)).float().mean().item():.2f}"
        for n, o in out.items() if n != "reference"))
