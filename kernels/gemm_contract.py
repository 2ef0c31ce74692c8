"""What the decode GEMM op accepts: its epilogues, batch sizes and (K, N) alignment.

One rule set for ``kernels/gemm.py``'s ``plan`` / ``linear`` and for both kernels behind them
(kernels/gemm_stream_k.py, kernels/gemm_wide.py), kept apart so the kernels can check a shape
without importing the front end that imports them.
"""

from __future__ import annotations

EPILOGUES = (None, "silu_mul")
MAX_M = 256                # the largest captured batch size
DEFAULT_SMS = 132          # H100 / H200 SXM: the persistent grid of a compile without a GPU
K_ALIGN = 64               # K granularity: one 128-byte swizzle atom of bf16
N_ALIGN = 64               # N granularity: one wgmma M of W rows in the stream-K kernel


def check_shape(m: int, k: int, n: int, epilogue: str | None = None) -> None:
    """Raise ValueError naming the rule a (M, K, N, epilogue) breaks."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} unsupported: one of {EPILOGUES}")
    if not isinstance(m, int) or not 1 <= m <= MAX_M:
        raise ValueError(f"M={m} out of range: 1 <= M <= {MAX_M} (the captured batch size)")
    if not isinstance(k, int) or k <= 0 or k % K_ALIGN:
        raise ValueError(f"K={k} unsupported: K must be a positive multiple of {K_ALIGN}")
    if not isinstance(n, int) or n <= 0 or n % N_ALIGN:
        raise ValueError(f"N={n} unsupported: N must be a positive multiple of {N_ALIGN}")
    if epilogue == "silu_mul" and n % (2 * N_ALIGN):
        raise ValueError(
            f"N={n} unsupported with silu_mul: W is [gate; up] with I = N/2 rows each, and I "
            f"must be a multiple of {N_ALIGN}, so N must be a multiple of {2 * N_ALIGN}"
        )
