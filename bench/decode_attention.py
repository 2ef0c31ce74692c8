"""Time the split-KV decode attention kernels against their HBM floor for a few tilings.

    python3 bench/decode_attention.py        # Kimi K3 attention: 64 heads, 8 KV heads, dim 128
    python3 bench/decode_attention.py --rows 64 --chunk 256,512 --warps 4,8 --no-fp32
    python3 bench/decode_attention.py --impl tma --rows 1,8,32,64 --chunk 128,256,512,1024 --stages 2,3
    python3 bench/decode_attention.py --impl cluster,triton --rows 1,2 --chunk 128 --block-n 64 --stages 3 --no-fp32

``--impl`` picks the kernel: ``triton`` (kernels/decode_attention.py, tilings chunk x block-n x
warps x stages x pv), ``tma`` (kernels/decode_attention_tma.py, CuTe DSL, tilings chunk x
stages) and/or ``cluster`` (kernels/decode_attention_cluster.py, CuTe DSL, one tiling: 128
positions per CTA, 8 CTAs per cluster; the chunk column shows 128). The CuTe DSL kernels are
launched without a PDL predecessor here, so ``use_pdl`` changes nothing, and the cluster
kernel's cache loads before its wait overlap nothing: inside the step they overlap the qkv
GEMM's tail (bench/attention_cluster_timeline.py).

``pv`` is the p @ V product (``--pv``): ``fp32`` exact FMAs, ``bf16`` tensor cores with p rounded
to bf16, ``bf16x2`` tensor cores with p split into two bf16 terms (the default). Every
configuration is checked against the torch reference before it is timed: ``err`` is the
output's max abs error, ``differ`` the share of output elements not bitwise equal to it. Calls
cycle over enough cache copies (3x the L2 in K/V read) that none finds its K/V in L2; before
session 21 two copies were used, which at 1-8 rows left the K/V in L2 (the 32-64-row numbers
quoted in the README read more than the L2 per call and were not affected).
"""
import argparse
import itertools
import math

import torch

def _ints(text):
    return [int(v) for v in text.split(",")]


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", type=_ints, default=[1, 8, 64])
ap.add_argument("--chunk", type=_ints, default=[64, 128, 256])
ap.add_argument("--block-n", type=_ints, default=[32, 64, 128])
ap.add_argument("--warps", type=_ints, default=[4])
ap.add_argument("--stages", type=_ints, default=[2, 3, 4])
ap.add_argument("--pv", default="bf16x2", help="p @ V modes, comma-separated (bf16x2, bf16)")
ap.add_argument("--no-fp32", action="store_true", help="skip the two fp32 p @ V reference rows")
ap.add_argument("--layouts", default="head-major",
                help="KV cache storage, comma-separated: head-major ([slot, 2, head, pos, dim], "
                     "graphc's) and/or position-major ([slot, pos, 2, head, dim])")
ap.add_argument("--pad", type=_ints, default=[0],
                help="extra positions allocated per head beyond max_context (strides that are not "
                     "powers of two), comma-separated")
ap.add_argument("--impl", default="triton", help="kernels, comma-separated: triton, tma, cluster")
ap.add_argument("--max-context", type=_ints, default=[2048],
                help="cache capacities per slot, comma-separated (the grids of the split kernels cover "
                     "the capacity; every call reads a context of 1024)")
args = ap.parse_args()

# After the arguments, so that --help works on a machine without Triton or a GPU.
from graphc.bench import time_replays  # noqa: E402
from graphc.kernels.decode_attention import decode_attention  # noqa: E402
from graphc.ops.attention import DecodeAttentionOp  # noqa: E402

H, KV, HD = 64, 8, 128
L2_BYTES = torch.cuda.get_device_properties(0).L2_cache_size
IMPLS = args.impl.split(",")
CONFIGS = []
if "triton" in IMPLS:
    CONFIGS += ([] if args.no_fp32 else [("triton", 64, 32, 4, 3, "fp32"), ("triton", 256, 32, 4, 3, "fp32")]) + [
        ("triton", chunk, bn, warps, stages, pv)
        for chunk, bn, warps, stages, pv in itertools.product(args.chunk, args.block_n, args.warps, args.stages,
                                                              args.pv.split(","))
        if bn <= chunk]
if "tma" in IMPLS:
    from graphc.kernels.decode_attention_tma import decode_attention as decode_attention_tma
    CONFIGS += [("tma", chunk, 64, 5, stages, "bf16x2") for chunk, stages in itertools.product(args.chunk, args.stages)]
if "cluster" in IMPLS:
    from graphc.kernels import decode_attention_cluster
    CONFIGS += [("cluster", decode_attention_cluster.CHUNK, 16, decode_attention_cluster.WARPS, 0, "bf16x2")]
print(f"{'impl':>6} {'layout':>13} {'T':>4} {'ctx':>5} {'max':>5} {'chunk':>6} {'bn':>4} {'warps':>5} {'stages':>6} {'pv':>6} "
      f"{'us':>8} {'floor us':>9} {'ratio':>6} {'err':>8} {'differ':>7}")


def cache(T: int, layout: str, pad: int, C: int) -> torch.Tensor:
    """A random [slots, 2, KV, C, HD] cache stored head-major, or position-major (a view), with
    ``pad`` unused positions after each head's (or slot's) last."""
    if layout == "head-major":
        return torch.randn(T + 1, 2, KV, C + pad, HD, device="cuda").to(torch.bfloat16)[:, :, :, :C]
    return torch.randn(T + 1, C + pad, 2, KV, HD, device="cuda").to(torch.bfloat16)[:, :C].permute(0, 2, 3, 1, 4)


for layout, pad, C, T in itertools.product(args.layouts.split(","), args.pad, args.max_context, args.rows):
    ctx = 1024
    op = DecodeAttentionOp(name="attn", heads=H, kv_heads=KV, head_dim=HD, max_context=C)
    qkv = torch.randn(T, (H + 2 * KV) * HD, device="cuda").to(torch.bfloat16)
    # Enough cache copies that the K/V a call reads (T x 4.2 MB) are out of L2 again by the
    # time the same copy comes round: two copies of one row's 4.2 MB would both stay in L2.
    read = T * ctx * 2 * KV * HD * 2
    kvs = [cache(T, layout, pad, C) for _ in range(max(2, math.ceil(3 * L2_BYTES / read)))]
    lens = torch.full((T,), ctx - 1, device="cuda", dtype=torch.int32)
    slots = torch.arange(T, device="cuda", dtype=torch.int32)
    out = torch.empty(T, H * HD, device="cuda", dtype=torch.bfloat16)
    floor = T * ctx * 2 * KV * HD * 2 / 4.3e12
    ref_kv = kvs[0].clone()
    ref_out = torch.empty_like(out)
    op.reference({"qkv": qkv, "kv": ref_kv, "seq_lens": lens, "cache_slots": slots, "out": ref_out}, {})
    for impl, chunk, bn, warps, stages, pv in CONFIGS:
        if impl in ("tma", "cluster") and (layout != "head-major" or pad):
            continue                      # the CuTe DSL kernels take graphc's contiguous cache only

        def attend(cache_, impl=impl, chunk=chunk, bn=bn, warps=warps, stages=stages, pv=pv):
            if impl == "tma":
                decode_attention_tma(qkv, cache_, lens, slots, out, heads=H, kv_heads=KV, head_dim=HD,
                                     chunk=chunk, stages=stages)
            elif impl == "cluster":
                decode_attention_cluster.decode_attention(qkv, cache_, lens, slots, out, heads=H, kv_heads=KV,
                                                          head_dim=HD)
            else:
                decode_attention(qkv, cache_, lens, slots, out, heads=H, kv_heads=KV, head_dim=HD,
                                 chunk=chunk, block_n=bn, num_warps=warps, num_stages=stages, pv=pv)

        def run(kv=kvs):
            for cache_ in kv:
                attend(cache_)
        out.fill_(float("nan"))
        attend(kvs[0])
        err = (out.float() - ref_out.float()).abs().max().item()
        differ = (out != ref_out).float().mean().item()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(5):
                run()
        t = time_replays(g.replay, 3, 20) / (5 * len(kvs))
        print(f"{impl:>6} {layout + (f'+{pad}' if pad else ''):>13} {T:4d} {ctx:5d} {C:5d} {chunk:6d} {bn:4d} {warps:5d} {stages:6d} "
              f"{pv:>6} {t * 1e6:8.1f} {floor * 1e6:9.1f} {t / floor:6.2f} {err:8.1e} {differ:7.1%}",
              flush=True)
