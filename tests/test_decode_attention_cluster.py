"""The few-row CuTe DSL decode attention (kernels/decode_attention_cluster.py).

CPU: the shapes it refuses, and compile-only checks of its PTX (CUTE_DSL_ARCH=sm_90a, set by
conftest.py): the mma.sync products, the cached K/V loaded before the PDL wait and the trigger
after it, the exchange through distributed shared memory, registers that leave room for a
decode GEMM CTA on the same SM, the bench's precompile list. GPU (``-m gpu``): against the op's fp32 torch reference with
poisoned outputs over ragged lengths (one pass, two passes, only the new token), other query
groups, NaN in never-written cache rows, bitwise-stable relaunches, the PDL race, and the
timeline build (same bits, stamps in order).
"""

from __future__ import annotations

import itertools
import re
import tempfile

import pytest
import torch

from attention_cases import C, H, HD, KV, check_close, check_pdl_race, make_case, reference
from graphc.kernels import decode_attention_cluster as cluster
from graphc.kernels.decode_attention_cluster import ClusterAttentionConfig


# ------------------------------------------------------------------------------------------------
# CPU: validation and PTX.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, rule", [
    (dict(heads=60, kv_heads=8), "multiple of kv_heads"),
    (dict(heads=128, kv_heads=8), "at most 8 query heads"),
    (dict(head_dim=256), "head_dim=256 unsupported"),
    (dict(head_dim=64), "head_dim=64 unsupported"),
    (dict(max_context=1000), "max_context=1000 must be a positive multiple of 64"),
    (dict(rows=0), "rows=0"),
])
def test_bad_shapes_are_refused(kwargs, rule):
    args = dict(rows=1, heads=H, kv_heads=KV, head_dim=HD, max_context=C) | kwargs
    with pytest.raises(ValueError, match=rule):
        ClusterAttentionConfig(**args)


def test_op_mirror_agrees_with_the_kernel():
    """graphc.ops.attention.cluster_supports (which cannot import cutlass) accepts exactly the
    shapes check_shape accepts."""
    from graphc.ops.attention import cluster_supports

    for heads, kv_heads, head_dim, max_context in itertools.product(
            (8, 12, 60, 64, 128), (1, 2, 4, 8, 0), (64, 128, 256), (64, 1000, 2048)):
        try:
            cluster.check_shape(heads, kv_heads, head_dim, max_context)
            ok = True
        except ValueError:
            ok = False
        assert cluster_supports(heads, kv_heads, head_dim, max_context) == ok, (heads, kv_heads, head_dim, max_context)


_PTX: dict[int, str] = {}


def ptx_of(rows: int) -> str:
    if rows not in _PTX:
        with tempfile.TemporaryDirectory() as d:
            _PTX[rows] = cluster.compile_attention(rows, H, KV, HD, C, options=f"--keep-ptx --dump-dir {d}").__ptx__
    return _PTX[rows]


def test_ptx_has_the_designed_instructions():
    ptx = ptx_of(1)
    # One pass: S^T = K Q^T over head_dim (8 k-steps of 16), then O^T = V^T P^T over the 128
    # positions for p's hi and lo (2 x 8).
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == 8 + 16
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx
    # The exchange: 16-byte st.async into peers' shared memory, cluster barriers around it.
    assert "st.async" in ptx and "mbarrier::complete_tx::bytes" in ptx
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert ".local" not in ptx       # the register arrays are indexed statically: nothing spills


def test_ptx_loads_the_cache_before_the_wait_and_triggers_after_it():
    """The cached K (8 x 16 bytes per thread) and V (32 words) are loaded before
    griddepcontrol.wait, through L2; the trigger follows the wait (TRIGGER = "late"); every load
    after the wait (q, the new token, later passes) goes through L2 too."""
    ptx = ptx_of(1)
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents")
    before = ptx[:wait]
    assert len(re.findall(r"ld\.global\.cg\.v4\.u32", before)) == 8
    assert len(re.findall(r"ld\.global\.cg\.u32", before)) == 32
    # The only other global loads: the row's length and slot (inputs of the step).
    assert len(re.findall(r"ld\.global\.(?!cg)", ptx)) == 2
    assert (cluster.TRIGGER, cluster.WAITS, cluster.PROLOGUE_INPUTS) == ("late", True, ("kv", "seq_lens", "cache_slots"))


def test_registers_leave_room_for_a_decode_gemm_cta(tmp_path):
    """A CTA (256 threads, the cache in registers) leaves room on its SM for a CTA of the o_proj
    decode GEMM launched after its wait, which streams its weights beside it (160 threads of
    34 registers at one row; counted here as 64). The SM has 64 K registers."""
    from ptxas_tool import run_ptxas

    src = tmp_path / "cluster.ptx"
    src.write_text(ptx_of(1))
    report = run_ptxas(src, tmp_path / "cluster.cubin", "-v")
    used = int(re.search(r"Used (\d+) registers", report).group(1))
    assert "0 bytes spill" in report, report
    per_warp = lambda regs: -(-regs * 32 // 256) * 256      # allocated per warp in units of 256
    assert cluster.WARPS * per_warp(used) + 5 * per_warp(64) <= 64 * 1024, used


# ------------------------------------------------------------------------------------------------
# GPU.
# ------------------------------------------------------------------------------------------------
def _run(qkv, kv, lens, slots, heads=H, kv_heads=KV, use_pdl=False):
    out = torch.full((qkv.shape[0], heads * HD), float("nan"), device="cuda", dtype=torch.bfloat16)
    cluster.decode_attention(qkv, kv, lens, slots, out, heads=heads, kv_heads=kv_heads, head_dim=HD,
                             use_pdl=use_pdl)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("T, maxlen", [
    (1, 0),       # only the new token: one live split
    (1, 127),     # one split, full, ending at the new token
    (1, 128),     # the new token opens a second split
    (1, 1023),    # the benchmark's context: 8 splits, one pass each
    (1, 1024),    # split 0 takes a second pass holding only the new token
    (1, 2047),    # every split two passes
    (2, 1500),
    (3, 700),
    (8, 2000),
])
def test_against_reference(T, maxlen):
    qkv, kv, lens, slots = make_case(T, maxlen, 11 * T + maxlen)
    want, want_kv = reference(qkv, kv, lens, slots)
    got = _run(qkv, kv, lens, slots)
    assert torch.equal(kv, want_kv), "the append (or something else) changed the cache differently"
    check_close(got, want)
    # A relaunch over the same cache (the token rewritten with the same values) gives the same bits.
    assert torch.equal(_run(qkv, kv, lens, slots), got)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(16, 4), (8, 8), (24, 3), (14, 2)])
def test_other_query_groups(heads, kv_heads):
    """Groups of 4, 1, 8 and 7 query heads (padded to the mma's N = 8)."""
    qkv, kv, lens, slots = make_case(3, 1300, heads + kv_heads, heads, kv_heads)
    want, want_kv = reference(qkv, kv, lens, slots, heads, kv_heads)
    got = _run(qkv, kv, lens, slots, heads, kv_heads)
    assert torch.equal(kv, want_kv)
    check_close(got, want)


@pytest.mark.gpu
def test_never_written_rows_may_hold_nan():
    """Rows past each sequence's new token are never written by graphc, so they hold whatever
    the memory held: NaN there must not reach the output (P = 0 there, and 0 x NaN is NaN)."""
    qkv, kv, lens, slots = make_case(4, 1100, 5)
    for t in range(4):
        kv[int(slots[t]), :, :, int(lens[t]):] = float("nan")
    clean = torch.nan_to_num(kv, nan=0.0)
    want, _ = reference(qkv, clean, lens, slots)
    got = _run(qkv, kv, lens, slots)
    check_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2])
def test_pdl_race_with_slow_producer(T):
    """A slow kernel (triggers at entry, spins 20 us, then writes qkv) precedes attention on a
    PDL edge: attention loads the cache before its wait, and must still read q and the new k, v
    only after it. 100 replays, qkv and the output poisoned before each, equal the serialised
    answer bit for bit, and so does the cache."""
    import pdl_producer

    qkv_src, kv0, lens, slots = make_case(T, 1500, 99 + T)
    want, want_kv = reference(qkv_src, kv0, lens, slots)
    qkv = qkv_src.clone()
    kv = kv0.clone()
    expected = _run(qkv, kv, lens, slots)
    torch.cuda.synchronize()
    assert torch.equal(kv, want_kv)
    out = torch.empty_like(expected)

    def step():
        qkv.fill_(float("nan"))
        out.fill_(float("nan"))
        pdl_producer.slow_copy(qkv_src, qkv, 20_000)
        cluster.decode_attention(qkv, kv, lens, slots, out, heads=H, kv_heads=KV, head_dim=HD, use_pdl=True)

    check_pdl_race(step, out, expected, kv, want_kv)


@pytest.mark.gpu
def test_the_timeline_build_computes_the_same_and_stamps_in_order():
    """bench/attention_cluster_timeline.py's build: the shipped build's output bits and cache,
    and per live CTA its stamps in STAMPS order, its SM id after them."""
    qkv, kv0, lens, slots = make_case(2, 1500, 3)
    kv = kv0.clone()
    want = _run(qkv, kv, lens, slots)
    kv_timed = kv0.clone()
    got = torch.full_like(want, float("nan"))
    stamps = torch.zeros(cluster.timeline_words(2, KV), dtype=torch.int64, device="cuda")
    cluster.decode_attention(qkv, kv_timed, lens, slots, got, heads=H, kv_heads=KV, head_dim=HD,
                             use_pdl=False, timeline=stamps)
    assert torch.equal(got, want) and torch.equal(kv_timed, kv)
    per_cta = stamps.view(-1, len(cluster.STAMPS) + 1).cpu()
    live = [min(int(L) // cluster.CHUNK + 1, cluster.SPLITS) for L in lens.cpu()]
    for i, row in enumerate(per_cta.tolist()):
        if i % cluster.SPLITS < live[i // (KV * cluster.SPLITS)]:
            times = row[:len(cluster.STAMPS)]
            assert all(0 < a <= b for a, b in zip(times, times[1:])), (i, times)
            assert 0 <= row[-1] < 1024                   # %smid
    with pytest.raises(ValueError, match="timeline needs"):
        cluster.decode_attention(qkv, kv_timed, lens, slots, got, heads=H, kv_heads=KV, head_dim=HD,
                                 timeline=stamps[:10])


def test_precompile_lists_the_step_variants():
    """bench/precompile.py compiles the cluster attention of every shipped spec it supports at
    the batch sizes where it is the step's default."""
    import os
    import sys

    from graphc.ops.attention import CLUSTER_MAX_BATCH

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import precompile

    keys = precompile.cluster_attention_configs()
    assert set(range(1, CLUSTER_MAX_BATCH + 1)) <= set(precompile.CLUSTER_ATTENTION_BATCH_SIZES)
    assert cluster.compiled_variant(1, H, KV, HD, C)[1] in keys
    assert all(ClusterAttentionConfig(*k).key() == k for k in keys)
