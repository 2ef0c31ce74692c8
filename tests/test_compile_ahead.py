"""Compiling a build's kernel variants ahead in worker processes (graphc/compile_ahead.py), on
the CPU: which variants a schedule needs, and real compiles (CUTE_DSL_ARCH=sm_90a, set by
conftest.py) into a fresh disk cache that the in-process cache then loads."""

from __future__ import annotations

import pytest

from graphc import compile_ahead as ca
from graphc.errors import GraphcError
from graphc.graph import build_graph
from graphc.kernels import attn_res, decode_attention_cluster, decode_attention_tma, gemm, gemm_stream_k, gemm_wide
from graphc.ops.attention import CLUSTER_MAX_BATCH, TMA_MIN_BATCH, DecodeAttentionOp
from graphc.ops.attn_res import AttnResOp
from graphc.ops.linear import LinearOp
from graphc.schedule import build_schedule
from graphc.spec import load_spec

SMS = 132


@pytest.fixture(scope="module")
def kimi_graph():
    return build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))


def _ops(graph, kind):
    return [op for _, op in graph.nodes(data="op") if isinstance(op, kind)]


def test_a_schedule_needs_one_gemm_per_shape_and_batch_one_attn_res_per_configuration(kimi_graph):
    sizes = (1, 2, 8, 64)
    schedules = {b: build_schedule(kimi_graph, None, True, batch=b) for b in sizes}
    variants = ca.schedule_variants(schedules, SMS)
    assert len(variants) == len(set(variants))

    gemms = {(key[0], key[1], key[2], key[3]) for m, key in variants if m == gemm_stream_k.__name__}
    linear = {(op.k, op.n, op.epilogue) for op in _ops(kimi_graph, LinearOp)}
    # Every linear shape at every size where the decode GEMM is its default, and nowhere else.
    assert gemms == {(b, k, n, e) for b in sizes for k, n, e in linear
                     if LinearOp(name="x", k=k, n=n, epilogue=e).decode_gemm_default(b)}
    assert all(key[4] == SMS for m, key in variants if m == gemm_stream_k.__name__)

    attention = {key for m, key in variants if m == decode_attention_tma.__name__}
    op = _ops(kimi_graph, DecodeAttentionOp)[0]
    assert attention == {decode_attention_tma.AttentionConfig(
        b, op.heads, op.kv_heads, op.head_dim, op.max_context,
        decode_attention_tma.default_chunk(b), decode_attention_tma.default_stages(b)).key()
        for b in sizes if b >= TMA_MIN_BATCH}
    few_rows = {key for m, key in variants if m == decode_attention_cluster.__name__}
    assert few_rows == {decode_attention_cluster.compiled_variant(b, **op.params())[1]
                        for b in sizes if b <= CLUSTER_MAX_BATCH}

    cluster = {key for m, key in variants if m == attn_res.__name__}
    assert cluster == {(op.hidden, op.nb, op.has_delta, op.final) for op in _ops(kimi_graph, AttnResOp)}


def test_library_and_torch_implementations_need_nothing_compiled(kimi_graph):
    chosen = {"linear": "cublas", "attn_res": "torch", "decode_attention": "triton"}
    schedules = {b: build_schedule(kimi_graph, chosen, True, batch=b) for b in (1, 8)}
    assert ca.schedule_variants(schedules, SMS) == []


def test_rows_past_the_wide_threshold_name_the_whole_k_kernel():
    module, key = gemm.compiled_variant(256, 8192, 7168, None, SMS)
    assert module == gemm_wide.__name__
    assert key == gemm.plan(256, 8192, 7168, None, SMS).key()
    assert gemm.compiled_variant(8, 8192, 7168, None, SMS)[0] == gemm_stream_k.__name__


def test_the_jobs_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ca.JOBS_ENV, "3")
    assert ca.default_jobs() == 3
    monkeypatch.setenv(ca.JOBS_ENV, "four")
    with pytest.raises(GraphcError, match="GRAPHC_COMPILE_JOBS='four'"):
        ca.default_jobs()
    monkeypatch.delenv(ca.JOBS_ENV)
    assert 1 <= ca.default_jobs() <= ca.MAX_DEFAULT_JOBS


# Small variants (one CTA per token: a second or two each); a hidden size the kernel refuses.
SMALL = [(attn_res.__name__, (1024, nb, True, False)) for nb in (0, 1, 2)]
REFUSED = (attn_res.__name__, (1000, 0, True, False))


def test_workers_compile_into_the_disk_cache_and_the_process_loads_it(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    cache = attn_res.compile_cache()
    for _, key in SMALL:       # another test of this process may hold them in memory already
        cache._memory.pop(key, None)
    heard = []
    done = ca.compile_ahead(SMALL + [REFUSED], jobs=2, progress=heard.append)

    assert sorted(done) == sorted(SMALL)
    assert all(cache.path(key).is_file() for _, key in SMALL)
    assert heard[0] == "compiling 4 kernel variants in 2 processes (cached on disk; GRAPHC_COMPILE_JOBS sets how many)"
    refusal = [m for m in heard if m.startswith("could not compile")]
    assert len(refusal) == 1 and "(1000, 0, True, False)" in refusal[0] and "hidden=1000" in refusal[0]
    assert heard[-1].startswith("compiled 3 of 4 variants ahead in ")

    before = dict(cache.stats)
    cache.get(SMALL[0][1])
    assert cache.stats["disk_hits"] == before["disk_hits"] + 1
    assert cache.stats["compiles"] == before["compiles"]
    # Nothing left to do: no worker starts.
    assert ca.compile_ahead(SMALL, jobs=2, progress=heard.append) == []
    assert ca.uncached(SMALL) == []


def test_nothing_runs_ahead_without_a_disk_cache_or_with_one_job(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    heard = []
    assert ca.compile_ahead(SMALL, jobs=1, progress=heard.append) == []
    monkeypatch.setenv("GRAPHC_KERNEL_CACHE", "0")
    assert ca.compile_ahead(SMALL, jobs=2, progress=heard.append) == []
    assert heard == [] and list(tmp_path.iterdir()) == []


def test_compiling_in_the_background_stops_when_the_build_fails(monkeypatch, tmp_path):
    """graphc.build loads its weights inside ``compiling_ahead``: a load that fails propagates
    at once and the workers start no further variant; a bad job count fails before the body."""
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    variants = [(attn_res.__name__, (1024, nb, False, False)) for nb in range(6)]
    with pytest.raises(RuntimeError, match="weights file is corrupt"):
        with ca.compiling_ahead(variants, jobs=2):
            raise RuntimeError("weights file is corrupt")
    assert len(list(tmp_path.glob("*.o"))) < len(variants)
    monkeypatch.setenv(ca.JOBS_ENV, "many")
    ran = []
    with pytest.raises(GraphcError, match="GRAPHC_COMPILE_JOBS"):
        with ca.compiling_ahead(variants):
            ran.append(True)
    assert ran == []


def test_a_worker_that_cannot_start_only_costs_the_speed_up(monkeypatch, tmp_path):
    """Compiling ahead is an optimisation: if no worker process can start, the build hears why
    and carries on (its warm-up compiles in process)."""
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))

    def no_processes(self):
        raise OSError("no more processes")

    monkeypatch.setattr(ca._Worker, "__init__", no_processes)
    heard, ran = [], []
    with ca.compiling_ahead(SMALL, jobs=2, progress=heard.append):
        ran.append(True)
    assert ran == [True]
    assert heard[-1] == ("compiling ahead failed (OSError: no more processes); "
                         "the warm-up compiles in process")
