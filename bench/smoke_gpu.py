"""Quick GPU smoke run of the capture path with a chosen AttnRes implementation.

    python3 bench/smoke_gpu.py --attn-res torch|cute --spec layer_specs/tiny.yaml
"""
import argparse
import time

import torch

import graphc
from graphc.reference import run_kernels
from graphc.plan import Plan
from graphc.schedule import build_schedule

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--spec", default="layer_specs/tiny.yaml")
p.add_argument("--attn-res", default="torch")
p.add_argument("--linear", default="cublas")
p.add_argument("--batch-sizes", default="1,3,8")
a = p.parse_args()
sizes = [int(x) for x in a.batch_sizes.split(",")]
t0 = time.time()
step = graphc.build(a.spec, sizes, implementations={"attn_res": a.attn_res, "linear": a.linear})
print("build", time.time() - t0, "s", {b: s.implementation_summary() for b, s in step.schedules.items()})
print(step.stats())
ref = Plan(build_schedule(step.schedule.graph, {"attn_res": "torch", "linear": "cublas",
                                                "decode_attention": "torch"}),
           step.plan.max_batch, step.plan.weights, "cuda")
for b in sizes:
    tokens = torch.arange(b).cuda() * 31 % step.spec.model.vocab
    lens = torch.arange(b, dtype=torch.int32).cuda() * 3
    slots = torch.arange(b, dtype=torch.int32).cuda()
    got = step(tokens, lens, slots).float()
    ref.write_inputs(b, tokens, lens, slots)
    want = run_kernels(ref, b).float()
    rel = ((got - want).norm() / want.norm()).item()
    print(f"batch {b}: rel {rel:.3e} argmax agree {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.3f}")
    g = step.graphs[b]
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    e.synchronize()
    print(f"  replay {s.elapsed_time(e) / 20 * 1e3:.1f} us")
