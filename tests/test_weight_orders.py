"""Which weights a build stores in 64 x 64 blocks (graphc/plan.py ``blocked_weights``), the
refusal of a build that could not read them, and ``Weights`` over both orders. CPU only: the
choice follows from the schedules, which need no GPU (the decode GEMM's ``plan`` runs with
CUTE_DSL_ARCH=sm_90a)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from graphc.errors import GraphcError  # noqa: E402
from graphc.graph import build_graph, weight_shapes  # noqa: E402
from graphc.kernels import weight_blocks  # noqa: E402
from graphc.plan import blocked_weights, check_weight_orders, row_major_for_some_sizes  # noqa: E402
from graphc.schedule import build_schedule  # noqa: E402
from graphc.spec import load_spec, parse_spec  # noqa: E402
from graphc.weights import Weights  # noqa: E402

SMS = 132
KIMI_8L = "layer_specs/kimi_k3_dense_8l.yaml"


def schedules(spec, batch_sizes, implementations=None):
    graph = build_graph(spec if not isinstance(spec, str) else load_spec(spec))
    return {b: build_schedule(graph, implementations, batch=b) for b in batch_sizes}, graph


def linear_weights(graph, *roles):
    return {name for name in weight_shapes(graph) if name.endswith(tuple(f"{r}.weight" for r in roles))}


def test_only_the_decode_gemms_weights_go_to_blocks():
    s, graph = schedules(KIMI_8L, [1, 8, 32, 64])
    every = linear_weights(graph, "qkv", "o_proj", "gate_up", "down", "lm_head")
    assert len(every) == 8 * 4 + 1
    assert blocked_weights(s, SMS) == every          # embedding, norms, queries stay as they are


def test_a_weight_cublas_reads_anywhere_stays_row_major():
    """One copy of a weight serves every captured size: a layer that runs cuBLAS at one size
    (qkv and lm_head at 192 rows, graphc/ops/linear.py's DECODE_GEMM_ROWS; or a node pinned to
    it) keeps its weight row-major at the small sizes too. So does a decode-GEMM kernel that reads
    rows faster (qkv's whole-K tiles at 128 rows, kernels/gemm.py ``reads_blocks``)."""
    s, graph = schedules(KIMI_8L, [1, 8, 192])
    assert s[192].implementations()["L00.attn.qkv"] == "cublas"
    assert s[192].implementations()["L00.mlp.gate_up"] == s[192].implementations()["L00.attn.o_proj"] == "cute"
    assert blocked_weights(s, SMS) == linear_weights(graph, "gate_up", "o_proj", "down")
    kept = row_major_for_some_sizes(s, SMS)         # what the build tells the user
    assert set(kept) == linear_weights(graph, "qkv", "lm_head")
    batch, kernel = kept["L00.attn.qkv.weight"]
    assert (batch, kernel.node, kernel.impl) == (192, "L00.attn.qkv", "cublas")
    s, graph = schedules(KIMI_8L, [160, 192])     # down: cuBLAS at 160, the decode GEMM at 192
    assert blocked_weights(s, SMS) == linear_weights(graph, "gate_up", "o_proj")
    assert row_major_for_some_sizes(s, SMS)["L00.mlp.down.weight"][0] == 160
    s, graph = schedules(KIMI_8L, [1, 8, 128])
    assert s[128].implementations()["L00.attn.qkv"] == "cute"
    assert blocked_weights(s, SMS) == linear_weights(graph, "gate_up", "o_proj")
    batch, kernel = row_major_for_some_sizes(s, SMS)["L00.attn.qkv.weight"]
    assert (batch, kernel.node, kernel.impl) == (128, "L00.attn.qkv", "cute")
    assert row_major_for_some_sizes(schedules(KIMI_8L, [1, 8])[0], SMS) == {}
    s, graph = schedules(KIMI_8L, [1, 8], {"L00.attn.qkv": "cublas"})
    every = linear_weights(graph, "qkv", "o_proj", "gate_up", "down", "lm_head")
    assert blocked_weights(s, SMS) == every - {"L00.attn.qkv.weight"}
    s, _ = schedules(KIMI_8L, [1, 8], {"linear": "cublas"})
    assert blocked_weights(s, SMS) == set()


def test_whole_k_tiles_that_lose_on_blocks_keep_their_weights_row_major():
    """Every Kimi linear forced onto the decode GEMM at 1-256 rows: the whole-K tiles read
    blocks too, but with 80- or 112-row W tiles (qkv at 128 rows, down and o_proj at 256) they
    lose on them (bench/gemm_notes.md §34), so those weights stay row-major; gate_up (stream-K
    at every size) and lm_head (stream-K, or whole-K with 256-row tiles) go to blocks."""
    s, graph = schedules(KIMI_8L, [1, 8, 128, 256], {"linear": "cute"})
    assert blocked_weights(s, SMS) == linear_weights(graph, "gate_up", "lm_head")
    kept = row_major_for_some_sizes(s, SMS)
    assert set(kept) == linear_weights(graph, "qkv", "o_proj", "down")
    batch, kernel = kept["L00.attn.qkv.weight"]
    assert (batch, kernel.impl) == (128, "cute")
    assert kept["L00.attn.o_proj.weight"][0] == 256 and kept["L00.mlp.down.weight"][0] == 128
    # Up to 64 rows and at 224 (stream-K for down and o_proj, 160-row tiles for qkv): all blocks.
    s, graph = schedules(KIMI_8L, [1, 64, 224], {"linear": "cute"})
    assert blocked_weights(s, SMS) == linear_weights(graph, "qkv", "o_proj", "gate_up", "down", "lm_head")


def test_tied_embedding_stays_row_major():
    text = open("layer_specs/tiny.yaml").read().replace("tied: false", "tied: true")
    s, graph = schedules(parse_spec(text, "tied.yaml"), [1, 4])
    blocked = blocked_weights(s, SMS)
    assert "embed.weight" not in blocked                 # the embedding gathers its rows
    assert blocked == linear_weights(graph, "qkv", "o_proj", "gate_up", "down")


def test_schedule_variants_load_the_blocked_kernels():
    from graphc.compile_ahead import schedule_variants
    from graphc.kernels.gemm_stream_k import TUNING_KNOBS

    s, _ = schedules("layer_specs/tiny.yaml", [1, 4])
    w_blocked = 5 + TUNING_KNOBS.index("w_blocked")      # key: (M, K, N, epilogue, ctas, *knobs)
    gemm_keys = [key for module, key in schedule_variants(s, SMS) if module == "graphc.kernels.gemm_stream_k"]
    assert gemm_keys and all(key[w_blocked] == 1 for key in gemm_keys)
    rows = [key for module, key in schedule_variants(s, SMS, blocked=()) if module == "graphc.kernels.gemm_stream_k"]
    assert len(rows) == len(gemm_keys) and all(key[w_blocked] == 0 for key in rows)
    # Blocks of 16 rows (graphc.build's block_rows): the kernels compiled for them.
    w_block_rows = 5 + TUNING_KNOBS.index("w_block_rows")
    assert all(key[w_block_rows] == 64 for key in gemm_keys)
    sixteen = [key for module, key in schedule_variants(s, SMS, block_rows=16) if module == "graphc.kernels.gemm_stream_k"]
    assert len(sixteen) == len(gemm_keys) and all(key[w_blocked] == 1 and key[w_block_rows] == 16 for key in sixteen)


def test_a_build_stores_the_blocks_it_is_asked_for(monkeypatch):
    """16-row blocks hold the same matrix; a GPU build's choice of weights (here on a faked SM
    count) is the same at either block size for tiny's shapes, and the build hands its
    block_rows to the store. (tests/test_step_gpu.py runs such a build.)"""
    import graphc
    from graphc import runtime

    spec, weights = tiny_weights()
    name = "L01.mlp.down.weight"
    plain = weights[name].clone()
    weights.store_blocked({name}, rows=16)
    assert weights[name].shape[2] == 16 and torch.equal(weights.matrix(name), plain)
    s, graph = schedules(spec, [1, 4])
    assert blocked_weights(s, SMS, 16) == blocked_weights(s, SMS)    # tiny's shapes: whole 64-row blocks
    monkeypatch.setattr(runtime, "_sm_count", lambda dev: SMS)
    for rows in (64, 16):
        assert runtime._weights_in_blocks(s, torch.device("cuda"), None, True, print, rows) == \
            blocked_weights(s, SMS, rows) != set()
    stored = []
    monkeypatch.setattr(Weights, "store_blocked", lambda self, names, rows: stored.append(rows))
    graphc.build("layer_specs/tiny.yaml", [1], device="cpu", block_rows=16, progress=None)
    assert stored == [16]
    with pytest.raises(GraphcError, match="block_rows=32 unsupported: rows per weight block are 64 or 16"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", block_rows=32)


def tiny_weights():
    spec = load_spec("layer_specs/tiny.yaml")
    return spec, Weights.random(weight_shapes(build_graph(spec)), seed=1)


def test_a_build_cannot_read_blocks_row_major():
    spec, weights = tiny_weights()
    weights.store_blocked({"L00.attn.qkv.weight"})
    s, _ = schedules(spec, [1, 4], {"linear": "cublas"})
    with pytest.raises(GraphcError, match=r"weight L00.attn.qkv.weight is stored in 64 x 64 blocks .* "
                                          r"L00.attn.qkv at batch 1 runs cublas"):
        check_weight_orders(s, weights, SMS)
    check_weight_orders(schedules(spec, [1, 4])[0], weights, SMS)      # the decode GEMM reads them


def test_weights_in_both_orders(tmp_path):
    _, weights = tiny_weights()
    name = "L01.mlp.down.weight"
    plain = weights[name].clone()
    weights.store_blocked({name})
    assert weights.is_blocked(name) and weights.blocked() == {name}
    assert weights[name].dim() == 4 and weights.shape(name) == tuple(plain.shape)
    assert torch.equal(weights.matrix(name), plain)
    assert torch.equal(weights[name], weight_blocks.to_blocks(plain))
    # A reload writes in the stored order; saving writes the model's [N, K].
    weights.copy_in(name, plain * 2)
    assert torch.equal(weights.matrix(name), plain * 2)
    weights.save(tmp_path / "w.safetensors")
    back = Weights.load(tmp_path / "w.safetensors", {n: weights.shape(n) for n in weights.tensors})
    assert torch.equal(back[name], plain * 2) and back.blocked() == set()
    # A row-major twin for tools: blocked ones copied back, the others shared.
    twin = weights.row_major()
    assert twin.blocked() == set() and torch.equal(twin[name], plain * 2)
    assert twin["L00.attn.qkv.weight"] is weights["L00.attn.qkv.weight"]
    # Once a build reads a weight row-major, it stays so.
    weights.pinned_rows.add("L00.attn.qkv.weight")
    with pytest.raises(GraphcError, match="L00.attn.qkv.weight: a build sharing these weights reads it row-major"):
        weights.store_blocked({"L00.attn.qkv.weight"})


def test_linear_reference_reads_blocks():
    s, graph = schedules("layer_specs/tiny.yaml", [2])
    op = graph.nodes["L00.attn.qkv"]["op"]
    x = torch.randn(2, op.k).to(torch.bfloat16)
    w = (torch.randn(op.n, op.k) / op.k ** 0.5).to(torch.bfloat16)
    rows, blocks = torch.empty(2, op.n, dtype=torch.bfloat16), torch.empty(2, op.n, dtype=torch.bfloat16)
    op.reference({"x": x, "out": rows}, {"weight": w})
    op.reference({"x": x, "out": blocks}, {"weight": weight_blocks.to_blocks(w)})
    assert torch.equal(rows, blocks)


def test_a_gpu_build_says_which_weights_a_large_size_keeps_row_major(monkeypatch):
    """graphc/runtime.py's choice for a GPU build, without a GPU (the SM count stubbed): the
    progress line names a kernel that keeps the weights row-major, and block_weights=False
    blocks nothing."""
    from graphc import runtime

    monkeypatch.setattr(runtime, "_sm_count", lambda dev: SMS)
    cuda = torch.device("cuda")
    heard = []
    s, graph = schedules(KIMI_8L, [1, 8, 192])
    assert runtime._weights_in_blocks(s, cuda, None, True, heard.append) == linear_weights(graph, "gate_up",
                                                                                            "o_proj", "down")
    assert len(heard) == 1 and heard[0].startswith("9 weights stay row-major at every batch size")
    assert "runs cublas at batch 192" in heard[0]
    s, graph = schedules(KIMI_8L, [1, 8])
    heard.clear()
    assert len(runtime._weights_in_blocks(s, cuda, None, True, heard.append)) == 33 and heard == []
    assert runtime._weights_in_blocks(s, cuda, None, False, heard.append) == set()
    # A shared Weights: what it already holds in blocks counts; what a build reads as rows stays.
    spec, weights = tiny_weights()
    s, graph = schedules(spec, [1, 4])
    weights.store_blocked({"L00.attn.qkv.weight"})
    weights.pinned_rows.add("L01.mlp.down.weight")
    chosen = runtime._weights_in_blocks(s, cuda, weights, True, heard.append)
    assert "L00.attn.qkv.weight" in chosen and "L01.mlp.down.weight" not in chosen
    assert runtime._weights_in_blocks(s, torch.device("cpu"), None, True, heard.append) == set()
