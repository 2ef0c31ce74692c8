import networkx as nx
import pytest

from graphc.graph import build_graph, describe_node, ops_in_order, weight_bytes, weight_shapes
from graphc.spec import load_spec


@pytest.fixture(scope="module")
def tiny():
    return build_graph(load_spec("layer_specs/tiny.yaml"))


def test_one_node_per_op_in_program_order(tiny):
    names = [op.name for op in ops_in_order(tiny)]
    per_layer = ["attn_res.attn", "attn.qkv", "attn.attention", "attn.o_proj",
                 "attn_res.mlp", "mlp.gate_up", "mlp.down"]
    want = ["embed"] + [f"L{l:02d}.{n}" for l in range(4) for n in per_layer]
    assert names == want + ["final.attn_res", "lm_head"]
    assert nx.is_directed_acyclic_graph(tiny)
    # Program order is one of its topological orders:
    order = {n: tiny.nodes[n]["order"] for n in tiny}
    assert all(order[a] < order[b] for a, b in tiny.edges)


def test_attn_res_calls_follow_the_design(tiny):
    # tiny: 4 layers, block size 2 -> blocks [embedding, layers 0-1], the last block is the prefix.
    want = {
        "L00.attn_res.attn": (0, False, 0), "L00.attn_res.mlp": (1, False, -1),
        "L01.attn_res.attn": (1, True, -1), "L01.attn_res.mlp": (1, True, -1),
        "L02.attn_res.attn": (1, True, 1), "L02.attn_res.mlp": (2, False, -1),
        "L03.attn_res.attn": (2, True, -1), "L03.attn_res.mlp": (2, True, -1),
        "final.attn_res": (2, True, -1),
    }
    for name, (nb, has_delta, write) in want.items():
        op = tiny.nodes[name]["op"]
        assert (op.nb, op.has_delta, op.write) == (nb, has_delta, write), name
        assert op.final == (name == "final.attn_res")


def test_in_place_updates_are_versions_of_one_buffer(tiny):
    ops = [op for op in ops_in_order(tiny) if op.kind == "attn_res"]
    versions = [op.writes["prefix"].version for op in ops]
    assert versions == list(range(1, len(ops) + 1))
    assert [op.writes["blocks"].name for op in ops if "blocks" in op.writes] == ["blocks@1", "blocks@2"]
    attn = tiny.nodes["L02.attn.attention"]["op"]
    assert attn.reads["kv"].name == "L02.kv@0" and attn.writes["kv"].name == "L02.kv@1"
    # The write of blocks@2 must follow every reader of blocks@1 (write-after-read hazards).
    readers = [op.name for op in ops if op.reads.get("blocks") and op.reads["blocks"].name == "blocks@1"]
    assert len(readers) == 4
    for r in readers:
        if r != "L02.attn_res.attn":
            assert "blocks@1" in tiny.edges[r, "L02.attn_res.attn"]["values"]
    assert tiny.edges["L00.attn_res.mlp", "L02.attn_res.attn"]["hazard"] == "war"


def test_shapes_are_functions_of_the_batch(tiny):
    qkv = tiny.nodes["L01.attn.qkv"]["op"].writes["out"].buffer
    assert qkv.dims == ("T", 8 * 128 + 2 * 2 * 128)
    assert qkv.shape({"T": 5}) == (5, 1536)
    blocks = tiny.graph["buffers"]["blocks"]
    assert blocks.shape({"T": 3}) == (3, 2, 1024)
    kv = tiny.graph["buffers"]["L00.kv"]
    assert kv.shape({"T": 3, "slots": 9}) == (9, 2, 2, 256, 128)   # head-major
    assert tiny.edges["L01.attn.qkv", "L01.attn.attention"]["values"] == ["L01.attn.qkv.out"]


def test_weights_are_named_after_nodes(tiny):
    shapes = weight_shapes(tiny)
    assert shapes["L03.attn.qkv.weight"] == (1536, 1024)
    assert shapes["L03.mlp.gate_up.weight"] == (2 * 2816, 1024)
    assert shapes["L00.attn_res.attn.query"] == (1024,)
    assert shapes["embed.weight"] == (4096, 1024) and shapes["lm_head.weight"] == (4096, 1024)
    assert weight_bytes(tiny) == 2 * sum(__import__("math").prod(s) for s in shapes.values())


def test_plain_residual_uses_nb_zero_and_no_blocks():
    g = build_graph(load_spec("layer_specs/tiny.yaml").with_residual("plain"))
    res = [g.nodes[n]["op"] for n in g if g.nodes[n]["kind"] == "attn_res"]
    assert all(op.nb == 0 and op.write == -1 and not op.learned_mixing for op in res)
    assert "blocks" not in g.graph["buffers"]
    assert "L00.residual.attn" in g and "final.residual" in g


def test_describe_node_lists_values_and_weights(tiny):
    text = describe_node(tiny, "L02.attn_res.attn")
    for piece in ["nb         1", "write      1", "blocks@1", "blocks@2", "prefix@5",
                  "L02.attn_res.attn.query", "L01.mlp.down"]:
        assert piece in text


def test_full_depth_spec_builds_quickly_without_weights():
    import time

    t = time.perf_counter()
    g = build_graph(load_spec("layer_specs/kimi_k3_dense.yaml"))
    assert time.perf_counter() - t < 10
    assert g.number_of_nodes() == 1 + 93 * 7 + 2
    assert weight_bytes(g) > 90e9
