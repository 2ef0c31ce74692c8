"""``DecodeStep``: the replayable decode step users call (DESIGN §5).

``graphc.build(spec, batch_sizes)`` validates, schedules, plans, compiles and captures one CUDA
graph per batch size. ``step(tokens, seq_lens)`` picks the smallest captured size that holds
the batch, pads, replays and returns the logits as a view of a static buffer. On a CPU device
the same API runs the reference executor instead of graphs (for tests and small specs).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import operator
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from .choices import Choices
from .errors import GraphcError
from .files import output_file, replace_file
from .graph import build_graph, weight_shapes
from .kernels import weight_blocks
from .plan import Plan, blocked_weights, check_fits, check_weight_orders, row_major_for_some_sizes
from .reference import run_kernels
from .schedule import Schedule, build_schedule, implementations_for_gpu
from .spec import Spec, load_spec
from .weights import Weights, check_finite_weights, random_init_temporary_bytes, read_weights

MAX_BATCH = 512      # the largest captured batch size (the decode GEMM's M; the kernels' sizing)


def _log(msg: str) -> None:
    print(f"[graphc] {msg}", file=sys.stderr, flush=True)


def _device_guard(dev: torch.device):
    """Make ``dev`` the current CUDA device within: the streams, graphs and memory queries of
    a build and its replays, and the Triton and CuTe DSL launches (which run on the current
    device), must all be on the step's GPU whichever device the caller has current."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _in_step_order(method):
    """Run a ``DecodeStep`` method that touches the step's GPU memory on the step's device,
    and after everything already queued on the stream its previous such method ran on.

    One step's calls share its static buffers (inputs, logits, the KV cache, the weights), so
    they must not overlap. On one stream they are in order anyway; a call from another stream
    (``with torch.cuda.stream(s)``) first waits, on the GPU, for all that the previous
    stream holds at that moment: the previous call's replay and whatever the caller queued
    after it, such as the clone of its logits. The host does not wait. The common case (the
    same stream again) costs one stream lookup. Inside a stream capture the caller orders its
    own streams (a captured stream may not wait on an event recorded outside the capture)."""
    @functools.wraps(method)
    def in_order(self, *args, **kwargs):
        with _device_guard(self.device):
            if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
                return method(self, *args, **kwargs)
            stream = torch.cuda.current_stream()
            previous = self._last_stream
            if previous is not None and previous != stream:
                done = torch.cuda.Event()
                done.record(previous)
                stream.wait_event(done)
            self._last_stream = stream
            return method(self, *args, **kwargs)
    return in_order


class DecodeStep:
    """One model's decode step at several batch sizes.

    The logits returned by a call are a view of a static buffer: the next call overwrites them.
    Clone them if you keep them.

    Calls run on the device's current stream, one after another. Two steps (two builds of one
    process) may run on two streams at once: each plan has its own split-K workspaces
    (``plan.workspaces``). One step's calls share its static input, output and KV-cache
    buffers, so a call (or ``reset``, ``load_weights``, ``profile``) issued on another stream
    than the step's previous one first waits, on the GPU, for everything queued on that
    previous stream so far: calls of one step from several streams run one after another.

    ``schedules`` holds each captured batch size's schedule (its implementations can differ:
    the decode GEMM at small batches, cuBLAS at large ones); ``schedule`` is the largest's.
    """

    def __init__(self, schedules: dict[int, Schedule], plan: Plan, graphs=None):
        self.schedules = dict(sorted(schedules.items()))
        self.batch_sizes = list(self.schedules)
        self.schedule = self.schedules[self.batch_sizes[-1]]
        self.spec = self.schedule.spec
        self.plan = plan
        self.graphs = graphs or {}
        self.device = plan.device
        self.fingerprint = self.spec.fingerprint()
        self._served = {size: [0, 0] for size in self.batch_sizes}    # calls, real rows
        self._last_stream = None     # the stream of the last call, reset, reload or profile

    def schedule_for(self, batch: int) -> Schedule:
        """The schedule that runs a batch of ``batch`` rows (that of its padded size)."""
        return self.schedules[self.padded_size(batch)]

    # --- the call ---------------------------------------------------------------------------
    def padded_size(self, batch: int) -> int:
        """The smallest captured batch size that holds ``batch`` rows."""
        try:
            if isinstance(batch, bool):
                raise TypeError
            rows = operator.index(batch)        # numpy and 0-d tensor integers too
        except TypeError:
            raise GraphcError(f"a batch size is an integer number of rows, found {batch!r}") from None
        if rows < 1:
            raise GraphcError(f"a batch has at least one row, found {rows}")
        batch = rows
        for size in self.batch_sizes:
            if size >= batch:
                return size
        raise GraphcError(f"batch of {batch} is larger than every captured batch size "
                          f"({', '.join(map(str, self.batch_sizes))}); build with a larger batch size "
                          f"(graphc.build(..., batch_sizes=[...]); graphc build / bench SPEC --batch-sizes ...)")

    @_in_step_order
    def __call__(self, tokens: torch.Tensor, seq_lens: torch.Tensor,
                 cache_slots: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
        """Run one decode step. tokens: [b] integer token ids; seq_lens: [b] tokens already
        cached for each sequence; cache_slots: [b] the KV-cache slot of each sequence
        (default 0..b-1). Returns logits [b, vocab] (bf16), a view of a static buffer.
        validate=False skips the range checks of tokens, seq_lens and cache_slots (a device
        sync each call): an out-of-range value then reads or writes out of bounds, so turn it
        off only for inputs already known good."""
        b = self._check_inputs(tokens, seq_lens, cache_slots, validate)
        size = self.padded_size(b)
        plan = self.plan
        if cache_slots is None:
            cache_slots = torch.arange(b, dtype=torch.int32, device=self.device)
        plan.view("tokens", size)[:b].copy_(tokens)
        plan.view("seq_lens", size)[:b].copy_(seq_lens)
        plan.view("cache_slots", size)[:b].copy_(cache_slots)
        if size > b:       # padding rows: token 0 at position 0 of the scratch slot
            plan.view("tokens", size)[b:].zero_()
            plan.view("seq_lens", size)[b:].zero_()
            plan.view("cache_slots", size)[b:].fill_(plan.scratch_slot)
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            run_kernels(plan, size)
        served = self._served[size]      # counted once it ran: padding() reports calls served
        served[0] += 1
        served[1] += b
        return plan.output(size)[:b]

    step = __call__

    def _check_inputs(self, tokens, seq_lens, cache_slots, validate) -> int:
        if not isinstance(validate, bool):      # "no" would read as True and validate
            raise GraphcError(f"validate: expected True or False, found {validate!r:.60}")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise GraphcError("tokens must be a 1-D tensor of token ids")
        b = tokens.shape[0]
        named = [("tokens", tokens), ("seq_lens", seq_lens)]
        if cache_slots is not None:
            named.append(("cache_slots", cache_slots))
        for name, t in named:
            if not isinstance(t, torch.Tensor) or t.shape != (b,):
                raise GraphcError(f"{name} must be a tensor of shape [{b}] (one per token), "
                                  f"found {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.layout != torch.strided:
                raise GraphcError(f"{name} must be a dense tensor, found layout {t.layout}")
            if t.dtype not in (torch.int32, torch.int64):
                raise GraphcError(f"{name} must be int32 or int64, found {t.dtype}")
            if t.device != self.device:
                raise GraphcError(f"{name} is on {t.device}, the step runs on {self.device}")
        if b == 0:
            raise GraphcError("empty batch")
        self.padded_size(b)
        if validate:
            # One small device-to-host read: refuse before anything is written to the cache.
            ranges = [tokens.min(), tokens.max(), seq_lens.min(), seq_lens.max()]
            if cache_slots is not None:
                ranges.append(cache_slots)
            lo_hi = torch.cat([r.to(torch.int64).reshape(-1) for r in ranges]).cpu()
            vocab, ctx = self.spec.model.vocab, self.spec.model.max_context
            if lo_hi[0] < 0 or lo_hi[1] >= vocab:
                raise GraphcError(f"token ids must be in [0, {vocab}), found {int(lo_hi[0])}..{int(lo_hi[1])}")
            if lo_hi[2] < 0:
                raise GraphcError(f"seq_lens (tokens already cached) must be >= 0, found {int(lo_hi[2])}")
            if lo_hi[3] >= ctx:
                raise GraphcError(f"a sequence is past the maximum context: seq_lens must be in "
                                  f"[0, {ctx - 1}] (max_context {ctx}), found {int(lo_hi[2])}..{int(lo_hi[3])}")
            if cache_slots is not None:
                slots = lo_hi[4:]
                if slots.min() < 0 or slots.max() >= self.plan.max_batch:
                    raise GraphcError(f"cache_slots must be in [0, {self.plan.max_batch}), "
                                      f"found {int(slots.min())}..{int(slots.max())}")
                if slots.unique().numel() != b:
                    raise GraphcError("cache_slots must be distinct: two rows would write one sequence")
        return b

    # --- state ------------------------------------------------------------------------------
    @_in_step_order
    def reset(self, cache_slots: Sequence[int] | torch.Tensor | int | None = None) -> None:
        """Start new sequences: clear the KV cache of the given slots (default: all). Slots
        are given as ``__call__`` takes them (an integer tensor) or as Python integers: one,
        or any sequence of them (an empty one clears nothing)."""
        if cache_slots is not None:
            cache_slots = _slot_list(cache_slots, self.plan.max_batch)
            if not cache_slots:
                return
        for name, buf in self.plan.buffers.items():
            if buf.kind == "state" and buf.dims and buf.dims[0] == "slots":
                cache = self.plan.storage[name]
                if cache_slots is None:
                    cache.zero_()
                else:
                    cache[torch.tensor(cache_slots, dtype=torch.long, device=cache.device)] = 0

    @_in_step_order
    def load_weights(self, path: str | os.PathLike) -> None:
        """Reload weights in place: the captured graphs read the same memory, so the next
        replay uses the new values and no graph is stale. (A spec change needs a new build.)
        The file is read twice: once to check every value (no NaN or Inf), then to copy, so a
        bad file changes nothing."""
        # Names, dtypes and shapes checked from the header, every value on a first pass
        # (check_finite_weights, on the GPU a chunk at a time), then one tensor at a time,
        # read on the host and copied straight into place: no GPU memory beyond the weights
        # themselves (a second copy of every weight, or even of the 2.35 GB lm_head, need
        # not fit).
        shapes = weight_shapes(self.schedule.graph)
        check_finite_weights(path, shapes, self.device if self.device.type == "cuda" else None)
        with torch.no_grad():
            for name, t in read_weights(path, shapes, "cpu", check_values=False):
                self.plan.weights.copy_in(name, t)      # in the order it is stored
                del t

    # --- reports ----------------------------------------------------------------------------
    def padding(self) -> dict[int, dict]:
        """Per captured batch size, since the build: calls, real rows, padding rows computed
        for nothing, and the waste (padding rows / rows computed). A large waste at one size
        says another batch size is worth capturing."""
        out = {}
        for size, (calls, rows) in self._served.items():
            computed = calls * size
            out[size] = {"calls": calls, "rows": rows, "padded_rows": computed - rows,
                         "waste": (computed - rows) / computed if computed else 0.0}
        return out

    def stats(self) -> dict[int, dict]:
        """Per captured batch size: capture time, graph memory, kernel count, PDL edges, the
        implementation of each op kind, and the padding waste so far (see ``padding``)."""
        padding = self.padding()
        return {size: {"capture_s": g.capture_s, "graph_memory_bytes": g.memory_bytes,
                       "kernels": g.kernel_nodes, "pdl_edges": g.pdl_edges,
                       "schedule_pdl_edges": len(self.schedules[size].pdl_edges()),
                       "implementations": self.schedules[size].implementation_summary(),
                       "padding_waste": padding[size]["waste"]}
                for size, g in sorted(self.graphs.items())}

    @_in_step_order
    def profile(self, batch: int, path: str | os.PathLike | None = None,
                context: int | None = None, replays: int = 20, repeat: int = 10) -> dict:
        """Per-kernel durations at one batch size, in the JSON the HTML timeline displays.

        Each kernel of the schedule is captured alone, ``repeat`` times back to back, in its
        own CUDA graph and replayed (median of ``replays``): GPU time without launch gaps and
        without the overlap PDL gives it next to its neighbours in the real step. The repeats
        read the same inputs, so a kernel whose inputs fit in L2 (AttnRes; attention over a
        short cache) finds them there from the second repeat on and times faster than in the
        step, where they arrive from HBM; the weight-streaming GEMMs read more than the L2
        holds and are not flattered. ``bench/step_timeline.py`` times kernels inside the real
        step. Rows attend
        over ``context`` tokens (default min(1024, max_context)) in slots 0..batch-1, whose KV
        entries at that position are overwritten: profile before serving, or ``reset()``.
        """
        from numbers import Integral

        counts = {"replays": replays, "repeat": repeat, **({} if context is None else {"context": context})}
        for name, value in counts.items():
            if not isinstance(value, Integral) or isinstance(value, bool) or value < 1:
                raise GraphcError(f"profile: {name} must be an integer >= 1, found {value!r:.60}")
        max_context = self.spec.model.max_context
        if context is not None and context > max_context:
            raise GraphcError(f"profile: context {context} is past the model's max_context {max_context}")
        if path is not None:
            output_file(path, "profile")       # before the timing, not after
        if self.device.type != "cuda":
            raise GraphcError("profile needs a CUDA device")
        from .bench import time_replays

        size = self.padded_size(batch)
        ctx = min(context or 1024, max_context)
        self.plan.view("seq_lens", size).fill_(ctx - 1)
        self.plan.view("cache_slots", size).copy_(torch.arange(size, device=self.device))
        rows = []
        # The plan's own stream, as the step's graphs were captured on: a cuBLAS kernel keeps
        # that stream's workspace, which no pooled stream's graph can share (capture_stream.py).
        side = self.plan.capture_stream().stream
        schedule = self.schedules[size]
        for k, b in zip(self.plan.kernels_of(schedule), self.plan.bindings(size)):
            launch = k.op.implementations[k.impl].launch
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                for _ in range(repeat):
                    launch(k.op, b.tensors, b.weights, torch.cuda.current_stream(), False,
                           self.plan.workspaces)
            rows.append({"node": k.node, "kind": k.op.kind,
                         "duration_us": time_replays(g.replay, 2, replays) * 1e6 / repeat})
            del g
        result = {"gpu": torch.cuda.get_device_name(), "batch": size, "context": ctx,
                  "method": f"each kernel alone, {repeat}x in its own CUDA graph (inputs L2-warm after the first)",
                  "implementations": schedule.implementations(), "kernels": rows}
        if path is not None:
            text = json.dumps(result, indent=1)
            replace_file(path, lambda tmp: tmp.write_text(text), "profile")
        return result


def _gpu_name(dev: torch.device) -> str:
    return f"{torch.cuda.get_device_name(dev)} ({dev})"


def gpu_implementations(graph, dev: torch.device, implementations: dict | None = None,
                        batch_sizes: Sequence[int] = (None,),
                        progress: Callable[[str], None] | None = None) -> dict:
    """The implementation choices a build on the CUDA device ``dev`` makes
    (``schedule.implementations_for_gpu``: the caller's, plus portable ones for op kinds whose
    defaults this GPU cannot run, which ``progress`` hears about)."""
    capability = torch.cuda.get_device_capability(dev)
    chosen, substituted = implementations_for_gpu(graph, capability, _gpu_name(dev), implementations,
                                                  tuple(batch_sizes))
    if substituted and progress is not None:
        progress(f"{_gpu_name(dev)} is sm_{capability[0]}{capability[1]}; graphc's Hopper kernels need "
                 f"sm_90a (H100/H200), so this build runs portable ones: " + "; ".join(substituted))
    return chosen


def batch_size_list(batch_sizes) -> list[int]:
    """The distinct captured batch sizes, sorted; refuses anything but integers in 1..MAX_BATCH
    (a list, a numpy array or a 1-D integer tensor of them)."""
    from collections.abc import Iterable, Mapping
    from numbers import Integral

    if isinstance(batch_sizes, torch.Tensor) and batch_sizes.dim() == 1 and not (
            batch_sizes.is_floating_point() or batch_sizes.is_complex() or batch_sizes.dtype == torch.bool):
        batch_sizes = batch_sizes.tolist()      # its elements are 0-d tensors, not integers
    items = list(batch_sizes) if isinstance(batch_sizes, Iterable) and not isinstance(batch_sizes, (str, Mapping)) else []
    if not items or any(not isinstance(b, Integral) or isinstance(b, bool) for b in items):
        raise GraphcError(f"batch_sizes must be a list of integers, e.g. [1, 8, 64]; found {batch_sizes!r}")
    sizes = sorted({int(b) for b in items})
    if sizes[0] < 1 or sizes[-1] > MAX_BATCH:
        raise GraphcError(f"batch sizes must be between 1 and {MAX_BATCH}, found {batch_sizes}")
    return sizes


def _slot_list(cache_slots, max_batch: int) -> list[int]:
    """``reset``'s slots (one integer, a sequence of them, a numpy array or an integer tensor)
    as Python ints, each checked to be a slot of this build."""
    wanted = f"reset: cache slots are integers in [0, {max_batch})"
    if isinstance(cache_slots, (str, bytes)):
        raise GraphcError(f"{wanted}, found {cache_slots!r}")
    try:
        t = torch.as_tensor(cache_slots)
    except (TypeError, ValueError, RuntimeError):
        raise GraphcError(f"{wanted}, found {cache_slots!r}") from None
    if t.layout != torch.strided or t.device.type == "meta":
        raise GraphcError(f"{wanted}: a dense tensor with values, found a {t.layout} tensor on {t.device}")
    if t.numel() == 0:
        return []
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise GraphcError(f"{wanted}, found {t.dtype} values")
    if t.dim() > 1:
        raise GraphcError(f"{wanted}: one or a 1-D sequence, found shape {list(t.shape)}")
    slots = [int(x) for x in t.reshape(-1).tolist()]
    bad = [x for x in slots if not 0 <= x < max_batch]
    if bad:
        raise GraphcError(f"{wanted}, found {bad[0]}")
    return slots


def run_device(device) -> torch.device:
    """The device a step runs on: a CUDA GPU (cuda:N once known) or the CPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise GraphcError(f"device {device!r}: graphc runs on 'cuda' (or 'cuda:N') or on 'cpu' "
                          f"(the reference executor)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GraphcError(f"device {str(dev)!r} requested but no CUDA GPU is available; run on the CPU "
                          "instead (device='cpu'; graphc run --device cpu)")
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise GraphcError(f"device {device!r}: the CPU is 'cpu' (or 'cpu:0')")
        return torch.device("cpu")      # "cpu:0" is the CPU too, and CPU tensors report plain "cpu"
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())   # tensors report cuda:N
    if dev.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise GraphcError(f"device {device!r}: this machine has {count} CUDA GPU{'s' if count != 1 else ''} "
                          f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")
    return dev


def host_free_bytes() -> int:
    """Memory the host can still give this process (MemAvailable; free pages where there is no
    /proc/meminfo)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cached_free_bytes(dev: torch.device) -> int:
    """Memory torch's caching allocator holds on ``dev`` in whole segments no tensor uses: not
    free to the driver, but to this process, since the allocator hands it out again or releases
    it when a request does not fit (so a process that dropped an earlier step can build another
    as large). Free pieces of segments still partly in use are left out: a large buffer cannot
    take them."""
    stats = torch.cuda.memory_stats(dev)
    return (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
            - stats.get("inactive_split_bytes.all.current", 0))


def check_memory(schedule: Schedule, max_batch: int, dev: torch.device, weights) -> None:
    """Refuse a build on ``dev`` (a GPU, or the host for the reference executor) whose buffers
    and weights cannot fit there, before anything is allocated (``plan.check_fits``).
    ``weights`` as ``build`` takes them: None (seeded random, with its temporaries), a file,
    or a ``Weights`` already there."""
    if dev.type == "cuda":
        gc.collect()        # a step dropped inside a reference cycle frees its memory only now
        (free, total), where, memory = torch.cuda.mem_get_info(dev), _gpu_name(dev), "GPU memory"
        free += cached_free_bytes(dev)
    else:
        free, total, where, memory = host_free_bytes(), None, "this host", "host memory"
    check_fits(schedule, max_batch, free, where, memory=memory, total_bytes=total,
               new_weight_bytes=0 if isinstance(weights, Weights) else None,
               transient_bytes=random_init_temporary_bytes(weight_shapes(schedule.graph)) if weights is None else 0)


def _compiling_kernels_ahead(schedules: dict[int, Schedule], dev: torch.device, blocked: set[str],
                             block_rows: int, jobs: int | None, progress: Callable[[str], None]):
    """On a GPU, the kernel variants the schedules need (``blocked``: the weights stored in
    blocks of ``block_rows`` rows) and no cache holds compile in worker processes while the
    body runs (graphc/compile_ahead.py); on the CPU nothing compiles."""
    if dev.type != "cuda":
        return contextlib.nullcontext()
    from .compile_ahead import compiling_ahead, schedule_variants

    return compiling_ahead(schedule_variants(schedules, _sm_count(dev), blocked, block_rows), jobs, progress)


def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _weights_in_blocks(schedules: dict[int, Schedule], dev: torch.device, weights, block_weights: bool,
                       progress: Callable[[str], None], block_rows: int = weight_blocks.BLOCK) -> set[str]:
    """The weights this build will have stored in blocks: on a GPU, those only the decode
    GEMM reads, with a kernel that gains from blocks (``plan.blocked_weights``), unless a build sharing ``weights``
    reads them row-major; plus any a shared ``Weights`` already holds in blocks. ``progress``
    hears which weights a large captured size keeps row-major at every size."""
    blocked = set()
    if dev.type == "cuda" and block_weights:
        blocked = blocked_weights(schedules, _sm_count(dev), block_rows)
        kept = row_major_for_some_sizes(schedules, _sm_count(dev), block_rows)
        if kept:
            batch, k = next(iter(kept.values()))
            progress(f"{len(kept)} weights stay row-major at every batch size because a kernel that reads "
                     f"them so runs at some (e.g. {k.node} runs {k.impl} at batch {batch}); at the others the decode "
                     f"GEMM would stream them 2-7% faster in {block_rows} x 64 blocks: for that, capture those sizes in a "
                     f"build of their own, with its own weights")
    if isinstance(weights, Weights):
        blocked = (blocked - weights.pinned_rows) | weights.blocked()
    return blocked


def build(spec: Spec | str | os.PathLike, batch_sizes: Sequence[int] = (1, 2, 4, 8),
          weights: Weights | str | os.PathLike | None = None, device: str = "cuda",
          implementations: dict | None = None, use_pdl: bool = True, seed: int = 0,
          progress: Callable[[str], None] | None = _log, compile_jobs: int | None = None,
          block_weights: bool = True, block_rows: int = weight_blocks.BLOCK) -> DecodeStep:
    """Validate, schedule, plan, compile and capture: one CUDA graph per batch size. The
    parameters are described on ``graphc.build``, the public entry point.

    Compiling ahead (graphc/compile_ahead.py) runs while the weights load, so ``progress`` also
    hears from a background thread meanwhile.
    """
    _check_build_arguments(weights, implementations, use_pdl, seed, progress, compile_jobs, block_weights,
                           block_rows)
    progress = progress or (lambda s: None)
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    sizes = batch_size_list(batch_sizes)
    dev = run_device(device)
    graph = build_graph(spec)
    # On the CPU the schedules only describe (the reference executor runs); the choices are
    # still checked, so a build there refuses what a GPU build would.
    chosen = gpu_implementations(graph, dev, implementations, sizes, progress) if dev.type == "cuda" else implementations
    schedules = {b: build_schedule(graph, chosen, use_pdl, batch=b) for b in sizes}
    shapes = weight_shapes(graph)
    if isinstance(weights, Weights):
        weights.check(shapes, dev)
        weights.check_values()          # as a weights file's values are checked when it loads
    idle = Choices(implementations).idle(sizes)
    if idle:
        progress(f"implementations: {', '.join(idle)} cover{'s' if len(idle) == 1 else ''} none of the batch "
                 f"sizes built ({', '.join(map(str, sizes))}), so decide{'s' if len(idle) == 1 else ''} nothing here")
    # Refuse now, naming what takes the memory, rather than fail allocating mid-build.
    check_memory(schedules[sizes[-1]], sizes[-1], dev, weights)
    # Ordinary tensors even when built under torch.inference_mode(): its tensors could never
    # be written outside it, and every call writes the step's buffers in place.
    with _device_guard(dev), torch.inference_mode(False):
        blocked = _weights_in_blocks(schedules, dev, weights, block_weights, progress, block_rows)
        return _allocate_and_capture(schedules, shapes, dev, weights, seed, blocked, block_rows, compile_jobs,
                                     progress)


MAX_SEED = 2**63 - 1      # torch.Generator.manual_seed's range, which `graphc run` seeds too


def _check_build_arguments(weights, implementations, use_pdl, seed, progress, compile_jobs, block_weights,
                           block_rows) -> None:
    """Refuse mistyped ``build`` arguments up front, as GraphcErrors: found late, a wrong
    ``progress`` would fail only after minutes of loading weights."""
    from collections.abc import Mapping
    from numbers import Integral

    def is_int(v) -> bool:
        return isinstance(v, Integral) and not isinstance(v, bool)

    if not (weights is None or isinstance(weights, (Weights, str, os.PathLike))):
        raise GraphcError(f"weights: expected None (random), a .safetensors path or a Weights, "
                          f"found {type(weights).__name__} {weights!r:.60}")
    if not (implementations is None or (isinstance(implementations, Mapping)
                                        and all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in implementations.items()))):
        raise GraphcError(f"implementations: expected a mapping from op kinds or node names to "
                          f"implementation names, e.g. {{'linear': 'cublas'}}; found {implementations!r:.80}")
    Choices(implementations, MAX_BATCH)        # the per-size terms' syntax and range (graphc/choices.py)
    for name, value in (("use_pdl", use_pdl), ("block_weights", block_weights)):
        if not isinstance(value, bool):
            raise GraphcError(f"{name}: expected True or False, found {value!r:.60}")
    if not (is_int(seed) and 0 <= seed <= MAX_SEED):
        raise GraphcError(f"seed: expected an integer in 0..2**63-1, found {seed!r:.60}")
    if not (progress is None or (callable(progress) and _takes_one_argument(progress))):
        raise GraphcError(f"progress: expected a callable taking one line, or None; found {progress!r:.60}")
    if not (compile_jobs is None or (is_int(compile_jobs) and compile_jobs >= 0)):
        raise GraphcError(f"compile_jobs: expected None or a count of processes >= 0, found {compile_jobs!r:.60}")
    if not (is_int(block_rows) and block_rows in weight_blocks.ROW_BLOCKS):
        raise GraphcError(f"block_rows={block_rows!r} unsupported: rows per weight block are "
                          f"{' or '.join(map(str, weight_blocks.ROW_BLOCKS))}")


def _takes_one_argument(f) -> bool:
    """Whether ``f("line")`` binds to ``f``'s signature (True where Python cannot tell, as for
    some builtins)."""
    import inspect

    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind("line")
    except TypeError:
        return False
    return True


def _allocate_and_capture(schedules: dict[int, Schedule], shapes, dev: torch.device, weights, seed: int,
                          blocked: set[str], block_rows: int, compile_jobs: int | None,
                          progress: Callable[[str], None]) -> DecodeStep:
    """The build's second half, on ``dev``: weights (while kernels compile ahead; ``blocked``
    are stored in blocks of ``block_rows`` rows), plan, warm-up, capture."""
    sizes = list(schedules)
    with _compiling_kernels_ahead(schedules, dev, blocked, block_rows, compile_jobs, progress):   # while the weights load
        t0 = time.perf_counter()
        if weights is None:
            weights = Weights.random(shapes, seed=seed, device=dev)
        elif not isinstance(weights, Weights):
            weights = Weights.load(weights, shapes, dev)
        weights.store_blocked(blocked - weights.blocked(), block_rows)
        progress(f"weights: {weights.nbytes() / 1e9:.2f} GB ({weights.origin}) in {time.perf_counter() - t0:.1f} s"
                 + (f"; {len(blocked)} of {len(shapes)} in {block_rows} x 64 blocks for the decode GEMM" if blocked else ""))
    if dev.type == "cuda":
        check_weight_orders(schedules, weights, _sm_count(dev))
        # Captured graphs will read these row-major: no later build may move them to blocks.
        weights.pinned_rows |= set(shapes) - weights.blocked()
    plan = Plan(schedules[sizes[-1]], sizes[-1], weights, dev)
    graphs = None
    if dev.type == "cuda":
        from .capture import capture_all

        for b, s in schedules.items():
            progress(f"batch {b}: {s.describe()}")
        from .kernels.compile_cache import reporting_compiles

        with reporting_compiles(progress):      # what is still uncompiled compiles in the warm-up
            graphs = capture_all(plan, schedules, progress)
    return DecodeStep(schedules, plan, graphs)
