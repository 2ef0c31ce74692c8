"""The PDL schedule: every shipped spec's schedule is safe, and planted unsafe ones are refused."""

import dataclasses
import importlib.util

import pytest

from graphc.errors import GraphcError
from graphc.graph import build_graph
from graphc.ops.base import PdlTraits
from graphc.schedule import Schedule, UnsafeSchedule, build_schedule, known_complete, verify
from graphc.spec import load_spec

SPECS = ["tiny", "kimi_k3_dense_8l", "kimi_k3_dense"]
GEMM = {"linear": "cute", "attn_res": "cute"}


@pytest.fixture(scope="module")
def tiny():
    return build_graph(load_spec("layer_specs/tiny.yaml"))


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("impls", [None, GEMM, {"attn_res": "torch"}])
def test_shipped_specs_schedule_and_verify(name, impls):
    schedule = build_schedule(build_graph(load_spec(f"layer_specs/{name}.yaml")), impls)
    assert verify(schedule) == []
    assert schedule.kernels[0].edge == "full"
    if impls == GEMM:
        # Not merely safe but not timid either: the decode GEMM and the AttnRes kernel read only
        # what is complete at launch before their wait, so every one of them after the first
        # kernel gets its PDL edge (an all-full schedule verifies too).
        assert all(k.edge == "pdl" for k in schedule.kernels[1:] if k.op.kind in ("linear", "attn_res"))
    for k in schedule.kernels:
        assert k.reason
        if k.edge == "pdl":
            assert k.traits.waits


def test_attn_res_enters_through_pdl_after_library_kernels(tiny):
    s = build_schedule(tiny)
    assert s.kernel("L01.attn_res.attn").edge == "pdl"
    assert "complete at launch because L00.mlp.down was entered through a full edge" in \
        s.kernel("L01.attn_res.attn").reason
    assert s.kernel("L01.attn.qkv").edge == "full"
    assert "never executes griddepcontrol.wait" in s.kernel("L01.attn.qkv").reason
    # Without PDL nothing overlaps.
    assert build_schedule(tiny, use_pdl=False).pdl_edges() == []


def test_decode_gemm_entered_through_pdl(tiny):
    s = build_schedule(tiny, GEMM)
    assert s.kernel("L01.attn.qkv").edge == "pdl"
    assert s.kernel("L01.mlp.gate_up").edge == "pdl"
    assert ("L01.attn_res.attn", "L01.attn.qkv") in s.pdl_edges()


def test_refuses_prologue_read_of_the_previous_kernels_output(tiny):
    s = build_schedule(tiny)
    k = s.kernel("L01.attn_res.mlp")        # its delta is o_proj's output, written just before
    unsafe = s.with_kernel(k.node, traits=PdlTraits(True, "early", ("delta", "blocks"), True))
    [refusal] = verify(unsafe)
    assert refusal.node == "L01.attn_res.mlp"
    assert "reads L01.attn.o_proj.out before its wait" in refusal.message
    assert "L01.attn.o_proj" in refusal.message and "may still be running" in refusal.message


def test_refuses_pdl_edge_into_a_kernel_that_never_waits(tiny):
    s = build_schedule(tiny)
    unsafe = s.with_kernel("L02.attn.qkv", edge="pdl")
    refusals = verify(unsafe)
    assert {r.node for r in refusals} == {"L02.attn.qkv"}
    assert any("cublas never executes griddepcontrol.wait" in r.message for r in refusals)


def test_refuses_a_chain_of_early_triggers_hiding_an_incomplete_writer(tiny):
    s = build_schedule(tiny, GEMM)
    # With the decode GEMM, gate_up (silu * up fused) -> down is one chain of early triggers
    # behind L00.attn_res.mlp, the writer of prefix@2.
    assert [s.kernel(n).edge for n in ("L00.mlp.gate_up", "L00.mlp.down")] == ["pdl", "pdl"]
    assert verify(s) == []
    # Now L01.attn_res.attn also reads the prefix before its wait: its writer may still run.
    reads_prefix = PdlTraits(True, "early", ("blocks", "prefix"), True)
    unsafe = s.with_kernel("L01.attn_res.attn", traits=reads_prefix)
    upto, because = known_complete(unsafe.kernels, unsafe.kernel("L01.attn_res.attn").index)
    assert unsafe.kernels[upto].node == "L00.attn.qkv"   # attention entered full
    [refusal] = verify(unsafe)
    assert "reads prefix@2 before its wait" in refusal.message
    assert "L00.attn_res.mlp" in refusal.message
    # A late trigger in the chain proves the writer complete again.
    late = PdlTraits(True, "late", (), True)
    assert verify(unsafe.with_kernel("L00.mlp.down", traits=late, edge="pdl")) == []


def test_a_late_trigger_proves_complete_only_what_ran_before_it(tiny):
    """A kernel that triggers after its own wait proves its predecessor finished, not itself:
    its successor may still not read its output before waiting."""
    late = PdlTraits(True, "late", (), True)
    s = build_schedule(tiny, GEMM).with_kernel("L00.mlp.down", traits=late, edge="pdl")
    i = s.kernel("L01.attn_res.attn").index
    assert s.kernels[i - 1].node == "L00.mlp.down"
    upto, because = known_complete(s.kernels, i)
    assert s.kernels[upto].node == "L00.mlp.gate_up"
    assert because == "L00.mlp.down triggers its dependents only after its own wait"
    reads_delta = PdlTraits(True, "early", ("blocks", "delta"), True)
    [refusal] = verify(s.with_kernel("L01.attn_res.attn", traits=reads_delta))
    assert refusal.node == "L01.attn_res.attn"
    assert "reads L00.mlp.down.out before its wait" in refusal.message
    assert "L00.mlp.down" in refusal.message and "may still be running" in refusal.message


def test_prefix_in_the_prologue_is_safe_behind_library_kernels(tiny):
    s = build_schedule(tiny)
    reads_prefix = PdlTraits(True, "early", ("blocks", "prefix"), True)
    assert verify(s.with_kernel("L01.attn_res.attn", traits=reads_prefix)) == []


def test_refuses_l1_cached_loads_and_the_first_kernel(tiny):
    s = build_schedule(tiny)
    cached = PdlTraits(True, "early", ("blocks",), bypasses_l1=False)
    [refusal] = verify(s.with_kernel("L01.attn_res.attn", traits=cached))
    assert "stale line" in refusal.message
    assert any("first kernel" in r.message for r in verify(s.with_kernel("embed", edge="pdl")))


def test_refuses_an_order_that_breaks_a_dependency(tiny):
    s = build_schedule(tiny)
    ks = list(s.kernels)
    a, b = s.kernel("L01.attn.qkv").index, s.kernel("L01.attn.attention").index
    ks[a], ks[b] = ks[b], ks[a]
    from dataclasses import replace
    swapped = Schedule(s.graph, tuple(replace(k, index=i) for i, k in enumerate(ks)))
    messages = [str(r) for r in verify(swapped)]
    assert any("L01.attn.attention: runs before L01.attn.qkv" in m for m in messages)


def test_build_refuses_unknown_implementation(tiny):
    from graphc.errors import GraphcError

    with pytest.raises(GraphcError, match="no implementation 'fast'"):
        build_schedule(tiny, {"linear": "fast"})


def test_unsafe_schedule_error_lists_every_refusal(tiny):
    s = build_schedule(tiny).with_kernel("L00.attn.qkv", edge="pdl").with_kernel("L01.attn.qkv", edge="pdl")
    refusals = verify(s)
    err = UnsafeSchedule(refusals)
    assert "L00.attn.qkv" in str(err) and "L01.attn.qkv" in str(err)
    # Each refusal says why, not only where.
    assert all(r.message and r.node in ("L00.attn.qkv", "L01.attn.qkv") for r in refusals), refusals


def test_an_edge_kind_that_is_neither_full_nor_pdl_is_refused(tiny):
    s = build_schedule(tiny).with_kernel("L00.attn.o_proj", edge="programmatic")
    assert [str(r) for r in verify(s)] == ["L00.attn.o_proj: unknown edge kind 'programmatic'"]


def test_decode_gemm_rows_are_ordered_spans_from_one_row_within_its_batch_limit():
    """DECODE_GEMM_ROWS: per Kimi shape, inclusive (first, last) spans of captured batch sizes,
    in order, apart, inside the decode GEMM's 1-256 rows, the first from 1 row (every shape
    runs it up to DECODE_GEMM_MAX_BATCH); any other shape: 1 to DECODE_GEMM_MAX_BATCH."""
    from graphc.kernels.gemm_contract import MAX_M
    from graphc.ops.linear import DECODE_GEMM_MAX_BATCH, DECODE_GEMM_ROWS, decode_gemm_default, decode_gemm_rows

    for (k, n, e), spans in DECODE_GEMM_ROWS.items():
        assert spans[0][0] == 1 and spans[0][1] >= DECODE_GEMM_MAX_BATCH
        assert all(first <= last for first, last in spans) and spans[-1][1] <= MAX_M
        assert all(prev_last + 1 < first for (_, prev_last), (first, _) in zip(spans, spans[1:]))
        rows = [b for b in range(1, MAX_M + 2) if decode_gemm_default(k, n, e, b)]
        assert rows == [b for first, last in spans for b in range(first, last + 1)]
    assert decode_gemm_rows(1024, 1536, None) == ((1, DECODE_GEMM_MAX_BATCH),)
    assert decode_gemm_default(1024, 1536, None, DECODE_GEMM_MAX_BATCH)
    assert not decode_gemm_default(1024, 1536, None, DECODE_GEMM_MAX_BATCH + 1)


def test_linear_implementation_follows_the_measured_crossover():
    """Each captured batch size gets its own schedule: the decode GEMM where it was measured
    faster than cuBLAS (every linear up to 16 rows; every Kimi linear up to 64, down up to 96, at
    192 and at 224, lm_head up to 96, qkv up to 160, o_proj up to 224, gate_up up to 256), cuBLAS elsewhere and when no batch size is known. A
    node-name entry overrides the kind's."""
    from graphc.ops.linear import DECODE_GEMM_MAX_BATCH, LinearOp

    if not LinearOp.implementations["cute"].available():
        pytest.skip("CuTe DSL is not installed: cuBLAS everywhere")
    g = build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))

    def linear_impls(schedule):
        return {k.node: k.impl for k in schedule.kernels if k.op.kind == "linear"}

    assert set(linear_impls(build_schedule(g)).values()) == {"cublas"}
    assert set(linear_impls(build_schedule(g, batch=DECODE_GEMM_MAX_BATCH)).values()) == {"cute"}
    at64 = build_schedule(g, batch=64)
    assert set(linear_impls(at64).values()) == {"cute"}
    assert at64.kernel("L03.mlp.gate_up").edge == at64.kernel("L03.attn.qkv").edge == "pdl"  # behind AttnRes
    def on_decode_gemm(batch):
        impls = linear_impls(build_schedule(g, batch=batch))
        return {node.split(".", 1)[-1] for node, impl in impls.items() if impl == "cute"}   # lm_head: no layer

    assert on_decode_gemm(96) == {"attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down", "lm_head"}
    assert on_decode_gemm(97) == on_decode_gemm(160) == {"attn.qkv", "attn.o_proj", "mlp.gate_up"}
    assert on_decode_gemm(161) == on_decode_gemm(191) == on_decode_gemm(193) == on_decode_gemm(223) \
        == {"attn.o_proj", "mlp.gate_up"}
    assert on_decode_gemm(192) == on_decode_gemm(224) == {"attn.o_proj", "mlp.gate_up", "mlp.down"}
    assert on_decode_gemm(225) == on_decode_gemm(256) == {"mlp.gate_up"}
    at128 = build_schedule(g, batch=128)
    assert at128.implementation_summary()["linear"] == "cute/cublas"
    assert at128.kernel("L03.mlp.down").edge == "full"         # cuBLAS never waits
    assert at128.kernel("L03.attn.qkv").edge == at128.kernel("L03.mlp.gate_up").edge == "pdl"
    assert set(linear_impls(build_schedule(g, batch=257)).values()) == {"cublas"}   # past the decode GEMM's M
    tiny = build_graph(load_spec("layer_specs/tiny.yaml"))     # not a Kimi shape: cuBLAS from 17 rows
    assert set(linear_impls(build_schedule(tiny, batch=DECODE_GEMM_MAX_BATCH + 1)).values()) == {"cublas"}
    mixed = build_schedule(g, {"lm_head": "cublas"}, batch=64)
    assert mixed.implementation_summary()["linear"] == "cute/cublas"
    # The exact per-node mapping rebuilds the same schedule; a node entry beats its kind's.
    assert build_schedule(g, mixed.implementations()).implementations() == mixed.implementations()
    pinned = build_schedule(g, {"linear": "cute", "lm_head": "cublas"}, batch=64)
    assert pinned.kernel("L03.attn.qkv").impl == "cute" and pinned.kernel("lm_head").impl == "cublas"


def test_a_choice_for_some_batch_sizes_leaves_the_others_as_shipped():
    """``NAME@SPANS`` moves one node's crossover (the per-board tuning the measured tables ask
    for, bench/gemm_notes.md §51-§53); sizes it does not cover keep the kind's entry or the
    default, and the same mapping gives the same schedules whatever else is captured."""
    from graphc.ops.linear import LinearOp

    if not LinearOp.implementations["cute"].available():
        pytest.skip("CuTe DSL is not installed: cuBLAS everywhere")
    g = build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))
    moved = {"L03.attn.qkv": "cute@1-192"}
    for batch, qkv in ((160, "cute"), (192, "cute"), (193, "cublas"), (224, "cublas")):
        s = build_schedule(g, moved, batch=batch)
        shipped = build_schedule(g, batch=batch)
        assert s.kernel("L03.attn.qkv").impl == qkv
        # Every other node exactly as shipped (L04's qkv, same shape, keeps the default).
        assert {n: i for n, i in s.implementations().items() if n != "L03.attn.qkv"} == \
            {n: i for n, i in shipped.implementations().items() if n != "L03.attn.qkv"}
    assert build_schedule(g, moved, batch=192).kernel("L03.attn.qkv").edge == "pdl"
    # A pattern moves every layer's qkv at once; a pattern that matches nothing is refused.
    every = build_schedule(g, {"L*.attn.qkv": "cute@1-192"}, batch=192)
    assert {every.kernel(f"L{i:02d}.attn.qkv").impl for i in range(8)} == {"cute"}
    assert every.kernel("L03.attn.o_proj").impl == "cute" and every.kernel("L03.mlp.down").impl == "cute"
    with pytest.raises(GraphcError, match=r"'L\*\.attn\.qkvv' is neither an op kind nor a node of this "
                                          r"graph, nor a pattern matching one"):
        build_schedule(g, {"L*.attn.qkvv": "cute"}, batch=1)
    # A kind entry with a bare name last decides every size its terms do not.
    kind = {"linear": "cute@1-8,cublas", "lm_head": "cute@1-32"}
    assert set(build_schedule(g, kind, batch=8).implementations()[n] for n in ("L00.attn.qkv", "lm_head")) == {"cute"}
    at32 = build_schedule(g, kind, batch=32)
    assert at32.kernel("L00.attn.qkv").impl == "cublas" and at32.kernel("lm_head").impl == "cute"
    assert build_schedule(g, kind, batch=33).kernel("lm_head").impl == "cublas"


def test_a_choice_past_a_kernels_batch_limit_is_refused_at_the_schedule(tiny):
    """The decode GEMM takes at most 256 rows: asking for it at 300 is refused by the schedule,
    before any weight is allocated, not by the kernel's compile; the default there is cuBLAS."""
    with pytest.raises(GraphcError, match=r"L00\.attn\.qkv: implementation 'cute' cannot run this linear: "
                                          r"the decode GEMM refuses it: M=300 out of range: 1 <= M <= 256 "
                                          r"\(the captured batch size\); choose cublas$"):
        build_schedule(tiny, {"linear": "cute@1-300"}, batch=300)
    assert build_schedule(tiny, {"linear": "cute@1-256"}, batch=300).implementation_summary()["linear"] == "cublas"
    with pytest.raises(GraphcError, match=r"no implementation 'cutee' of linear.*did you mean cute"):
        build_schedule(tiny, {"linear": "cutee@300"}, batch=1)     # a name is checked at every size


def test_a_linear_shape_the_decode_gemm_refuses_gets_cublas_by_default(tmp_path):
    """The spec holds heads x head_dim to 64 columns but not qkv's N, (heads + 2 kv_heads) x
    head_dim: at head_dim 8 that is 96, which the decode GEMM refuses (kernels/gemm_contract.py).
    Such a linear gets cuBLAS even where the decode GEMM is the default, and asking for it is
    refused by the schedule, naming the rule, not by the kernel's compile on a GPU."""
    from graphc.ops.linear import DECODE_GEMM_MAX_BATCH, LinearOp

    path = tmp_path / "head_dim_8.yaml"
    path.write_text(open("layer_specs/tiny.yaml").read().replace("head_dim: 128", "head_dim: 8"))
    graph = build_graph(load_spec(path))
    at1 = build_schedule(graph, batch=1)
    assert at1.kernel("L00.attn.qkv").impl == "cublas"
    assert graph.nodes["L00.attn.qkv"]["op"].unsupported("cute", DECODE_GEMM_MAX_BATCH) is not None
    if LinearOp.implementations["cute"].available():
        assert at1.kernel("L00.attn.o_proj").impl == "cute"      # K = heads x head_dim = 64 fits
    with pytest.raises(GraphcError, match=r"L00\.attn\.qkv: implementation 'cute' cannot run this linear: "
                                          r"the decode GEMM refuses it: N=96 unsupported: N must be a "
                                          r"positive multiple of 64; choose cublas$"):
        build_schedule(graph, {"linear": "cute"}, batch=1)


def test_unknown_implementation_key_is_refused(tiny):
    """A typo in a node name or op kind must not silently leave the default in place."""
    from graphc.errors import GraphcError

    with pytest.raises(GraphcError, match=r"'L03.mlp.dwn' is neither an op kind nor a node.*L03.mlp.down"):
        build_schedule(tiny, {"L03.mlp.dwn": "cute"})
    with pytest.raises(GraphcError, match="'lienar'.*linear"):
        build_schedule(tiny, {"lienar": "cublas"})
    with pytest.raises(GraphcError, match="no implementation 'cuda'"):
        build_schedule(tiny, {"L03.mlp.down": "cuda"})


def test_attention_triggers_early_without_hiding_anything(tiny):
    """The Triton attention never waits (entered through a full edge) but triggers at entry,
    so the o_proj decode GEMM after it is launched during attention and streams its weights
    there. The kernels before attention stay known complete for everything after it."""
    s = build_schedule(tiny, {**GEMM, "decode_attention": "triton"})
    att, o_proj = s.kernel("L01.attn.attention"), s.kernel("L01.attn.o_proj")
    assert (att.edge, att.traits.waits, att.traits.trigger) == ("full", False, "early")
    assert o_proj.edge == "pdl"
    mlp = s.kernel("L01.attn_res.mlp")
    upto, because = known_complete(s.kernels, mlp.index)
    assert s.kernels[upto].node == "L01.attn.qkv" and "L01.attn.attention" in because
    assert verify(s) == []


def test_tma_attention_enters_through_pdl(tiny):
    """The CuTe DSL attention waits, reads before its wait only the cached K/V and the step's
    inputs (no kernel of the step writes them before it) and reads qkv through L2, so the rule
    lets it overlap the qkv GEMM: a PDL edge in, and still a PDL edge out to o_proj."""
    s = build_schedule(tiny, {**GEMM, "decode_attention": "tma"})
    att, o_proj = s.kernel("L01.attn.attention"), s.kernel("L01.attn.o_proj")
    assert (att.edge, att.traits.waits, att.traits.trigger) == ("pdl", True, "late")
    assert "kv" in att.traits.prologue and o_proj.edge == "pdl"
    assert verify(s) == []


def test_attention_default_follows_the_batch_size(tiny):
    """Where CuTe DSL is installed the cluster attention up to CLUSTER_MAX_BATCH rows and the
    TMA attention from TMA_MIN_BATCH rows (each measured faster in the step there); the Triton or
    torch kernel otherwise."""
    import importlib.util

    from graphc.ops.attention import CLUSTER_MAX_BATCH, TMA_MIN_BATCH, cluster_supports, tma_supports

    assert tma_supports(64, 8, 128, 2048) and not tma_supports(64, 8, 96, 2048)
    assert not tma_supports(64, 8, 64, 2048)
    assert not tma_supports(64, 8, 128, 1000) and not tma_supports(128, 2, 128, 2048)
    assert tma_supports(128, 4, 128, 2048)      # 32 query heads per KV head: the kernel's limit
    assert cluster_supports(64, 8, 128, 2048) and cluster_supports(8, 2, 128, 256)
    assert not cluster_supports(128, 8, 128, 2048) and not cluster_supports(64, 8, 256, 2048)
    assert CLUSTER_MAX_BATCH < TMA_MIN_BATCH
    cute = importlib.util.find_spec("cutlass") is not None
    portable = build_schedule(tiny, GEMM).kernel("L01.attn.attention").impl    # no batch size known
    assert portable in ("triton", "torch")
    small = build_schedule(tiny, GEMM, batch=CLUSTER_MAX_BATCH).kernel("L01.attn.attention")
    large = build_schedule(tiny, GEMM, batch=TMA_MIN_BATCH).kernel("L01.attn.attention")
    assert small.impl == ("cluster" if cute else portable)
    assert large.impl == ("tma" if cute else portable)


@pytest.mark.parametrize("attention", ["cluster", "tma"])
def test_cuda_attention_keeps_every_attn_res_pdl_edge(tiny, monkeypatch, attention):
    """Both CuTe DSL attentions are entered through a PDL edge and trigger after their wait:
    the kernels before them are then known complete when o_proj and the AttnRes after it
    launch, so that AttnRes keeps its PDL edge at a block start, where it reads the block the
    AttnRes before attention wrote. The same kernel triggering at entry (as the TMA kernel did
    until session 23) would cost that edge: the rule then cannot prove the block written."""
    import dataclasses

    from graphc.ops.attention import DecodeAttentionOp

    s = build_schedule(tiny, {**GEMM, "decode_attention": attention})
    att = s.kernel("L01.attn.attention")
    assert (att.edge, att.traits.waits, att.traits.trigger) == ("pdl", True, "late")
    assert "kv" in att.traits.prologue and att.traits.bypasses_l1
    assert verify(s) == []
    impl = DecodeAttentionOp.implementations[attention]
    monkeypatch.setitem(DecodeAttentionOp.implementations, attention,
                        dataclasses.replace(impl, traits=dataclasses.replace(impl.traits, trigger="early")))
    early = build_schedule(tiny, {**GEMM, "decode_attention": attention})
    assert verify(early) == []
    block_start = "L02.attn_res.mlp"                    # block size 2: layer 2 starts a block
    assert s.kernel(block_start).edge == "pdl" and early.kernel(block_start).edge == "full"
    assert sum(k.edge == "pdl" for k in s.kernels) == sum(k.edge == "pdl" for k in early.kernels) + 2


@pytest.mark.parametrize("head_dim, default", [(96, "torch"), (8, "torch"), (64, "triton")])
def test_attention_kernels_only_get_head_dims_they_compile(tmp_path, head_dim, default, monkeypatch):
    """A head_dim the spec allows but a kernel cannot compile (the Triton kernel's tl.arange
    takes powers of two, the TMA kernel 128 or 256) gets the torch attention by default, and an
    explicit choice of that kernel is refused, naming the node and the rule. (Triton is taken
    as installed: scheduling launches nothing, and CI has no Triton.)"""
    from graphc.ops.attention import DecodeAttentionOp

    triton = DecodeAttentionOp.implementations["triton"]
    monkeypatch.setitem(DecodeAttentionOp.implementations, "triton",
                        dataclasses.replace(triton, available=lambda: True))
    text = open("layer_specs/tiny.yaml").read().replace("head_dim: 128", f"head_dim: {head_dim}")
    path = tmp_path / "odd_heads.yaml"
    path.write_text(text)
    graph = build_graph(load_spec(path))
    # (The linears keep their defaults: at head_dim 8 qkv's N is 96, which the decode GEMM refuses.)
    for batch in (1, 8):
        assert build_schedule(graph, {"attn_res": "cute"}, batch=batch).kernel("L01.attn.attention").impl == default
    with pytest.raises(GraphcError, match=r"L00\.attn\.attention: implementation 'tma' cannot run .*"
                                          rf"head_dim 128 or 256.*found head_dim {head_dim}"):
        build_schedule(graph, {"attn_res": "cute", "decode_attention": "tma"})
    if default == "torch":
        with pytest.raises(GraphcError, match=rf"'triton' cannot run .*power-of-two head_dim.*found {head_dim}"):
            build_schedule(graph, {"L01.attn.attention": "triton"})
        chosen, _, schedules = _schedules_for(graph, (8, 0))
        assert all(s.kernel("L01.attn.attention").impl == "torch" for s in schedules)


# --- implementations a GPU can run ------------------------------------------------------------

def _schedules_for(graph, capability, implementations=None, batches=(1, 2, 64)):
    from graphc.schedule import implementations_for_gpu

    chosen, notes = implementations_for_gpu(graph, capability, "GPU X (cuda:0)", implementations, batches)
    return chosen, notes, [build_schedule(graph, chosen, batch=b) for b in batches]


def test_a_hopper_gpu_keeps_every_default():
    graph = build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))
    chosen, notes, _ = _schedules_for(graph, (9, 0))
    assert chosen == {} and notes == []


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0)])
def test_other_gpus_get_implementations_they_can_run(capability):
    """graphc's CuTe DSL kernels are sm_90a code: elsewhere every op kind gets one that runs
    there, for every batch size, and the substitutions are named."""
    graph = build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))
    chosen, notes, schedules = _schedules_for(graph, capability)
    for s in schedules:
        assert verify(s) == []
        for k in s.kernels:
            assert k.op.implementations[k.impl].runs_on(capability), (k.node, k.impl)
    assert chosen["linear"] == "cublas" and chosen["attn_res"] == "torch"
    assert any(n.startswith("linear: cublas instead of cute (sm_90a)") for n in notes), notes
    # What each kind lost is named once, whatever the batch sizes.
    assert len(notes) == len({n.split(":")[0] for n in notes})


def test_a_choice_the_gpu_cannot_run_is_refused_by_name():
    from graphc.errors import GraphcError

    graph = build_graph(load_spec("layer_specs/tiny.yaml"))
    with pytest.raises(GraphcError, match=r"L00\.attn\.qkv: implementation 'cute' of linear needs "
                                          r"sm_90a \(H100/H200\); GPU X \(cuda:0\) is sm_80\. Choose one of cublas"):
        _schedules_for(graph, (8, 0), {"linear": "cute"})
    # A choice that runs there stands, and the other kinds still get portable ones.
    chosen, notes, _ = _schedules_for(graph, (8, 0), {"L00.attn.qkv": "cublas"})
    assert chosen["L00.attn.qkv"] == "cublas" and chosen["attn_res"] == "torch"


def test_a_choice_for_some_sizes_keeps_the_portable_fallback_elsewhere():
    """On a GPU that cannot run the Hopper kernels, cuBLAS chosen at some sizes leaves the other
    sizes to the portable substitute, not to the decode GEMM it cannot run; the decode GEMM
    chosen at any size is refused, even at a size this build does not capture."""
    from graphc.errors import GraphcError

    graph = build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))
    chosen, notes, schedules = _schedules_for(graph, (8, 0), {"linear": "cublas@65-256"})
    assert chosen["linear"] == "cublas@65-256,cublas"
    for s in schedules:
        assert s.implementation_summary()["linear"] == "cublas"
    chosen, _, schedules = _schedules_for(graph, (8, 0), {"L03.attn.qkv": "cublas@1-8"})
    assert chosen["linear"] == "cublas" and all(s.kernel("L03.attn.qkv").impl == "cublas" for s in schedules)
    with pytest.raises(GraphcError, match=r"L03\.attn\.qkv: implementation 'cute' of linear needs sm_90a"):
        _schedules_for(graph, (8, 0), {"L03.attn.qkv": "cute@200"})
    # On a Hopper GPU a per-size choice is passed on as given.
    assert _schedules_for(graph, (9, 0), {"L03.attn.qkv": "cute@1-192"})[:2] == ({"L03.attn.qkv": "cute@1-192"}, [])


def test_a_choice_that_is_not_installed_is_refused_by_name(monkeypatch):
    """Asking for Triton's attention where Triton is not installed fails at the build, naming
    the node and what else runs, not later in the warm-up."""
    import dataclasses

    from graphc.errors import GraphcError
    from graphc.ops.attention import DecodeAttentionOp

    missing = dataclasses.replace(DecodeAttentionOp.implementations["triton"], available=lambda: False)
    monkeypatch.setitem(DecodeAttentionOp.implementations, "triton", missing)
    graph = build_graph(load_spec("layer_specs/tiny.yaml"))
    with pytest.raises(GraphcError, match=r"L00\.attn\.attention: implementation 'triton' of decode_attention "
                                          r"is not available here \(its package is not installed\)\. "
                                          r"Choose one of .*torch"):
        _schedules_for(graph, (9, 0), {"decode_attention": "triton"})


def test_a_schedule_prints_as_one_line():
    graph = build_graph(load_spec("layer_specs/tiny.yaml"))
    schedule = build_schedule(graph, {"linear": "cublas", "attn_res": "torch", "decode_attention": "torch"}, batch=1)
    assert repr(schedule) == ("<Schedule of tiny: 31 kernels, 0 PDL edges; embedding torch, attn_res torch, "
                              "linear cublas, decode_attention torch>")
