"""First-run diagnosis of the decode GEMM: each case in a fresh process (an illegal
instruction poisons the CUDA context), then compute-sanitizer on the first failure.

    python3 bench/gemm_diag.py
"""
import os
import subprocess
import sys

CASE = r"""
import os, sys, torch
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from graphc.kernels import gemm
m, k, n = map(int, sys.argv[1:4]); ep = None if sys.argv[4] == "none" else sys.argv[4]
pdl = sys.argv[5] == "1"
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
nout = n // 2 if ep else n
out = torch.full((m, nout), float("nan"), device="cuda", dtype=torch.bfloat16)
gemm.linear(x, w, out, epilogue=ep, use_pdl=pdl)
torch.cuda.synchronize()
y = x.float() @ w.float().T
if ep:
    y = torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2:]
err = ((out.float() - y).norm() / y.norm()).item()
print(f"ok rel {err:.3e} nan {torch.isnan(out).sum().item()}")
"""
cases = [("1", "1024", "1024", "none", "0"), ("8", "1024", "1024", "none", "0"),
         ("16", "1024", "1024", "none", "0"), ("64", "1024", "1024", "none", "0"),
         ("8", "7168", "10240", "none", "0"), ("8", "1024", "5632", "silu_mul", "0"),
         ("8", "1024", "1024", "none", "1")]
first_bad = None
for c in cases:
    r = subprocess.run([sys.executable, "-c", CASE, *c], capture_output=True, text=True, timeout=120)
    last = (r.stdout.strip().splitlines() or ["-"])[-1]
    err = [l for l in r.stderr.splitlines() if "Error" in l or "error" in l][-1:] or [""]
    print(" ".join(c), "->", last if r.returncode == 0 else f"FAILED rc={r.returncode} {err[0][:160]}", flush=True)
    if r.returncode != 0 and first_bad is None:
        first_bad = c
if first_bad and os.path.exists("/usr/local/cuda/bin/compute-sanitizer"):
    r = subprocess.run(["/usr/local/cuda/bin/compute-sanitizer", "--tool", "memcheck", "--show-backtrace", "device",
                        sys.executable, "-c", CASE, *first_bad], capture_output=True, text=True, timeout=240)
    lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
    print("\n".join(lines[:40]))
