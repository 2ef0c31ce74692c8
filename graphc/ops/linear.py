"""Linear layers: ``y[T, N] = x[T, K] @ W[N, K]^T`` (bf16 in/out, fp32 accumulation).

cuBLAS (through torch) cannot execute ``griddepcontrol.wait``, so the scheduler may enter it
only through a full edge. The CuTe DSL decode GEMM streams its weights before the wait.

Which one a captured batch size gets by default was measured (bench/gemm.py on an H200,
bench/gemm_notes.md): the decode GEMM streams the weights faster than cuBLAS up to
``DECODE_GEMM_MAX_BATCH`` rows on every linear shape of the Kimi specs; above, cuBLAS's
tiling wins on some shapes, so larger batch sizes keep cuBLAS.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .base import LIBRARY_KERNEL, Implementation, Op, PdlTraits


def _launch_cublas(op: "LinearOp", t, w, stream, use_pdl: bool) -> None:
    torch.matmul(t["x"], w["weight"].t(), out=t["out"])


def _decode_gemm_traits() -> PdlTraits:
    # Mirrors kernels/gemm.py without importing cutlass at schedule time.
    return PdlTraits(waits=True, trigger="early", prologue=("weight",), bypasses_l1=True)


def _launch_decode_gemm(op: "LinearOp", t, w, stream, use_pdl: bool) -> None:
    from graphc.kernels.gemm import linear

    linear(t["x"], w["weight"], t["out"], epilogue=op.epilogue, stream=stream, use_pdl=use_pdl)


def _decode_gemm_available() -> bool:
    return (importlib.util.find_spec("cutlass") is not None
            and importlib.util.find_spec("graphc.kernels.gemm") is not None)


DECODE_GEMM_MAX_BATCH = 16


@dataclass(eq=False)
class LinearOp(Op):
    kind = "linear"
    implementations = {
        "cute": Implementation("cute", _decode_gemm_traits(), _launch_decode_gemm,
                               available=_decode_gemm_available, max_batch=DECODE_GEMM_MAX_BATCH),
        "cublas": Implementation("cublas", LIBRARY_KERNEL, _launch_cublas),
    }

    k: int = 0
    n: int = 0
    weight_name: str = ""
    epilogue: str | None = None

    def weight_shapes(self):
        return {"weight": (self.weight_name or f"{self.name}.weight", (self.n, self.k))}

    def params(self):
        return {"k": self.k, "n": self.n}

    def reference(self, t, w):
        y = t["x"].float() @ w["weight"].float().t()
        t["out"].copy_(y.to(t["out"].dtype))

    def flops(self, sizes):
        return 2 * sizes["T"] * self.k * self.n
