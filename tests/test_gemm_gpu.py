"""Decode GEMM (kernels/gemm.py) on the GPU: numerics against fp32 torch, CUDA-graph replay
determinism, and a PDL race against a slow producer of x.

    source .gpu/setup.sh && python3 -m pytest -m gpu -q tests/test_gemm_gpu.py

Every test is marked ``gpu``; conftest.py skips them without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from graphc.kernels import gemm, gemm_stream_k, weight_blocks  # noqa: E402

# A kernel bug shows up as a hang in synchronize(); the thread method of pytest-timeout (on the
# GPU image) dumps the stacks and ends the process instead of holding the machine.
try:
    import pytest_timeout  # noqa: F401

    _HANG_GUARD = [pytest.mark.timeout(300, method="thread")]
except ImportError:
    _HANG_GUARD = []
pytestmark = [pytest.mark.gpu, *_HANG_GUARD]

from gemm_shapes import TUNING_CASES, reference_cases  # noqa: E402

def _inputs(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda", dtype=torch.float32) / k**0.5).to(torch.bfloat16)
    return x, w


def _reference(x, w, epilogue):
    y = x.float() @ w.float().T
    if epilogue == "silu_mul":
        i = y.shape[1] // 2
        gate, up = y[:, :i], y[:, i:]
        y = torch.nn.functional.silu(gate) * up
    return y


def _out(m: int, n: int, epilogue):
    n_out = n // 2 if epilogue == "silu_mul" else n
    return torch.full((m, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)


def _ulps_apart(a, b):
    """Distance of two bf16 tensors in units in the last place (sign-aware bit order)."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def _check_close(out, ref, what=""):
    """Every element within one bf16 ulp of bf16(fp32 reference) (the sums differ only in
    order), except where cancellation leaves it near zero (within max|ref| / 1024); and the
    relative error of the whole output below 1e-2. A wrong slice of the output (one k-block of
    one tile, say) fails the first check even when the norm hides it."""
    assert not torch.isnan(out).any(), f"NaN in the output {what}"
    ulps = _ulps_apart(out, ref.to(torch.bfloat16))
    near_zero = (out.float() - ref).abs() <= ref.abs().max() / 1024
    bad = ~((ulps <= 1) | near_zero)
    assert not bad.any(), (f"{int(bad.sum())} elements more than one ulp from bf16(reference), "
                           f"worst {int(ulps[bad].max())} ulps {what}")
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.3e} {what}"
    return err


@pytest.mark.parametrize("m, k, n, epilogue", list(reference_cases()))
def test_matches_fp32_reference(m, k, n, epilogue):
    x, w = _inputs(m, k, n)
    ref = _reference(x, w, epilogue)
    for use_pdl in (False, True):
        out = _out(m, n, epilogue)               # poisoned before every run
        gemm.linear(x, w, out, epilogue=epilogue, use_pdl=use_pdl)
        torch.cuda.synchronize()
        _check_close(out, ref, f"(M={m}, K={k}, N={n}, {epilogue}, use_pdl={use_pdl})")
    # Most elements agree exactly with bf16(fp32 reference) (DESIGN §6): the sums differ only
    # in order, so a mismatch is at most one bf16 ulp.
    exact = (out == ref.to(torch.bfloat16)).float().mean().item()
    assert exact > 0.9, f"only {exact:.1%} of the elements equal bf16(reference)"


@pytest.mark.parametrize("m, k, n, epilogue, tuning", TUNING_CASES)
def test_tuning_variants_match_reference(m, k, n, epilogue, tuning):
    """The benchmark's variants: K = 128 per stage (two TMA boxes per half), 256-row tiles on
    two row warpgroups, and their opposites."""
    x, w = _inputs(m, k, n)
    out = _out(m, n, epilogue)
    # w_blocked: the kernel reads W's blocks (kernels/weight_blocks.py; of w_block_rows rows),
    # given as the 4-D weight; the reference multiplies the row-major W.
    knobs = {knob: v for knob, v in tuning.items() if knob not in ("w_blocked", "w_block_rows")}
    rows = tuning.get("w_block_rows", weight_blocks.BLOCK)
    gemm.linear(x, weight_blocks.to_blocks(w, rows) if tuning.get("w_blocked") else w, out, epilogue=epilogue,
                **knobs)
    torch.cuda.synchronize()
    _check_close(out, _reference(x, w, epilogue), f"({tuning}, M={m}, K={k}, N={n})")


def test_fresh_inputs_each_call():
    """Back-to-back calls with new data: no state (counters, partials) leaks between launches."""
    m, k, n = 8, 7168, 10240
    for seed in range(4):
        x, w = _inputs(m, k, n, seed)
        out = _out(m, n, None)
        gemm.linear(x, w, out)
        torch.cuda.synchronize()
        _check_close(out, _reference(x, w, None), f"(seed {seed})")


def test_explicit_stream():
    m, k, n = 8, 1024, 5632
    x, w = _inputs(m, k, n)
    out = _out(m, n, "silu_mul")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())      # x, w, out were made on this one
    gemm.linear(x, w, out, epilogue="silu_mul", stream=side)
    side.synchronize()
    _check_close(out, _reference(x, w, "silu_mul"))


def _capture(fn, warmup: bool = True, programmatic_edges: int = 0):
    """A CUDA graph of ``fn`` (warmed up once on a side stream, as torch recommends), checked
    to hold at least ``programmatic_edges`` PDL edges: a race test whose launches had silently
    lost their PDL attribute would run serialised and pass without testing anything."""
    from graphc.graph_edges import read_edges

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    if warmup:
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    edges = read_edges(graph.raw_cuda_graph())
    assert len(edges.programmatic) >= programmatic_edges, edges
    graph.instantiate()
    torch.cuda.synchronize()
    return graph


@pytest.mark.parametrize("m, k, n, epilogue, tuning", [
    (8, 18432, 7168, None, {}),        # every tile split over ~2-4 CTAs
    (64, 7168, 36864, "silu_mul", {}),
    (1, 1024, 1024, None, {}),
    (256, 8192, 7168, None, {"wide": 0}),
    (256, 8192, 7168, None, {}),        # the whole-K tiles
    (256, 8192, 7168, None, {"cluster": 4}),                # ... in clusters of four (W and x shared)
    (200, 1024, 4096, None, {"wide": 1, "n_tile": 16}),     # ... several per CTA
    (192, 7168, 10240, None, {"fixup_split": 1}),           # the fix-up shared out: its counters reset
])
def test_graph_replay_is_bitwise_deterministic(m, k, n, epilogue, tuning):
    x, w = _inputs(m, k, n)
    out = _out(m, n, epilogue)

    def step():
        out.fill_(float("nan"))
        gemm.linear(x, w, out, epilogue=epilogue, use_pdl=True, **tuning)

    graph = _capture(step)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    _check_close(first, _reference(x, w, epilogue))
    for i in range(100):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), f"replay {i} differs"


@pytest.mark.parametrize("m, k, n, epilogue, knobs", [
    (192, 7168, 10240, None, {}),
    (96, 1024, 4096, None, {}),
    (64, 8192, 7168, None, {"publish_first": 0}),
    (128, 1024, 5632, "silu_mul", {}),
])
def test_fixup_split_gives_the_single_reducers_bits(m, k, n, epilogue, knobs):
    """The fix-up shared out by warpgroup (fixup_split) adds the same partials in the same
    order as one reducer per tile: the outputs are bitwise equal, with PDL and without."""
    x, w = _inputs(m, k, n, seed=3)
    outs = []
    for fixup in (0, 1):
        out = _out(m, n, epilogue)
        gemm.linear(x, w, out, epilogue=epilogue, use_pdl=bool(fixup), fixup_split=fixup, **knobs)
        torch.cuda.synchronize()
        outs.append(out)
    _check_close(outs[0], _reference(x, w, epilogue))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_graph_chain_of_gemms():
    """Several GEMMs of one configuration back to back in a graph with PDL edges: they share
    the workspace and counters, so this checks that PDL ordering keeps them apart."""
    m, k, n = 8, 8192, 7168
    xs = [_inputs(m, k, n, seed)[0] for seed in range(3)]
    _, w = _inputs(m, k, n, 7)
    outs = [_out(m, n, None) for _ in xs]

    def step():
        for x, out in zip(xs, outs):
            gemm.linear(x, w, out, use_pdl=True)

    graph = _capture(step, programmatic_edges=len(xs) - 1)
    for _ in range(10):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, out in zip(xs, outs):
            _check_close(out, _reference(x, w, None))


# ------------------------------------------------------------------------------------------------
# PDL race: the GEMM overlaps a slow kernel that writes x.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, k, n, epilogue", [
    (8, 7168, 10240, None),
    (64, 1024, 5632, "silu_mul"),   # small: all its weights are requested before the wait
    (256, 8192, 7168, None),        # the whole-K tiles (kernels/gemm_wide.py)
])
def test_pdl_race_with_slow_producer(m, k, n, epilogue):
    import pdl_producer   # tests/pdl_producer.py: triggers at entry, spins, then writes dst

    x_src, w = _inputs(m, k, n)
    x = torch.empty_like(x_src)
    out = _out(m, n, epilogue)

    # The non-overlapped answer: everything serialised, no PDL.
    x.copy_(x_src)
    gemm.linear(x, w, out, epilogue=epilogue, use_pdl=False)
    torch.cuda.synchronize()
    expected = out.clone()
    _check_close(expected, _reference(x_src, w, epilogue))

    def step():
        x.fill_(float("nan"))                                    # poison x
        out.fill_(float("nan"))
        pdl_producer.slow_copy(x_src, x, 20_000)                 # spins ~20 us, then writes x
        gemm.linear(x, w, out, epilogue=epilogue, use_pdl=True)  # PDL edge from the slow copy

    graph = _capture(step, programmatic_edges=1)
    for i in range(200):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), (
            f"replay {i}: the GEMM read x before its producer finished")


@pytest.mark.parametrize("m", [1, 64, 256])     # 256: the whole-K tiles, producer and consumer
def test_pdl_race_gemm_as_producer(m):
    """The GEMM as the producer: a second GEMM reads its output as x, and an AttnRes call
    reads that one's output as delta, both launched with PDL (their weight / saved-block
    prologues overlap the producer). Outputs are poisoned before every replay; 200 replays
    must equal the serialised (no PDL) run bit for bit."""
    import math

    from graphc.kernels.attn_res import attn_res

    D, nb = 7168, 2
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, D, generator=g, device="cuda").to(torch.bfloat16)
    w1 = (torch.randn(D, D, generator=g, device="cuda") / D**0.5).to(torch.bfloat16)
    w2 = (torch.randn(D, D, generator=g, device="cuda") / D**0.5).to(torch.bfloat16)
    prefix0 = (2 * torch.randn(m, D, generator=g, device="cuda")).to(torch.bfloat16)
    blocks = torch.randn(m, nb, D, generator=g, device="cuda").to(torch.bfloat16)
    key_norm = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    query = (torch.randn(D, generator=g, device="cuda") / math.sqrt(D)).to(torch.bfloat16)
    out_norm = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    y1, y2, prefix, res = (torch.empty(m, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def step(use_pdl):
        for t in (y1, y2, res):
            t.fill_(float("nan"))
        prefix.copy_(prefix0)
        gemm.linear(x, w1, y1, use_pdl=use_pdl)
        gemm.linear(y1, w2, y2, use_pdl=use_pdl)                 # reads the producer's y1
        attn_res(y2, prefix, blocks, key_norm, query, out_norm, res, nb=nb, has_delta=True,
                 write=-1, final=False, eps=1e-6, out_eps=1e-6, use_pdl=use_pdl)

    step(False)
    torch.cuda.synchronize()
    expected = [t.clone() for t in (y1, y2, res)]
    _check_close(expected[1], _reference(_reference(x, w1, None).to(torch.bfloat16), w2, None))
    graph = _capture(lambda: step(True), programmatic_edges=2)     # into the second GEMM and AttnRes
    for i in range(200):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip((y1, y2, res), expected):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                f"replay {i}: a PDL consumer read its producer's output too early")


@pytest.mark.parametrize("m, k, n, tuning", [
    (24, 1024, 1536, {}),               # stream-K: its workspace (a configuration no other test uses)
    (136, 1024, 1536, {"wide": 1}),     # the whole-K tiles: loading the kernel
])
def test_capture_without_warmup_is_refused(m, k, n, tuning):
    """The first call of a configuration allocates its workspace (stream-K) or loads its
    kernel, neither of which belongs in a capture: it says so instead."""
    x, w = _inputs(m, k, n)
    out = _out(m, n, None)
    if not tuning:      # compiled and loaded already: the refusal is the workspace's
        gemm.compile_linear(m, k, n, ctas=torch.cuda.get_device_properties(0).multi_processor_count)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside the graph|warm-up"):
        with torch.cuda.graph(graph):
            gemm.linear(x, w, out, **tuning)
    torch.cuda.synchronize()


_SPIN_CHILD = """
import time, torch
from graphc.kernels import gemm, gemm_stream_k
from graphc.kernels.workspaces import Workspaces
m, k, n = 32, 8192, 7168                      # o_proj at 32 rows: arrive first, then poll
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
own = Workspaces()
gemm.linear(x, w, out, workspaces=own)
torch.cuda.synchronize()
assert torch.allclose(out.float(), x.float() @ w.float().T, rtol=0.02, atol=0.02)
cfg = gemm.plan(m, k, n, None, torch.cuda.get_device_properties(0).multi_processor_count)
assert not cfg.publish_first and cfg.workspace_floats > 0, cfg
_, counters = gemm_stream_k._workspace(cfg, x.device, own)
counters[cfg.tiles:] = 1 << 20                # "ready" counts no contributor can bring back down
torch.cuda.synchronize()
t0 = time.perf_counter()
gemm.linear(x, w, out, workspaces=own)
try:
    torch.cuda.synchronize()
except Exception as e:
    print(f"FAILED after {time.perf_counter() - t0:.2f} s: {e}")
else:
    print("RETURNED")
"""


def test_reducer_with_a_corrupted_ready_count_traps_instead_of_hanging():
    """A split tile's last contributor polls the ``ready`` count for the others' partials. If
    that count can never come right (another kernel touched the counters), the launch fails
    with a CUDA error after REDUCER_SPIN_LIMIT_NS instead of spinning forever. In a child
    process: a trap ends its CUDA context."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SPIN_CHILD], capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert "FAILED after" in done.stdout, out[-3000:]
    seconds = float(done.stdout.split("FAILED after ")[1].split(" s")[0])
    limit = gemm_stream_k.REDUCER_SPIN_LIMIT_NS / 1e9
    assert limit <= seconds < limit + 10, out[-3000:]
