"""Small ops with no weights of their own: the MLP's silu(gate)·up and the token embedding."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import LIBRARY_KERNEL, Implementation, Op


def _launch_reference(op, t, w, stream, use_pdl):
    op.reference(t, w)


def _launch_triton_silu_mul(op, t, w, stream, use_pdl):
    from graphc.kernels.silu_mul import silu_mul

    silu_mul(t["x"], t["out"])


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(eq=False)
class SiluMulOp(Op):
    """out = bf16(silu(gate) * up) over the two halves of the fused gate_up projection."""

    kind = "silu_mul"
    implementations = {
        "triton": Implementation("triton", LIBRARY_KERNEL, _launch_triton_silu_mul,
                                 available=_triton_available),
        "torch": Implementation("torch", LIBRARY_KERNEL, _launch_reference),
    }
    intermediate: int = 0

    def params(self):
        return {"intermediate": self.intermediate}

    def reference(self, t, w):
        gate_up = t["x"].float()
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate:]
        t["out"].copy_((F.silu(gate) * up).to(torch.bfloat16))


@dataclass(eq=False)
class EmbeddingOp(Op):
    kind = "embedding"
    implementations = {"torch": Implementation("torch", LIBRARY_KERNEL, _launch_reference)}
    vocab: int = 0
    hidden: int = 0

    def weight_shapes(self):
        return {"weight": ("embed.weight", (self.vocab, self.hidden))}

    def params(self):
        return {"vocab": self.vocab, "hidden": self.hidden}

    def reference(self, t, w):
        torch.index_select(w["weight"], 0, t["tokens"], out=t["out"])

    def bytes_moved(self, sizes):
        return 2 * sizes["T"] * self.hidden * 2 + sizes["T"] * 8   # rows gathered, not the table
