"""The token embedding: a row gather from the embedding table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LIBRARY_KERNEL, Implementation, Op


def _launch_reference(op, t, w, stream, use_pdl, workspaces):
    op.reference(t, w)


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
