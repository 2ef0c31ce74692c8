"""The AttnRes op (DESIGN §2): softmax mixing over saved blocks and the running prefix, then RMSNorm.

A plain pre-norm residual is the same op with ``nb == 0`` and no learned mixing weights:
``new = prefix + delta; out = rmsnorm(new) * gamma``. So ``residual: plain`` specs run the
very same kernel, which keeps A/B comparisons honest.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Mapping

import torch

from .attn_res_math import attn_res_reference
from .base import Implementation, Op, PdlTraits, write_output

# The CuTe DSL kernel: launch_dependents at entry, wait right before the delta is read,
# saved blocks and weights read in the prologue, every step-written load bypasses L1.
CLUSTER_KERNEL_TRAITS = PdlTraits(
    waits=True, trigger="early", prologue=("blocks", "key_norm", "query", "norm"), bypasses_l1=True
)


def _blocks_or_placeholder(t: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # nb == 0 and no slot write: the kernel never touches blocks, but it takes a [T, NB, D] tensor.
    return t["blocks"] if "blocks" in t else t["prefix"].unsqueeze(1)


def _mixing_weights(op: "AttnResOp", w: Mapping[str, torch.Tensor]):
    # Without learned mixing (plain residual) the key weights are never read (nb == 0).
    norm = w["norm"]
    return w.get("key_norm", norm), w.get("query", norm)


def _launch_cluster_kernel(op: "AttnResOp", t, w, stream, use_pdl: bool, workspaces) -> None:
    from graphc.kernels.attn_res import attn_res

    key_norm, query = _mixing_weights(op, w)
    attn_res(
        t["delta"], t["prefix"], _blocks_or_placeholder(t), key_norm, query, w["norm"], t["out"],
        nb=op.nb, has_delta=op.has_delta, write=op.write, final=op.final,
        eps=op.eps, out_eps=op.out_eps, stream=stream, use_pdl=use_pdl,
    )


def _cluster_kernel_variants(op: "AttnResOp", batch: int, sms: int, block_rows: int) -> list[tuple[str, tuple]]:
    from graphc.kernels.attn_res import compiled_variant

    return [compiled_variant(op.hidden, op.nb, op.has_delta, op.final)]   # one for every batch


def _launch_torch(op: "AttnResOp", t, w, stream, use_pdl: bool, workspaces) -> None:
    op.reference(t, w)


def _cute_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None


@dataclass(eq=False)
class AttnResOp(Op):
    kind = "attn_res"
    implementations = {
        "cute": Implementation("cute", CLUSTER_KERNEL_TRAITS, _launch_cluster_kernel,
                               available=_cute_available, arch="sm_90a",
                               variants=_cluster_kernel_variants),
        "torch": Implementation("torch", PdlTraits(waits=False, trigger="exit"), _launch_torch),
    }

    hidden: int = 0
    nb: int = 0
    has_delta: bool = True
    write: int = -1
    final: bool = False
    eps: float = 1e-6
    out_eps: float = 1e-6
    learned_mixing: bool = True

    def weight_shapes(self):
        shapes = {"norm": (f"{self.name}.norm", (self.hidden,))}
        if self.learned_mixing:
            shapes["key_norm"] = (f"{self.name}.key_norm", (self.hidden,))
            shapes["query"] = (f"{self.name}.query", (self.hidden,))
        return shapes

    def params(self):
        return {"nb": self.nb, "has_delta": self.has_delta, "write": self.write,
                "final": self.final, "eps": self.eps, "out_eps": self.out_eps}

    def reference(self, t, w):
        key_norm, query = _mixing_weights(self, w)
        out = attn_res_reference(
            t["delta"], t["prefix"], _blocks_or_placeholder(t), key_norm, query, w["norm"],
            nb=self.nb, has_delta=self.has_delta, write=self.write, final=self.final,
            eps=self.eps, out_eps=self.out_eps,
        )
        write_output(t["out"], out)

    def bytes_moved(self, sizes):
        # Rows touched, not whole buffers: nb saved blocks read, the delta read, the prefix
        # read (when adding to it) and written, the output, the written slot; weights once.
        T, D = sizes["T"], self.hidden
        rows = self.nb + 3 + int(self.has_delta) + int(self.write >= 0)
        return rows * T * D * 2 + self.weight_bytes()

    def flops(self, sizes):
        return 4 * (self.nb + 1) * sizes["T"] * self.hidden
