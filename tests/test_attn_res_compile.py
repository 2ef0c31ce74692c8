"""Compile-only tests of the AttnRes kernel (no GPU): the PTX has what DESIGN §3-§4 needs.

conftest.py sets CUTE_DSL_ARCH=sm_90a before cutlass is imported, so CuTe DSL compiles for
Hopper on a machine without a GPU. Each configuration class (cluster sizes 1, 2, 3, 4, 7;
nb 0, 1, 5, 12; the flag combinations) is compiled once and its PTX checked for the PDL
contract, the exchange machinery, L1-bypassing loads and (with ptxas on the PATH) spills.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from graphc.kernels import attn_res as ar
from graphc.ops.attn_res_math import SUPPORTED_HIDDEN_RULE, cluster_shape

import test_attn_res_gpu as gpu_cases
from ptxas_tool import run_ptxas

# (hidden, nb, has_delta, final): every cluster size, every exchange-round layout.
CONFIGS = [
    (1024, 0, True, False),
    (1024, 5, True, True),
    (2048, 1, True, False),
    (2048, 12, False, True),
    (2304, 5, False, False),
    (2304, 0, False, True),
    (4096, 12, True, False),
    (4096, 1, False, True),
    (7168, 0, True, False),
    (7168, 1, True, True),
    (7168, 5, False, False),
    (7168, 12, True, True),
]


def _rounds(nb: int, final: bool) -> int:
    return int(nb > 0) + 1 + int(final and nb > 0)


_PTX: dict = {}


def _ptx(config) -> str:
    if config not in _PTX:
        hidden, nb, has_delta, final = config
        _PTX[config] = ar.attn_res_ptx(hidden, nb, has_delta, -1, final)
    return _PTX[config]


def _body(ptx: str) -> list[str]:
    """Instruction lines of the kernel entry, comments dropped."""
    entry = ptx[ptx.index(".entry"):]
    lines = []
    for line in entry.splitlines():
        line = line.split("//")[0].strip()
        if line:
            lines.append(line)
    return lines


def _find(lines, pattern) -> list[int]:
    rx = re.compile(pattern)
    return [i for i, line in enumerate(lines) if rx.search(line)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "h{}-nb{}-delta{}-final{}".format(c[0], c[1], int(c[2]), int(c[3])))
def test_ptx_structure(config):
    hidden, nb, has_delta, final = config
    ctas, threads = cluster_shape(hidden)
    ptx = _ptx(config)
    assert re.search(r"^\.target\s+sm_90a\b", ptx, re.M), "not compiled for sm_90a"
    assert f".reqntid {threads}, 1, 1" in ptx
    lines = _body(ptx)

    # PDL: trigger once at entry, wait once, before any read of delta/prefix.
    trigger = _find(lines, r"griddepcontrol\.launch_dependents")
    wait = _find(lines, r"griddepcontrol\.wait")
    assert len(trigger) == 1 and len(wait) == 1, (trigger, wait)
    loads = _find(lines, r"\bld\.global")
    assert trigger[0] < loads[0], "launch_dependents must come before the first global load"
    w = wait[0]

    # Every global load bypasses L1 (.cg, data written during the step) or is a weight (.nc).
    cg = _find(lines, r"\bld\.global\.cg\.v4\.u32")
    nc = _find(lines, r"\bld\.global\.nc\.v4\.u32")
    assert sorted(cg + nc) == loads, [lines[i] for i in loads if i not in cg + nc]
    assert sum(i < w for i in cg) == nb, "the pre phase reads exactly the nb saved blocks"
    assert sum(i > w for i in cg) == 1 + int(has_delta), "post reads delta (and prefix) after the wait"
    assert all(i < w for i in nc) and len(nc) == 1 + 2 * int(nb > 0), "weights are prologue inputs"

    # delta (and prefix) are only prefetched into L2 before the wait, never loaded.
    prefetch = _find(lines, r"prefetch\.global\.L2")
    assert len(prefetch) == 1 + int(has_delta) and all(trigger[0] < i < w for i in prefetch)

    # Rule (3), wait before exit on every path: one exit, after the wait, and no branch before
    # the wait lands past it (the compiler's $L__ labels; the labels inside the inline-asm
    # mbarrier loops are local to their braces).
    exits = _find(lines, r"^\s*(ret|exit)\b")
    assert len(exits) == 1 and exits[0] > w, [lines[i] for i in exits]
    label_at = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\$L__\w+):", line))}
    for i in _find(lines, r"\bbra(\.uni)?\s+\$L__"):
        target = label_at[re.search(r"(\$L__\w+)", lines[i]).group(1)]
        assert not (i < w < target), f"branch at {i} jumps over the wait to {target}"

    # No global store before the wait: prefix, aux0, aux1, block slot, output after it.
    stores = _find(lines, r"\bst\.global")
    assert len(stores) == 5 and all(i > w for i in stores), [lines[i] for i in stores]

    rounds = _rounds(nb, final)
    st_async = _find(lines, r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes")
    cluster_waits = _find(lines, r"barrier\.cluster\.wait")
    if ctas > 1:
        assert len(_find(lines, r"mbarrier\.init")) == rounds
        assert len(_find(lines, r"mbarrier\.arrive\.expect_tx")) == rounds
        assert len(_find(lines, r"mbarrier\.try_wait")) == rounds
        assert _find(lines, r"fence\.mbarrier_init")
        assert _find(lines, r"mapa\.shared::cluster")
        assert len(st_async) == ctas * rounds, "one push per peer per round"
        arrive_relaxed = _find(lines, r"barrier\.cluster\.arrive\.relaxed")
        arrive = _find(lines, r"barrier\.cluster\.arrive;")
        assert len(arrive_relaxed) == 1 and len(arrive) == 1 and len(cluster_waits) == 2
        # Barriers armed, then the cluster sync, then the first remote store.
        assert _find(lines, r"mbarrier\.init")[-1] < arrive_relaxed[0] < cluster_waits[0] < st_async[0]
        # The last remote store precedes the exit barrier's arrive; the kernel ends with its wait.
        assert st_async[-1] < arrive[0] < cluster_waits[1]
        assert cluster_waits[1] > stores[-1]
    else:
        assert not st_async and not cluster_waits
        assert not _find(lines, r"mbarrier|barrier\.cluster|mapa")

    assert ".local" not in ptx, "local memory (spills or stack arrays) in the PTX"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] in (1024, 7168)],
                         ids=lambda c: "h{}-nb{}-delta{}-final{}".format(c[0], c[1], int(c[2]), int(c[3])))
def test_no_spills(config, tmp_path):
    src = tmp_path / "k.ptx"
    src.write_text(_ptx(config))
    report = run_ptxas(src, tmp_path / "k.cubin", "-v")
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "0 bytes stack frame" in report, report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    # The saved blocks wait in shared memory, not registers: <= 80 registers a thread keeps
    # 6+ CTAs of 128 threads per SM (the next kernel's CTAs need room too, with PDL).
    assert registers <= 80, report


def test_pdl_traits():
    assert ar.PROLOGUE_INPUTS == ("blocks", "key_norm", "query", "out_norm")
    assert ar.TRIGGER == "early"
    assert ar.WAITS is True


# ------------------------------------------------------------------------------------------------
# The compile cache.
# ------------------------------------------------------------------------------------------------
def test_compile_cache_in_process():
    cache = ar.compile_cache()
    first = ar.compile_attn_res(2048, 1, True, -1, False, 0)
    hits = cache.stats["memory_hits"]
    # write and aux_count are runtime arguments: same variant.
    second = ar.compile_attn_res(2048, 1, True, 2, False, 2)
    assert second is first
    assert cache.stats["memory_hits"] == hits + 1
    assert ar.compile_attn_res(2048, 1, True, -1, True, 0) is not first


_CHILD = textwrap.dedent("""
    import json
    from graphc.kernels import attn_res as ar
    fn = ar.compile_attn_res(2048, 3, True, -1, True, 1)
    assert fn is not None
    print(json.dumps(ar.compile_cache().stats))
""")


def test_disk_cache_survives_a_new_process(tmp_path):
    env = dict(os.environ, GRAPHC_CACHE_DIR=str(tmp_path), GRAPHC_KERNEL_CACHE="1", CUTE_DSL_ARCH="sm_90a")
    stats = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        stats.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert stats[0]["compiles"] == 1 and stats[0]["disk_hits"] == 0, stats
    assert stats[1]["compiles"] == 0 and stats[1]["disk_hits"] == 1, stats
    assert len(list(tmp_path.glob("attn_res-*.o"))) == 1


def test_disk_cache_key_depends_on_source_and_config():
    cache = ar.compile_cache()
    a = cache.digest((2048, 3, True, True))
    assert a == cache.digest((2048, 3, True, True))
    assert a != cache.digest((2048, 3, True, False))
    other = type(cache)("attn_res", lambda *k: None, "different source text")
    assert other.digest((2048, 3, True, True)) != a


# ------------------------------------------------------------------------------------------------
# Validation: each rule its own clear error.
# ------------------------------------------------------------------------------------------------
def _cpu_call(T=2, D=2048, NB=3, nb=1, write=-1, aux_count=0, **overrides):
    bf = torch.bfloat16
    args = dict(
        delta=torch.zeros(T, D, dtype=bf), prefix=torch.zeros(T, D, dtype=bf),
        blocks=torch.zeros(T, NB, D, dtype=bf), key_norm=torch.zeros(D, dtype=bf),
        query=torch.zeros(D, dtype=bf), out_norm=torch.zeros(D, dtype=bf),
        output=torch.zeros(T, D, dtype=bf),
    )
    aux = tuple(torch.zeros(T, D, dtype=bf) for _ in range(aux_count))
    args.update(overrides)
    return lambda: ar.attn_res(**args, nb=nb, has_delta=True, write=write, final=False,
                               eps=1e-6, out_eps=1e-6, aux=aux)


@pytest.mark.parametrize("call, message", [
    (_cpu_call(D=1000), "hidden=1000 unsupported"),
    (_cpu_call(D=8 * 130), "hidden=1040 unsupported"),
    (_cpu_call(nb=13, NB=14), r"nb=13 out of range"),
    (_cpu_call(nb=4, NB=3), r"nb=4 out of range"),
    (_cpu_call(nb=-1), r"nb=-1 out of range"),
    (_cpu_call(T=513), r"T=513 tokens out of range"),
    (_cpu_call(T=0), r"T=0 tokens out of range"),
    (_cpu_call(write=3, NB=3), r"write=3 must be -1"),
    (_cpu_call(write=-2), r"write=-2 must be -1"),
    (_cpu_call(write=0, nb=1), r"write=0 < nb=1"),
    (_cpu_call(aux_count=3), r"aux must be a tuple of at most 2"),
    (_cpu_call(delta=torch.zeros(2, 2048)), r"delta must be bfloat16"),
    (_cpu_call(query=torch.zeros(1024, dtype=torch.bfloat16)), r"query must have shape \[2048\]"),
    (_cpu_call(blocks=torch.zeros(3, 3, 2048, dtype=torch.bfloat16)), r"blocks must have shape \[2, 3, 2048\]"),
    (_cpu_call(output=torch.zeros(2048, 2, dtype=torch.bfloat16).t()), r"output must be contiguous"),
    (_cpu_call(prefix=torch.zeros(2, 2048, 1, dtype=torch.bfloat16)), r"prefix must be a 2-D"),
    (_cpu_call(), r"CUDA device"),
])
def test_validation_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_validation_names_the_hidden_rule():
    with pytest.raises(ValueError) as info:
        _cpu_call(D=1000)()
    assert SUPPORTED_HIDDEN_RULE in str(info.value)


def test_validation_misaligned():
    flat = torch.zeros(2 * 2048 + 8, dtype=torch.bfloat16)
    misaligned = flat[1:1 + 2 * 2048].view(2, 2048)  # 2-byte offset
    with pytest.raises(ValueError, match="16-byte aligned"):
        _cpu_call(output=misaligned)()


def test_compile_rejects_unsupported():
    with pytest.raises(ValueError, match="unsupported"):
        ar.compile_attn_res(1000, 1, True, -1, False, 0)
    with pytest.raises(ValueError, match="nb=13"):
        ar.compile_attn_res(7168, 13, True, -1, False, 0)
    with pytest.raises(ValueError, match="aux count"):
        ar.compile_attn_res(7168, 1, True, -1, False, 3)


# ------------------------------------------------------------------------------------------------
# The GPU tests' input generation and comparison helpers, exercised on the CPU.
# ------------------------------------------------------------------------------------------------
def test_gpu_case_helpers_on_cpu():
    case = gpu_cases.make_case(3, 2048, 5, has_delta=True, final=False, write_slot=True,
                               aux_count=2, seed=1, device="cpu")
    kw = case["kwargs"]
    assert 5 <= kw["write"] < 7 and case["blocks"].shape == (3, 7, 2048)
    assert torch.isnan(case["output"].float()).all() and torch.isnan(case["aux"][1].float()).all()
    assert torch.isnan(case["blocks"][:, 5:].float()).all() and torch.isfinite(case["blocks"][:, :5].float()).all()
    expected = gpu_cases.run_reference(case)
    # The reference wrote the slot, the aux streams and a finite output; untouched slots stay NaN.
    assert gpu_cases.bitwise_equal(expected["blocks"][:, kw["write"]], expected["prefix"]).all()
    other = 11 - kw["write"]  # the other slot of 5, 6
    assert torch.isnan(expected["blocks"][:, other].float()).all()
    stats = gpu_cases.check_case(gpu_cases.clone_case(expected), expected)
    assert stats["exact"] == 1.0

    # The softmax is far from uniform: the largest weight of a token well above 1 / (nb + 1).
    sources = torch.cat([case["blocks"][:, :5].float(), expected["prefix"].float().unsqueeze(1)], dim=1)
    w = case["key_norm"].float() * case["query"].float()
    logits = (sources * w).sum(-1) * torch.rsqrt((sources * sources).mean(-1) + 1e-6)
    assert torch.softmax(logits, -1).max(-1).values.min() > 2.0 / 6

    # A broken result fails: one NaN, a wrong prefix element, or many 1-ulp flips.
    broken = gpu_cases.clone_case(expected)
    broken["output"][1, 7] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        gpu_cases.check_case(broken, expected)
    broken = gpu_cases.clone_case(expected)
    broken["prefix"].view(torch.int16)[0, 3] += 1
    with pytest.raises(AssertionError, match="prefix"):
        gpu_cases.check_case(broken, expected)
    broken = gpu_cases.clone_case(expected)
    broken["output"].view(torch.int16)[:, ::20] += 1
    with pytest.raises(AssertionError, match="bitwise equal"):
        gpu_cases.check_case(broken, expected)
    broken = gpu_cases.clone_case(expected)
    broken["output"][0] *= 1.5
    with pytest.raises(AssertionError, match="relative error"):
        gpu_cases.check_case(broken, expected)


def test_gpu_case_helpers_nb0_final_cpu():
    case = gpu_cases.make_case(2, 2304, 0, has_delta=False, final=True, write_slot=False,
                               aux_count=0, seed=2, device="cpu")
    expected = gpu_cases.run_reference(case)
    assert gpu_cases.bitwise_equal(expected["prefix"], case["delta"]).all()  # replace
    # The GPU tests' expected output against the oracle written straight from DESIGN §2.
    from oracle import attn_res_one_token

    kw = case["kwargs"]
    for t in range(2):
        want, _ = attn_res_one_token(case["delta"][t].float(), case["prefix"][t].float(), [],
                                     case["key_norm"].float(), case["query"].float(), case["out_norm"].float(),
                                     nb=0, has_delta=False, final=True, eps=kw["eps"], out_eps=kw["out_eps"])
        gpu_cases.compare_bf16("output", expected["output"][t:t + 1], want.to(torch.bfloat16)[None])


def test_precompile_lists_every_attn_res_call_of_the_shipped_specs():
    """bench/precompile.py compiles each AttnRes variant a shipped spec's step calls (so a GPU
    machine given its cache compiles none of them)."""
    from graphc.graph import build_graph
    from graphc.kernels.attn_res import static_key
    from graphc.ops.attn_res import AttnResOp
    from graphc.spec import load_spec

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import precompile

    keys = precompile.attn_res_configs()
    graph = build_graph(load_spec(os.path.join(os.path.dirname(__file__), "..", "layer_specs",
                                               "kimi_k3_dense_8l.yaml")))
    calls = {static_key(op.hidden, op.nb, op.has_delta, op.final)
             for _, op in graph.nodes(data="op") if isinstance(op, AttnResOp)}
    assert calls and calls <= set(keys)
    assert len(keys) == len(set(keys))
