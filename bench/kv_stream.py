"""The KV cache's own streaming rate: read exactly the bytes decode attention reads, with its
program grid (one program per (row, KV head), 1024 cached tokens each), and only sum them.

    python3 bench/kv_stream.py                 # rows 32 and 64, cp.async and TMA loads

A yardstick for bench/decode_attention.py: the gap between this and the attention kernel at the
same tiling is what the attention's math costs; the gap between this and the HBM floor is the
access pattern's (bench/decode_attention_notes.md, v12).
"""
import argparse


def _ints(text):
    return [int(v) for v in text.split(",")]


def _arguments():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=_ints, default=[32, 64])
    ap.add_argument("--block-n", type=_ints, default=[32, 64, 128])
    ap.add_argument("--tilings", default="4x4,3x8,6x4", help="stages x warps, comma-separated")
    ap.add_argument("--loads", default="pointers,tma")
    return ap.parse_args()


if __name__ == "__main__":
    ARGS = _arguments()     # before Triton is imported, so that --help works without it

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from graphc.bench import time_replays  # noqa: E402

KV, HD, C, CONTEXT = 8, 128, 2048, 1024


@triton.jit
def _read_pointers(kv, out, stride_slot, stride_pos, stride_kind, stride_head, L,
                   BLOCK_N: tl.constexpr, HD: tl.constexpr, KV: tl.constexpr):
    # Pointer loads, which Triton pipelines through shared memory with cp.async.
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    d = tl.arange(0, HD)
    base = kv + t * stride_slot + kvh * stride_head
    acc = tl.zeros([BLOCK_N, HD], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < L
        k = tl.load(base + pos[:, None] * stride_pos + d[None, :], mask=pm[:, None], other=0.0)
        v = tl.load(base + stride_kind + pos[:, None] * stride_pos + d[None, :], mask=pm[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out + (t * KV + kvh) * HD + d, tl.sum(acc, 0))


@triton.jit
def _read_tma(desc, out, C, L, BLOCK_N: tl.constexpr, HD: tl.constexpr, KV: tl.constexpr):
    # Tensor-descriptor (TMA) loads of the same tiles from the cache viewed as [rows, HD].
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    rk = (t * 2 * KV + kvh) * C
    rv = ((t * 2 + 1) * KV + kvh) * C
    acc = tl.zeros([BLOCK_N, HD], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        acc += desc.load([rk + n0, 0]).to(tl.float32) + desc.load([rv + n0, 0]).to(tl.float32)
    tl.store(out + (t * KV + kvh) * HD + tl.arange(0, HD), tl.sum(acc, 0))


def main(args):
    tilings = [tuple(int(v) for v in s.split("x")) for s in args.tilings.split(",")]
    print(f"{'loads':>9} {'T':>4} {'bn':>4} {'stages':>6} {'warps':>5} {'us':>8} {'floor us':>9} {'ratio':>6}")
    for T in args.rows:
        # Two caches, alternated, so consecutive calls do not hit L2.
        kvs = [torch.randn(T + 1, 2, KV, C, HD, device="cuda").to(torch.bfloat16) for _ in range(2)]
        out = torch.empty(T * KV * HD, device="cuda")
        floor = T * CONTEXT * 2 * KV * HD * 2 / 4.3e12
        for loads, bn, (stages, warps) in ((l, b, t) for l in args.loads.split(",")
                                           for b in args.block_n for t in tilings):
            if loads == "tma":
                descs = [TensorDescriptor.from_tensor(c.view(-1, HD), [bn, HD]) for c in kvs]

                def call(i):
                    _read_tma[(T, KV)](descs[i], out, C, CONTEXT, BLOCK_N=bn, HD=HD, KV=KV,
                                       num_warps=warps, num_stages=stages)
            else:
                def call(i):
                    c = kvs[i]
                    _read_pointers[(T, KV)](c, out, c.stride(0), c.stride(3), c.stride(1), c.stride(2),
                                            CONTEXT, BLOCK_N=bn, HD=HD, KV=KV, num_warps=warps,
                                            num_stages=stages)
            call(0)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(5):
                    call(0)
                    call(1)
            t = time_replays(g.replay, 3, 20) / 10
            print(f"{loads:>9} {T:4d} {bn:4d} {stages:6d} {warps:5d} {t * 1e6:8.1f} {floor * 1e6:9.1f} "
                  f"{t / floor:6.2f}", flush=True)
        del kvs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(ARGS)
