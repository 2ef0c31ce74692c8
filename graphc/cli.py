"""The ``graphc`` command line: build, inspect, viz, run, compile, bench.

Every user mistake (a bad spec, an unsupported shape, a batch no graph holds) prints one line
naming the problem and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .errors import GraphcError, did_you_mean      # SpecError too (its subclass): the spec module loads torch
from .files import check_writable, staging_name

BUILD_OUTPUTS = ("graph.json", "schedule.txt", "graph.svg", "schedule.html")
SMALL_MODEL_BYTES = 512 << 20     # reference step runs by default below this weight size
MAX_BATCH = 512                   # graphc.runtime.MAX_BATCH (importing it here would load torch)
DEFAULT_CONTEXT = 1024            # tokens per sequence for the floor and the benchmark
H200_MEMORY_BYTES = 141e9         # NVIDIA's figure; a GPU build checks the GPU's real free memory
MAX_SEED = 2**63 - 1              # graphc.runtime.MAX_SEED
SPEC_HELP = "layer spec YAML file, e.g. layer_specs/tiny.yaml (docs/spec.md)"


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({_integer(x) for x in text.split(",")})
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from None
    bad = [b for b in sizes if not 1 <= b <= MAX_BATCH]
    if bad:
        raise argparse.ArgumentTypeError(f"batch sizes must be between 1 and {MAX_BATCH}, found {bad[0]} in {text!r}")
    return sizes


def _integer(text: str) -> int:
    try:
        if not text.isascii():      # int() also reads other scripts' digits: '１６' would be 16
            raise ValueError
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None


def _seed(text: str) -> int:
    n = _integer(text)
    if not 0 <= n <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is an integer in 0..2**63-1, found {n}")
    return n


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, found an empty one")
    return text


def _batch(text: str) -> int:
    b = _integer(text)
    if not 1 <= b <= MAX_BATCH:
        raise argparse.ArgumentTypeError(f"a batch size is between 1 and {MAX_BATCH}, found {b}")
    return b


def _positive(text: str) -> int:
    n = _integer(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {n}")
    return n


def _impl(text: str) -> tuple[str, str]:
    """``--impl KEY=VALUE``: an op kind or node and its implementation choice (graphc/choices.py),
    its syntax checked here; whether KEY and the names exist, once the spec is read."""
    from .choices import parse_choice

    key, eq, value = text.partition("=")
    if not (eq and key and value):
        raise argparse.ArgumentTypeError(f"expected KIND=NAME or NODE=NAME (e.g. linear=cublas, "
                                         f"L03.attn.qkv=cute@1-192), found {text!r}")
    try:
        parse_choice(key, value, MAX_BATCH)
    except GraphcError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return key, value


def _implementations(args) -> dict[str, str] | None:
    """The ``--impl`` options as ``graphc.build``'s ``implementations``; a key given twice is
    refused rather than one of them silently winning."""
    pairs = getattr(args, "impl", None) or []
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise GraphcError(f"--impl {twice[0]}=... is given more than once: give one value "
                          f"(terms separated by commas, e.g. {twice[0]}=cute@1-160,cublas)")
    return dict(pairs) or None


def _front(spec_path: str, implementations=None, use_pdl=True, batch: int | None = 1):
    """spec -> graph -> schedule at one batch size (implementations can differ per batch
    size), with timings."""
    from .graph import build_graph
    from .schedule import build_schedule
    from .spec import load_spec

    t0 = time.perf_counter()
    spec = load_spec(spec_path)
    graph = build_graph(spec)
    t1 = time.perf_counter()
    schedule = build_schedule(graph, implementations, use_pdl, batch=batch)
    _progress(f"graph {graph.number_of_nodes()} nodes in {t1 - t0:.2f} s; schedule verified in "
              f"{time.perf_counter() - t1:.2f} s")
    return spec, graph, schedule


def _context(spec, requested: int | None) -> int:
    """Tokens per sequence for the HBM floor: ``requested`` (--context), which the model must
    hold, or 1024 (at most the model's max_context)."""
    if requested is None:
        return min(DEFAULT_CONTEXT, spec.model.max_context)
    if requested > spec.model.max_context:
        raise GraphcError(f"--context {requested} is more than {spec.path} holds "
                          f"(model.max_context {spec.model.max_context})")
    return requested


def _writable_folder(path: Path, what: str) -> list[Path]:
    """Create the folder ``path`` (and its parents) for ``what``, or refuse naming why; a
    refusal creates nothing. Returns the folders it created, deepest first, for
    ``_write_all`` to remove again if the outputs cannot be written."""
    check_writable(path, what, folder=True)
    made = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        made.append(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_folders(made)
        raise GraphcError(f"{what} {path}: cannot create it ({e.strerror})") from None
    return made


def _remove_folders(made: list[Path]) -> None:
    """Remove folders a command created (deepest first), each only while it is empty."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def _writable_file(path: Path, what: str) -> None:
    """Check, before any work and without creating anything, that ``path`` can be written as a
    file for ``what`` (an existing file overwritten, or a new one in folders that exist or can
    be created), or refuse naming why."""
    check_writable(path, what, folder=False)


def _refuse_overwriting_inputs(path: Path, what: str, others: dict) -> None:
    """Refuse an output path that is also one of ``others`` (path -> what it is; None skipped):
    `--write-weight-names layer_specs/x.yaml` would replace the spec with a list of names."""
    target = path.resolve()
    for other, name in others.items():
        if other is not None and Path(other).resolve() == target:
            raise GraphcError(f"{what} {path}: that is {name}; writing there would replace it")


def _write_all(files: dict[Path, str], made: list[Path] = ()) -> None:
    """Write every file under a temporary name beside it, then rename each into place: a
    failure on the way (a full disk, a folder that refuses) leaves no truncated output,
    replaces nothing and removes the folders ``made`` for the outputs (``_writable_folder``).
    A file that is replaced keeps its permission bits (a group-readable schedule stays so)."""
    staged, done = [], False
    try:
        for path, text in files.items():
            tmp = staging_name(path)
            staged.append(tmp)
            try:
                tmp.write_text(text, encoding="utf-8")
                if path.is_file():
                    shutil.copymode(path, tmp)
            except OSError as e:
                raise GraphcError(f"{path}: cannot write it ({e.strerror or e}); no output was "
                                  f"written or replaced") from None
        for path in files:          # checked up front too; a rename over a folder would fail half-way
            if path.exists() and not path.is_file():
                raise GraphcError(f"{path}: not a regular file; no output was written or replaced")
        for tmp, path in zip(staged, files):
            os.replace(tmp, path)
        done = True
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        if not done:            # the staged files are gone, so the folders made for them are empty
            _remove_folders(made)


def _shown_tokens(tokens: list[int]) -> str:
    """Next tokens for a progress line: the first 8 of a batch."""
    return f"{tokens[:8]}" + (f" ... ({len(tokens)} rows)" if len(tokens) > 8 else "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def cmd_build(args) -> int:
    from .floor import H200_BF16_FLOPS_PER_S, H200_HBM_BYTES_PER_S, step_floor_s
    from .graph import weight_bytes, weight_shapes
    from .plan import DEVICE_HEADROOM_BYTES, memory_layout
    from .runtime import check_memory, gpu_implementations
    from .weights import check_finite_weights, check_weights
    from .viz import dataflow_svg, schedule_html

    from .schedule import build_schedule, not_installed

    import torch

    sizes = args.batch_sizes
    capture = torch.cuda.is_available() and not args.no_capture
    # The files describe what runs: on a GPU that is to capture, its implementations (portable
    # ones where it is not an H100/H200), else the Hopper schedule graphc is built for, made of
    # the kernels installed here (the summary names those that are not: not_installed).
    impls = _implementations(args)
    spec, graph, schedule = _front(args.spec, impls, use_pdl=not args.no_pdl, batch=sizes[0])
    # The choices graphc.build makes on this GPU (the caller's; portable ones where it is not
    # an H100/H200).
    chosen = gpu_implementations(graph, torch.device("cuda", torch.cuda.current_device()), impls,
                                 batch_sizes=sizes) if capture else impls
    if chosen != (impls or {}):
        schedule = build_schedule(graph, chosen, not args.no_pdl, batch=sizes[0])
    schedules = {b: schedule if b == sizes[0] else build_schedule(graph, chosen, not args.no_pdl, batch=b)
                 for b in sizes}
    # Everything the outputs and the later steps need is checked before the first file is
    # written: a refused build leaves nothing half-written.
    ctx = _context(spec, args.context)
    if args.weights:
        check_weights(args.weights, weight_shapes(graph))
    wbytes = weight_bytes(graph)
    reference = args.reference or (args.reference is None and wbytes <= SMALL_MODEL_BYTES)
    no_reference_why = None       # why a reference step nobody asked for is not run, said below
    if args.reference is None and not reference:
        no_reference_why = (f"the weights are {wbytes / 1e9:.2f} GB, above the "
                            f"{SMALL_MODEL_BYTES / 2**20:.0f} MiB a build steps through by default "
                            f"(--reference runs one)")
    if reference:     # the CPU reference step must fit in host memory
        try:
            check_memory(schedule, sizes[0], torch.device("cpu"), args.weights)
        except GraphcError as e:
            if args.reference:       # asked for: the refusal stands
                raise
            # The default must not cost the build: small weights can still come with a KV
            # cache (model.max_context) the host cannot hold.
            reference, no_reference_why = False, f"it does not fit in host memory: {e}"
    if reference and args.weights:    # it reads every value, so check them now (a small model: cheap)
        check_finite_weights(args.weights, weight_shapes(graph))
    out = Path(args.out or Path("out") / Path(args.spec).stem)
    inputs = {args.spec: "the spec", args.weights: "the --weights file"}
    check_writable(out, "--out", folder=True)
    for name in BUILD_OUTPUTS:      # each output replaces only a file, and never an input
        _writable_file(out / name, "--out")
        _refuse_overwriting_inputs(out / name, "--out", inputs)
    names_file = Path(args.write_weight_names) if args.write_weight_names else None
    if names_file:       # written where it says: into a folder that exists, or the --out folder
        if not names_file.parent.is_dir() and names_file.parent.resolve() != out.resolve():
            raise GraphcError(f"--write-weight-names {names_file}: no folder {names_file.parent}")
        _writable_file(names_file, "--write-weight-names")
        _refuse_overwriting_inputs(names_file, "--write-weight-names",
                                   {**inputs, out: "the --out folder",
                                    **{out / name: "an output of this build" for name in BUILD_OUTPUTS}})
    made = _writable_folder(out, "--out")
    shapes = weight_shapes(graph)
    outputs = {out / "graph.json": json.dumps(graph_json(graph), indent=1),
               out / "schedule.txt": schedules_text(schedules),
               out / "graph.svg": dataflow_svg(graph),
               out / "schedule.html": schedule_html(schedule)}
    if names_file:
        outputs[names_file] = "".join(f"{name}\t{list(shape)}\n" for name, shape in shapes.items())
    _write_all(outputs, made)
    if names_file:
        _progress(f"wrote {len(shapes)} weight names to {names_file}")

    _say(f"{spec.model.name}: {_plural(len(spec.layers), 'layer')}, residual {spec.residual.kind}"
         + (f" (block size {spec.residual.block_size}, {_plural(spec.num_blocks(), 'block')})"
            if spec.residual.kind == "attn_res" else ""))
    _say(f"  kernels {len(schedule.kernels)}, weights {wbytes / 1e9:.2f} GB")
    layout = memory_layout(schedule, sizes[-1])
    gpu_bytes = layout.total_bytes + DEVICE_HEADROOM_BYTES
    _say(f"  GPU memory at batch sizes up to {sizes[-1]}: {gpu_bytes / 1e9:.2f} GB ({layout.describe()}, "
         f"workspace {DEVICE_HEADROOM_BYTES / 1e9:.1f} GB)"
         + (f"; more than an H200's {H200_MEMORY_BYTES / 1e9:.0f} GB, so a GPU build there refuses it"
            if not capture and gpu_bytes > H200_MEMORY_BYTES else ""))
    for group, s in _groups(schedules):
        _say(f"  batch {', '.join(map(str, group))}: {s.describe()}")
    missing = not_installed(graph, tuple(args.batch_sizes))
    if missing:
        _say("  not installed here: " + "; ".join(f"{kind} {'/'.join(names)}" for kind, names in missing.items())
             + " (the schedules above use the next implementation; a GPU machine that has them would choose them)")
    _say(f"  H200 floor per step (context {ctx}; per kernel its bytes at {H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s, "
         f"or its FLOPs at {H200_BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s where longer):")
    for b in args.batch_sizes:
        _say(f"    batch {b:4d}: {step_floor_s(schedule, b, ctx) * 1e6:10.1f} us")
    _say(f"  wrote {out}/{', '.join(BUILD_OUTPUTS)} (batch {sizes[0]})")

    if reference:
        _reference_step(spec, schedule, sizes[0], args.weights)
    elif no_reference_why:
        _say(f"  no reference step on CPU: {no_reference_why}")

    if not capture:
        _say("  no GPU capture: " + ("--no-capture" if args.no_capture else "no CUDA GPU on this machine")
             + " (graphc run --device cpu runs the reference executor)")
    else:
        from .bench import bench_step, format_step_table

        rows = bench_step(args.spec, args.batch_sizes, ctx, weights=args.weights,
                          use_pdl=not args.no_pdl, progress=_progress, implementations=impls)
        _say(format_step_table(rows))
    return 0


def _reference_step(spec, schedule, batch, weights_path):
    import torch

    from .graph import weight_shapes
    from .plan import Plan
    from .reference import reference_step
    from .weights import Weights

    shapes = weight_shapes(schedule.graph)
    weights = Weights.load(weights_path, shapes) if weights_path else Weights.random(shapes)
    plan = Plan(schedule, batch, weights)
    tokens = torch.arange(batch) % spec.model.vocab
    t0 = time.perf_counter()
    logits = reference_step(plan, tokens, torch.zeros(batch, dtype=torch.int32))
    _say(f"  reference step on CPU (batch {batch}): {time.perf_counter() - t0:.2f} s, "
         f"next tokens {_shown_tokens(logits.float().argmax(-1).tolist())}")


def graph_json(graph) -> dict:
    def dims(buf):
        return list(buf.dims)

    nodes = []
    for name in sorted(graph.nodes, key=lambda n: graph.nodes[n]["order"]):
        op = graph.nodes[name]["op"]
        nodes.append({
            "name": name, "kind": op.kind, "order": graph.nodes[name]["order"],
            "params": op.params(),
            "reads": {r: v.name for r, v in op.reads.items()},
            "writes": {r: v.name for r, v in op.writes.items()},
            "weights": {r: {"name": n, "shape": list(s)} for r, (n, s) in op.weight_shapes().items()},
        })
    edges = [{"from": a, "to": b, "values": d["values"], "hazard": d["hazard"]}
             for a, b, d in graph.edges(data=True)]
    buffers = {n: {"dims": dims(b), "dtype": b.dtype, "kind": b.kind}
               for n, b in graph.graph["buffers"].items()}
    return {"spec": graph.graph["spec"].path, "nodes": nodes, "edges": edges, "buffers": buffers}


def schedule_text(schedule) -> str:
    lines = [f"# {len(schedule.kernels)} kernels, {len(schedule.pdl_edges())} PDL edges; "
             f"edge kind into each kernel and why"]
    for k in schedule.kernels:
        lines.append(f"{k.index:4d} {k.edge:4s} {k.node:24s} {k.op.kind}/{k.impl}: {k.reason}")
    return "\n".join(lines) + "\n"


def _groups(schedules: dict) -> list[tuple[list[int], object]]:
    """Batch sizes whose schedules are the same (same implementations and edges), in order."""
    groups: list[tuple[list[int], object]] = []
    for b, s in sorted(schedules.items()):
        key = [(k.impl, k.edge) for k in s.kernels]
        for sizes, other in groups:
            if [(k.impl, k.edge) for k in other.kernels] == key:
                sizes.append(b)
                break
        else:
            groups.append(([b], s))
    return groups


def schedules_text(schedules: dict) -> str:
    """One section per group of batch sizes that share a schedule."""
    return "\n".join(f"## batch sizes {', '.join(map(str, sizes))}\n{schedule_text(s)}"
                     for sizes, s in _groups(schedules))


def _inspect_sms() -> tuple[int, str]:
    """(SMs, where the count comes from) for the configurations `graphc inspect` names: this
    machine's GPU, or without one an H100 / H200 SXM's (a kernel's tiling follows the SMs)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.multi_processor_count, f"on this {props.name}, {props.multi_processor_count} SMs"
    return HOPPER_SMS, f"on {HOPPER_SMS} SMs, an H100 / H200 SXM: no GPU here"


def _spans_text(spans: dict[str, list[tuple[int, int]]]) -> str:
    """``{"cute": [(1, 96), (192, 192)], ...}`` -> ``"cute 1-96, 192; ..."``."""
    return "; ".join(f"{name} " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
                     for name, runs in spans.items())


def cmd_inspect(args) -> int:
    from .choices import Choices
    from .graph import describe_node, format_dims, weight_bytes

    impls = _implementations(args)
    spec, graph, schedule = _front(args.spec, impls, batch=args.batch)
    if args.node is not None:
        if args.node not in graph:
            raise GraphcError(f"no node {args.node!r} in {args.spec}{did_you_mean(args.node, graph.nodes)}")
        _say(describe_node(graph, args.node))
        k = schedule.kernel(args.node)
        _say(f"  kernel #{k.index}: {k.impl}, {k.edge} edge: {k.reason}")
        _say(f"  by default at batch sizes: {_spans_text(k.op.defaults_by_batch(MAX_BATCH))} (with what is installed here)")
        choices = Choices(impls)
        if choices.names_for(k.op):
            chosen = _spans_text(k.op.defaults_by_batch(MAX_BATCH, lambda b: choices.for_op(k.op, b)))
            _say(f"  with --impl at batch sizes: {chosen}")
        impl = k.op.implementations[k.impl]
        if impl.describe is not None and impl.available():
            sms, where = _inspect_sms()
            _say(f"  runs {impl.describe(k.op, args.batch, sms)} ({where})")
        return 0
    _say(f"{spec.path}: {len(spec.layers)} layers, {graph.number_of_nodes()} ops, "
         f"{graph.number_of_edges()} edges, weights {weight_bytes(graph) / 1e9:.2f} GB; "
         f"schedule at batch {args.batch}: {len(schedule.pdl_edges())} PDL edges")
    for k in schedule.kernels:
        op = k.op
        outs = ", ".join(f"{v.name}{format_dims(v.buffer.dims)}" for v in op.writes.values())
        _say(f"  {k.index:4d} {k.edge:4s} {k.node:24s} {op.kind:16s} -> {outs}")
    return 0


def cmd_viz(args) -> int:
    from .viz import picture, picture_suffix

    out = Path(args.out)
    _writable_file(out, "--out")        # a folder given as --out is named as such first
    _refuse_overwriting_inputs(out, "--out", {args.spec: "the spec", args.profile: "the --profile file"})
    suffix = picture_suffix(out)        # before any work, and before a folder is made for it
    if args.profile and suffix != ".html":
        raise GraphcError(f"--profile draws measured durations on the schedule timeline: write it to "
                          f"an .html file, not {out.name} (.svg and .dot draw the dataflow graph)")
    profile = _load_profile(args.profile) if args.profile else None
    # Draw the schedule that was measured: the profile names its batch and the implementations.
    batch = (profile or {}).get("batch", args.batch)
    _, graph, schedule = _front(args.spec, _implementations(args), batch=batch)
    if profile and profile.get("implementations"):
        from .schedule import build_schedule

        try:
            schedule = build_schedule(graph, profile["implementations"], batch=batch)
        except GraphcError as e:        # the profile's names, not the command line's
            raise GraphcError(f"--profile {args.profile}: {e}") from None
    try:
        drawn = picture(schedule, out, profile)
    except GraphcError as e:
        if profile is None:
            raise
        # What is wrong with the profile, named by the option that gave it, as _load_profile does.
        raise GraphcError(f"--profile {args.profile}: {str(e).removeprefix('profile: ')}") from None
    made = _writable_folder(out.parent, "--out folder")       # only once there is a picture
    _write_all({out: drawn}, made)
    _say(f"wrote {out}")
    return 0


def _load_profile(path: str) -> dict:
    """A profile written by DecodeStep.profile: a JSON object whose batch (if given) is a batch
    size and whose implementations (if given) map names to implementation names."""
    try:
        profile = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GraphcError(f"--profile {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphcError(f"--profile {path}: not a JSON profile ({e})") from None
    if not isinstance(profile, dict):
        raise GraphcError(f"--profile {path}: expected a JSON object (DecodeStep.profile's output), "
                          f"found a {type(profile).__name__}")
    batch = profile.get("batch", 1)
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_BATCH:
        raise GraphcError(f"--profile {path}: batch must be an integer in 1..{MAX_BATCH}, found {batch!r}")
    impls = profile.get("implementations", {})
    if not isinstance(impls, dict) or not all(isinstance(v, str) for v in impls.values()):
        raise GraphcError(f"--profile {path}: implementations must map op kinds or nodes to "
                          f"implementation names, found {impls!r}")
    return profile


def cmd_run(args) -> int:
    import torch

    from .runtime import build
    from .spec import load_spec

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = load_spec(args.spec)
    if args.steps > spec.model.max_context:
        raise GraphcError(f"--steps {args.steps}: step i writes position i, and {args.spec} holds "
                          f"{spec.model.max_context} (model.max_context)")
    step = build(spec, [args.batch], weights=args.weights, device=device, seed=args.seed,
                 implementations=_implementations(args), progress=_progress)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, step.spec.model.vocab, (args.batch,), generator=gen).to(device)
    for i in range(args.steps):
        seq_lens = torch.full((args.batch,), i, dtype=torch.int32, device=device)
        t0 = time.perf_counter()
        logits = step(tokens, seq_lens)
        tokens = logits.float().argmax(-1)
        if device == "cuda":
            torch.cuda.synchronize()
        _say(f"step {i}: {(time.perf_counter() - t0) * 1e3:8.2f} ms  next tokens {_shown_tokens(tokens.tolist())}")
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench
    from .spec import load_spec

    context = _context(load_spec(args.spec), args.context)
    # The results file is written after minutes of timing: refuse a bad --out before them
    # (without creating anything: the default file's name needs the GPU's).
    if args.out:
        _writable_file(Path(args.out), "--out")
    else:
        check_writable(Path("bench/results"), "results folder", folder=True)
    run_bench(args.spec, args.batch_sizes, context=context, out=args.out,
              weights=args.weights, compare=not args.quick, progress=_progress, say=_say,
              power=not args.no_power, implementations=_implementations(args))
    return 0


HOPPER_SMS = 132                  # H100 / H200 SXM: `graphc compile`'s target without a GPU


def cmd_compile(args) -> int:
    """Compile the CuTe DSL kernels a GPU build of SPEC at these batch sizes loads into the
    kernel cache, with or without a GPU here (without one, for sm_90a on ``--sms`` SMs), so
    that the build only loads them: e.g. while building a serving image."""
    import importlib.util

    from .kernels.compile_cache import default_cache_dir, disk_cache_enabled

    if not disk_cache_enabled():
        raise GraphcError("graphc compile fills the disk kernel cache, which GRAPHC_KERNEL_CACHE=0 "
                          "switches off")
    if importlib.util.find_spec("cutlass") is None:
        raise GraphcError("CuTe DSL (nvidia-cutlass-dsl) is not installed here: graphc's Hopper "
                          "kernels cannot be compiled")
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:      # the DSL would otherwise target its default architecture, not Hopper
        arch = os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        if arch != "sm_90a":
            raise GraphcError(f"CUTE_DSL_ARCH={arch}: graphc's kernels are sm_90a code (H100/H200)")
    from .compile_ahead import compile_variants, kernel_cache, not_on_disk, schedule_variants
    from .schedule import build_schedule

    cache_dir = default_cache_dir()
    check_writable(cache_dir, "kernel cache (GRAPHC_CACHE_DIR)", folder=True)
    sizes = args.batch_sizes
    impls = _implementations(args)
    spec, graph, _ = _front(args.spec, impls, batch=sizes[0])
    _writable_folder(cache_dir, "kernel cache (GRAPHC_CACHE_DIR)")    # created once the spec is good
    if gpu:
        from .runtime import gpu_implementations

        dev = torch.device("cuda", torch.cuda.current_device())
        chosen = gpu_implementations(graph, dev, impls, batch_sizes=sizes, progress=_progress)
        sms = args.sms or torch.cuda.get_device_properties(dev).multi_processor_count
        target = f"{torch.cuda.get_device_name(dev)}, {sms} SMs"
    else:
        chosen, sms = impls, args.sms or HOPPER_SMS
        target = f"sm_90a, {sms} SMs (no GPU here; --sms for another count)"
    variants = schedule_variants({b: build_schedule(graph, chosen, batch=b) for b in sizes}, sms)
    _say(f"{spec.model.name} at batch sizes {', '.join(map(str, sizes))}: {_plural(len(variants), 'kernel variant')} "
         f"for {target} -> {cache_dir}")
    t0 = time.perf_counter()
    compiled = compile_variants(variants, args.jobs, _progress)
    missing = not_on_disk(variants)
    if missing:
        module, key = missing[0]
        cache = kernel_cache(module)
        why = f": {cache.last_disk_error}" if cache.last_disk_error else ""
        raise GraphcError(f"{len(missing)} of {_plural(len(variants), 'kernel variant')} compiled but not "
                          f"written to {cache_dir} (the first: {cache.path(key).name}{why}); "
                          f"check its free space and permissions: a build would compile them again")
    _say(f"  compiled {len(compiled)}, {len(variants) - len(compiled)} already cached, in "
         f"{time.perf_counter() - t0:.1f} s; a GPU build at these batch sizes loads them")
    return 0


IMPL_HELP = ("an implementation choice, repeatable: KIND=NAME or NODE=NAME (NODE may be a "
             "pattern, 'L*.attn.qkv') for every batch size (linear=cublas), or NAME@SIZES terms "
             "for some sizes, the default elsewhere ('L*.attn.qkv=cute@1-192'; "
             "linear=cute@1-64,cublas); `graphc inspect SPEC NODE` lists a node's implementations")


def _add_impl_option(parser) -> None:
    parser.add_argument("--impl", type=_impl, action="append", metavar="KEY=CHOICE", help=IMPL_HELP)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphc", description="CUDA-graph decode-step compiler for Attention-Residual "
        "transformers on Hopper GPUs.", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment (GPU builds):\n"
               "  GRAPHC_CACHE_DIR     where compiled kernels are kept (default ~/.cache/graphc/kernels,\n"
               "                       or $XDG_CACHE_HOME/graphc/kernels where that is set)\n"
               "  GRAPHC_KERNEL_CACHE  0: keep compiled kernels in memory only\n"
               "  GRAPHC_COMPILE_JOBS  processes compiling uncached kernels while weights load\n"
               "                       (default: the CPU count, at most 8; 1: one at a time)")
    from . import __version__

    p.add_argument("--version", action="version", version=f"graphc {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="validate, schedule, verify and write the graph, schedule "
                       "and pictures; on a GPU machine also capture and time")
    b.add_argument("spec", type=_path, help=SPEC_HELP)
    b.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 2, 4, 8],
                   help="batch sizes to schedule (and capture on a GPU), comma-separated (default 1,2,4,8)")
    b.add_argument("--out", type=_path, help="output folder (default out/<spec name>)")
    b.add_argument("--context", type=_positive,
                   help="tokens per sequence for the HBM floor (default 1024, or the model's max_context if smaller)")
    b.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                   help="run one reference step on the CPU (default: when weights are at most 512 MiB)")
    b.add_argument("--weights", type=_path, help="safetensors file (default: seeded random weights)")
    b.add_argument("--write-weight-names", type=_path, metavar="FILE", help="list expected weight names and shapes")
    b.add_argument("--no-pdl", action="store_true", help="full edges everywhere")
    b.add_argument("--no-capture", action="store_true", help="skip GPU capture even on a GPU machine")
    _add_impl_option(b)
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("inspect", help="print the graph, or one node")
    i.add_argument("spec", type=_path, help=SPEC_HELP)
    i.add_argument("node", nargs="?", help="a node name, e.g. L03.attn.qkv (default: every kernel)")
    i.add_argument("--batch", type=_batch, default=1,
                   help="the batch size whose schedule to show (implementations differ per size)")
    _add_impl_option(i)
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("viz", help="write the dataflow graph (.svg/.dot) or schedule timeline (.html)")
    v.add_argument("spec", type=_path, help=SPEC_HELP)
    v.add_argument("--out", type=_path, required=True,
                   help="picture file: .svg or .dot (dataflow graph), .html (schedule timeline)")
    v.add_argument("--profile", type=_path, help="profile JSON (from DecodeStep.profile): the .html timeline to scale")
    v.add_argument("--batch", type=_batch, default=1,
                   help="the batch size whose schedule to draw (default 1; a profile names its own)")
    _add_impl_option(v)
    v.set_defaults(func=cmd_viz)

    r = sub.add_parser("run", help="build and run a few decode steps on random tokens")
    r.add_argument("spec", type=_path, help=SPEC_HELP)
    r.add_argument("--batch", type=_batch, default=1, help="sequences per step (default 1)")
    r.add_argument("--steps", type=_positive, default=4, help="decode steps to run (default 4)")
    r.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where there is a GPU")
    r.add_argument("--weights", type=_path, help="safetensors file (default: seeded random weights)")
    r.add_argument("--seed", type=_seed, default=0, help="seed of the random weights and tokens (default 0)")
    _add_impl_option(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("compile", help="compile the GPU kernels a build needs into the kernel cache "
                       "(no GPU needed): builds then only load them")
    c.add_argument("spec", type=_path, help=SPEC_HELP)
    c.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 2, 4, 8],
                   help="the batch sizes the build will capture, comma-separated (default 1,2,4,8)")
    c.add_argument("--sms", type=_positive,
                   help=f"SM count of the GPU that will run them (default: this GPU's, else {HOPPER_SMS}: "
                        "H100/H200 SXM)")
    c.add_argument("--jobs", type=_positive, help="compile processes (default GRAPHC_COMPILE_JOBS, else "
                   "the CPU count up to 8)")
    _add_impl_option(c)
    c.set_defaults(func=cmd_compile)

    n = sub.add_parser("bench", help="time the captured step on the GPU against its floor and baselines")
    n.add_argument("spec", type=_path, help=SPEC_HELP)
    n.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8, 64],
                   help="batch sizes to capture and time, comma-separated (default 1,8,64)")
    n.add_argument("--context", type=_positive,
                   help="tokens per sequence, the new one included: 1023 cached at the default 1024 "
                        "(or the model's max_context if smaller)")
    n.add_argument("--weights", type=_path, help="safetensors file (default: seeded random weights)")
    n.add_argument("--out", type=_path, help="JSON results file (default bench/results/step_<spec>_<gpu>_<date>.json)")
    n.add_argument("--quick", action="store_true", help="only the graphc step, no baselines")
    n.add_argument("--no-power", action="store_true",
                   help="skip sampling board power and SM clock (1.5 s of replays per batch size)")
    _add_impl_option(n)
    n.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    # `graphc inspect SPEC --batch 2 NODE`: argparse takes the optional NODE only right after SPEC.
    if args.command == "inspect" and args.node is None and len(extra) == 1 and not extra[0].startswith("-"):
        args.node, extra = extra[0], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except GraphcError as e:
        print(f"graphc: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (graphc inspect SPEC | head): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        # The file system refused a read or write of a named file that the checks could not
        # foresee (a special folder such as /proc, a full disk): one line, like every other
        # refusal. An OSError about no file is graphc's or a library's: its traceback stays.
        if e.filename is None:
            raise
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        print(f"graphc: error: {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
