"""The CuTe DSL decode attention (kernels/decode_attention_tma.py).

CPU: the shapes it refuses, and compile-only checks of its PTX (CUTE_DSL_ARCH=sm_90a, set by
conftest.py). GPU (``-m gpu``): against the op's fp32 torch reference over ragged lengths and
split counts with poisoned outputs, bitwise-stable relaunches, and the PDL race (a slow kernel
writes qkv while attention streams the cache before its wait).
"""

from __future__ import annotations

import itertools
import re
import tempfile

import pytest
import torch

from attention_cases import C, H, HD, KV, check_close, check_pdl_race, make_case, reference
from graphc.kernels import decode_attention_tma as tma
from graphc.kernels.decode_attention_tma import AttentionConfig
from graphc.kernels.workspaces import SHARED


# ------------------------------------------------------------------------------------------------
# CPU: validation and PTX.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, rule", [
    (dict(heads=60, kv_heads=8), "multiple of kv_heads"),
    (dict(heads=128, kv_heads=2), "at most 32 query heads"),
    (dict(head_dim=96), "head_dim=96 unsupported"),
    (dict(head_dim=64), "head_dim=64 unsupported"),      # the consumer's column loops own 128
    (dict(max_context=1000), "max_context=1000 must be a positive multiple of 64"),
    (dict(chunk=100), "chunk=100 must be a positive multiple of 64"),
    (dict(stages=9), "stages=9"),
    (dict(head_dim=256, stages=4), "shared memory"),
])
def test_bad_shapes_are_refused(kwargs, rule):
    args = dict(rows=8, heads=H, kv_heads=KV, head_dim=HD, max_context=C, chunk=256, stages=3) | kwargs
    with pytest.raises(ValueError, match=rule):
        AttentionConfig(**args)


def test_op_mirror_agrees_with_the_kernel():
    """graphc.ops.attention.tma_supports (which cannot import cutlass) accepts exactly the
    shapes check_shape accepts."""
    from graphc.ops.attention import tma_supports

    for heads, kv_heads, head_dim, max_context in itertools.product(
            (8, 12, 60, 64, 128, 256), (1, 2, 4, 8, 0), (64, 96, 128, 256), (64, 1000, 2048)):
        try:
            tma.check_shape(heads, kv_heads, head_dim, max_context)
            ok = True
        except ValueError:
            ok = False
        assert tma_supports(heads, kv_heads, head_dim, max_context) == ok, (heads, kv_heads, head_dim, max_context)


def test_splits_cover_the_context():
    assert AttentionConfig(8, H, KV, HD, C, 256, 3).splits == 8
    assert AttentionConfig(8, H, KV, HD, C, 4096, 3).chunk == C       # never longer than the cache
    assert AttentionConfig(8, H, KV, HD, 1088, 1024, 3).splits == 2
    assert (tma.default_stages(64), tma.default_stages(32)) == (1, 3)


def test_validate_names_the_problem():
    qkv = torch.zeros(2, (H + 2 * KV) * HD, dtype=torch.bfloat16)
    kv = torch.zeros(3, 2, KV, 128, HD, dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32)
    out = torch.zeros(2, H * HD, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        tma.validate(qkv, kv, lens.long(), lens, out, H, KV, HD)
    with pytest.raises(ValueError, match="kv must be contiguous"):
        tma.validate(qkv, kv.transpose(3, 4).contiguous().transpose(3, 4), lens, lens, out, H, KV, HD)
    with pytest.raises(ValueError, match="out must be"):
        tma.validate(qkv, kv, lens, lens, out[:1], H, KV, HD)
    with pytest.raises(ValueError, match="CUDA"):
        tma.validate(qkv, kv, lens, lens, out, H, KV, HD)


_PTX: dict[tuple, str] = {}


def ptx_of(rows: int, chunk: int, stages: int = 3) -> str:
    key = (rows, chunk, stages)
    if key not in _PTX:
        with tempfile.TemporaryDirectory() as d:
            _PTX[key] = tma.compile_attention(rows, H, KV, HD, C, chunk=chunk, stages=stages,
                                              options=f"--keep-ptx --dump-dir {d}").__ptx__
    return _PTX[key]


@pytest.mark.parametrize("rows, chunk", [(1, 128), (32, 1024)])
def test_ptx_has_the_designed_instructions(rows, chunk):
    ptx = ptx_of(rows, chunk)
    # The 8 query heads are wgmma's N in both products: S^T = K Q^T (64 positions x head_dim in
    # steps of 16), then O^T = V^T P^T (hi and lo x two 64-row halves of head_dim x 64 positions).
    n8 = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16\.f32\.bf16\.bf16", ptx)
    assert len(n8) == HD // 16 + 2 * 2 * 64 // 16
    assert not re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(?!8k)", ptx)
    assert "cp.async.bulk.tensor.2d" in ptx
    # Each role triggers right after its wait (TRIGGER = "late"); the append is fenced to the
    # async proxy before its tile's TMA.
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
    triggers = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
    assert len(waits) == len(triggers) == 2 and all(w < t for w, t in zip(waits, triggers))
    assert tma.TRIGGER == "late"
    assert "fence.proxy.async.global" in ptx
    assert "ld.global.cg." in ptx         # the combine reads other CTAs' partials through L2


def test_ptx_loads_cached_tiles_before_the_wait():
    """The producer's first TMA loads (the cached tiles) precede its griddepcontrol.wait in
    program order: the cache streams while the predecessor finishes."""
    ptx = ptx_of(32, 1024)
    loads = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor", ptx)]
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
    # Two load sites (K and V, two 64-column boxes each): the prologue's, then a wait, then
    # the steady state's.
    assert len(loads) == 8
    assert any(loads[3] < w < loads[4] for w in waits)


# ------------------------------------------------------------------------------------------------
# GPU.
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(12, 4), (32, 2), (24, 1)])
def test_other_query_groups(heads, kv_heads):
    """Groups of 3 (padded to wgmma's N = 8), 16 (two blocks of 8 per thread) and 24."""
    qkv, kv, lens, slots = make_case(5, 1500, heads, heads, kv_heads)
    want, want_kv = reference(qkv, kv, lens, slots, heads, kv_heads)
    got = torch.full_like(want, float("nan"))
    tma.decode_attention(qkv, kv, lens, slots, got, heads=heads, kv_heads=kv_heads, head_dim=HD, chunk=256)
    assert torch.equal(kv, want_kv)
    check_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("T, maxlen, chunk, stages", [
    (1, 0, None, 3),          # only the new token
    (1, 63, 64, 3),           # one full tile ending at the new token
    (3, 700, None, 3),
    (8, 2000, None, 3),
    (32, 1100, None, 3),      # two splits for the long rows, one for the short
    (64, 1030, None, None),   # the 64-row default: one stage
    (5, 900, 128, 2),         # stages < tiles in flight
    (4, 1500, 2048, 4),       # one split: no combine
    (2, 1900, 64, 1),         # 30 splits, one stage
])
def test_against_reference(T, maxlen, chunk, stages):
    qkv, kv, lens, slots = make_case(T, maxlen, T * 7 + (chunk or 0))
    want, want_kv = reference(qkv, kv, lens, slots)
    got = torch.full_like(want, float("nan"))
    tma.decode_attention(qkv, kv, lens, slots, got, heads=H, kv_heads=KV, head_dim=HD, chunk=chunk,
                         stages=stages)
    assert torch.equal(kv, want_kv), "the append (or something else) changed the cache differently"
    check_close(got, want)
    # A relaunch over the same cache (the token rewritten with the same values) gives the same
    # bits, and the combine left every arrival counter at zero.
    again = torch.full_like(got, float("nan"))
    tma.decode_attention(qkv, kv, lens, slots, again, heads=H, kv_heads=KV, head_dim=HD, chunk=chunk,
                         stages=stages)
    assert torch.equal(again, got)
    assert all(int(ws[1].abs().sum()) == 0 for ws in SHARED.of("attention_tma"))


@pytest.mark.gpu
def test_never_written_rows_may_hold_nan():
    """Rows past each sequence's new token are never written by graphc, so they hold whatever
    the memory held: NaN there must not reach the output, nor the cache rows it does write."""
    qkv, kv, lens, slots = make_case(4, 1100, 5)
    for t in range(4):
        kv[int(slots[t]), :, :, int(lens[t]):] = float("nan")
    clean = torch.nan_to_num(kv, nan=0.0)
    want, want_kv = reference(qkv, clean, lens, slots)
    got = torch.full_like(want, float("nan"))
    tma.decode_attention(qkv, kv, lens, slots, got, heads=H, kv_heads=KV, head_dim=HD)
    check_close(got, want)
    for t in range(4):          # the appended token is the reference's, NaN elsewhere untouched
        s, n = int(slots[t]), int(lens[t])
        assert torch.equal(kv[s, :, :, :n + 1], want_kv[s, :, :, :n + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32])
def test_pdl_race_with_slow_producer(T):
    """A slow kernel (triggers at entry, spins 20 us, then writes qkv) precedes attention on a
    PDL edge: attention streams the cache before its wait, and must still read q and the new
    k, v only after it. 100 replays, qkv and the output poisoned before each, equal the
    serialised answer bit for bit, and so does the cache."""
    import pdl_producer

    qkv_src, kv0, lens, slots = make_case(T, 1500, 99 + T)
    want, want_kv = reference(qkv_src, kv0, lens, slots)
    qkv = torch.empty_like(qkv_src)
    kv = kv0.clone()
    out = torch.empty_like(want)
    qkv.copy_(qkv_src)
    tma.decode_attention(qkv, kv, lens, slots, out, heads=H, kv_heads=KV, head_dim=HD, use_pdl=False)
    torch.cuda.synchronize()
    expected = out.clone()
    assert torch.equal(kv, want_kv)

    def step():
        qkv.fill_(float("nan"))
        out.fill_(float("nan"))
        pdl_producer.slow_copy(qkv_src, qkv, 20_000)
        tma.decode_attention(qkv, kv, lens, slots, out, heads=H, kv_heads=KV, head_dim=HD, use_pdl=True)

    check_pdl_race(step, out, expected, kv, want_kv)


def test_precompile_lists_the_step_variants():
    """bench/precompile.py compiles the TMA attention of every shipped spec at the batch sizes
    where it is the step's default (it is the default from TMA_MIN_BATCH rows)."""
    import os
    import sys

    from graphc.ops.attention import TMA_MIN_BATCH

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import precompile

    keys = precompile.attention_configs()
    assert min(precompile.ATTENTION_BATCH_SIZES) >= TMA_MIN_BATCH
    assert (32, H, KV, HD, C, 1024, 3) in keys and (64, H, KV, HD, C, 1024, 1) in keys
    assert all(AttentionConfig(*k).key() == k for k in keys)
