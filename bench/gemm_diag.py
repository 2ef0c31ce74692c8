"""First-run diagnosis of the decode GEMM: each case in a fresh process (an illegal
instruction poisons the CUDA context), then compute-sanitizer on the first failure.

    python3 bench/gemm_diag.py               # every case, one process each
    python3 bench/gemm_diag.py --small-m     # only the M = 1..7 cases (the M = 1 fix), plus M = 8
    python3 bench/gemm_diag.py --small-m --one-process   # same, all in one process (< 60 s)

With --one-process the cases run one after another in a single process (one torch/CUDA start)
and it stops at the first failure; rerun without it to isolate a failing case and get the
compute-sanitizer report.
"""
import os
import subprocess
import sys

CASE = r"""
import os, sys, torch
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from graphc.kernels import gemm
args = sys.argv[1:]
assert len(args) % 5 == 0
for c in range(0, len(args), 5):
    m, k, n = map(int, args[c:c + 3]); ep = None if args[c + 3] == "none" else args[c + 3]
    pdl = args[c + 4] == "1"
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    nout = n // 2 if ep else n
    out = torch.full((m, nout), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.linear(x, w, out, epilogue=ep, use_pdl=pdl)
    torch.cuda.synchronize()
    first = out.clone()
    gemm.linear(x, w, out, epilogue=ep, use_pdl=pdl)      # replay: counters reset, same bits
    torch.cuda.synchronize()
    y = x.float() @ w.float().T
    if ep:
        y = torch.nn.functional.silu(y[:, : n // 2]) * y[:, n // 2:]
    err = ((out.float() - y).norm() / y.norm()).item()
    print(" ".join(args[c:c + 5]), f"-> ok rel {err:.3e} nan {torch.isnan(out).sum().item()} "
          f"replay_equal {bool(torch.equal(first, out))}", flush=True)
"""
CASES = [("1", "1024", "1024", "none", "0"), ("8", "1024", "1024", "none", "0"),
         ("16", "1024", "1024", "none", "0"), ("64", "1024", "1024", "none", "0"),
         ("8", "7168", "10240", "none", "0"), ("8", "1024", "5632", "silu_mul", "0"),
         ("8", "1024", "1024", "none", "1")]
# M = 1..7 pad to the same mma_n = 8 as M = 8 (M = 1 was the illegal instruction).
SMALL_M = ([(str(m), "1024", "1024", "none", "0") for m in range(1, 9)]
           + [("1", "1024", "5632", "silu_mul", "0"), ("1", "1024", "1024", "none", "1"),
              ("1", "7168", "10240", "none", "1"), ("3", "2816", "1024", "none", "1")])


def main() -> int:
    unknown = [a for a in sys.argv[1:] if a not in ("--small-m", "--one-process")]
    if unknown:                 # --help, or a typo that would otherwise run every case
        print(__doc__)
        return 0 if unknown in (["-h"], ["--help"]) else 2
    small = "--small-m" in sys.argv
    cases = SMALL_M if small else CASES + SMALL_M[1:7] + SMALL_M[8:]
    if "--one-process" in sys.argv:
        r = subprocess.run([sys.executable, "-c", CASE, *[a for c in cases for a in c]], timeout=300)
        print("all ok" if r.returncode == 0 else f"FAILED rc={r.returncode} (rerun without --one-process)")
        return r.returncode
    first_bad = None
    for c in cases:
        r = subprocess.run([sys.executable, "-c", CASE, *c], capture_output=True, text=True, timeout=120)
        last = (r.stdout.strip().splitlines() or ["-"])[-1]
        err = [l for l in r.stderr.splitlines() if "Error" in l or "error" in l][-1:] or [""]
        print(last if r.returncode == 0 else " ".join(c) + f" -> FAILED rc={r.returncode} {err[0][:160]}", flush=True)
        if r.returncode != 0 and first_bad is None:
            first_bad = c
    if first_bad and os.path.exists("/usr/local/cuda/bin/compute-sanitizer"):
        r = subprocess.run(["/usr/local/cuda/bin/compute-sanitizer", "--tool", "memcheck", "--show-backtrace", "device",
                            sys.executable, "-c", CASE, *first_bad], capture_output=True, text=True, timeout=240)
        lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
        print("\n".join(lines[:40]))
    return 1 if first_bad else 0


if __name__ == "__main__":
    sys.exit(main())
