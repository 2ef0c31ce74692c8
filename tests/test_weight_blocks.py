"""The blocked weight order (kernels/weight_blocks.py), on the CPU: the exact memory order the
decode GEMM's w_blocked tensor map assumes, round trips, and the refusals."""

from __future__ import annotations

import pytest
import torch

from graphc.kernels import weight_blocks as wb


def test_memory_order_is_the_kernels_layout():
    """Element (n, k) of W lands at (n // 64) * 64K + (k // 64) * 4096 + (n % 64) * 64 + k % 64:
    kernels/gemm_stream_k.py's w_blocked layout ((64, N/64), (64, K/64)) : ((64, 64K), (1, 4096))."""
    n, k = 192, 256
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    blocks = wb.to_blocks(w)
    assert blocks.shape == (3, 4, 64, 64) and blocks.is_contiguous()
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    offset = (rows // 64) * 64 * k + (cols // 64) * 4096 + (rows % 64) * 64 + cols % 64
    assert torch.equal(blocks.reshape(-1)[offset], w)


def test_16_row_blocks_memory_order():
    """rows=16 (the decode GEMMs' w_block_rows=16 variant): element (n, k) at
    (n // 16) * 16K + (k // 64) * 1024 + (n % 16) * 64 + k % 64: the layout
    ((16, N/16), (64, K/64)) : ((64, 16K), (1, 1024))."""
    n, k = 48, 192
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    blocks = wb.to_blocks(w, rows=16)
    assert blocks.shape == (3, 3, 16, 64) and wb.block_rows(blocks) == 16
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    offset = (rows // 16) * 16 * k + (cols // 64) * 1024 + (rows % 16) * 64 + cols % 64
    assert torch.equal(blocks.reshape(-1)[offset], w)
    assert wb.matrix_shape(blocks) == (n, k) and torch.equal(wb.to_matrix(blocks), w)
    assert wb.blockable((48, 192), rows=16) and not wb.blockable((48, 192))
    with pytest.raises(ValueError, match="blocks of 32 rows unsupported"):
        wb.to_blocks(w, rows=32)


def test_round_trip_and_shapes():
    w = torch.randn(128, 320).to(torch.bfloat16)
    blocks = wb.to_blocks(w)
    assert wb.is_blocked(blocks) and not wb.is_blocked(w)
    assert wb.matrix_shape(blocks) == wb.matrix_shape(w) == (128, 320)
    assert torch.equal(wb.to_matrix(blocks), w) and torch.equal(wb.as_matrix(blocks), w)
    assert wb.as_matrix(w) is w
    assert torch.equal(wb.as_float_matrix(blocks), w.float()) and torch.equal(wb.as_float_matrix(w), w.float())
    assert wb.blockable((128, 320)) and not wb.blockable((100, 320)) and not wb.blockable((128,))


def test_refusals_name_the_shape():
    with pytest.raises(ValueError, match=r"shape \[100, 256\] cannot be stored in 64 x 64 blocks"):
        wb.to_blocks(torch.zeros(100, 256))
    with pytest.raises(ValueError, match=r"must have shape \[N/rows, K/64, rows, 64\] with rows 64 or 16, got \[2, 2, 32, 64\]"):
        wb.to_matrix(torch.zeros(2, 2, 32, 64))


def test_in_place_conversion_matches_the_copy():
    """to_blocks_ works row blocks at a time in the matrix's memory; more row blocks than one
    pass converts, so the pass boundaries are exercised."""
    for rows in wb.ROW_BLOCKS:
        n = wb._IN_PLACE_ROWS + 3 * rows
        w = torch.randn(n, 128).to(torch.bfloat16)
        expected = wb.to_blocks(w, rows)
        ptr = w.data_ptr()
        blocks = wb.to_blocks_(w, rows)
        assert blocks.data_ptr() == ptr and blocks.shape == expected.shape
        assert torch.equal(blocks, expected)
    with pytest.raises(ValueError, match="contiguous"):
        wb.to_blocks_(torch.zeros(128, 128).t())
