"""How long a first `graphc.build` takes on a machine with an empty kernel cache, with its
kernel variants compiled ahead by N worker processes (graphc/compile_ahead.py) and one at a
time by the warm-up (N = 1).

    python3 bench/cold_build.py layer_specs/kimi_k3_dense_8l.yaml --batch-sizes 1,2,4,8 --jobs 1,8

Each run is a fresh Python process with a fresh, empty GRAPHC_CACHE_DIR, so nothing is in
either level of the compile cache; it prints the build's wall time, the seconds spent before
the warm-up compiling ahead, and how many variants the warm-up still compiled. Needs a GPU
(graphc.build captures); results go to bench/results/cold_build_<spec>_<gpu>_<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One cold build in a child process: prints one JSON line.
CHILD = """
import json, re, sys, time
import graphc
heard = []
t0 = time.perf_counter()
graphc.build(sys.argv[1], batch_sizes=json.loads(sys.argv[2]), compile_jobs=int(sys.argv[3]),
             progress=lambda s: heard.append((time.perf_counter() - t0, s)))
total = time.perf_counter() - t0
ahead = [t for t, s in heard if re.match(r"compiled \\d+ of \\d+ variants ahead", s)]
started = [t for t, s in heard if re.match(r"compiling \\d+ kernel variants in", s)]
print(json.dumps({"build_s": total, "ahead_s": ahead[0] - started[0] if ahead else 0.0,
                  "ahead_variants": sum(bool(re.match(r"\\[ *\\d+/", s)) for _, s in heard),
                  "warm_up_compiles": sum(bool(re.match(r"compiling \\w+ \\(", s)) for _, s in heard)}))
"""


def cold_build(spec: str, batch_sizes: list[int], jobs: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GRAPHC_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", CHILD, spec, json.dumps(batch_sizes), str(jobs)],
                             env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return {"jobs": jobs, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--jobs", default="1,8", help="worker counts to time, each in its own cold build")
    ap.add_argument("--out", help="JSON results file")
    args = ap.parse_args()
    import torch

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    gpu = torch.cuda.get_device_name()
    print(f"{args.spec}, batch sizes {sizes}, {gpu}, {os.cpu_count()} CPUs")
    print(f"{'jobs':>5s} {'build s':>8s} {'compiling ahead s':>18s} {'variants ahead':>15s} {'warm-up compiles':>17s}")
    rows = []
    for jobs in [int(j) for j in args.jobs.split(",")]:
        r = cold_build(args.spec, sizes, jobs)
        rows.append(r)
        print(f"{jobs:5d} {r['build_s']:8.1f} {r['ahead_s']:18.1f} {r['ahead_variants']:15d} {r['warm_up_compiles']:17d}",
              flush=True)
    out = Path(args.out or ROOT / "bench" / "results" / (
        f"cold_build_{Path(args.spec).stem}_{gpu.replace(' ', '_')}_{time.strftime('%Y-%m-%d')}.json"))
    out.write_text(json.dumps({"spec": args.spec, "batch_sizes": sizes, "gpu": gpu, "cpus": os.cpu_count(),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
