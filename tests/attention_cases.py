"""Shared by the GPU tests of the two CuTe DSL decode attentions: random cases (ragged lengths,
shuffled cache slots), the op's fp32 torch reference, and the closeness rule."""

from __future__ import annotations

import torch

H, KV, HD, C = 64, 8, 128, 2048


def make_case(T: int, maxlen: int, seed: int, heads: int = H, kv_heads: int = KV):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * HD, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(T + 1, 2, kv_heads, C, HD, generator=gen, device="cuda").to(torch.bfloat16)
    lens = torch.randint(0, maxlen + 1, (T,), generator=gen, device="cuda", dtype=torch.int32)
    lens[0] = maxlen              # the longest row is always there: the case's split count holds
    slots = torch.randperm(T + 1, device="cuda")[:T].to(torch.int32)
    return qkv, kv, lens, slots


def reference(qkv, kv, lens, slots, heads: int = H, kv_heads: int = KV):
    """(output, cache after the append) of graphc.ops.attention's torch reference."""
    from graphc.ops.attention import DecodeAttentionOp

    op = DecodeAttentionOp(name="attn", heads=heads, kv_heads=kv_heads, head_dim=HD, max_context=C)
    want_kv = kv.clone()
    want = torch.full((qkv.shape[0], heads * HD), float("nan"), device="cuda", dtype=torch.bfloat16)
    op.reference({"qkv": qkv, "kv": want_kv, "seq_lens": lens, "cache_slots": slots, "out": want}, {})
    return want, want_kv


def ulps_apart(a, b):
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def check_close(got, want):
    # As the Triton kernel: p = hi + lo carries 16 bits, so only the fp32 summation order
    # differs from the reference: within one bf16 ulp except near zero.
    assert not torch.isnan(got).any()
    ulps = ulps_apart(got, want)
    near_zero = (got.float() - want.float()).abs() <= want.float().abs().max() / 1024
    assert bool(((ulps <= 1) | near_zero).all()), int(ulps.max())
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 2e-3, rel


def check_pdl_race(step, out, expected, kv, want_kv, replays: int = 100):
    """Capture ``step`` (a slow producer writing qkv, then attention on a PDL edge; it poisons
    qkv and ``out`` first) in a CUDA graph and replay it: every replay must give ``expected``
    bit for bit and leave the cache equal to ``want_kv``."""
    from graphc.graph_edges import read_edges

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    # A launch that lost its PDL attribute would run serialised and pass without testing anything.
    assert read_edges(graph.raw_cuda_graph()).programmatic, "no PDL edge into the attention"
    graph.instantiate()
    for i in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), (
            f"replay {i}: attention read qkv before its producer finished")
        assert torch.equal(kv, want_kv), f"replay {i}: the cache got a poisoned append"
