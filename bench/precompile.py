"""Compile the decode-GEMM variants that the GPU tests and benchmarks use, the AttnRes variants
of the shipped specs, and their two CuTe DSL attentions at the batch sizes where they are the default,
on a machine without a GPU, into the disk compile cache (kernels/compile_cache.py), so that the GPU machine loads
them instead of spending its time in the compiler.

    CUTE_DSL_ARCH=sm_90a GRAPHC_CACHE_DIR=.kcache python3 bench/precompile.py
    # then on the GPU machine: carry .kcache and export GRAPHC_CACHE_DIR=$PWD/.kcache

``--lean --prune`` compiles only what the GPU tests, `graphc bench` and `bench/gemm.py
--no-variants` need and deletes every other object of these kernels from the cache (older
sources included): about 9 MB, which fits beside the GPU bundle under the carry limit only
just (move the attention's objects out for a GEMM-only session).

The cache key includes the DSL's CUDA runtime build (cu12 / cu13), so compile with the same
build the GPU machine runs: the GPU bundle's (cu13) under a Python 3.12 that has numpy and
cuda-python, with PYTHONPATH=<bundle>:<bundle>/nvidia_cutlass_dsl/dsl_packages.

The list is the union of tests/test_gemm_gpu.py's cases, bench/gemm.py's rows and variants and
the linear shapes of the shipped specs at the batch sizes the step tests and `graphc bench`
capture, all for an H200's 132 SMs. A variant missing from the list is simply compiled on the
GPU machine as before; a stale object is never loaded (the cache key hashes the kernel source).
The step A/Bs of bench/step_ab.py (other batch sizes, other implementations or knobs) compile
their own list with its ``--precompile``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

H200_SMS = 132
STEP_BATCH_SIZES = (1, 2, 3, 4, 5, 8, 16)  # step tests, `graphc bench`, `graphc build` at <= 16 rows
ATTENTION_BATCH_SIZES = (2, 3, 4, 5, 8, 16, 24, 32, 64, 128)  # the TMA attention's default from 2 rows
CLUSTER_ATTENTION_BATCH_SIZES = (1, 2, 3)   # the cluster attention's default (1 row), its tests and A/Bs
STEP_TEST_BUILDS = ((128,), (160, 192))     # tests/test_step_gpu.py's 8-layer builds past 64 rows


def shipped_ops(op_type) -> list:
    """Every op of type ``op_type`` in the graphs of the shipped specs, spec by spec in name
    order."""
    import glob

    from graphc.graph import build_graph
    from graphc.spec import load_spec

    return [op for path in sorted(glob.glob(os.path.join(ROOT, "layer_specs", "*.yaml")))
            for _, op in build_graph(load_spec(path)).nodes(data="op") if isinstance(op, op_type)]


def kernel_modules() -> dict:
    """Compile-cache name -> kernel module, for the CuTe DSL kernels this tool compiles: the two
    decode GEMMs (stream-K and whole-K tiles), AttnRes and the two attentions."""
    from graphc.kernels import attn_res, decode_attention_cluster, decode_attention_tma, gemm_stream_k, gemm_wide

    return {m.compile_cache().name: m
            for m in (gemm_stream_k, gemm_wide, attn_res, decode_attention_tma, decode_attention_cluster)}


def spec_linear_shapes() -> set[tuple]:
    """(K, N, epilogue) of every linear op of the shipped specs (lm_head included)."""
    from graphc.ops.linear import LinearOp

    return {(op.k, op.n, op.epilogue) for op in shipped_ops(LinearOp)}


def gemm_configs(extra_tunings=(), extra_ms=(), lean: bool = False) -> list[tuple]:
    """Jobs (compile-cache name, key) of the decode-GEMM variants to compile, each through
    kernels/gemm.py's ``plan`` (the stream-K kernel or the whole-K tiles of gemm_wide.py).
    ``lean``: only the GPU tests' cases, the spec shapes at the step's batch sizes (up to 64
    rows) and bench/gemm.py's rows with their default tuning (no knob variants, no chain): what
    a GPU session needs for the tests, `graphc bench` and `bench/gemm.py --no-variants`, small
    enough to travel with the GPU bundle; plus, lean or not, ``extra_tunings`` at
    ``extra_ms`` on bench/gemm.py's rows (its ``--tunings`` / ``--m``)."""
    import gemm_shapes as t
    from gemm_shapes import SPEC_SHAPES

    from graphc.kernels.gemm import GemmConfig, cache_of, plan

    wanted = [(m, k, n, e, {}) for m, k, n, e in t.reference_cases()]
    wanted += list(t.TUNING_CASES)
    wanted += [(m, k, n, e, {}) for m, k, n, e in t.OTHER_CASES]
    from gemm import variant_tunings                 # bench/gemm.py

    from gemm import BIG_SHAPES as BENCH_SHAPES      # bench/gemm.py's rows

    from graphc.kernels.gemm import reads_blocks

    for _, k, n, e in BENCH_SHAPES:                  # bench/gemm.py: default + its variants
        for m in (1, 8, 16, 32, 64, 128, 200, 256) if lean else (1, 8, 16, 32, 64, 256):
            wanted.append((m, k, n, e, {}))
            if reads_blocks(m, k, n, e, H200_SMS):  # ours reads blocks there, as the step does
                wanted.append((m, k, n, e, {"w_blocked": 1}))
            if not lean:
                for _, tuning in variant_tunings(GemmConfig(m, k, n, e, H200_SMS)):
                    wanted.append((m, k, n, e, tuning))
    for k, n, e in sorted(set(SPEC_SHAPES) | spec_linear_shapes(), key=str):
        for m in STEP_BATCH_SIZES + ((24, 32, 64) if lean else ()):
            # Row-major weights, and the 64 x 64 blocks a build stores where only the
            # decode GEMM reads them (graphc/plan.py blocked_weights).
            wanted += [(m, k, n, e, {}), (m, k, n, e, {"w_blocked": 1})]
    for _, k, n, e in BENCH_SHAPES:                  # bench/gemm.py --m ... --tunings: each row
        for m in extra_ms:                           # times the default and the given tunings
            wanted += [(m, k, n, e, {})] + [(m, k, n, e, tuning) for _, tuning in extra_tunings]
    for m in () if lean else (1, 8, 64):             # bench/chain.py
        for pf in (None, 0, 16):
            wanted.append((m, 7168, 7168, None, {"l2_prefetch": pf}))
    jobs = []
    for m, k, n, e, tuning in wanted:
        try:
            cfg = plan(m, k, n, e, **{"ctas": H200_SMS, **tuning})
        except ValueError:
            continue                                 # an illegal variant: the bench skips it too
        job = (cache_of(cfg).name, cfg.key())
        if job not in jobs:
            jobs.append(job)
    return jobs


def _attention_keys(module, supports, batch_sizes) -> list[tuple]:
    """Compile-cache keys of an attention kernel module (its default tiling, ``compiled_variant``)
    for every attention op of the shipped specs it ``supports``, at ``batch_sizes``."""
    from graphc.ops.attention import DecodeAttentionOp

    keys = []
    for op in shipped_ops(DecodeAttentionOp):
        if supports(**op.params()):
            for rows in batch_sizes:
                key = module.compiled_variant(rows, **op.params())[1]
                if key not in keys:
                    keys.append(key)
    return keys


def attention_configs() -> list[tuple]:
    """Keys of the TMA attention at ATTENTION_BATCH_SIZES."""
    from graphc.kernels import decode_attention_tma
    from graphc.ops.attention import tma_supports

    return _attention_keys(decode_attention_tma, tma_supports, ATTENTION_BATCH_SIZES)


def cluster_attention_configs() -> list[tuple]:
    """Keys of the cluster attention at CLUSTER_ATTENTION_BATCH_SIZES."""
    from graphc.kernels import decode_attention_cluster
    from graphc.ops.attention import cluster_supports

    return _attention_keys(decode_attention_cluster, cluster_supports, CLUSTER_ATTENTION_BATCH_SIZES)


def attn_res_configs() -> list[tuple]:
    """Keys of every AttnRes call of the shipped specs (the kernel does not depend on the batch
    size)."""
    from graphc.kernels.attn_res import static_key
    from graphc.ops.attn_res import AttnResOp

    keys = []
    for op in shipped_ops(AttnResOp):
        try:
            key = static_key(op.hidden, op.nb, op.has_delta, op.final)
        except ValueError:
            continue                                 # a hidden size the kernel refuses
        if key not in keys:
            keys.append(key)
    return keys


def step_test_build_configs() -> list[tuple]:
    """Jobs of tests/test_step_gpu.py's 8-layer builds past 64 rows (STEP_TEST_BUILDS), every
    kernel as graphc.build schedules them, their weights' order included."""
    from graphc.compile_ahead import schedule_variants
    from graphc.graph import build_graph
    from graphc.schedule import build_schedule
    from graphc.spec import load_spec

    name_of = {module.__name__: name for name, module in kernel_modules().items()}
    graph = build_graph(load_spec(os.path.join(ROOT, "layer_specs", "kimi_k3_dense_8l.yaml")))
    return [(name_of[module], key) for sizes in STEP_TEST_BUILDS
            for module, key in schedule_variants({b: build_schedule(graph, batch=b) for b in sizes}, H200_SMS)]


def prune(jobs: list[tuple]) -> tuple[int, int]:
    """Delete the cache's objects of these kernels that no job names (older sources,
    variants not asked for); returns (files, bytes) removed. A job is (compile-cache name, key)."""
    modules = kernel_modules()
    wanted = {modules[name].compile_cache().path(key).name for name, key in jobs}
    cache_dir = modules["gemm_stream_k"].compile_cache().cache_dir
    removed = [f for f in cache_dir.glob("*.o")
               if f.name.split("-")[0] in modules and f.name not in wanted]
    size = sum(f.stat().st_size for f in removed)
    for f in removed:
        f.unlink()
    return len(removed), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tunings", default="", help="also bench/gemm.py --tunings TUNINGS ...")
    ap.add_argument("--m", default="", help="... at these batch sizes")
    ap.add_argument("--lean", action="store_true",
                    help="only what the GPU tests, graphc bench and bench/gemm.py --no-variants need")
    ap.add_argument("--prune", action="store_true",
                    help="then delete the cache's objects of these kernels that the list does not name")
    args = ap.parse_args()
    from gemm import parse_tunings                   # bench/gemm.py

    jobs = (gemm_configs(parse_tunings(args.tunings), [int(m) for m in args.m.split(",") if m], args.lean)
            + [("attn_res", k) for k in attn_res_configs()] + [("attention", k) for k in attention_configs()]
            + [("attention_cluster", k) for k in cluster_attention_configs()])
    jobs = list(dict.fromkeys(jobs + step_test_build_configs()))
    counts = {kind: sum(j[0] == kind for j in jobs)
              for kind in ("gemm_stream_k", "gemm_wide", "attn_res", "attention", "attention_cluster")}
    print(f"{counts['gemm_stream_k']} stream-K and {counts['gemm_wide']} whole-K decode-GEMM, {counts['attn_res']} "
          f"AttnRes, {counts['attention']} TMA attention and {counts['attention_cluster']} cluster "
          f"attention variants -> "
          f"{os.environ.get('GRAPHC_CACHE_DIR', '~/.cache/graphc/kernels')}")
    from graphc.compile_ahead import compile_variants

    t0 = time.perf_counter()
    modules = kernel_modules()
    compile_variants([(modules[name].__name__, key) for name, key in jobs], args.jobs,
                     lambda s: print(s, flush=True))
    print(f"done in {time.perf_counter() - t0:.0f} s")
    if args.prune:
        files, size = prune(jobs)
        print(f"pruned {files} objects ({size / 1e6:.1f} MB) the list does not name")


if __name__ == "__main__":
    main()
