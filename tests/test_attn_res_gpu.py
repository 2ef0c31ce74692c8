"""GPU tests of the AttnRes cluster kernel (kernels/attn_res.py) against attn_res_reference.

Every test is marked ``gpu`` (skipped without CUDA by conftest.py). Run on an H100/H200 with
``python3 -m pytest -m gpu -q tests/test_attn_res_gpu.py``.

The helpers at the top (``make_case``, ``run_reference``, ``check_case``, ``compare_bf16``,
``graph_edges``) are plain torch and also run on the CPU: tests/test_attn_res_compile.py
exercises them there.

Every case gets fresh random inputs: saved blocks, prefix and delta each scaled per token by a
random factor in [0.1, 10] (log-uniform), a query large enough that the softmax over the
sources is far from uniform; output, aux streams and the written block slot are poisoned with
NaN before the run, and the slots the kernel must neither read nor write hold NaN too.
prefix, aux and every block slot must match the reference bit for bit (they are bf16 adds or
copies); the output must match to a relative error below 1e-2 and mostly bit for bit.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from graphc.ops.attn_res_math import attn_res_reference

HIDDEN = (2048, 2304, 4096, 7168)
NBS = (0, 1, 5, 8, 12)
EPS, OUT_EPS = 1e-6, 1e-6
# (has_delta, final, write a slot?, aux count): every flag combination.
FLAGS = list(itertools.product((False, True), (False, True), (False, True), (0, 1, 2)))

OUTPUT_EXACT_FRACTION = 0.99   # output elements bitwise equal to the reference
OUTPUT_REL_ERROR = 1e-2        # ||out - ref|| / ||ref|| per row
OUTPUT_ELEMENT_RTOL = 2e-2     # per element, plus an absolute floor of 1e-3 * rms(row)


# ------------------------------------------------------------------------------------------------
# Case generation and comparison (CPU or GPU).
# ------------------------------------------------------------------------------------------------
def _scales(gen, shape, device):
    """Log-uniform factors in [0.1, 10]."""
    return 10.0 ** (torch.rand(shape, generator=gen, device=device) * 2.0 - 1.0)


def make_case(T: int, hidden: int, nb: int, *, has_delta: bool, final: bool, write_slot: bool,
              aux_count: int, seed: int, device="cuda", slots: int | None = None) -> dict:
    """Inputs and poisoned outputs of one attn_res call, plus the call's keyword arguments.

    ``slots`` (NB) defaults to nb + 2: the slots at and above nb hold NaN (never read), the
    write slot (when ``write_slot``) is one of them, chosen at random.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    NB = slots if slots is not None else nb + 2
    write = -1
    if write_slot:
        write = int(torch.randint(nb, NB, (1,), generator=gen, device=device))

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device)

    nan = float("nan")
    blocks = torch.full((T, NB, hidden), nan, dtype=torch.bfloat16, device=device)
    if nb:
        blocks[:, :nb] = (randn(T, nb, hidden) * _scales(gen, (T, nb, 1), device)).to(torch.bfloat16)
    prefix = (randn(T, hidden) * _scales(gen, (T, 1), device)).to(torch.bfloat16)
    delta = (randn(T, hidden) * _scales(gen, (T, 1), device)).to(torch.bfloat16)
    key_norm = (1.0 + 0.2 * randn(hidden)).to(torch.bfloat16)
    # logit_b = sum(v_b / rms(v_b) * W): with W ~ N(0, (4 / sqrt(D))^2) logits spread by ~4.
    query = (randn(hidden) * (4.0 / math.sqrt(hidden))).to(torch.bfloat16)
    out_norm = (1.0 + 0.2 * randn(hidden)).to(torch.bfloat16)
    output = torch.full((T, hidden), nan, dtype=torch.bfloat16, device=device)
    aux = tuple(torch.full((T, hidden), nan, dtype=torch.bfloat16, device=device) for _ in range(aux_count))
    return dict(
        delta=delta, prefix=prefix, blocks=blocks, key_norm=key_norm, query=query,
        out_norm=out_norm, output=output, aux=aux,
        kwargs=dict(nb=nb, has_delta=has_delta, write=write, final=final, eps=EPS, out_eps=OUT_EPS),
    )


def clone_case(case: dict) -> dict:
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out["aux"] = tuple(a.clone() for a in case["aux"])
    out["kwargs"] = dict(case["kwargs"])
    return out


def run_reference(case: dict) -> dict:
    """The expected state after the call: a clone of ``case`` updated by attn_res_reference."""
    ref = clone_case(case)
    ref["output"] = attn_res_reference(
        ref["delta"], ref["prefix"], ref["blocks"], ref["key_norm"], ref["query"], ref["out_norm"],
        aux=ref["aux"], **ref["kwargs"],
    )
    return ref


def run_kernel(case: dict, *, stream=None, use_pdl: bool = True) -> None:
    from graphc.kernels.attn_res import attn_res

    attn_res(case["delta"], case["prefix"], case["blocks"], case["key_norm"], case["query"],
             case["out_norm"], case["output"], aux=case["aux"], stream=stream, use_pdl=use_pdl,
             **case["kwargs"])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality of two bf16 tensors (NaN == NaN when the bits agree)."""
    return a.view(torch.int16) == b.view(torch.int16)


def assert_bitwise(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    same = bitwise_equal(actual, expected)
    if not bool(same.all()):
        bad = (~same).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{name}: {bad.shape[0]} of {same.numel()} elements differ; first at {first}: "
            f"got {actual[first].item()}, expected {expected[first].item()}"
        )


def compare_bf16(name: str, actual: torch.Tensor, expected: torch.Tensor, *,
                 exact_fraction: float = OUTPUT_EXACT_FRACTION, rel_error: float = OUTPUT_REL_ERROR,
                 element_rtol: float = OUTPUT_ELEMENT_RTOL) -> dict:
    """Check a bf16 result [..., D] against the reference; returns the statistics.

    NaN or inf in ``actual`` never passes. Per row: ||a - e|| / ||e|| < rel_error; per element:
    |a - e| <= element_rtol * |e| + 1e-3 * rms(row of e) (the floor covers elements that
    cancel to nearly zero, where fp32 summation order decides the last bits); overall at
    least ``exact_fraction`` of the elements bitwise equal.
    """
    a, e = actual.float(), expected.float()
    if not bool(torch.isfinite(e).all()):
        raise AssertionError(f"{name}: the reference itself is not finite")
    finite = torch.isfinite(a)
    if not bool(finite.all()):
        first = tuple((~finite).nonzero()[0].tolist())
        raise AssertionError(f"{name}: {int((~finite).sum())} non-finite elements, first at {first}")
    diff = (a - e).abs()
    rows_e = e.reshape(-1, e.shape[-1])
    rows_d = diff.reshape(-1, e.shape[-1])
    row_norm = rows_e.norm(dim=-1).clamp_min(1e-30)
    row_rel = (rows_d.norm(dim=-1) / row_norm).max().item()
    rms = (row_norm / math.sqrt(e.shape[-1])).reshape(*e.shape[:-1], 1)
    element_ok = diff <= element_rtol * e.abs() + 1e-3 * rms
    exact = bitwise_equal(actual, expected).float().mean().item()
    stats = dict(row_rel=row_rel, exact=exact, element_bad=int((~element_ok).sum()))
    if row_rel >= rel_error:
        raise AssertionError(f"{name}: relative error {row_rel:.3g} >= {rel_error} ({stats})")
    if stats["element_bad"]:
        first = tuple((~element_ok).nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {stats['element_bad']} elements off by more than {element_rtol} relative; first at "
            f"{first}: got {actual[first].item()}, expected {expected[first].item()} ({stats})"
        )
    if exact < exact_fraction:
        raise AssertionError(f"{name}: only {exact:.4%} of elements bitwise equal (< {exact_fraction:.0%}) ({stats})")
    return stats


def check_case(actual: dict, expected: dict) -> dict:
    """All outputs of a call: prefix, aux, every block slot (written or not) bit for bit,
    the output within tolerance."""
    assert_bitwise("prefix", actual["prefix"], expected["prefix"])
    for i, (a, e) in enumerate(zip(actual["aux"], expected["aux"])):
        assert_bitwise(f"aux[{i}]", a, e)
    assert_bitwise("blocks", actual["blocks"], expected["blocks"])
    assert_bitwise("delta (input, must be untouched)", actual["delta"], expected["delta"])
    return compare_bf16("output", actual["output"], expected["output"])


# ------------------------------------------------------------------------------------------------
# CUDA-graph edge inspection (the lead reuses this for the captured decode step).
# ------------------------------------------------------------------------------------------------
def _kernel_node_name(driver, node) -> str:
    try:
        err, params = driver.cuGraphKernelNodeGetParams(node)
        if err != driver.CUresult.CUDA_SUCCESS:
            return "?"
        for handle, getter in ((getattr(params, "kern", None), "cuKernelGetName"),
                               (getattr(params, "func", None), "cuFuncGetName")):
            if handle is None or not int(handle):
                continue
            err, name = getattr(driver, getter)(handle)
            if err == driver.CUresult.CUDA_SUCCESS and name:
                return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # names are a diagnostic nicety, never a failure
        pass
    return "?"


def graph_edges(graph: "torch.cuda.CUDAGraph") -> list[dict]:
    """Edges of a captured graph (``CUDAGraph(keep_graph=True)``) with their dependency type.

    Each edge: {"from": name, "to": name, "programmatic": bool, "type": int, "from_port": int};
    a name is the kernel's name for kernel nodes, else the node type. An edge is programmatic
    when its type is CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (what a PDL launch captures into).
    """
    from cuda.bindings import driver

    raw = graph.raw_cuda_graph()
    cu_graph = driver.CUgraph(int(raw))
    err, _, _, _, count = driver.cuGraphGetEdges(cu_graph, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, f"cuGraphGetEdges (count): {err}"
    if count == 0:
        return []
    err, src, dst, data, count = driver.cuGraphGetEdges(cu_graph, count)
    assert err == driver.CUresult.CUDA_SUCCESS, f"cuGraphGetEdges: {err}"

    def name(node):
        err, kind = driver.cuGraphNodeGetType(node)
        if err == driver.CUresult.CUDA_SUCCESS and kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            return _kernel_node_name(driver, node)
        return str(kind).split(".")[-1]

    programmatic = int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    edges = []
    for i in range(count):
        kind = int(data[i].type)
        edges.append(dict(**{"from": name(src[i]), "to": name(dst[i])}, programmatic=kind == programmatic,
                          type=kind, from_port=int(data[i].from_port)))
    return edges


# ------------------------------------------------------------------------------------------------
# Correctness against the reference.
# ------------------------------------------------------------------------------------------------
def _run_and_check(T, hidden, nb, flags, seed):
    has_delta, final, write_slot, aux_count = flags
    case = make_case(T, hidden, nb, has_delta=has_delta, final=final, write_slot=write_slot,
                     aux_count=aux_count, seed=seed)
    expected = run_reference(case)
    run_kernel(case)
    torch.cuda.synchronize()
    check_case(case, expected)


def _seed(*parts) -> int:
    """A reproducible seed per case (str hashes are salted per process; crc32 is not)."""
    return zlib.crc32(repr(parts).encode())


@pytest.mark.gpu
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"delta{int(f[0])}-final{int(f[1])}-write{int(f[2])}-aux{f[3]}")
@pytest.mark.parametrize("nb", NBS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("T", (1, 257))
def test_all_flags(T, hidden, nb, flags):
    _run_and_check(T, hidden, nb, flags, seed=_seed("all", T, hidden, nb, flags))


@pytest.mark.gpu
@pytest.mark.parametrize("nb", NBS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("T", (3, 8, 64))
def test_sampled_flags(T, hidden, nb):
    # Three flag combinations per (T, hidden, nb), rotating so that every combination is
    # covered at every T across the hidden sizes and nb values.
    index = (HIDDEN.index(hidden) * len(NBS) + NBS.index(nb)) * 3
    for k in range(3):
        flags = FLAGS[(index + k) % len(FLAGS)]
        _run_and_check(T, hidden, nb, flags, seed=_seed("sampled", T, hidden, nb, k))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", (1024, 5120, 6144, 8192))     # clusters of 1, 5, 6 and 8 CTAs
@pytest.mark.parametrize("nb", (0, 5))
def test_every_cluster_size(hidden, nb):
    """HIDDEN covers clusters of 2, 3, 4 and 7 CTAs; the other portable sizes, tiny's width
    (one CTA: no peers to exchange with) and 8 CTAs (the portable maximum) among them."""
    for k, flags in enumerate([(True, False, True, 1), (False, True, False, 0)]):
        _run_and_check(3, hidden, nb, flags, seed=_seed("cluster", hidden, nb, k))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, nb", [(2048, 1), (7168, 5)])
@pytest.mark.parametrize("final", (False, True))
def test_eps_and_out_eps_each_reach_their_norm(hidden, nb, final):
    """With EPS = OUT_EPS = 1e-6 beside data of RMS 0.1-10 a kernel that dropped or swapped
    the two would pass every other case; here both matter (sources of RMS ~0.3, eps 0.5 on the
    key norm, out_eps 0.02 on the output norm) and differ."""
    case = make_case(4, hidden, nb, has_delta=True, final=final, write_slot=False, aux_count=0,
                     seed=_seed("eps", hidden, nb, final))
    for name in ("delta", "prefix", "blocks"):
        case[name] = (case[name].float() * 0.1).to(torch.bfloat16)
    case["kwargs"].update(eps=0.5, out_eps=0.02)
    expected = run_reference(case)
    swapped = clone_case(case)
    swapped["kwargs"].update(eps=0.02, out_eps=0.5)
    assert not torch.allclose(run_reference(swapped)["output"].float(), expected["output"].float(), rtol=2e-2)
    run_kernel(case)
    torch.cuda.synchronize()
    check_case(case, expected)


@pytest.mark.gpu
def test_write_last_slot_of_many():
    """NB larger than needed (13 slots), nb = 3, write the last slot: the token stride is NB * D."""
    for T in (1, 5):
        case = make_case(T, 7168, 3, has_delta=True, final=False, write_slot=False, aux_count=1,
                         seed=_seed("last", T), slots=13)
        case["kwargs"]["write"] = 12
        case["blocks"][:, 12] = float("nan")
        expected = run_reference(case)
        run_kernel(case)
        torch.cuda.synchronize()
        check_case(case, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", (False, True))
def test_side_stream(use_pdl):
    """Launch on an explicit stream (not the current one), with and without the PDL attribute."""
    case = make_case(8, 4096, 5, has_delta=True, final=True, write_slot=True, aux_count=2,
                     seed=_seed("stream", use_pdl))
    expected = run_reference(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    run_kernel(case, stream=side, use_pdl=use_pdl)
    side.synchronize()
    check_case(case, expected)


@pytest.mark.gpu
def test_repeat_is_deterministic():
    """Same inputs twice: bitwise identical outputs (totals are summed in a fixed order)."""
    case = make_case(64, 7168, 8, has_delta=True, final=False, write_slot=True, aux_count=0, seed=7)
    first = clone_case(case)
    run_kernel(first)
    second = clone_case(case)
    run_kernel(second)
    torch.cuda.synchronize()
    for key in ("output", "prefix", "blocks"):
        assert_bitwise(key, second[key], first[key])


# ------------------------------------------------------------------------------------------------
# PDL inside a CUDA graph: the race test and the programmatic edge.
# ------------------------------------------------------------------------------------------------
def _capture_race_graph(case, delta_source, prefix_source, spin_ns, use_pdl=True):
    """One graph: restore prefix, poison delta and every output with NaN (so that each replay
    must write all of them again), a slow producer writes delta, then attn_res (PDL edge to the
    producer when use_pdl)."""
    import pdl_producer

    def step(stream):
        case["prefix"].copy_(prefix_source)
        case["delta"].fill_(float("nan"))
        case["output"].fill_(float("nan"))
        for a in case["aux"]:
            a.fill_(float("nan"))
        if case["kwargs"]["write"] >= 0:
            case["blocks"][:, case["kwargs"]["write"]] = float("nan")
        pdl_producer.slow_copy(delta_source, case["delta"], spin_ns, stream=stream)
        run_kernel(case, stream=stream, use_pdl=use_pdl)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(side)  # warm-up outside capture: module loads happen here
    side.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=side):
        step(side)
    return graph


@pytest.mark.gpu
def test_pdl_race_slow_producer():
    """attn_res launched early behind a producer that writes its delta ~20 us late: the
    kernel must wait before it reads the delta. 1000 replays, bitwise identical each time."""
    T, hidden, nb = 64, 7168, 8
    case = make_case(T, hidden, nb, has_delta=True, final=False, write_slot=True, aux_count=1, seed=11)
    delta_source, prefix_source = case["delta"].clone(), case["prefix"].clone()
    expected = run_reference(case)
    graph = _capture_race_graph(case, delta_source, prefix_source, spin_ns=20_000)
    graph.replay()
    torch.cuda.synchronize()
    check_case(case, expected)
    reference = {k: case[k].clone() for k in ("output", "prefix", "blocks")}
    reference["aux0"] = case["aux"][0].clone()
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(1000):
        graph.replay()
        for key in ("output", "prefix", "blocks"):
            mismatches += (~bitwise_equal(case[key], reference[key])).sum()
        mismatches += (~bitwise_equal(case["aux"][0], reference["aux0"])).sum()
    torch.cuda.synchronize()
    assert int(mismatches) == 0, f"{int(mismatches)} mismatching elements over 1000 replays"


@pytest.mark.gpu
def test_graph_has_programmatic_edge():
    case = make_case(8, 7168, 5, has_delta=True, final=False, write_slot=False, aux_count=0, seed=3)
    source_delta, source_prefix = case["delta"].clone(), case["prefix"].clone()

    graph = _capture_race_graph(case, source_delta, source_prefix, spin_ns=1_000, use_pdl=True)
    edges = graph_edges(graph)
    programmatic = [e for e in edges if e["programmatic"]]
    assert len(programmatic) == 1, edges
    assert "attn_res" in programmatic[0]["to"].lower(), programmatic

    graph_full = _capture_race_graph(case, source_delta, source_prefix, spin_ns=1_000, use_pdl=False)
    assert not any(e["programmatic"] for e in graph_edges(graph_full)), graph_edges(graph_full)


# ------------------------------------------------------------------------------------------------
# The disk compile cache works across processes on the GPU (a loaded object runs).
# ------------------------------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from test_attn_res_gpu import make_case, run_reference, run_kernel, check_case
    from graphc.kernels.attn_res import compile_cache
    case = make_case(5, 2304, 3, has_delta=True, final=True, write_slot=True, aux_count=1, seed=5)
    expected = run_reference(case)
    run_kernel(case)
    torch.cuda.synchronize()
    check_case(case, expected)
    print(json.dumps(compile_cache().stats))
""")


@pytest.mark.gpu
def test_disk_cache_across_processes(tmp_path):
    import json

    env = dict(os.environ, GRAPHC_CACHE_DIR=str(tmp_path), GRAPHC_KERNEL_CACHE="1")
    code = _CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    stats = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        stats.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert stats[0]["compiles"] == 1 and stats[0]["disk_hits"] == 0, stats
    assert stats[1]["compiles"] == 0 and stats[1]["disk_hits"] == 1, stats
