"""Time the Triton split-KV decode attention against its HBM floor for a few tilings.

    python3 bench/decode_attention.py        # Kimi K3 attention: 64 heads, 8 KV heads, dim 128
"""
import itertools
import math

import torch

from graphc.bench import time_replays
from graphc.kernels.decode_attention import decode_attention

H, KV, HD, C = 64, 8, 128, 2048
print(f"{'T':>4} {'ctx':>5} {'chunk':>6} {'bn':>4} {'warps':>5} {'stages':>6} {'us':>8} {'floor us':>9} {'ratio':>6}")
for T, ctx in [(1, 1024), (8, 1024), (64, 1024)]:
    qkv = torch.randn(T, (H + 2 * KV) * HD, device="cuda").to(torch.bfloat16)
    kvs = [torch.randn(T + 1, C, 2, KV, HD, device="cuda").to(torch.bfloat16) for _ in range(2)]
    lens = torch.full((T,), ctx - 1, device="cuda", dtype=torch.int32)
    slots = torch.arange(T, device="cuda", dtype=torch.int32)
    out = torch.empty(T, H * HD, device="cuda", dtype=torch.bfloat16)
    floor = T * ctx * 2 * KV * HD * 2 / 4.3e12
    for chunk, bn, warps, stages in itertools.product([64, 128, 256], [32, 64], [4, 8], [2, 3]):
        if bn > chunk:
            continue
        def run(kv=kvs):
            for cache in kv:
                decode_attention(qkv, cache, lens, slots, out, heads=H, kv_heads=KV, head_dim=HD,
                                 chunk=chunk, block_n=bn, num_warps=warps, num_stages=stages)
        run()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(5):
                run()
        t = time_replays(g.replay, 3, 20) / 10
        print(f"{T:4d} {ctx:5d} {chunk:6d} {bn:4d} {warps:5d} {stages:6d} {t * 1e6:8.1f} {floor * 1e6:9.1f} {t / floor:6.2f}")
