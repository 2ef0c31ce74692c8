"""CPU checks of the benchmark tools' bookkeeping (their GPU runs are in bench/)."""

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from graphc.floor import H200_HBM_BYTES_PER_S
from graphc.graph import build_graph
from graphc.schedule import build_schedule
from graphc.spec import load_spec

BENCH = pathlib.Path(__file__).parent.parent / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_breakdown_groups_layers_into_roles():
    breakdown = _load("step_breakdown")
    schedule = build_schedule(build_graph(load_spec("layer_specs/tiny.yaml")))
    sizes = {"T": 8, "slots": 9, "context": 100}
    floors = {k.node: k.op.bytes_moved(sizes) / H200_HBM_BYTES_PER_S * 1e6 for k in schedule.kernels}
    # A recorded-style profile: every kernel at 1.25x its floor plus 2 us, layer 0 twice as slow.
    kernels = [{"node": k.node, "kind": k.op.kind,
                "duration_us": (1.25 * floors[k.node] + 2) * (2 if k.node.startswith("L00.") else 1)}
               for k in schedule.kernels]
    profile = {"implementations": schedule.implementations(), "kernels": kernels}
    rows = {r["role"]: r for r in breakdown.breakdown(profile, floors)}

    assert set(rows) == {"embed", "attn_res.attn", "attn.qkv", "attn.attention", "attn.o_proj",
                         "attn_res.mlp", "mlp.gate_up", "mlp.down", "final.attn_res", "lm_head"}
    down = [f for node, f in floors.items() if node.endswith(".mlp.down")]
    assert rows["mlp.down"]["count"] == len(down) == 4
    assert rows["mlp.down"]["floor_us"] == pytest.approx(sum(down))
    assert rows["mlp.down"]["us"] == pytest.approx(1.25 * sum(down) + 8 + 1.25 * down[0] + 2)
    assert rows["lm_head"]["loss_us"] == pytest.approx(0.25 * floors["lm_head"] + 2)
    table = breakdown.format_breakdown(list(rows.values()), step_us=500.0, step_floor_us=400.0, batch=8)
    assert "batch 8: step 500 us, floor 400 us (1.250x)" in table
    # Sorted by time lost: layer-repeated roles before the one-off embedding gather.
    order = [line.split()[0] for line in table.splitlines()[2:-2]]
    assert order.index("mlp.gate_up") < order.index("embed")


def test_step_breakdown_in_step_spans():
    """Kernel records of two replays (out of order, a PDL dependent starting before its
    predecessor ends) become each node's end minus the previous end, median over replays, and
    sum per role next to the time alone."""
    breakdown = _load("step_breakdown")
    nodes = ["L00.attn.qkv", "L00.attn.attention", "L01.attn.qkv", "L01.attn.attention"]
    replay = [(0.0, 10.0), (10.5, 20.0), (25.0, 12.0), (30.0, 9.0)]      # (start, duration) us
    events = [{"ts": 1000.0 * r + 5 * r + start, "dur": dur} for r in (1, 0) for start, dur in replay]
    spans = breakdown.kernel_spans(events, nodes)
    assert spans == pytest.approx({"L00.attn.qkv": 10.0, "L00.attn.attention": 20.5,
                                   "L01.attn.qkv": 6.5, "L01.attn.attention": 2.0})
    with pytest.raises(RuntimeError, match="7 kernels"):
        breakdown.kernel_spans(events[:7], nodes)
    profile = {"implementations": {n: "cute" for n in nodes},
               "kernels": [{"node": n, "kind": "k", "duration_us": 5.0} for n in nodes]}
    rows = {r["role"]: r for r in breakdown.breakdown(profile, {n: 1.0 for n in nodes}, spans)}
    assert rows["attn.qkv"]["in_step_us"] == pytest.approx(16.5)
    assert rows["attn.attention"]["in_step_us"] == pytest.approx(22.5)
    table = breakdown.format_breakdown(list(rows.values()), step_us=39.0, step_floor_us=4.0, batch=1)
    assert "in step us" in table and "22.5" in table


def test_step_breakdown_timeline_is_a_viz_profile():
    """The replayed step as a profile: median start (from each replay's first kernel) and
    duration per node, which graphc viz draws with the measured overlap."""
    from graphc.viz import schedule_html

    breakdown = _load("step_breakdown")
    schedule = build_schedule(build_graph(load_spec("layer_specs/tiny.yaml")))
    nodes = [k.node for k in schedule.kernels]
    events = []
    for r, base in enumerate((5000.0, 100.0, 9000.0)):       # three replays, out of order
        t = base
        for i, _ in enumerate(nodes):
            # Each kernel starts 1 us before its predecessor ends (PDL overlap), lasts 3 + i us.
            events.append({"ts": t, "dur": 3.0 + i + r})
            t += 3.0 + i + r - 1.0
    profile = breakdown.step_timeline(events, nodes, schedule.implementations(), "GPU", 8)
    rows = profile["kernels"]
    assert [row["node"] for row in rows] == nodes
    assert rows[0]["start_us"] == 0.0 and rows[1]["start_us"] == pytest.approx(3.0)   # median replay
    assert rows[2]["duration_us"] == pytest.approx(6.0)
    html = schedule_html(schedule, profile)
    assert "first start to last end" in html


def test_attention_timeline_compiles_and_summarises():
    """bench/attention_timeline.py: its instrumented kernels (the shipped consumer between two
    timer reads, and a consumer that only frees each tile) still compile against the kernel,
    it refuses a chunk that would need the split workspace its timer words borrow, and its
    summary reads the words right."""
    import torch

    timeline = _load("attention_timeline")
    with pytest.raises(SystemExit, match="chunk=512"):
        timeline.config(8, 512, 3)
    assert set(timeline.compile_variants(timeline.config(8, 1024, 3))) == {"kernel", "stream_only"}
    # (start ns, end ns, SM): two CTAs on SM 0, one on SM 5, and an empty split's unwritten words.
    words = torch.tensor([[1000, 11000, 0], [2000, 13000, 0], [0, 0, 0], [3000, 9000, 5]])
    text = timeline.summary(words, "x").splitlines()
    assert text[0] == "x: 3 CTAs, 1-2 per SM"
    assert "start 0.0 0.2 1.0 1.8 2.0 | end 8.0 8.4 10.0 11.6 12.0 | duration 6.0 6.8 10.0 10.8 11.0" in text[1]
    assert text[2] == "   on SMs with 1 CTAs: 1 CTAs, end median 8.0 max 8.0, duration median 6.0"
    assert text[3] == "   on SMs with 2 CTAs: 2 CTAs, end median 10.0 max 12.0, duration median 10.0"


def test_precompile_lean_list_and_prune(tmp_path, monkeypatch):
    """bench/precompile.py --lean names the GPU tests' GEMM cases and the step's shapes up to
    64 rows, and no knob variants; --prune deletes only objects of its kernels that the
    list does not name."""
    from graphc.kernels import gemm, gemm_stream_k

    monkeypatch.syspath_prepend(str(BENCH))                  # precompile imports bench/gemm.py
    monkeypatch.syspath_prepend(str(BENCH.parent / "tests"))  # and tests/gemm_shapes.py
    precompile = _load("precompile")
    import gemm_shapes

    def job(m, k, n, e, **tuning):
        cfg = gemm.plan(m, k, n, e, 132, **tuning)
        return gemm.cache_of(cfg).name, cfg.key()

    lean, full = precompile.gemm_configs(lean=True), precompile.gemm_configs()
    assert {job(*case) for case in gemm_shapes.reference_cases()} <= set(lean)
    assert job(64, 7168, 10240, None) == ("gemm_stream_k", gemm.GemmConfig(64, 7168, 10240, None, 132).key())
    assert job(64, 7168, 10240, None) in lean                          # qkv at 64 rows (graphc bench)
    assert job(256, 8192, 7168, None)[0] == "gemm_wide" and job(256, 8192, 7168, None) in lean
    assert len(lean) < len(full)
    from gemm import BIG_SHAPES as BENCH_SHAPES                         # bench/gemm.py's rows

    shapes = ({(k, n, e) for k, n, e in gemm_shapes.SPEC_SHAPES} | precompile.spec_linear_shapes()
              | {(k, n, e) for _, k, n, e in BENCH_SHAPES}
              | {(k, n, e) for _, k, n, e in [*gemm_shapes.reference_cases(), *gemm_shapes.OTHER_CASES]})
    defaults = {job(m, k, n, e) for m in range(1, 257) for k, n, e in shapes}
    # ... and the spec shapes on weights in blocks, as a build stores those only it reads.
    defaults |= {job(m, k, n, e, w_blocked=1) for m in range(1, 257)
                 for k, n, e in {*gemm_shapes.SPEC_SHAPES, *precompile.spec_linear_shapes()}}
    assert job(8, 7168, 10240, None, w_blocked=1) in lean
    assert len(set(lean) - defaults) <= len(gemm_shapes.TUNING_CASES)  # knob variants: the tests' only
    # The step tests' 8-layer builds past 64 rows, as built: at 160 + 192 rows down runs cuBLAS at 160
    # and the decode GEMM on its row-major weight at 192, qkv the decode GEMM at 160 on rows too.
    built = precompile.step_test_build_configs()
    assert job(192, 18432, 7168, None) in built and job(192, 18432, 7168, None, w_blocked=1) not in built
    assert job(160, 7168, 10240, None) in built and job(128, 7168, 10240, None) in built
    assert {name for name, _ in built} >= {"gemm_stream_k", "gemm_wide", "attn_res", "attention"}

    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    assert lean[0][0] == "gemm_stream_k"
    keep = gemm_stream_k.compile_cache().path(lean[0][1])
    for name in (keep.name, "gemm_stream_k-0123.o", "gemm_wide-0123.o", "attention-4567.o", "gemm_timeline-89ab.o",
                 "notes.txt"):
        (tmp_path / name).write_bytes(b"x" * 10)
    assert precompile.prune([lean[0]]) == (3, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keep.name, "gemm_timeline-89ab.o", "notes.txt"])


def test_gemm_wide_apart_probes_compile_as_described(monkeypatch):
    """bench/gemm_wide_apart.py: its cases resolve to the whole-K configuration gemm.linear runs
    (W in blocks where the default reads them; a stream-K case refused by name), and its three
    probes compile to what its docstring says: ``feed`` the shipped loads and waits with no
    wgmma, ``feed_w`` only the W loads, ``tensor`` the shipped wgmma with only the first round's
    loads and no wait on a freed stage."""
    import re
    import tempfile

    from graphc.kernels import gemm_wide

    monkeypatch.syspath_prepend(str(BENCH))                  # it imports bench/gemm.py, gemm_ncu.py
    apart = _load("gemm_wide_apart")
    with pytest.raises(SystemExit, match="o_proj:8: runs gemm_stream_k, not the whole-K tiles"):
        apart.wide_config("o_proj", 8, {}, 132)
    with pytest.raises(SystemExit, match="o_proj:256: wg_release=1 is not probed"):
        apart.wide_config("o_proj", 256, {"wg_release": 1}, 132)
    assert apart.wide_config("qkv", 256, {}, 132)[1] == 64                 # qkv 256 reads blocks
    cfg, rows = apart.wide_config("o_proj", 256, {"static_stages": 1}, 132)
    assert (rows, cfg.cluster_shares, cfg.static_stages, cfg.wgs) == (0, "w", 1, 2)

    def counts(fn):
        ptx = fn.__ptx__
        return {"wgmma": ptx.count("wgmma.mma_async"), "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                "waits": ptx.count("mbarrier.try_wait")}

    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir {dump_dir}"
        shipped = counts(gemm_wide.compile_wide(cfg, options=options))
        probes = {name: counts(fn) for name, fn in apart.compile_probes(cfg, options=options).items()}
    # Unrolled by the 6 stages: the producer's first-round loop (one body: W, then an x box per
    # warpgroup), its refill round (6 bodies) and the 128 % 6 = 2 k-blocks left over; the
    # consumers' round and left-over k-blocks, each with its wait (as the producer's refills).
    producer_bodies, consumer_bodies = 1 + cfg.stages + cfg.k_blocks % cfg.stages, cfg.stages + cfg.k_blocks % cfg.stages
    x_loads = cfg.wgs * producer_bodies
    assert shipped == {"wgmma": 4 * consumer_bodies, "tma": (1 + cfg.wgs) * producer_bodies,
                       "waits": 2 * consumer_bodies}
    assert probes["feed"] == {**shipped, "wgmma": 0}
    assert probes["feed_w"] == {**shipped, "wgmma": 0, "tma": shipped["tma"] - x_loads}
    assert probes["tensor"] == {**shipped, "tma": 1 + cfg.wgs, "waits": consumer_bodies}


def test_chain_timeline_instrumentation_compiles():
    """bench/chain_timeline.py: its timer stores still apply to kernels/attn_res.py at their
    anchors (one each) and the instrumented AttnRes compiles; the chain's GEMM configurations
    alternate so that links 21 and 22 have timer words of their own, and the last link a third."""
    import ast

    pytest.importorskip("cutlass")
    timeline = _load("chain_timeline")
    src = timeline.attn_res_source()
    ast.parse(src)
    assert src.count("globaltimer_lo()") == 6 and 'CompileCache("attn_res_timeline"' in src
    ar = timeline.attn_res_module()
    ar.compile_cache().get(ar.static_key(timeline.D, timeline.NB, True, False))
    pf = [timeline.l2_prefetch_of(i) for i in range(timeline.LINKS)]
    assert pf[21] != pf[22] and pf[23] not in (pf[21], pf[22]) and pf[21] not in pf[22:]
    assert pf[22] not in pf[23:]


def test_gemm_timeline_reads_the_words_of_the_workspaces_it_is_given(monkeypatch, capsys):
    """report() reads the timer words of an instrumented launch from the pool it is handed (a
    step's plan.workspaces), in µs from the first CTA's entry, and refuses a pool with no such
    launch rather than print a timeline of zeros."""
    import types

    import torch

    from graphc.kernels.workspaces import Workspaces

    timeline = _load("gemm_timeline")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cfg = types.SimpleNamespace(tiles=3, ctas=2, publish_first=0, key=lambda: ("cfg",))
    base = 5_000_000
    # CTA 0: entry, wait passed, last k-block, end, arrived, ready, summed (ns), role, SM.
    words = [[base, base + 2000, base + 30000, base + 33000, base + 30500, base + 31000, base + 32000, 2, 7],
             [base + 1000, base + 2500, base + 28000, base + 29000, base + 28400, base + 28900, 0, 1, 9]]
    counters = torch.tensor([0] * (2 * cfg.tiles) + sum(words, []), dtype=torch.int64)
    pool = Workspaces()
    pool.get(("gemm_timeline", 0, cfg.key()), lambda: (torch.empty(4), counters), lambda: "timeline words")

    summary = timeline.report(None, cfg, "x:2", workspaces=pool)
    assert summary["wait_passed_max"] == 2.5 and summary["end_max"] == 33.0
    assert summary["wait_to_end"] == 31.0 and summary["entries_after_wait"] == 0
    assert summary["per_cta"]["sm"] == [7, 9] and summary["per_cta"]["role"] == [2, 1]
    assert summary["streaming_max"] == 28.0                  # CTA 0: 30 - 2 us
    assert "latest ends" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="would read zeros"):
        timeline.report(None, cfg, "x:2", workspaces=Workspaces())


def test_floor_bandwidth_is_fixed_for_the_h200_and_measured_elsewhere():
    from graphc.errors import GraphcError
    from graphc.floor import floor_bandwidth

    assert floor_bandwidth("NVIDIA H200", 4.1e12) == (H200_HBM_BYTES_PER_S, "NVIDIA H200 lab measurement")
    bw, source = floor_bandwidth("NVIDIA H100 80GB HBM3", 2.9e12)
    assert bw == 2.9e12 and "measured on this NVIDIA H100 80GB HBM3" in source
    with pytest.raises(GraphcError, match="no HBM bandwidth known for NVIDIA H100"):
        floor_bandwidth("NVIDIA H100 80GB HBM3", None)


def test_step_ab_precompile_lists_the_kernels_its_builds_load(monkeypatch):
    """``--precompile``'s list: the shipped step's kernels, each variant's under its ``impl.`` /
    ``rows.`` / ``build.`` settings (their weight order included), and the decode GEMMs its knobs
    change for its roles, as ``linear`` would key them."""
    pytest.importorskip("cutlass")
    step_ab = _load("step_ab")
    monkeypatch.syspath_prepend(str(BENCH))
    from graphc.kernels import gemm, gemm_stream_k

    graph = build_graph(load_spec(BENCH.parent / "layer_specs" / "kimi_k3_dense_8l.yaml"))
    down, qkv = (18432, 7168, None), (7168, 10240, None)
    shipped = set(step_ab.kernel_variants(graph, [160], [], 132))
    assert gemm.compiled_variant(160, *qkv, 132, w_block_rows=64) in shipped       # qkv: its default at 160
    assert not any(key[:4] == (160, *down) for m, key in shipped if m == gemm_stream_k.__name__)
    variants = [step_ab.parse_variant(v) for v in ("d:rows.mlp.down=1-96+160", "s4:stages=4@attn.qkv",
                                                   "rows:build.block_weights=0")]
    listed = step_ab.kernel_variants(graph, [160], variants, 132)
    assert len(listed) == len(set(listed)) and shipped <= set(listed)
    assert gemm.compiled_variant(160, *down, 132, w_block_rows=64) in listed       # rows.: down on it, in blocks
    assert gemm.compiled_variant(160, *qkv, 132, w_block_rows=64, stages=4) in listed    # knobs, its role only
    assert gemm.compiled_variant(160, 8192, 7168, None, 132, w_block_rows=64, stages=4) not in listed
    assert gemm.compiled_variant(160, *qkv, 132) in listed                           # build.block_weights=0: rows


def test_step_ab_variants_reach_only_their_roles(monkeypatch):
    step_ab = _load("step_ab")
    import torch

    from graphc.kernels import gemm

    assert step_ab.parse_variant("pf8:l2_prefetch=8,stages=6@attn.qkv,lm_head") == (
        "pf8", {"l2_prefetch": 8, "stages": 6}, {"attn.qkv", "lm_head"}, {}, {}, {})
    assert step_ab.parse_variant("pf16:l2_prefetch=16") == ("pf16", {"l2_prefetch": 16}, None, {}, {}, {})
    assert step_ab.parse_variant("c256:attention.chunk=256") == ("c256", {"attention.chunk": 256}, None, {}, {}, {})
    assert step_ab.parse_variant("cl:impl.decode_attention=cluster,cluster.trigger_at=2") == (
        "cl", {"cluster.trigger_at": 2}, None, {"decode_attention": "cluster"}, {}, {})
    assert step_ab.parse_variant("rows:build.block_weights=0,impl.linear=cute") == (
        "rows", {}, None, {"linear": "cute"}, {"block_weights": False}, {})
    assert step_ab.parse_variant("b16:build.block_rows=16").options == {"block_rows": 16}
    assert step_ab.parse_variant("d:rows.mlp.down=1-96+192+224,rows.lm_head=1-8").rows == {
        "mlp.down": ((1, 96), (192, 192), (224, 224)), "lm_head": ((1, 8),)}
    # impl.ROLE=NAME: every node of the role (a name with a dot), an op kind as it is.
    gu = step_ab.parse_variant("gu:impl.mlp.gate_up=cute,impl.decode_attention=cluster")
    assert gu[3] == {"mlp.gate_up": "cute", "decode_attention": "cluster"}
    monkeypatch.syspath_prepend(str(BENCH))        # step_ab imports step_breakdown, as a script does
    graph = build_graph(load_spec(BENCH.parent / "layer_specs" / "kimi_k3_dense_8l.yaml"))
    assert step_ab.by_node(gu[3], graph) == {"decode_attention": "cluster",
                                             **{f"L{i:02d}.mlp.gate_up": "cute" for i in range(8)}}
    assert step_ab.by_node({"L03.mlp.down": "cute"}, graph) == {"L03.mlp.down": "cute"}
    # rows.ROLE=SPANS: the build a changed DECODE_GEMM_ROWS entry would ship, for every node of
    # the role's shape, through graphc.build's per-size implementations (no library table changed).
    from graphc.ops import linear as linear_op
    from graphc.schedule import build_schedule

    shipped_rows = dict(linear_op.DECODE_GEMM_ROWS)
    down = step_ab.parse_variant("d:rows.mlp.down=1-8+200")
    chosen = step_ab.variant_implementations(down, graph)
    assert chosen == {f"L{i:02d}.mlp.down": "cute@1-8+200,cublas" for i in range(8)}
    impls = [build_schedule(graph, chosen, batch=b).kernel("L05.mlp.down").impl for b in (8, 9, 200)]
    assert impls == ["cute", "cublas", "cute"]
    assert linear_op.DECODE_GEMM_ROWS == shipped_rows
    assert step_ab.variant_implementations(gu, graph) == step_ab.by_node(gu[3], graph)
    with pytest.raises(SystemExit, match="no linear of role 'mlp.gate'"):
        step_ab.variant_implementations(step_ab.parse_variant("g:rows.mlp.gate=1-8"), graph)
    with pytest.raises(SystemExit, match="rows.mlp.down and an impl. setting both decide L00.mlp.down"):
        step_ab.variant_implementations(step_ab.parse_variant("x:rows.mlp.down=1-8,impl.linear=cublas"), graph)
    with pytest.raises(SystemExit, match="no node of role 'mlp.gate'"):
        step_ab.by_node({"mlp.gate": "cute"}, graph)
    for bad in ("pf8", "shipped:l2_prefetch=8", "x:l2_prefetch", "x:warp_speed=9", "x:attention.heads=2",
                "x:cluster.chunk=2", "x:impl.decode_attention=", "x:w_blocked=1", "x:build.seed=1",
                "x:build.block_weights=no", "x:rows.mlp.down=", "x:rows.mlp.down=96-1", "x:rows.mlp.down=1-96+90",
                "x:rows.mlp.down=1-96+97", "x:rows.mlp.down=0-8", "x:rows.mlp.down=1-257", "x:rows.=1-8",
                "x:rows.mlp.down=a"):
        with pytest.raises(SystemExit, match="--variant"):
            step_ab.parse_variant(bad)

    calls = []
    monkeypatch.setattr(gemm, "linear", lambda x, w, out, **kw: calls.append((w, kw)))
    shipped = gemm.linear
    qkv, down = torch.zeros(2), torch.zeros(3)
    roles = {qkv.data_ptr(): "attn.qkv", down.data_ptr(): "mlp.down"}
    with step_ab.step_knobs({"l2_prefetch": 8}, {"attn.qkv"}, roles):
        gemm.linear(None, qkv, None, epilogue=None)
        gemm.linear(None, down, None, epilogue=None)
    with step_ab.step_knobs({"stages": 6}, None, roles):
        gemm.linear(None, down, None, use_pdl=True)
    assert gemm.linear is shipped
    assert [kw for _, kw in calls] == [{"l2_prefetch": 8, "epilogue": None}, {"epilogue": None},
                                       {"stages": 6, "use_pdl": True}]

    # attention.KNOB reaches the Triton attention (a stand-in module here: CI has no Triton).
    import sys
    import types

    fake = types.ModuleType("graphc.kernels.decode_attention")
    fake.decode_attention = lambda *args, **kw: calls.append(("attention", kw))
    monkeypatch.setitem(sys.modules, "graphc.kernels.decode_attention", fake)
    with step_ab.step_knobs({"attention.chunk": 256}, {"attn.qkv"}, roles):
        fake.decode_attention(1, 2, heads=8)
        gemm.linear(None, qkv, None)                # no GEMM knob in this variant
    assert calls[-2:] == [("attention", {"chunk": 256, "heads": 8}), (qkv, {})]

    # cluster.KNOB reaches the cluster attention.
    from graphc.kernels import decode_attention_cluster

    monkeypatch.setattr(decode_attention_cluster, "decode_attention",
                        lambda *args, **kw: calls.append(("cluster", kw)))
    with step_ab.step_knobs({"cluster.trigger_at": 1}, None, roles):
        decode_attention_cluster.decode_attention(1, 2, heads=8)
    assert calls[-1] == ("cluster", {"trigger_at": 1, "heads": 8})


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_bench_script_explains_itself_on_a_machine_without_a_gpu(script):
    """`--help` is how one finds out what a benchmark measures and how to run it; it must work
    where the benchmark cannot (no GPU, no Triton: CI), and say what the script is."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    r = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=BENCH.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    opening = " ".join(_docstring(BENCH / script).split()[:8])      # as argparse may re-wrap it
    assert opening and opening in " ".join(r.stdout.split()), r.stdout[:500]


def _docstring(path):
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_gemm_bench_checks_its_command_line_before_any_gpu_work(monkeypatch, capsys):
    """bench/gemm.py refuses what it would otherwise drop or fail on mid-run: --tunings beside
    --no-variants, a batch size the decode GEMM does not take, a shape name not in --shapes;
    and it parses a good line into the rows it will time."""
    monkeypatch.syspath_prepend(str(BENCH))
    bench = _load("gemm")
    for argv, says in [(["--no-variants", "--tunings", "cluster=4"], "would drop --tunings"),
                       (["--m", "1,300"], "[300] outside 1..256"),
                       (["--m", "8,x"], "comma-separated integers"),
                       (["--only", "qkv,o_prj"], "no shape o_prj in --shapes big"),
                       (["--shape", "odd=7168,10000"], "N must be a positive multiple of 64"),
                       (["--shape", "qkv39=7168"], "a shape is NAME=K,N"),
                       (["--shape", "=7168,9984"], "a shape is NAME=K,N")]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert says in capsys.readouterr().err
    args = bench.parse_args(["--only", "qkv,down", "--m", "1,256", "--tunings", "cluster=4;wide=1"])
    assert ([s[0] for s in args.shape_rows], args.ms) == (["down", "qkv"], [1, 256])
    assert args.tunings == [("cluster4", {"cluster": 4}), ("wide1", {"wide": 1})]
    # --shape adds rows (a shape the bundled lists do not have), which --only may name.
    args = bench.parse_args(["--only", "qkv,qkv39,gu", "--shape", "qkv39=7168,9984", "--shape", "gu=7168,1024,silu_mul"])
    assert args.shape_rows == [("qkv", 7168, 10240, None), ("qkv39", 7168, 9984, None),
                               ("gu", 7168, 1024, "silu_mul")]
    args = bench.parse_args(["--only", "qkv39", "--shape", "qkv39=7168,9984", "--shape", "gu=7168,1024,silu_mul"])
    assert args.shape_rows == [("qkv39", 7168, 9984, None)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "qkv39"])
    assert "no shape qkv39" in capsys.readouterr().err


def test_gemm_ncu_cases_carry_knobs(monkeypatch):
    """bench/gemm_ncu.py's ``shape:M[:knob=value,...]``: parsed into what ``gemm.linear`` takes,
    and a bad shape, M or knob refused by name before anything is launched."""
    monkeypatch.syspath_prepend(str(BENCH))
    ncu = _load("gemm_ncu")
    assert ncu.parse_case("qkv:192") == ("qkv", 192, {})
    assert ncu.parse_case("qkv:192:wide=1,batch_tile=64,cluster=4") == (
        "qkv", 192, {"wide": 1, "batch_tile": 64, "cluster": 4})
    assert ncu.parse_case("o_proj:256:wide=1,ctas=112") == ("o_proj", 256, {"wide": 1, "ctas": 112})
    for arg, says in [("qvk:8", "unknown shape 'qvk'"), ("qkv:300", "M must be"),
                      ("qkv:8:tile=64", "'tile=64' is not knob=integer"), ("qkv:8:wide=x", "'wide=x'"),
                      ("qkv:8:wide=1;wide=0", "one configuration per case")]:
        with pytest.raises(SystemExit, match=says):
            ncu.parse_case(arg)


def test_gemm_ncu_profiles_on_the_weight_order_asked(monkeypatch):
    """``w_blocked`` / ``w_block_rows`` in a case choose the W copy the kernel is profiled on
    (``linear`` refuses them as knobs: the order is read off the weight), and leave the rest."""
    monkeypatch.syspath_prepend(str(BENCH))
    ncu = _load("gemm_ncu")
    for knobs, rows in [({"wide": 1}, 0), ({"wide": 1, "w_blocked": 1}, 64), ({"w_blocked": 0}, 0),
                        ({"wide": 1, "w_block_rows": 16}, 16), ({"w_blocked": 1, "w_block_rows": 16}, 16)]:
        assert ncu.weight_order(knobs) == ({k: v for k, v in knobs.items() if k not in ("w_blocked", "w_block_rows")},
                                           rows)
    # bench/gemm.py's rows share the rule, with blocks where the default reads them.
    assert ncu.weight_order({"wide": 1}, True) == ({"wide": 1}, 64)
    assert ncu.weight_order({"wide": 1, "w_blocked": 0}, True) == ({"wide": 1}, 0)


def test_gemm_bench_names_the_tunings_it_cannot_time(monkeypatch):
    """An explicit tuning that gemm.plan refuses at a row is reported with the reason, not
    silently left out; the default alternatives are just the ones that apply."""
    monkeypatch.syspath_prepend(str(BENCH))
    bench = _load("gemm")
    explicit = [("wide1_cluster4_xgroup2", {"wide": 1, "cluster": 4, "x_group": 2}), ("wide1", {"wide": 1})]
    timed, refused = bench.variants(64, 8192, 7168, None, explicit, 132)   # one batch tile
    assert [label for label, _ in timed] == ["wide1"] and list(refused) == ["wide1_cluster4_xgroup2"]
    assert "cluster=4, x_group=2 unsupported here" in refused["wide1_cluster4_xgroup2"]
    timed, refused = bench.variants(256, 8192, 7168, None, explicit, 132)   # two
    assert [label for label, _ in timed] == ["wide1_cluster4_xgroup2", "wide1"] and refused == {}
    timed, refused = bench.variants(8, 8192, 7168, None, None, 132)
    assert timed and refused == {}


def test_gemm_bench_names_a_second_wave_of_clusters(monkeypatch):
    """A variant's line says how many clusters its grid launches and how many the board runs at
    once (the driver's count, here given), and names the second wave where they do not all fit:
    W in threes at qkv 192 rows is 40 clusters of 3, and session 45's H100 ran 39 (§47)."""
    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    bench = _load("gemm")
    blocks = torch.empty(10240 // 64, 7168 // 64, 64, 64, dtype=torch.bfloat16, device="meta")
    threes = bench.variant_plan(192, 7168, 10240, None, 132, {"wide": 1, "batch_tile": 64, "n_tile": 256,
                                                              "cluster": 3}, blocks)
    asked = []

    def resident(count):
        def query(cluster, smem, threads):
            asked.append((cluster, smem, threads))
            return count
        return query

    assert bench.cluster_residency(threes, resident(39)) == (
        " [40 clusters of 3; this GPU runs 39 at once: the rest start as a second wave]")
    assert asked == [(3, threes.stages * threes.stage_bytes, threes.threads)] and threes.stages * threes.stage_bytes > 114 * 1024
    assert bench.cluster_residency(threes, resident(40)) == " [40 clusters of 3; this GPU runs 40 at once]"
    plain = bench.variant_plan(192, 7168, 10240, None, 132, {}, blocks)
    assert plain.cluster == 1 and bench.cluster_residency(plain, resident(0)) == ""


def test_gemm_bench_says_what_each_variant_ran(monkeypatch):
    """bench/gemm.py prints, per explicit variant, the configuration gemm.plan makes of its knobs
    on the weights it passes: with ``ctas=120`` alone the whole-K tile is re-chosen for 120 SMs
    (128 x 16 at qkv 256 rows, not the 128 x 160 of 128 CTAs), which the table of session 42
    did not show (bench/gemm_notes.md §45); blocks add their order."""
    import torch

    from graphc.kernels import weight_blocks

    monkeypatch.syspath_prepend(str(BENCH))
    bench = _load("gemm")
    rows = torch.empty(10240, 7168, dtype=torch.bfloat16, device="meta")
    fours = {"wide": 1, "cluster": 4, "x_group": 4}
    assert "ctas=128, tile=128x160" in bench.variant_config(256, 7168, 10240, None, 132, {**fours, "ctas": 128}, rows)
    assert "ctas=120, tile=128x16," in bench.variant_config(256, 7168, 10240, None, 132, {**fours, "ctas": 120}, rows)
    pinned = bench.variant_config(256, 7168, 10240, None, 132, {**fours, "ctas": 120, "n_tile": 160}, rows)
    assert "ctas=120, tile=128x160" in pinned
    blocks = torch.empty(10240 // 64, 7168 // 64, 64, 64, dtype=torch.bfloat16, device="meta")
    assert weight_blocks.is_blocked(blocks)
    stream_k = bench.variant_config(8, 7168, 10240, None, 132, {}, blocks)
    assert stream_k.startswith("GemmConfig(m=8,") and "w_blocked=1" in stream_k
    assert "w_blocked" not in bench.variant_config(8, 7168, 10240, None, 132, {}, rows)
