"""One decode-GEMM launch per (shape, M) for Nsight Compute to profile.

    source .gpu/setup.sh && ncu --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats -k regex:kernel python3 bench/gemm_ncu.py o_proj:8 o_proj:64

Each argument is ``shape:M`` with a shape name of bench/gemm.py's BIG_SHAPES. The kernel is
warmed up (compiled, workspace allocated) and then launched once more, without PDL.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from graphc.kernels import gemm  # noqa: E402

from gemm import BIG_SHAPES  # noqa: E402  (bench/gemm.py)

SHAPES = {name: (k, n, e) for name, k, n, e in BIG_SHAPES}

for arg in sys.argv[1:]:
    name, m = arg.split(":")
    k, n, epi = SHAPES[name]
    m = int(m)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    out = torch.empty(m, n // 2 if epi else n, device="cuda", dtype=torch.bfloat16)
    gemm.linear(x, w, out, epilogue=epi, use_pdl=False)
    torch.cuda.synchronize()
    gemm.linear(x, w, out, epilogue=epi, use_pdl=False)
    torch.cuda.synchronize()
    print(arg, gemm.GemmConfig(m, k, n, epi, torch.cuda.get_device_properties(0).multi_processor_count))
