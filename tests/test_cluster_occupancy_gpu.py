"""bench/cluster_occupancy.py on the GPU: the driver's co-resident cluster counts for a CTA
of the decode GEMM's footprint (one per SM).

    source .gpu/setup.sh && python3 -m pytest -m gpu -q tests/test_cluster_occupancy_gpu.py
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

from graphc.kernels.smem_pipeline import SMEM_BUDGET  # noqa: E402


def _tool():
    path = pathlib.Path(__file__).parent.parent / "bench" / "cluster_occupancy.py"
    spec = importlib.util.spec_from_file_location("cluster_occupancy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_gemm_cta_per_sm_and_clusters_within_the_sms():
    tool = _tool()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    probe = tool.probe_function(SMEM_BUDGET)
    # Single CTAs of the ring's footprint: exactly one per SM (the second does not fit).
    assert tool.max_active_clusters(probe, 1, SMEM_BUDGET, 160) == sms
    # A small CTA fits several times per SM: the query reads the footprint, not a constant.
    assert tool.max_active_clusters(tool.probe_function(0), 1, 0, 128) > sms
    for cluster in range(2, tool.MAX_PORTABLE_CLUSTER + 1):
        clusters = tool.max_active_clusters(probe, cluster, SMEM_BUDGET, 160)
        assert 1 <= clusters and clusters * cluster <= sms, (cluster, clusters)


def test_gemm_bench_asks_the_driver_through_the_tool(monkeypatch):
    """bench/gemm.py's per-variant residency (``resident_on_this_gpu``) is the tool's count."""
    bench_dir = pathlib.Path(__file__).parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))
    spec = importlib.util.spec_from_file_location("gemm_bench", bench_dir / "gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tool = _tool()
    for cluster in (2, 3, 4):
        assert bench.resident_on_this_gpu(cluster, SMEM_BUDGET, 160) == tool.max_active_clusters(
            tool.probe_function(SMEM_BUDGET), cluster, SMEM_BUDGET, 160)
