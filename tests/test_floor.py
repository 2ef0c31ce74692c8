"""The step's floor (graphc/floor.py, DESIGN §7): per kernel, its bytes over HBM bandwidth or
its FLOPs over the matrix rate, whichever is longer, summed; the bytes counted by hand here."""

import pytest

from graphc.floor import H200_BF16_FLOPS_PER_S, H200_HBM_BYTES_PER_S, kernel_floor_s, step_floor_s
from graphc.graph import build_graph
from graphc.schedule import build_schedule
from graphc.spec import load_spec

D = 7168


@pytest.fixture(scope="module")
def kimi8():
    return build_schedule(build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml")))


def _op(schedule, node):
    return next(k.op for k in schedule.kernels if k.node == node)


@pytest.mark.parametrize("node, rows_per_token", [
    # replace (a block start): the delta read, the prefix and the output written, the slot written
    ("L00.attn_res.attn", 0 + 1 + 1 + 1 + 1),
    # replace after the block's first slot is written: that block, the delta; prefix, output
    ("L00.attn_res.mlp", 1 + 1 + 1 + 1),
    # add (layer 1 continues the block), nb = 1: the block, delta and prefix read; prefix, output
    ("L01.attn_res.attn", 1 + 1 + 1 + 1 + 1),
    # the final call: every block of the 8-layer model (4 blocks of 2 layers), an add
    ("final.attn_res", None),
])
def test_attn_res_moves_every_row_it_reads_and_writes(kimi8, node, rows_per_token):
    op = _op(kimi8, node)
    if rows_per_token is None:
        rows_per_token = op.nb + 4
    weights = 3 * D * 2                          # norm, key norm, query
    for T in (1, 64):
        assert op.bytes_moved({"T": T}) == rows_per_token * T * D * 2 + weights


def test_the_floor_is_bytes_up_to_64_rows_and_flops_for_the_large_gemms_at_256(kimi8):
    for T in (1, 64):
        floors = kernel_floor_s(kimi8, T, 1024)
        sizes = {"T": T, "context": 1024, "slots": T + 1}
        assert all(floors[k.node] == pytest.approx(k.op.bytes_moved(sizes) / H200_HBM_BYTES_PER_S)
                   for k in kimi8.kernels)
    floors = kernel_floor_s(kimi8, 256, 1024)
    gate_up = 2 * 256 * D * 36864 / H200_BF16_FLOPS_PER_S        # 171 µs of tensor-core work
    assert floors["L00.mlp.gate_up"] == pytest.approx(gate_up)
    bytes_only = kernel_floor_s(kimi8, 256, 1024, flops_per_s=None)
    assert bytes_only["L00.mlp.gate_up"] < gate_up
    assert step_floor_s(kimi8, 256, 1024) == pytest.approx(sum(floors.values()))
    assert step_floor_s(kimi8, 256, 1024) > step_floor_s(kimi8, 256, 1024, flops_per_s=None)
