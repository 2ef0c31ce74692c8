"""Static memory for a schedule: every buffer, every weight, bound to every kernel.

One set of buffers is allocated for the largest batch size; a smaller batch uses the first
rows of each (so all captured graphs share memory and a replay at any size sees the same
KV cache). Activations whose lifetimes do not overlap share a slab. The KV cache has one
slot more than the largest batch: padded rows write into that scratch slot, never into a
live sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import GraphcError
from .graph import weight_shapes
from .ops.base import Buffer
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
        expected = weight_shapes(schedule.graph)
        for name, shape in expected.items():
            if name not in weights.tensors or tuple(weights[name].shape) != tuple(shape):
                raise GraphcError(f"weight {name}: expected shape {list(shape)}")
        self.buffers: dict[str, Buffer] = schedule.graph.graph["buffers"]
        self.storage = self._allocate()
        self._bindings: dict[int, list[Binding]] = {}

    @property
    def max_sizes(self) -> dict[str, int]:
        return {"T": self.max_batch, "slots": self.slots}

    def _allocate(self) -> dict[str, torch.Tensor]:
        """Buffer name -> tensor at the largest size; activations share slabs where their
        lifetimes (producer .. last reader, in kernel order) do not overlap."""
        kernels = self.schedule.kernels
        born, last_use = {}, {}
        for k in kernels:
            for v in k.op.reads.values():
                last_use[v.buffer.name] = k.index
            for v in k.op.writes.values():
                born.setdefault(v.buffer.name, k.index)
        for out in self.schedule.graph.graph["outputs"]:
            last_use[out] = len(kernels)           # outputs outlive the step
        storage, slabs = {}, []                     # slabs: [numel, dtype, free_after, tensor]
        for name, buf in self.buffers.items():
            shape = buf.shape(self.max_sizes)
            numel = 1
            for s in shape:
                numel *= s
            if buf.kind != "activation":      # inputs and state start zeroed (an empty KV cache)
                storage[name] = torch.zeros(shape, dtype=buf.torch_dtype, device=self.device)
                continue
            start, end = born[name], last_use.get(name, born[name])
            slab = next((s for s in slabs if s[0] == numel and s[1] == buf.dtype and s[2] < start), None)
            if slab is None:
                slab = [numel, buf.dtype, end, torch.empty(numel, dtype=buf.torch_dtype, device=self.device)]
                slabs.append(slab)
            slab[2] = end
            storage[name] = slab[3]
        self.activation_bytes = sum(s[3].numel() * s[3].element_size() for s in slabs)
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
