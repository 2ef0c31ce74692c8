"""Do two CUDA graphs captured on one stream share cuBLAS's scratch memory?

torch keeps one cuBLAS workspace per (handle, stream) and a captured cuBLAS call bakes in the
workspace of the stream it was captured on. So two graphs captured on the same stream (and
``torch.cuda.Stream()`` hands out one of 32 pooled streams, round-robin) share it, and if
cuBLAS chose a kernel that uses it (split-K), replaying them on two streams at once can mix
their partials. This probe captures ``torch.matmul`` at the Kimi linears' shapes twice, on one
capture stream and on two, replays the pairs on two streams at once, and prints how many
replays differ from the graph replayed alone (bit for bit), and whether cuBLAS split the
work into several kernels (graph nodes per matmul).

    source .gpu/setup.sh && python3 bench/cublas_shared_workspace.py [--rows 128,256] [--replays 200]
"""
import argparse

SHAPES = [("gate_up", 7168, 36864), ("down", 18432, 7168), ("qkv", 7168, 10240),
          ("o_proj", 8192, 7168), ("lm_head", 7168, 163840)]


def capture(torch, x, w, out, stream):
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, stream=stream):
        torch.matmul(x, w.t(), out=out)
    g.instantiate()
    return g


def graph_nodes(g):
    from cuda.bindings import runtime as rt

    err, _, count = rt.cudaGraphGetNodes(g.raw_cuda_graph(), 0)
    return int(count) if int(err) == 0 else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="128,256")
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        for name, k, n in SHAPES:
            w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
            xs = [torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
            for layout in ("one capture stream", "two capture streams"):
                outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                torch.matmul(xs[0], w.t(), out=outs[0])          # warm up cuBLAS outside capture
                torch.cuda.synchronize()
                s1 = torch.cuda.Stream()
                s2 = s1 if layout == "one capture stream" else torch.cuda.Stream()
                graphs = [capture(torch, x, w, o, s) for x, o, s in zip(xs, outs, (s1, s2))]
                nodes = graph_nodes(graphs[0])
                alone = []
                for g, o in zip(graphs, outs):
                    g.replay()
                    torch.cuda.synchronize()
                    alone.append(o.clone())
                run = [torch.cuda.Stream(), torch.cuda.Stream()]
                for s in run:
                    s.wait_stream(torch.cuda.current_stream())
                differ = [0, 0]
                for _ in range(args.replays):
                    for g, s in zip(graphs, run):
                        with torch.cuda.stream(s):
                            g.replay()
                    torch.cuda.synchronize()
                    for i in range(2):
                        differ[i] += int(not torch.equal(outs[i], alone[i]))
                print(f"{name:8s} {rows:4d} rows  {layout:20s}  nodes per matmul {nodes}  "
                      f"replays differing from alone: {differ[0]} / {differ[1]} of {args.replays}", flush=True)
                del graphs, outs
            del w, xs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
