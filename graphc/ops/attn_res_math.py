"""AttnRes semantics exactly as DESIGN.md §2: the torch reference every faster path answers to.

All math is fp32, all storage bf16; the bf16 rounding points are marked ``# bf16``.
Works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import torch

MAX_CLUSTER = 8          # portable cluster size limit on Hopper
MAX_THREADS = 128        # threads per CTA; each holds 8 bf16 columns (one 16-byte vector)
COLUMNS_PER_THREAD = 8
MAX_SAVED_BLOCKS = 12


def cluster_shape(hidden: int) -> tuple[int, int] | None:
    """(CTAs per cluster, threads per CTA) that cover ``hidden`` columns, or None.

    The kernel needs hidden = C x threads x 8 with C <= 8 and threads a multiple of 32 no
    larger than 128. The smallest such C is chosen: fewer CTAs means a cheaper exchange.
    """
    if hidden <= 0 or hidden % (32 * COLUMNS_PER_THREAD):
        return None
    vectors = hidden // COLUMNS_PER_THREAD
    for ctas in range(1, MAX_CLUSTER + 1):
        if vectors % ctas == 0:
            threads = vectors // ctas
            if threads <= MAX_THREADS and threads % 32 == 0:
                return ctas, threads
    return None


SUPPORTED_HIDDEN_RULE = (
    "hidden = C x threads x 8 with C <= 8 CTAs per cluster and threads a multiple of 32 "
    "no larger than 128 (e.g. 1024, 2048, 2304, 4096, 7168, 8192)"
)


def attn_res_reference(
    delta: torch.Tensor,
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    key_norm: torch.Tensor,
    query: torch.Tensor,
    out_norm: torch.Tensor,
    *,
    nb: int,
    has_delta: bool,
    write: int,
    final: bool,
    eps: float,
    out_eps: float,
    aux: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """One AttnRes call for every token row. Updates ``prefix``, ``aux`` and
    ``blocks[:, write]`` in place and returns the normalised output (bf16, [T, D]).

    delta, prefix, aux: [T, D] bf16; blocks: [T, NB, D] bf16 (only slots < nb are read);
    key_norm, query, out_norm: [D] bf16.
    """
    T, D = prefix.shape
    incoming = delta.float()
    if has_delta:
        new = (prefix.float() + incoming).to(torch.bfloat16)            # bf16
    else:
        new = incoming.to(torch.bfloat16)                                # bf16
    prefix.copy_(new)
    for stream in aux:
        stream.copy_(new)
    if write >= 0:
        blocks[:, write].copy_(new)

    if nb == 0:
        mix = new.float()
    else:
        sources = torch.cat([blocks[:, :nb].float(), new.float().unsqueeze(1)], dim=1)  # [T, nb+1, D]
        w = key_norm.float() * query.float()                             # folded, not rounded
        rstd = torch.rsqrt((sources * sources).sum(-1) / D + eps)        # [T, nb+1]
        logits = (sources * w).sum(-1) * rstd
        p = torch.softmax(logits, dim=-1)                                # max-subtracted
        mix = (p.unsqueeze(-1) * sources).sum(1)                         # fp32

    if final:
        mix = mix.to(torch.bfloat16).float()                             # bf16
    scale = torch.rsqrt((mix * mix).mean(-1, keepdim=True) + out_eps)
    return (mix * scale * out_norm.float()).to(torch.bfloat16)           # bf16
