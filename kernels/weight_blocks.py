"""Weights stored in 64 x 64 blocks: the memory order the decode GEMM streams fastest.

In a row-major W [N, K] the 64 values of one row that the decode GEMM (kernels/gemm_stream_k.py)
loads per k-block (128 bytes) lie K*2 bytes from the next row's, so each of its 8 KB TMA
boxes is 64 separate 128-byte reads. Stored as blocks, ``[N/64, K/64, 64, 64]``
(row block, k block, row in block, k in block), the same box is one contiguous 8 KB read:
fewer DRAM row activations per byte. Measured on an H200 (bench/gemm_notes.md §33): 2-7%
faster on every Kimi shape at 1-64 rows, and up to 36 W less board power at 8 rows.

The shape says the order: a 2-D weight is row-major, a 4-D one is blocked. torch.matmul
refuses a 4-D weight, so no reader can mistake blocks for rows. Pure torch, no CuTe DSL:
graphc's weights and plan use it on machines without a GPU too.

Blocks of 16 rows (``[N/16, K/64, 16, 64]``, 2 KB each: ``rows=16``) are a measurement
variant of the decode GEMMs (their ``w_block_rows`` knob; bench/gemm_notes.md §34-§35): a build
stores 64-row blocks unless asked for 16 (``graphc.build(block_rows=16)``, measured 0-0.6%
slower in the 8-layer step, §35).
"""

from __future__ import annotations

import torch

BLOCK = 64      # K values per block, and rows per block by default: 128 bytes per row, 8 KB in bf16
ROW_BLOCKS = (BLOCK, 16)   # the rows per block the decode GEMMs read (16: a measurement variant)


def _check_rows(rows: int) -> None:
    if rows not in ROW_BLOCKS:
        raise ValueError(f"blocks of {rows} rows unsupported: {' or '.join(map(str, ROW_BLOCKS))}")


def blockable(shape: tuple[int, ...], rows: int = BLOCK) -> bool:
    """Whether a weight of this shape can be stored in blocks of ``rows`` x 64: a matrix whose
    rows and columns are whole blocks."""
    return len(shape) == 2 and shape[0] % rows == 0 and shape[1] % BLOCK == 0


def is_blocked(weight: torch.Tensor) -> bool:
    return weight.dim() == 4


def block_rows(weight: torch.Tensor) -> int:
    """Rows per block of a blocked weight (its shape says it)."""
    return int(weight.shape[2])


def _not_blockable(matrix: torch.Tensor, rows: int, how: str) -> ValueError:
    return ValueError(f"weight of shape {list(matrix.shape)} cannot be stored in {rows} x {BLOCK} blocks{how}: "
                      f"it must be a {'contiguous ' if how else ''}2-D [N, K] matrix with N a multiple of "
                      f"{rows} and K of {BLOCK}")


def to_blocks(matrix: torch.Tensor, rows: int = BLOCK) -> torch.Tensor:
    """W [N, K] -> a new contiguous [N/rows, K/64, rows, 64] tensor of its blocks."""
    _check_rows(rows)
    if not blockable(tuple(matrix.shape), rows):
        raise _not_blockable(matrix, rows, "")
    n, k = matrix.shape
    return matrix.reshape(n // rows, rows, k // BLOCK, BLOCK).permute(0, 2, 1, 3).contiguous()


# Rows converted at a time by ``to_blocks_``: a temporary of 4096 x K bf16 (59 MB at K = 7168),
# however large the weight.
_IN_PLACE_ROWS = 64 * BLOCK


def to_blocks_(matrix: torch.Tensor, rows: int = BLOCK) -> torch.Tensor:
    """``to_blocks`` in the matrix's own memory, returned as the 4-D view of it. A row block
    occupies the same bytes in both orders, so converting a few row blocks at a time needs a
    temporary of only those: no second copy of a 2.35 GB weight on a full GPU. The matrix
    must not be read as rows afterwards."""
    _check_rows(rows)
    if not blockable(tuple(matrix.shape), rows) or not matrix.is_contiguous():
        raise _not_blockable(matrix, rows, " in place")
    n, k = matrix.shape
    as_rows = matrix.view(n // rows, rows, k // BLOCK, BLOCK)
    blocks = matrix.view(n // rows, k // BLOCK, rows, BLOCK)
    step = _IN_PLACE_ROWS // rows
    for first in range(0, n // rows, step):
        part = slice(first, first + step)
        blocks[part] = as_rows[part].permute(0, 2, 1, 3).contiguous()
    return blocks


def to_matrix(blocks: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N/rows, K/64, rows, 64] blocks -> a new contiguous W [N, K], in ``dtype`` (default the
    blocks'): the reorder and the conversion are one copy."""
    if blocks.dim() != 4 or blocks.shape[2] not in ROW_BLOCKS or blocks.shape[3] != BLOCK:
        raise ValueError(f"blocked weight must have shape [N/rows, K/{BLOCK}, rows, {BLOCK}] with rows "
                         f"{' or '.join(map(str, ROW_BLOCKS))}, got {list(blocks.shape)}")
    nb, kb, rows = blocks.shape[:3]
    out = torch.empty(nb * rows, kb * BLOCK, dtype=dtype or blocks.dtype, device=blocks.device)
    out.view(nb, rows, kb, BLOCK).copy_(blocks.permute(0, 2, 1, 3))
    return out


def as_float_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The weight as an fp32 W [N, K] (a new tensor), in one pass over it in either order. The
    torch reference multiplies this, so it costs that reference no more with blocks than
    without (graphc bench times the reference as a baseline)."""
    return to_matrix(weight, torch.float32) if is_blocked(weight) else weight.float()


def matrix_shape(weight: torch.Tensor) -> tuple[int, int]:
    """[N, K] of a weight in either order."""
    if is_blocked(weight):
        return (weight.shape[0] * weight.shape[2], weight.shape[1] * BLOCK)
    return tuple(weight.shape)


def as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The weight as W [N, K]: itself if row-major, else a row-major copy (for references
    and tools, never for a captured step: it allocates)."""
    return to_matrix(weight) if is_blocked(weight) else weight
