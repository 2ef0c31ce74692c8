"""Decode-GEMM and attention knobs A/B inside the whole decode step, in one process.

    python3 bench/step_ab.py layer_specs/kimi_k3_dense_8l.yaml --batch-sizes 1,8,32 \\
        --variant pf8:l2_prefetch=8 --variant pf8_s6:l2_prefetch=8,stages=6
    python3 bench/step_ab.py SPEC --variant pf8_qkv:l2_prefetch=8@attn.qkv   # one role only
    python3 bench/step_ab.py SPEC --batch-sizes 1 --variant c256:attention.chunk=256
    python3 bench/step_ab.py SPEC --batch-sizes 1,2 --variant cl:impl.decode_attention=cluster
    python3 bench/step_ab.py SPEC --batch-sizes 160,192,224 --variant d224:rows.mlp.down=1-96+192+224
    # without a GPU, before a GPU session: the same arguments, their CuTe DSL kernels into the cache
    CUTE_DSL_ARCH=sm_90a GRAPHC_CACHE_DIR=.kcache python3 bench/step_ab.py SPEC ... --precompile

A micro-benchmark runs one kernel after itself; the step is what ships. So a knob of
kernels/gemm.py (``plan``'s knobs) is decided here: every variant passes its knobs to the
decode GEMMs of the step (or, with ``@role,role``, only to those roles: ``attn.qkv``,
``mlp.gate_up``, ``lm_head``; a role is a node name without its layer prefix), beside the
shipped defaults ('shipped'). ``attention.KNOB`` sets a tiling argument of the Triton attention
(kernels/decode_attention.py: chunk, block_n, num_warps, num_stages, combine_splits; the one-row
default) for
every attention call it makes, ``cluster.KNOB`` one of the cluster attention
(kernels/decode_attention_cluster.py: trigger_at). ``impl.KIND=NAME`` builds the variant with implementation NAME
for the op kind KIND (``graphc.build``'s ``implementations``; a KIND with a dot is a role, e.g.
``impl.mlp.gate_up=cute``: every node of it); ``build.block_weights=0`` builds it with
every weight row-major (``graphc.build``'s ``block_weights``; the decode GEMM reads the weights it alone
reads in 64 x 64 blocks by default), ``build.block_rows=16`` with those blocks of 16 rows
(``graphc.build``'s ``block_rows``). ``rows.ROLE=SPANS`` builds the variant as another entry of
the table that says at which captured batch sizes the decode GEMM is a linear's default
(graphc/ops/linear.py ``DECODE_GEMM_ROWS``, which is per (K, N, epilogue): every role of that
shape follows it) would, e.g. ``rows.mlp.down=1-96+192+224``: the decode GEMM at those sizes,
cuBLAS at the others, through ``graphc.build``'s per-size ``implementations``
(``cute@1-96+192+224,cublas``, graphc/choices.py), so the same build, weight order included,
that a user can make with ``--impl`` once the A/B says which spans win on their board.
Variants with only knobs share the shipped step's weights; one with ``impl.``, ``rows.`` or
``build.`` settings, which may store them in another order, gets its own copy (the same values:
the same seed). Each variant is captured once; every round replays each variant in turn (``graphc.bench.interleaved_rounds``: the
median of 100 replays per variant and round), so a board that slows down or caps its power hits every variant alike.

``--precompile`` runs no step: it compiles the CuTe DSL kernels that the shipped step's and the
variants' builds load (``kernel_variants``) into the disk compile cache, on a machine without a
GPU, so that the GPU machine, given that cache (``GRAPHC_CACHE_DIR``, carried along), only
loads them (bench/precompile.py says how to match the GPU machine's DSL build). ``--sms`` is
the GPU's SM count (default 132).

Prints per batch size each variant's median step time of every round, its best round against
the HBM floor, and the largest difference of its logits from the shipped step's: 0.0 where
a knob leaves the arithmetic alone, as the prefetch knobs do, but 0.0 was also printed where
two builds ran different kernels (down on cuBLAS against the decode GEMM at 224 rows, session
52; most likely the few bf16 roundings another summation order changes are absorbed where
the small down output joins the residual stream), so it is a check that a variant is
not broken, not a proof that it sums in the same order (the GPU tests compare every kernel with
its reference).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHIPPED = "shipped"
ATTENTION = "attention."
IMPL = "impl."
ATTENTION_KNOBS = ("chunk", "block_n", "num_warps", "num_stages", "combine_splits")   # kernels/decode_attention.py
CLUSTER = "cluster."
CLUSTER_KNOBS = ("trigger_at",)     # kernels/decode_attention_cluster.py
BUILD = "build."
BUILD_OPTIONS = ("block_weights", "block_rows")  # graphc.build's keyword arguments a variant may set
ROWS = "rows."


class Variant(NamedTuple):
    name: str
    knobs: dict                     # decode-GEMM, attention. and cluster. knobs
    roles: set | None               # the GEMM roles the knobs reach (None: all)
    implementations: dict           # impl.: op kind, role or node -> implementation
    options: dict                   # build.: graphc.build keyword arguments
    rows: dict                      # rows.: role -> the decode GEMM's default spans of batch sizes


def parse_rows(text: str) -> tuple[tuple[int, int], ...]:
    """``1-96+192`` -> ((1, 96), (192, 192)): ordered, apart, within the decode GEMM's rows."""
    from graphc.choices import parse_spans
    from graphc.kernels.gemm_contract import MAX_M

    spans = parse_spans(text)
    if spans[-1][1] > MAX_M:
        raise ValueError(f"{text!r}: the decode GEMM takes at most {MAX_M} rows")
    return spans


def parse_variant(text: str) -> Variant:
    """``name:knob=v,knob=v[@role,role]`` -> its Variant."""
    from graphc.kernels.gemm import LINEAR_KNOBS

    # (w_blocked and w_block_rows follow from how the build stores the weights: build.block_weights.)
    known = (*(k for k in LINEAR_KNOBS if k not in ("w_blocked", "w_block_rows")), *(ATTENTION + k for k in ATTENTION_KNOBS),
             *(CLUSTER + k for k in CLUSTER_KNOBS), *(BUILD + k for k in BUILD_OPTIONS))

    name, sep, rest = text.partition(":")
    if not sep or not name or name == SHIPPED:
        raise SystemExit(f"--variant {text!r}: expected NAME:KNOB=V[,KNOB=V][@ROLE,ROLE] "
                         f"(NAME not {SHIPPED!r})")
    knob_text, _, role_text = rest.partition("@")
    knobs, implementations, options, rows = {}, {}, {}, {}
    for item in filter(None, knob_text.split(",")):
        knob, eq, value = item.partition("=")
        if eq and knob.startswith(IMPL) and value:
            implementations[knob[len(IMPL):]] = value
            continue
        if eq and knob.startswith(ROWS) and len(knob) > len(ROWS):
            try:
                rows[knob[len(ROWS):]] = parse_rows(value)
            except ValueError as e:
                raise SystemExit(f"--variant {text!r}: {item!r}: {e}") from None
            continue
        if not eq or knob not in known or not value.isdigit():
            raise SystemExit(f"--variant {text!r}: {item!r} is not KNOB=V with KNOB one of {', '.join(known)} "
                             f"and V an integer (or {IMPL}KIND=NAME, {ROWS}ROLE=SPANS)")
        if knob.startswith(BUILD):
            option = knob[len(BUILD):]
            options[option] = bool(int(value)) if option == "block_weights" else int(value)
        else:
            knobs[knob] = int(value)
    roles = set(filter(None, role_text.split(","))) or None
    return Variant(name, knobs, roles, implementations, options, rows)


def by_node(implementations: dict, graph) -> dict:
    """``graphc.build``'s ``implementations`` for a variant's ``impl.`` settings: an op kind as it
    is, a node name (``L03.mlp.down``) as it is, a role (a name with a dot, e.g. ``mlp.gate_up``)
    as every node of that role."""
    from step_breakdown import role

    out = {}
    for key, impl in implementations.items():
        if "." not in key or key in graph.nodes:
            out[key] = impl
            continue
        nodes = [node for node in graph.nodes if role(node) == key]
        if not nodes:
            raise SystemExit(f"impl.{key}: no node of role {key!r} in this spec")
        out.update(dict.fromkeys(nodes, impl))
    return out


def variant_implementations(variant: Variant, graph) -> dict | None:
    """``graphc.build``'s ``implementations`` for a variant: its ``impl.`` settings
    (``by_node``), and for each ``rows.ROLE=SPANS`` every linear of that role's shape (K, N,
    epilogue: the key of graphc/ops/linear.py's ``DECODE_GEMM_ROWS``, so the build a changed
    table would ship) on the decode GEMM at those sizes and on cuBLAS at every other
    (graphc/choices.py). A variant that sets both for one node is refused: which should win?"""
    from graphc.choices import Term
    from graphc.ops.linear import LinearOp
    from step_breakdown import role

    chosen = by_node(variant.implementations, graph)
    linears = {node: op for node, op in graph.nodes(data="op") if isinstance(op, LinearOp)}
    for key, spans in variant.rows.items():
        shapes = {(op.k, op.n, op.epilogue) for node, op in linears.items() if role(node) == key}
        if not shapes:
            raise SystemExit(f"rows.{key}: no linear of role {key!r} in this spec")
        on_decode_gemm = Term("cute", spans)
        for node, op in linears.items():
            if (op.k, op.n, op.epilogue) not in shapes:
                continue
            if node in chosen or "linear" in chosen:
                raise SystemExit(f"variant {variant.name}: rows.{key} and an impl. setting both decide "
                                 f"{node}; give one of them")
            chosen[node] = f"{on_decode_gemm},cublas"
    return chosen or None


@contextlib.contextmanager
def step_knobs(knobs: dict, roles: set | None, role_of_weight: dict):
    """While open, the decode GEMM (``graphc.kernels.gemm.linear``) gets the GEMM knobs of
    ``knobs`` for the weights of ``roles`` (None: all), and the Triton attention
    (``graphc.kernels.decode_attention.decode_attention``) the ``attention.`` ones. graphc's
    ops import both at each launch, so a build made meanwhile captures the variant."""
    import importlib

    gemm_knobs = {k: v for k, v in knobs.items() if not k.startswith((ATTENTION, CLUSTER))}
    attention_knobs = {k[len(ATTENTION):]: v for k, v in knobs.items() if k.startswith(ATTENTION)}
    cluster_knobs = {k[len(CLUSTER):]: v for k, v in knobs.items() if k.startswith(CLUSTER)}
    patched = []

    def patch(module_name: str, name: str, applies):
        module = importlib.import_module(module_name)
        shipped = getattr(module, name)

        def launch(*args, **kwargs):
            extra = applies(*args)
            shipped(*args, **({**extra, **kwargs} if extra else kwargs))

        setattr(module, name, launch)
        patched.append((module, name, shipped))

    if gemm_knobs:
        patch("graphc.kernels.gemm", "linear", lambda x, weight, out: gemm_knobs if (
            roles is None or role_of_weight.get(weight.data_ptr()) in roles) else None)
    if attention_knobs:
        patch("graphc.kernels.decode_attention", "decode_attention", lambda *args: attention_knobs)
    if cluster_knobs:
        patch("graphc.kernels.decode_attention_cluster", "decode_attention", lambda *args: cluster_knobs)
    try:
        yield
    finally:
        for module, name, shipped in patched:
            setattr(module, name, shipped)


def kernel_variants(graph, batch_sizes, variants, sms: int) -> list:
    """(kernel module, compile-cache key) of every CuTe DSL kernel that the builds of the shipped
    step and of ``variants`` at ``batch_sizes`` load on ``sms`` SMs: their schedules' kernels
    (graphc/compile_ahead.py, with each variant's ``impl.``, ``rows.`` and ``build.`` settings),
    and the decode GEMMs as a variant's knobs change them for its roles. (The attention's knobs
    are left out: the Triton attention is not cached here, the cluster attention's trigger is
    compiled on first use.)"""
    from graphc.compile_ahead import schedule_variants
    from graphc.kernels import gemm, weight_blocks
    from graphc.plan import blocked_weights
    from graphc.schedule import build_schedule
    from step_breakdown import role

    found: dict = {}
    for variant in (Variant(SHIPPED, {}, None, {}, {}, {}), *variants):
        block_rows = variant.options.get("block_rows", weight_blocks.BLOCK)
        implementations = variant_implementations(variant, graph)
        schedules = {b: build_schedule(graph, implementations, batch=b) for b in batch_sizes}
        blocked = set() if variant.options.get("block_weights") is False else blocked_weights(schedules, sms, block_rows)
        found.update(dict.fromkeys(schedule_variants(schedules, sms, blocked, block_rows)))
        knobs = {k: v for k, v in variant.knobs.items() if not k.startswith((ATTENTION, CLUSTER))}
        for b, schedule in schedules.items() if knobs else ():
            for k in schedule.kernels:
                if k.op.kind == "linear" and k.impl == "cute" and (variant.roles is None or role(k.node) in variant.roles):
                    in_blocks = k.op.weight_shapes()["weight"][0] in blocked
                    found[gemm.compiled_variant(b, k.op.k, k.op.n, k.op.epilogue, sms,
                                                w_block_rows=block_rows if in_blocks else 0, **knobs)] = None
    return list(found)


def precompile(graph, batch_sizes, variants, sms: int) -> int:
    """``--precompile``: compile ``kernel_variants`` into the disk cache (no GPU needed)."""
    from graphc.compile_ahead import compile_variants, default_jobs, not_on_disk

    wanted = kernel_variants(graph, batch_sizes, variants, sms)
    todo = not_on_disk(wanted)
    print(f"{len(wanted)} CuTe DSL kernels for the shipped step and {len(variants)} variant(s) on {sms} SMs, "
          f"{len(todo)} not yet in the cache")
    compile_variants(todo, default_jobs(), print)
    missing = not_on_disk(wanted)
    print(f"{len(wanted) - len(missing)} of {len(wanted)} in the cache")
    return 1 if missing else 0


def main(argv=None) -> int:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # a compile here, without a GPU, is for Hopper
    import torch

    from graphc.bench import _inputs, device_floor_bandwidth, interleaved_rounds
    from graphc.floor import step_floor_s
    from graphc.graph import build_graph, weight_shapes
    from graphc.runtime import build
    from graphc.spec import load_spec
    from graphc.weights import Weights
    from step_breakdown import role

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KNOB=V[,KNOB=V][@ROLE,ROLE]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--precompile", action="store_true",
                    help="compile the builds' CuTe DSL kernels into the disk cache and stop (no GPU needed)")
    ap.add_argument("--sms", type=int, default=132, help="with --precompile: the GPU's SM count")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if not variants:
        raise SystemExit("give at least one --variant")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    spec = load_spec(args.spec)
    graph = build_graph(spec)
    if args.precompile:
        return precompile(graph, batch_sizes, variants, args.sms)
    shapes = weight_shapes(graph)
    weights = Weights.random(shapes, seed=0, device="cuda")
    role_of_weight = {t.data_ptr(): role(name.rsplit(".", 1)[0]) for name, t in weights.tensors.items()}
    steps = {SHIPPED: build(spec, batch_sizes, weights=weights, progress=None)}
    for variant in variants:
        name, knobs, roles, implementations, options, rows = variant
        own = Weights.random(shapes, seed=0, device="cuda") if implementations or options or rows else weights
        with step_knobs(knobs, roles, role_of_weight):
            steps[name] = build(spec, batch_sizes, weights=own, progress=None,
                                implementations=variant_implementations(variant, graph), **options)

    floor_rates = device_floor_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: {args.spec}, {args.rounds} rounds of the median of "
          f"100 replays; variants: " + "; ".join(a for a in args.variant))
    for b in batch_sizes:
        tokens, seq_lens = _inputs(steps[SHIPPED], b, args.context)
        logits = {name: step(tokens, seq_lens).float().clone() for name, step in steps.items()}
        passes = interleaved_rounds({name: step.graphs[b].replay for name, step in steps.items()},
                                    args.rounds, per_pass=100)
        times = {name: [t * 1e6 for t in p] for name, p in passes.items()}
        floor_us = step_floor_s(steps[SHIPPED].schedule, b, args.context, floor_rates["hbm_bytes_per_s"],
                                floor_rates["flops_per_s"]) * 1e6
        print(f"batch {b} (floor {floor_us:.1f} us):")
        for name in steps:
            diff = (logits[name] - logits[SHIPPED]).abs().max().item()
            rounds = " ".join(f"{t:.1f}" for t in times[name])
            print(f"  {name:<14} {rounds}   best {min(times[name]) / floor_us:.3f}x floor   "
                  f"max |logits - shipped| {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
