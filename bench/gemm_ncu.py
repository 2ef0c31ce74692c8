"""One decode-GEMM launch per (shape, M) for Nsight Compute to profile, optionally beside
cuBLAS's (torch.matmul) for the same problem.

    source .gpu/setup.sh && ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python3 bench/gemm_ncu.py --cublas o_proj:8 o_proj:256

Each argument is ``shape:M`` with a shape name of bench/gemm.py's BIG_SHAPES, optionally
followed by ``:knob=value,...`` (``ctas`` or ``gemm.plan``'s knobs, as bench/gemm.py's
``--tunings`` takes them, e.g. ``qkv:192:wide=1,batch_tile=64``; ``w_blocked=1`` or
``w_block_rows=16`` profiles the kernel on a copy of W in those blocks, as bench/gemm.py does,
else W is row-major);
each line printed names the configuration ``linear`` ran (``gemm.plan``). Every kernel is
warmed up (compiled, workspace allocated) and then launched once more, without PDL, inside an
NVTX range named ``profile`` (so ``--nvtx-include "profile/"`` skips the set-up kernels).
cuBLAS's launch is the bf16 projection alone (no silu * up kernel after it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from graphc.kernels import gemm, weight_blocks  # noqa: E402

from gemm import BIG_SHAPES, parse_tunings, weight_order  # noqa: E402  (bench/gemm.py)

SHAPES = {name: (k, n, e) for name, k, n, e in BIG_SHAPES}


def profiled(launch) -> None:
    """Warm ``launch`` up, then run it once inside the ``profile`` NVTX range."""
    launch()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    launch()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", metavar="shape:M")
    ap.add_argument("--cublas", action="store_true", help="also profile torch.matmul per case")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [parse_case(arg) for arg in args.cases]     # every argument checked before any launch
    for arg, (name, m, tuning) in zip(args.cases, cases):
        k, n, epi = SHAPES[name]
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        out = torch.empty(m, n // 2 if epi else n, device="cuda", dtype=torch.bfloat16)
        ctas = tuning.pop("ctas", sms)
        knobs, rows = weight_order(tuning)         # row-major unless the case asks for blocks
        w_in = weight_blocks.to_blocks(w, rows) if rows else w
        profiled(lambda: gemm.linear(x, w_in, out, epilogue=epi, use_pdl=False, ctas=ctas, **knobs))
        print(arg, gemm.plan(m, k, n, epi, ctas, **knobs, **dict(gemm.weight_order_knobs(w_in))))
        if args.cublas:
            projection = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            profiled(lambda: torch.matmul(x, w.t(), out=projection))
            print(arg, "cuBLAS (torch.matmul)")


def parse_case(arg: str) -> tuple[str, int, dict]:
    """``"qkv:192:wide=1,cluster=4"`` -> ("qkv", 192, {"wide": 1, "cluster": 4}); exits naming
    the problem for an unknown shape, a bad M or a knob ``gemm.plan`` does not take (the knobs
    parsed as bench/gemm.py's ``--tunings`` parses one alternative)."""
    name, _, rest = arg.partition(":")
    m_text, _, knobs = rest.partition(":")
    if name not in SHAPES:
        raise SystemExit(f"{arg}: unknown shape {name!r}: one of {', '.join(SHAPES)}")
    if not m_text.isdigit() or not 1 <= int(m_text) <= gemm.MAX_M:
        raise SystemExit(f"{arg}: M must be an integer in 1..{gemm.MAX_M}")
    if ";" in knobs:
        raise SystemExit(f"{arg}: one configuration per case (give each its own shape:M:knobs)")
    tunings = parse_tunings(knobs)
    return name, int(m_text), tunings[0][1] if tunings else {}


if __name__ == "__main__":
    main()
