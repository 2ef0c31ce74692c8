"""GQA decode attention over a per-layer KV cache.

Each row ``t`` of the batch is one sequence living in cache slot ``cache_slots[t]`` with
``seq_lens[t]`` tokens already cached. The op appends the row's new K/V at position
``seq_lens[t]`` and attends over positions ``0 ..= seq_lens[t]``. The KV cache is a state
buffer ``[slots, 2 (K, V), kv_heads, max_context, head_dim]`` (head-major: each head's cached
tokens are contiguous); the append is a new version of it.
(No rotary embedding: the specs describe none.)
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

from .base import LIBRARY_KERNEL, Implementation, Op, PdlTraits, write_output

# The Triton kernel never waits (so it is entered through a full edge) but triggers its
# dependents at entry: a decode GEMM after it streams weights during attention.
TRITON_TRAITS = PdlTraits(waits=False, trigger="early")
# The CuTe DSL kernels (kernels/decode_attention_tma.py, kernels/decode_attention_cluster.py;
# mirrored here without importing cutlass) wait, so they may be entered through a PDL edge:
# before the wait they read only the lengths, the slots and the cached K/V (none written by this
# step before them), and they read qkv through L2. They trigger right after their wait: the
# kernel after them then launches once qkv is complete, so the AttnRes after o_proj keeps its PDL
# edge at block starts (an early trigger cost it that edge, and the step time; session 23).
TMA_TRAITS = PdlTraits(waits=True, trigger="late", prologue=("kv", "seq_lens", "cache_slots"),
                       bypasses_l1=True)
CLUSTER_TRAITS = TMA_TRAITS


def _launch_reference(op, t, w, stream, use_pdl, workspaces):
    op.reference(t, w)


def _launch_triton(op, t, w, stream, use_pdl, workspaces):
    from graphc.kernels.decode_attention import decode_attention

    decode_attention(t["qkv"], t["kv"], t["seq_lens"], t["cache_slots"], t["out"],
                     heads=op.heads, kv_heads=op.kv_heads, head_dim=op.head_dim, workspaces=workspaces)


class _CuteAttention:
    """Launch, compiled variants and availability of one CuTe DSL attention kernel module
    (kernels/decode_attention_tma.py, kernels/decode_attention_cluster.py: the same entry
    points). The module is imported only when used: it needs cutlass."""

    def __init__(self, module: str):
        self.module = module

    def launch(self, op, t, w, stream, use_pdl, workspaces):
        importlib.import_module(self.module).decode_attention(
            t["qkv"], t["kv"], t["seq_lens"], t["cache_slots"], t["out"], heads=op.heads,
            kv_heads=op.kv_heads, head_dim=op.head_dim, stream=stream, use_pdl=use_pdl,
            workspaces=workspaces)

    def variants(self, op, batch: int, sms: int, block_rows: int) -> list[tuple[str, tuple]]:
        kernel = importlib.import_module(self.module)
        return [kernel.compiled_variant(batch, op.heads, op.kv_heads, op.head_dim, op.max_context)]

    def available(self) -> bool:
        return (importlib.util.find_spec("cutlass") is not None
                and importlib.util.find_spec(self.module) is not None)


_TMA = _CuteAttention("graphc.kernels.decode_attention_tma")
_CLUSTER = _CuteAttention("graphc.kernels.decode_attention_cluster")


def cluster_supports(heads: int, kv_heads: int, head_dim: int, max_context: int) -> bool:
    """The shapes kernels/decode_attention_cluster.check_shape accepts (mirrored without cutlass)."""
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 8
            and head_dim == 128 and max_context % 64 == 0 and max_context > 0)


# From this captured batch size up the TMA kernel is the default. Measured in the 8-layer step,
# A/B in one process against the Triton kernel (bench/decode_attention_notes.md v16): batch 4
# 2712 us against 2737, 8 2680 / 2695, 16 2747 / 2781, 24 2871 / 2914, 32 2939 / 2996, 64 3342 /
# 3362; at batch 1 2693 against 2686 (a tie). Batches 2 and 3, measured in session 16 (A/B in
# one process, 4 rounds; bench/results/step_attention_triton_vs_tma_b1_3_*_session16.txt): the
# 8-layer step 2622.7-2637.1 against 2632.0-2634.6 us at 2 rows, 2628.4-2640.1 against
# 2651.6-2654.7 at 3; the 93-layer step 24745 against 24937-24980 at 2 rows. At 1 row Triton
# stays ahead (2598.0-2602.9 against 2620.7-2625.8; 93 layers 24557-24618 against 24741-24747).
TMA_MIN_BATCH = 2
# Up to this captured batch size the cluster kernel is the default. Measured in the step, A/B in
# one process against the Triton kernel at 1 row and the TMA kernel at 2-3
# (bench/decode_attention_notes.md, session 23): the 8-layer step 2532.8-2536.1 us against
# 2557.2-2558.3 at 1 row, 2572.5-2573.3 against 2584.4-2585.7 at 2, 2580.7-2581.6 against
# 2587.2-2588.7 at 3; the 93-layer step 23906.5-23915.0 against 24101.9-24123.6 at 1 row but
# 24303.5-24305.9 against 24223.5-24236.1 at 2 rows.
CLUSTER_MAX_BATCH = 1


def tma_supports(heads: int, kv_heads: int, head_dim: int, max_context: int) -> bool:
    """The shapes kernels/decode_attention_tma.check_shape accepts (mirrored without cutlass)."""
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 32
            and head_dim in (128, 256) and max_context % 64 == 0 and max_context > 0)


def triton_supports(head_dim: int) -> bool:
    """The head dims kernels/decode_attention.py compiles: tl.arange and tl.dot need a power
    of two of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _triton_available() -> bool:
    return (importlib.util.find_spec("triton") is not None
            and importlib.util.find_spec("graphc.kernels.decode_attention") is not None)


@dataclass(eq=False)
class DecodeAttentionOp(Op):
    kind = "decode_attention"
    implementations = {
        # Split-KV Triton kernel: reads only the cached tokens (the torch path reads max_context).
        "triton": Implementation("triton", TRITON_TRAITS, _launch_triton, available=_triton_available,
                                 arch="sm_90"),
        "torch": Implementation("torch", LIBRARY_KERNEL, _launch_reference),
        # TMA producer warp + wgmma warpgroup (CuTe DSL); contiguous head-major cache.
        "tma": Implementation("tma", TMA_TRAITS, _TMA.launch, available=_TMA.available, arch="sm_90a",
                              variants=_TMA.variants),
        # K/V in registers loaded before the PDL wait, splits combined through distributed
        # shared memory (CuTe DSL; few rows).
        "cluster": Implementation("cluster", CLUSTER_TRAITS, _CLUSTER.launch, available=_CLUSTER.available,
                                  arch="sm_90a", variants=_CLUSTER.variants),
    }

    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    max_context: int = 0

    def preference(self, batch: int | None = None) -> list[str]:
        """A CuTe DSL kernel first (where the shape allows it and CuTe DSL is installed): the
        cluster kernel up to CLUSTER_MAX_BATCH rows, the TMA kernel from TMA_MIN_BATCH rows.
        Then, and alone when no batch size is known, the Triton kernel, then torch."""
        portable = ["triton", "torch"]
        if batch is None:
            return portable
        if batch <= CLUSTER_MAX_BATCH:
            return ["cluster", *portable]
        return (["tma"] if batch >= TMA_MIN_BATCH else []) + portable

    def unsupported(self, impl: str, batch: int | None = None) -> str | None:
        if impl == "tma" and not tma_supports(self.heads, self.kv_heads, self.head_dim, self.max_context):
            return ("the TMA kernel takes head_dim 128 or 256, up to 32 query heads per KV head and "
                    f"max_context a multiple of 64; found head_dim {self.head_dim}, "
                    f"{self.heads} heads over {self.kv_heads} KV heads, max_context {self.max_context}")
        if impl == "cluster" and not cluster_supports(self.heads, self.kv_heads, self.head_dim, self.max_context):
            return ("the cluster kernel takes head_dim 128, up to 8 query heads per KV head and "
                    f"max_context a multiple of 64; found head_dim {self.head_dim}, "
                    f"{self.heads} heads over {self.kv_heads} KV heads, max_context {self.max_context}")
        if impl == "triton" and not triton_supports(self.head_dim):
            return f"the Triton kernel takes a power-of-two head_dim of at least 16; found {self.head_dim}"
        return None

    def params(self):
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "max_context": self.max_context}

    def reference(self, t, w):
        H, KV, hd = self.heads, self.kv_heads, self.head_dim
        qkv, kv = t["qkv"], t["kv"]
        T, C = qkv.shape[0], kv.shape[3]
        slots, pos = t["cache_slots"].long(), t["seq_lens"].long()
        q = qkv[:, : H * hd].reshape(T, KV, H // KV, hd).float()
        kv[slots, 0, :, pos] = qkv[:, H * hd:(H + KV) * hd].reshape(T, KV, hd)
        kv[slots, 1, :, pos] = qkv[:, (H + KV) * hd:].reshape(T, KV, hd)
        keys, vals = kv[slots, 0].float(), kv[slots, 1].float()              # [T, KV, C, hd]
        scores = torch.einsum("tkgd,tkcd->tkgc", q, keys) / math.sqrt(hd)
        beyond = torch.arange(C, device=qkv.device)[None, :] > pos[:, None]  # [T, C]
        scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out = torch.einsum("tkgc,tkcd->tkgd", p, vals).reshape(T, H * hd)
        write_output(t["out"], out)

    def bytes_moved(self, sizes):
        # The cached tokens actually read (sizes["context"] per row), the new K/V, q and out.
        T, KV, hd = sizes["T"], self.kv_heads, self.head_dim
        cache = T * sizes.get("context", 1) * 2 * KV * hd * 2
        io = T * ((self.heads + 2 * KV) * hd + self.heads * hd) * 2
        return cache + io

    def flops(self, sizes):
        return 4 * sizes["T"] * sizes.get("context", 1) * self.heads * self.head_dim
