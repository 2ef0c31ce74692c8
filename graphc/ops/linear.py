"""Linear layers: ``y[T, N] = x[T, K] @ W[N, K]^T`` (bf16 in/out, fp32 accumulation).

With ``epilogue="silu_mul"`` (the MLP's gate_up projection, W = [gate; up]) the op's output
is ``bf16(silu(g) * u)`` of the two fp32 halves, so the MLP is two ops: the decode GEMM
computes it in its epilogue from the fp32 accumulators; cuBLAS writes the bf16 projection into
the op's ``scratch`` buffer and one Triton kernel applies silu * up (two kernels, one op, and
one extra bf16 rounding of the projection: an approximation of the op's semantics that moves
an 8-layer model's logits by ~6e-3, bench/step_notes.md).

cuBLAS (through torch) cannot execute ``griddepcontrol.wait``, so the scheduler may enter it
only through a full edge. The CuTe DSL decode GEMM streams its weights before the wait.

Which one a captured batch size gets by default was measured (bench/gemm.py and
bench/step_ab.py on H200s, and on H100s for down, o_proj, qkv and lm_head; bench/gemm_notes.md): the decode GEMM up to
``DECODE_GEMM_MAX_BATCH`` rows on every linear shape, and on the Kimi shapes up to the rows
listed in ``DECODE_GEMM_ROWS`` (up to 64; down up to 96, at 192 and at 224, lm_head up to 96, qkv up to
160, o_proj up to 224, gate_up up to 256); cuBLAS elsewhere. Where the decode GEMM is the only reader of
a weight at every captured batch size, the build stores that weight in 64 x 64 blocks
(graphc/plan.py), which it streams 2-7% faster.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import GraphcError
from ..kernels.gemm_contract import check_shape
from ..kernels.weight_blocks import as_float_matrix, is_blocked
from .base import LIBRARY_KERNEL, Implementation, Op, PdlTraits, write_output


def output_width(n: int, epilogue: str | None) -> int:
    """Columns of the op's output: silu_mul halves the [gate | up] projection."""
    return n // 2 if epilogue == "silu_mul" else n


def silu_mul_reference(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out = bf16(silu(gate) * up) over the two halves of the projection, math in fp32 (the
    op's reference passes the fp32 projection, the cuBLAS path without Triton its bf16 one)."""
    i = out.shape[1]
    y = gate_up.float()
    write_output(out, F.silu(y[:, :i]) * y[:, i:])


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _launch_cublas(op: "LinearOp", t, w, stream, use_pdl: bool, workspaces) -> None:
    if is_blocked(w["weight"]):     # graphc/plan.py never binds blocks to a row-major reader
        raise GraphcError(f"{op.name}: cuBLAS reads row-major weights, but this one is stored in blocks")
    if op.epilogue is None:
        torch.matmul(t["x"], w["weight"].t(), out=t["out"])
        return
    torch.matmul(t["x"], w["weight"].t(), out=t["scratch"])
    if _triton_available():             # one kernel instead of five torch ops
        from graphc.kernels.silu_mul import silu_mul

        silu_mul(t["scratch"], t["out"])
    else:
        silu_mul_reference(t["scratch"], t["out"])


def _decode_gemm_traits() -> PdlTraits:
    # Mirrors kernels/gemm.py's PDL traits without importing cutlass at schedule time.
    return PdlTraits(waits=True, trigger="early", prologue=("weight",), bypasses_l1=True)


def _launch_decode_gemm(op: "LinearOp", t, w, stream, use_pdl: bool, workspaces) -> None:
    from graphc.kernels.gemm import linear

    linear(t["x"], w["weight"], t["out"], epilogue=op.epilogue, stream=stream, use_pdl=use_pdl,
           workspaces=workspaces)


def _decode_gemm_variants(op: "LinearOp", batch: int, sms: int, block_rows: int) -> list[tuple[str, tuple]]:
    from graphc.kernels.gemm import compiled_variant

    return [compiled_variant(batch, op.k, op.n, op.epilogue, sms, w_block_rows=block_rows)]


def _decode_gemm_reads_blocks(op: "LinearOp", batch: int, sms: int) -> bool:
    # Both decode GEMMs read blocks; true where the blocks leave plan()'s kernel as it is (not
    # where 80- or 112-row whole-K tiles run: bench/gemm_notes.md §33-§34).
    from graphc.kernels.gemm import reads_blocks

    return reads_blocks(batch, op.k, op.n, op.epilogue, sms)


def _decode_gemm_describe(op: "LinearOp", batch: int, sms: int) -> str:
    # Row-major weights: where a build stores them in blocks, the kernel and tile are the same
    # (kernels/gemm.py reads_blocks), only its w_blocked differs.
    from graphc.kernels.gemm import plan

    return repr(plan(batch, op.k, op.n, op.epilogue, sms))


def _decode_gemm_available() -> bool:
    return (importlib.util.find_spec("cutlass") is not None
            and importlib.util.find_spec("graphc.kernels.gemm") is not None)


DECODE_GEMM_MAX_BATCH = 16
# (K, N, epilogue) -> the captured batch sizes at which the decode GEMM is the default, as
# inclusive (first, last) spans; other shapes: up to DECODE_GEMM_MAX_BATCH. Every entry was set
# by A/B runs of the whole 8-layer step (bench/step_ab.py, 3 interleaved rounds in one process;
# a kernel timed alone misses the step's PDL overlap, cache state and weight order), recorded
# in bench/step_notes.md and bench/gemm_notes.md:
# - every Kimi linear up to 64 rows: with the weights it alone reads in 64 x 64 blocks the
#   step was faster at 1-64 rows than with qkv, o_proj and lm_head on cuBLAS (session 26:
#   3270-3272 against 3293-3298 us at 64 rows); with every linear on it, bimodal at 128 rows
#   and slower at 256 (session 27).
# - gate_up up to 256 (its silu·mul fused, against cuBLAS plus the Triton silu·mul): 2.5-4.9%
#   faster at 96, 160 and 192 rows, tied at 128 and 256 (session 36, two H200s).
# - o_proj up to 224: -0.6 to -3.6% at 96, 192 and 224 rows, tied at 128-160 (session 38, two
#   H100s); at 256 its whole-K tiles, on rows, lose to cuBLAS.
# - down up to 96, at 192 and at 224: -2.0% at 96 (session 38); -2.7 to -3.9% at 192 and -0.7
#   to -2.0% at 224 on three H100s with its weight in blocks, and -0.6% at 224 with it
#   row-major, as a build that also captures a cuBLAS size keeps it (session 51); these are the
#   sizes where cuBLAS's own choice is poor. 0.3-1.5% slower at 160, 184, 200, 208 and 216
#   (session 50).
# - qkv up to 160: -0.4 to -1.2% at 96-160 rows (session 50, two H100 leases). At 192 -0.3 to
#   -0.7% there too, but alone it is 1.08x cuBLAS at 192 rows on an H200, the target board.
# - lm_head up to 96: -1.1% at 80 rows, -0.4 / -0.6% at 96, tied at 112-192 (session 50).
# Spans rather than one crossover per shape because of down's 192 and 224 rows.
DECODE_GEMM_ROWS = {
    (7168, 36864, "silu_mul"): ((1, 256),),            # gate_up
    (18432, 7168, None): ((1, 96), (192, 192), (224, 224)),   # down
    (7168, 10240, None): ((1, 160),),                   # qkv
    (8192, 7168, None): ((1, 224),),                    # o_proj
    (7168, 163840, None): ((1, 96),),                   # lm_head
}


def decode_gemm_rows(k: int, n: int, epilogue: str | None) -> tuple[tuple[int, int], ...]:
    """The (first, last) spans of captured batch sizes at which the decode GEMM is the default
    for this linear shape."""
    return DECODE_GEMM_ROWS.get((k, n, epilogue), ((1, DECODE_GEMM_MAX_BATCH),))


def decode_gemm_default(k: int, n: int, epilogue: str | None, batch: int) -> bool:
    """Whether the decode GEMM is this linear shape's default at this captured batch size."""
    return any(first <= batch <= last for first, last in decode_gemm_rows(k, n, epilogue))


@dataclass(eq=False)
class LinearOp(Op):
    kind = "linear"
    implementations = {
        "cublas": Implementation("cublas", LIBRARY_KERNEL, _launch_cublas),
        "cute": Implementation("cute", _decode_gemm_traits(), _launch_decode_gemm,
                               available=_decode_gemm_available, arch="sm_90a",
                               variants=_decode_gemm_variants, reads_blocks=_decode_gemm_reads_blocks,
                               describe=_decode_gemm_describe),
    }

    k: int = 0
    n: int = 0
    weight_name: str = ""
    epilogue: str | None = None

    def weight_shapes(self):
        return {"weight": (self.weight_name or f"{self.name}.weight", (self.n, self.k))}

    def unsupported(self, impl: str, batch: int | None = None) -> str | None:
        # The decode GEMM's own contract (kernels/gemm_contract.py: its largest batch, K and N
        # alignment, epilogues), checked at one row where no batch size is known.
        if impl != "cute":
            return None
        try:
            check_shape(1 if batch is None else batch, self.k, self.n, self.epilogue)
        except ValueError as e:
            return f"the decode GEMM refuses it: {e}; choose cublas"
        return None

    def decode_gemm_default(self, batch: int) -> bool:
        """Whether the decode GEMM is this op's default at this captured batch size."""
        return decode_gemm_default(self.k, self.n, self.epilogue, batch)

    def preference(self, batch: int | None = None) -> list[str]:
        """The decode GEMM at batch sizes where it was measured faster (where CuTe DSL is
        installed), cuBLAS otherwise and when no batch size is known."""
        if batch is not None and self.decode_gemm_default(batch):
            return ["cute", "cublas"]
        return ["cublas"]

    def params(self):
        return {"k": self.k, "n": self.n, **({"epilogue": self.epilogue} if self.epilogue else {})}

    def reference(self, t, w):
        # The op's semantics: fp32 products and sums, one bf16 rounding of the output. With
        # silu_mul the activation is applied to the fp32 projection, as the decode GEMM's
        # epilogue does; the cuBLAS path rounds the projection to bf16 first (one more
        # rounding, within an ulp of the projection).
        # (A weight stored in blocks is put back in rows by the same pass that converts it.)
        y = t["x"].float() @ as_float_matrix(w["weight"]).t()
        if self.epilogue is None:
            write_output(t["out"], y)
        else:
            silu_mul_reference(y, t["out"])

    def bytes_moved(self, sizes):
        # x once, the weights once, the output once; ``scratch`` only exists on the cuBLAS
        # path and is not a byte the op must move.
        T = sizes["T"]
        return T * self.k * 2 + self.weight_bytes() + T * self.n_out * 2

    @property
    def n_out(self) -> int:
        return output_width(self.n, self.epilogue)

    def flops(self, sizes):
        return 2 * sizes["T"] * self.k * self.n
