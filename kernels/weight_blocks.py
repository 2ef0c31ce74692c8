"""Weights stored in 64 x 64 blocks: the memory order the decode GEMM streams fastest.

In a row-major W [N, K] the 64 values of one row that the decode GEMM (kernels/gemm.py)
loads per k-block (128 bytes) lie K*2 bytes from the next row's, so each of its 8 KB TMA
boxes is 64 separate 128-byte reads. Stored as blocks, ``[N/64, K/64, 64, 64]``
(row block, k block, row in block, k in block), the same box is one contiguous 8 KB read:
fewer DRAM row activations per byte. Measured on an H200 (bench/gemm_notes.md §33): 2-7%
faster on every Kimi shape at 1-64 rows, and up to 36 W less board power at 8 rows.

The shape says the order: a 2-D weight is row-major, a 4-D one is blocked. torch.matmul
refuses a 4-D weight, so no reader can mistake blocks for rows. Pure torch, no CuTe DSL:
graphc's weights and plan use it on machines without a GPU too.
"""

from __future__ import annotations

import torch

BLOCK = 64      # rows and K values per block: one 128-byte swizzle atom per row, 8 KB in bf16


def blockable(shape: tuple[int, ...]) -> bool:
    """Whether a weight of this shape can be stored in blocks: a matrix whose rows and
    columns are whole blocks."""
    return len(shape) == 2 and shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0


def is_blocked(weight: torch.Tensor) -> bool:
    return weight.dim() == 4


def to_blocks(matrix: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> a new contiguous [N/64, K/64, 64, 64] tensor of its blocks."""
    if not blockable(tuple(matrix.shape)):
        raise ValueError(f"weight of shape {list(matrix.shape)} cannot be stored in {BLOCK} x {BLOCK} "
                         f"blocks: it must be a 2-D [N, K] matrix with N and K multiples of {BLOCK}")
    n, k = matrix.shape
    return matrix.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).permute(0, 2, 1, 3).contiguous()


# Row blocks converted at a time by ``to_blocks_``: a temporary of 64 x 64 x K bf16 (59 MB
# at K = 7168), however large the weight.
_IN_PLACE_ROW_BLOCKS = 64


def to_blocks_(matrix: torch.Tensor) -> torch.Tensor:
    """``to_blocks`` in the matrix's own memory, returned as the 4-D view of it. A row block
    (64 rows) occupies the same bytes in both orders, so converting a few row blocks at a
    time needs a temporary of only those: no second copy of a 2.35 GB weight on a full GPU.
    The matrix must not be read as rows afterwards."""
    if not blockable(tuple(matrix.shape)) or not matrix.is_contiguous():
        raise ValueError(f"weight of shape {list(matrix.shape)} cannot be stored in {BLOCK} x {BLOCK} "
                         f"blocks in place: it must be a contiguous 2-D [N, K] matrix with N and K "
                         f"multiples of {BLOCK}")
    n, k = matrix.shape
    rows = matrix.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    blocks = matrix.view(n // BLOCK, k // BLOCK, BLOCK, BLOCK)
    for first in range(0, n // BLOCK, _IN_PLACE_ROW_BLOCKS):
        part = slice(first, first + _IN_PLACE_ROW_BLOCKS)
        blocks[part] = rows[part].permute(0, 2, 1, 3).contiguous()
    return blocks


def to_matrix(blocks: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N/64, K/64, 64, 64] blocks -> a new contiguous W [N, K], in ``dtype`` (default the
    blocks'): the reorder and the conversion are one copy."""
    if blocks.dim() != 4 or blocks.shape[2:] != (BLOCK, BLOCK):
        raise ValueError(f"blocked weight must have shape [N/{BLOCK}, K/{BLOCK}, {BLOCK}, {BLOCK}], "
                         f"got {list(blocks.shape)}")
    nb, kb = blocks.shape[:2]
    out = torch.empty(nb * BLOCK, kb * BLOCK, dtype=dtype or blocks.dtype, device=blocks.device)
    out.view(nb, BLOCK, kb, BLOCK).copy_(blocks.permute(0, 2, 1, 3))
    return out


def as_float_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The weight as an fp32 W [N, K] (a new tensor), in one pass over it in either order. The
    torch reference multiplies this, so it costs that reference no more with blocks than
    without (graphc bench times the reference as a baseline)."""
    return to_matrix(weight, torch.float32) if is_blocked(weight) else weight.float()


def matrix_shape(weight: torch.Tensor) -> tuple[int, int]:
    """[N, K] of a weight in either order."""
    if is_blocked(weight):
        return (weight.shape[0] * BLOCK, weight.shape[1] * BLOCK)
    return tuple(weight.shape)


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The weight as W [N, K]: itself if row-major, else a row-major copy (for references
    and tools, never for a captured step: it allocates)."""
    return to_matrix(weight) if is_blocked(weight) else weight
