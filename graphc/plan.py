"""Static memory for a schedule: every buffer, every weight, bound to every kernel.

Weights are bound as stored (``Weights``): row-major, or in 64 x 64 blocks for the weights only
the decode GEMM reads, with a kernel that gains from blocks, at every captured batch size
(``blocked_weights``, the
build's choice; ``check_weight_orders`` refuses a build whose kernels could not read them).

One set of buffers is allocated for the largest batch size; a smaller batch uses the first
rows of each (so all captured graphs share memory and a replay at any size sees the same
KV cache). Activations whose lifetimes do not overlap share a slab. The KV cache has one
slot more than the largest batch: padded rows write into that scratch slot, never into a
live sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import GraphcError
from .graph import weight_bytes, weight_shapes
from .kernels import weight_blocks
from .kernels.workspaces import Workspaces
from .ops.base import DTYPES, Buffer
from .schedule import Schedule
from .weights import Weights


@dataclass(frozen=True)
class Binding:
    """The tensors one kernel sees at one batch size: role -> tensor, role -> weight."""

    tensors: dict
    weights: dict


class Plan:
    def __init__(self, schedule: Schedule, max_batch: int, weights: Weights,
                 device: str | torch.device = "cpu"):
        self.schedule = schedule
        self.spec = schedule.spec
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.slots = max_batch + 1
        self.scratch_slot = max_batch
        self.weights = weights
        weights.check(weight_shapes(schedule.graph), self.device)
        self.buffers: dict[str, Buffer] = schedule.graph.graph["buffers"]
        self.storage = self._allocate()
        # The split-K kernels' scratch memory, this plan's own: two steps of one process may
        # then be replayed on two streams at once without mixing each other's partials.
        self.workspaces = Workspaces()
        self._capture_stream = None
        self._bindings: dict[int, list[Binding]] = {}

    def capture_stream(self):
        """The stream this plan's graphs are captured on (graphc/capture_stream.py: it keeps
        their cuBLAS workspace apart from every other plan's), created on first use."""
        if self._capture_stream is None:
            from .capture_stream import CaptureStream

            self._capture_stream = CaptureStream(self.device)
        return self._capture_stream

    @property
    def max_sizes(self) -> dict[str, int]:
        return {"T": self.max_batch, "slots": self.slots}

    def _allocate(self) -> dict[str, torch.Tensor]:
        """Buffer name -> tensor at the largest size (``memory_layout``'s slabs)."""
        layout = memory_layout(self.schedule, self.max_batch)
        slabs = [torch.empty(numel, dtype=DTYPES[dtype], device=self.device)
                 for numel, dtype in layout.slabs]
        storage = {}
        for name, buf in self.buffers.items():
            if name in layout.slab_of:
                storage[name] = slabs[layout.slab_of[name]]
            else:                     # inputs and state start zeroed (an empty KV cache)
                storage[name] = torch.zeros(buf.shape(self.max_sizes), dtype=buf.torch_dtype,
                                            device=self.device)
        self.activation_bytes = layout.activation_bytes
        return storage

    def view(self, name: str, batch: int) -> torch.Tensor:
        buf = self.buffers[name]
        shape = buf.shape({"T": batch, "slots": self.slots})
        t = self.storage[name]
        if buf.kind == "activation":
            n = 1
            for s in shape:
                n *= s
            return t[:n].view(shape)
        return t[:batch] if buf.dims and buf.dims[0] == "T" else t

    def bindings(self, batch: int) -> list[Binding]:
        """Per kernel, the views it reads and writes at this batch size (cached)."""
        if not 1 <= batch <= self.max_batch:
            raise GraphcError(f"batch {batch} is outside this plan (1..{self.max_batch})")
        if batch not in self._bindings:
            out = []
            for k in self.schedule.kernels:
                roles = {**k.op.reads, **k.op.writes}
                tensors = {role: self.view(v.buffer.name, batch) for role, v in roles.items()}
                weights = {role: self.weights[name] for role, (name, _) in k.op.weight_shapes().items()}
                out.append(Binding(tensors, weights))
            self._bindings[batch] = out
        return self._bindings[batch]

    def kernels_of(self, schedule: Schedule):
        """``schedule``'s kernels, checked to be this plan's kernels in this plan's order (the
        bindings are per kernel index): a schedule of another batch size may differ in
        implementations and edges, never in ops or order."""
        if schedule is not self.schedule:
            ours = [k.node for k in self.schedule.kernels]
            if [k.node for k in schedule.kernels] != ours:
                raise GraphcError("schedule does not run this plan's kernels in this plan's order")
        return schedule.kernels

    def write_inputs(self, batch: int, tokens, seq_lens, cache_slots) -> None:
        """Copy one step's inputs into the static input buffers (rows beyond the real batch are
        the caller's padding)."""
        self.view("tokens", batch).copy_(tokens, non_blocking=True)
        self.view("seq_lens", batch).copy_(seq_lens, non_blocking=True)
        self.view("cache_slots", batch).copy_(cache_slots, non_blocking=True)

    def output(self, batch: int) -> torch.Tensor:
        return self.view(self.schedule.graph.graph["outputs"][0], batch)


def weight_readers(schedules: Mapping[int, Schedule]) -> dict[str, tuple[tuple, list]]:
    """Weight name -> (its shape, [(batch size, kernel) of every kernel that reads it]), over
    the schedules of one build (batch size -> Schedule)."""
    readers: dict[str, tuple[tuple, list]] = {}
    for batch, schedule in schedules.items():
        for k in schedule.kernels:
            for name, shape in k.op.weight_shapes().values():
                readers.setdefault(name, (tuple(shape), []))[1].append((batch, k))
    return readers


def _reads_blocks(k, batch: int, sms: int) -> bool:
    reads = k.op.implementations[k.impl].reads_blocks
    return reads is not None and reads(k.op, batch, sms)


def blocked_weights(schedules: Mapping[int, Schedule], sms: int, rows: int = weight_blocks.BLOCK) -> set[str]:
    """The weights a build of these schedules on a GPU of ``sms`` SMs stores in blocks of
    ``rows`` x 64 (kernels/weight_blocks.py): those whose every reader, at every captured batch size, reads
    blocks (the decode GEMM, 2-7% faster from them, wherever they leave its choice of kernel as
    it is: ``gemm.reads_blocks``; bench/gemm_notes.md §33-§34). A weight that any kernel reads
    row-major stays so: one copy of each weight, in one order, serves every captured graph.
    (So a build that also captures a batch size where a layer runs cuBLAS keeps that layer's
    weight row-major at every size.)"""
    return {name for name, (shape, readers) in weight_readers(schedules).items()
            if weight_blocks.blockable(shape, rows) and all(_reads_blocks(k, batch, sms) for batch, k in readers)}


def row_major_for_some_sizes(schedules: Mapping[int, Schedule], sms: int,
                             rows: int = weight_blocks.BLOCK) -> dict[str, tuple[int, object]]:
    """Weight name -> (batch size, kernel) of its first row-major reader, for the weights that
    the decode GEMM reads in blocks at some captured sizes but a kernel reads row-major
    at others: what ``blocked_weights`` keeps row-major at every size (a build says so)."""
    kept = {}
    for name, (shape, readers) in weight_readers(schedules).items():
        by_rows = [(batch, k) for batch, k in readers if not _reads_blocks(k, batch, sms)]
        if by_rows and len(by_rows) < len(readers) and weight_blocks.blockable(shape, rows):
            kept[name] = by_rows[0]
    return kept


def check_weight_orders(schedules: Mapping[int, Schedule], weights: Weights, sms: int) -> None:
    """Refuse a build whose kernels cannot read the weights in the order they are stored: a
    weight in blocks that some kernel reads row-major (a ``Weights`` object that another
    build stored in blocks, shared with a build that runs cuBLAS on it)."""
    for name, (_, readers) in weight_readers(schedules).items():
        if weights.is_blocked(name):
            for batch, k in readers:
                if not _reads_blocks(k, batch, sms):
                    raise GraphcError(
                        f"weight {name} is stored in {weight_blocks.block_rows(weights[name])} x "
                        f"{weight_blocks.BLOCK} blocks (an earlier build sharing these "
                        f"Weights put it there), but {k.node} at batch {batch} runs {k.impl}, which "
                        f"reads it row-major; give this build its own weights, or build both with "
                        f"block_weights=False")


@dataclass(frozen=True)
class MemoryLayout:
    """Where a plan's buffers live at one largest batch size, and the device bytes it takes,
    computed without allocating anything.

    slab_of: activation buffer -> slab index; slabs: (numel, dtype) of each slab (activations
    whose lifetimes, producer .. last reader in kernel order, do not overlap share one);
    every other buffer (inputs, state such as the KV cache) has its own tensor."""

    max_batch: int
    slots: int
    slab_of: dict
    slabs: list
    weight_bytes: int
    kv_cache_bytes: int           # state with a leading "slots" dimension
    other_state_bytes: int        # prefix, saved blocks, step inputs
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.other_state_bytes + self.activation_bytes

    def describe(self, weight_bytes: int | None = None) -> str:
        """What takes the memory; ``weight_bytes``: the weights still to allocate (default all)."""
        w = self.weight_bytes if weight_bytes is None else weight_bytes
        weights = f"weights {w / 1e9:.2f} GB" if w else "weights already on the device"
        return (f"{weights}, KV cache {self.kv_cache_bytes / 1e9:.2f} GB ({self.slots} slots: batch "
                f"{self.max_batch} + 1 for padding), activations and state "
                f"{(self.activation_bytes + self.other_state_bytes) / 1e9:.2f} GB")


def memory_layout(schedule: Schedule, max_batch: int) -> MemoryLayout:
    """The buffers of ``schedule``'s graph at ``max_batch`` rows (module docstring), and what
    they and the weights take on the device."""
    sizes = {"T": max_batch, "slots": max_batch + 1}
    buffers: dict[str, Buffer] = schedule.graph.graph["buffers"]
    kernels = schedule.kernels
    born, last_use = {}, {}
    for k in kernels:
        for v in k.op.reads.values():
            last_use[v.buffer.name] = k.index
        for v in k.op.writes.values():
            born.setdefault(v.buffer.name, k.index)
    for out in schedule.graph.graph["outputs"]:
        last_use[out] = len(kernels)           # outputs outlive the step
    slab_of, slabs, free_after = {}, [], []
    kv = other = 0
    for name, buf in buffers.items():
        if buf.kind != "activation":
            if buf.kind == "state" and buf.dims and buf.dims[0] == "slots":
                kv += buf.nbytes(sizes)
            else:
                other += buf.nbytes(sizes)
            continue
        numel = math.prod(buf.shape(sizes))
        start, end = born[name], last_use.get(name, born[name])
        i = next((i for i, (n, d) in enumerate(slabs)
                  if n == numel and d == buf.dtype and free_after[i] < start), None)
        if i is None:
            i = len(slabs)
            slabs.append((numel, buf.dtype))
            free_after.append(end)
        free_after[i] = end
        slab_of[name] = i
    activations = sum(n * DTYPES[d].itemsize for n, d in slabs)
    return MemoryLayout(max_batch, max_batch + 1, slab_of, slabs, weight_bytes(schedule.graph), kv,
                        other, activations)


# Device memory beyond the buffers and the weights: kernel workspaces (the decode GEMM's
# partials: at most ~35 MB), cuBLAS's workspace, the captured graphs' private pools (33 MB at
# 32-64 rows on kimi_k3_dense_8l) and compiled modules.
DEVICE_HEADROOM_BYTES = 1 << 30


def check_fits(schedule: Schedule, max_batch: int, free_bytes: int, device_name: str,
               new_weight_bytes: int | None = None, transient_bytes: int = 0,
               memory: str = "GPU memory", total_bytes: int | None = None) -> MemoryLayout:
    """Refuse, before anything is allocated, a build whose buffers and weights cannot fit in
    ``free_bytes``; say what takes the memory and the largest batch size that would fit.

    new_weight_bytes: the weights still to be allocated (None: all of them; 0 when they are
    already on the device); transient_bytes: the peak of temporaries while creating them;
    total_bytes: the device's whole memory, which tells a device too small for the model from
    one whose memory other tensors or processes hold now."""
    layout = memory_layout(schedule, max_batch)
    weights = layout.weight_bytes if new_weight_bytes is None else new_weight_bytes

    def need(lay: MemoryLayout) -> int:
        return lay.total_bytes - lay.weight_bytes + weights + transient_bytes + DEVICE_HEADROOM_BYTES

    if need(layout) <= free_bytes:
        return layout
    lo, hi = 0, max_batch            # the largest batch that fits is in [lo, hi): need grows with it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(memory_layout(schedule, mid)) <= free_bytes else (lo, mid)
    fits = lo
    spec = schedule.spec
    workspace = transient_bytes + DEVICE_HEADROOM_BYTES
    if fits:
        advice = f"Capture batch sizes up to {fits}, or lower model.max_context ({spec.model.max_context}) in {spec.path}"
    elif weights and weights + workspace > free_bytes:
        # No KV cache however small makes room: only more free memory helps, which an idle
        # device of this size has unless the model is larger than the device itself.
        alone = f"The weights alone ({weights / 1e9:.1f} GB, {(weights + workspace) / 1e9:.1f} GB with the workspace)"
        if total_bytes is not None and need(memory_layout(schedule, 1)) <= total_bytes:
            advice = (f"{alone} do not fit in what is free: {(total_bytes - free_bytes) / 1e9:.1f} GB of its "
                      f"{total_bytes / 1e9:.1f} GB are in use (by this process or another); free them, "
                      f"or build on an idle device.")
        else:
            advice = f"{alone} do not fit: this model needs a device with more memory."
    else:
        advice = f"No batch size fits: lower model.max_context ({spec.model.max_context}) in {spec.path}"
    raise GraphcError(
        f"{spec.model.name} at batch sizes up to {max_batch} needs {need(layout) / 1e9:.1f} GB of "
        f"{memory}: {layout.describe(weights)}, workspace {workspace / 1e9:.1f} GB; "
        f"{device_name} has {free_bytes / 1e9:.1f} GB free. " + advice)
