"""What every op kind shares: buffers and SSA values, PDL traits, and the Op interface.

A *buffer* is memory the step owns (an activation, the AttnRes prefix, the saved blocks, a
KV cache). A *value* is one version of a buffer: in-place updates (prefix, block slots, KV
appends) make a new version of the same buffer, so the scheduler sees every hazard.
Shapes are tuples whose entries are ints or the symbols ``"T"`` (rows in the batch) and
``"slots"`` (KV-cache sequence slots), resolved by the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping

import torch

Dim = int | str
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
}


@dataclass(frozen=True)
class Buffer:
    name: str
    dims: tuple[Dim, ...]
    dtype: str = "bfloat16"
    kind: str = "activation"      # "input" (host-written), "activation" or "state" (updated in place)

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)

    def nbytes(self, sizes: Mapping[str, int]) -> int:
        return math.prod(self.shape(sizes)) * DTYPES[self.dtype].itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Value:
    """One SSA version of a buffer."""

    buffer: Buffer
    version: int = 0

    @property
    def name(self) -> str:
        return f"{self.buffer.name}@{self.version}" if self.buffer.kind == "state" else self.buffer.name


@dataclass(frozen=True)
class PdlTraits:
    """How a kernel behaves under programmatic dependent launch (DESIGN §4).

    waits:     executes ``griddepcontrol.wait`` (library kernels such as cuBLAS do not);
    trigger:   "early" (launch_dependents before its wait), "late" (after it) or "exit"
               (no explicit trigger: dependents launch as its CTAs exit, which counts as late);
    prologue:  roles (inputs or weights) read before the wait;
    bypasses_l1: every load of step-written data skips L1 (ld.global.cg / relaxed gpu scope).
    """

    waits: bool
    trigger: str
    prologue: tuple[str, ...] = ()
    bypasses_l1: bool = False

    @property
    def triggers_late(self) -> bool:
        return self.trigger in ("late", "exit")


LIBRARY_KERNEL = PdlTraits(waits=False, trigger="exit")


def write_output(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` by a kernel. A torch implementation ends with this, not with a plain
    ``copy_``: between tensors of one dtype that is a memcpy, captured as a memcpy node, and the
    launch after a memcpy node gets a full edge even with the PDL attribute, so the captured
    graph would not have the PDL edge the schedule chose (graphc/capture.py refuses it). A
    copy that converts the dtype is a kernel, so fp32 -> bf16 goes straight through; the
    multiplication by one is exact in bf16 (-0 and NaN included)."""
    if dst.dtype != src.dtype:
        dst.copy_(src)
    else:
        torch.mul(src, 1, out=dst)


@dataclass(frozen=True)
class Implementation:
    """One way to run an op on the GPU: its PDL traits and how to launch it.

    ``launch(op, tensors, weights, stream, use_pdl, workspaces)`` enqueues the work on
    ``stream``; a split-K kernel takes its scratch memory from ``workspaces`` (the plan's own,
    kernels/workspaces.py). Its first call (compilation, workspace allocation) happens in the
    warm-up, outside capture.
    """

    name: str
    traits: PdlTraits
    launch: Callable
    available: Callable[[], bool] = lambda: True
    # The GPUs its code runs on: None (any CUDA GPU), "sm_90" (compute capability 9.0 or later:
    # it executes griddepcontrol) or "sm_90a" (9.0 only: CuTe DSL kernels compiled for sm_90a,
    # whose wgmma and cluster instructions no other architecture has).
    arch: str | None = None
    # The CuTe DSL kernel variants a launch at ``batch`` rows loads, as (kernel module,
    # compile-cache key) pairs: ``variants(op, batch, sms, block_rows)``, ``block_rows``
    # saying how the op's weights are stored: 0 row-major, else in blocks of that many rows
    # (kernels/weight_blocks.py). A build
    # compiles the ones not yet cached in parallel processes while its weights load
    # (graphc/compile_ahead.py). None: nothing to compile ahead (library kernels; Triton
    # compiles in the warm-up).
    variants: Callable | None = None
    # ``reads_blocks(op, batch, sms)``: whether a launch at ``batch`` rows on a GPU of ``sms``
    # SMs takes the op's weights stored in 64 x 64 blocks (kernels/weight_blocks.py) as well as
    # row-major ones, and streams them at least as fast. None: row-major only. A build stores
    # a weight in blocks where every kernel reading it does (graphc/plan.py).
    reads_blocks: Callable | None = None
    # ``describe(op, batch, sms)``: the configuration a launch at ``batch`` rows on ``sms`` SMs
    # runs (which kernel, its tiling), for `graphc inspect`. None: nothing to say beyond the name.
    describe: Callable | None = None

    def runs_on(self, capability: tuple[int, int]) -> bool:
        if self.arch is None:
            return True
        return tuple(capability) >= (9, 0) if self.arch == "sm_90" else tuple(capability) == (9, 0)


@dataclass(eq=False)
class Op:
    """One op instance: a node of the dataflow graph and a kernel of the schedule.

    ``reads`` and ``writes`` map roles to values. A state buffer updated in place appears in
    both under the same role (the plan binds both to the same memory).
    """

    kind: ClassVar[str] = "op"
    implementations: ClassVar[dict[str, Implementation]] = {}

    name: str
    reads: dict[str, Value] = field(default_factory=dict)
    writes: dict[str, Value] = field(default_factory=dict)

    # --- per-kind interface -------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """role -> (weight name, shape). Weights are bf16 and never written by the step."""
        return {}

    def reference(self, t: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor]) -> None:
        """Run the op with torch on the tensors bound to its roles (writes in place)."""
        raise NotImplementedError

    def params(self) -> dict:
        """Static parameters shown by ``graphc inspect`` and written to graph.json."""
        return {}

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """Fewest HBM bytes the op must move: each input read once, each output written once."""
        seen = {}
        for v in list(self.reads.values()) + list(self.writes.values()):
            seen[v.name] = v.buffer.nbytes(sizes)
        return sum(seen.values()) + self.weight_bytes()

    def flops(self, sizes: Mapping[str, int]) -> int:
        return 0

    # --- derived ------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return sum(2 * math.prod(shape) for _, shape in self.weight_shapes().values())

    def traits(self, impl: str) -> PdlTraits:
        return self.implementations[impl].traits

    def unsupported(self, impl: str, batch: int | None = None) -> str | None:
        """Why implementation ``impl`` cannot run this op's shape (at a captured ``batch``
        size, where one is known), or None where it can. Ops whose kernels take only some
        shapes override it; the scheduler refuses such a choice and never makes it by default."""
        return None

    def preference(self, batch: int | None = None) -> list[str]:
        """This op's implementations in order of preference at a captured ``batch`` size
        (None: no batch size known), installed here or not: the order of ``implementations``.
        Ops whose best implementation depends on the batch override it."""
        return list(self.implementations)

    def defaults_by_batch(self, max_batch: int, chosen=None) -> dict[str, list[tuple[int, int]]]:
        """Implementation -> the (first, last) spans of captured batch sizes 1..``max_batch``
        that get it by default here (``default_implementation``), in order of first use; with
        ``chosen`` (batch -> a caller's choice or None, graphc/choices.py) what a build with
        those choices gets."""
        spans: dict[str, list[tuple[int, int]]] = {}
        previous = None
        for batch in range(1, max_batch + 1):
            name = (chosen and chosen(batch)) or self.default_implementation(batch)
            if name == previous:
                first, _ = spans[name][-1]
                spans[name][-1] = (first, batch)
            else:
                spans.setdefault(name, []).append((batch, batch))
            previous = name
        return spans

    def default_implementation(self, batch: int | None = None) -> str:
        """The implementation a captured ``batch`` size gets: the first of ``preference(batch)``
        that is installed here and runs this shape."""
        for name in self.preference(batch):
            if self.implementations[name].available() and self.unsupported(name, batch) is None:
                return name
        raise RuntimeError(f"no implementation of {self.kind} is available")

