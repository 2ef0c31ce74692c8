"""Kernel order, the edge kind into every kernel, and the PDL safety proof (DESIGN §4).

The step is one stream of kernels k_0 ... k_n in program order. The edge into k_i is
``full`` (launch after k_{i-1} completes) or ``pdl`` (launch once every CTA of k_{i-1} has
triggered or exited). ``build_schedule`` chooses ``pdl`` wherever the rule allows it and
``verify`` re-checks any schedule (including hand-edited, unsafe ones) from scratch, giving
each refusal in a sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import networkx as nx

from .choices import Choices
from .errors import GraphcError, did_you_mean
from .graph import ops_in_order
from .ops.base import Op, PdlTraits


@dataclass(frozen=True)
class Launch:
    """One kernel of the schedule."""

    index: int
    op: Op
    impl: str
    traits: PdlTraits
    edge: str          # "full" | "pdl"
    reason: str

    @property
    def node(self) -> str:
        return self.op.name

    @property
    def phases(self) -> tuple[str, ...]:
        """What runs before and after the wait: AttnRes's ``pre`` and ``post``."""
        if not self.traits.waits:
            return ()
        return ("pre", "post") if self.op.kind == "attn_res" else ("prologue", "main")


@dataclass(frozen=True)
class Refusal:
    node: str
    message: str

    def __str__(self) -> str:
        return f"{self.node}: {self.message}"


class UnsafeSchedule(GraphcError):
    def __init__(self, refusals: list[Refusal]):
        self.refusals = refusals
        super().__init__("unsafe schedule:\n  " + "\n  ".join(map(str, refusals)))


@dataclass(frozen=True)
class Schedule:
    graph: nx.DiGraph
    kernels: tuple[Launch, ...]

    @property
    def spec(self):
        return self.graph.graph["spec"]

    def pdl_edges(self) -> list[tuple[str, str]]:
        return [(self.kernels[k.index - 1].node, k.node) for k in self.kernels if k.edge == "pdl"]

    def kernel(self, node: str) -> Launch:
        for k in self.kernels:
            if k.node == node:
                return k
        raise KeyError(node)

    def with_kernel(self, node: str, **changes) -> "Schedule":
        """A copy with one kernel changed (its ``edge``, ``traits``, ...): tests plant unsafe
        schedules this way, and ``verify`` must refuse them."""
        kernels = tuple(replace(k, **changes) if k.node == node else k for k in self.kernels)
        return Schedule(self.graph, kernels)

    def implementations(self) -> dict[str, str]:
        """Node -> implementation: exactly what runs (``build_schedule`` takes it back)."""
        return {k.node: k.impl for k in self.kernels}

    def implementation_summary(self) -> dict[str, str]:
        """Op kind -> its implementations in order of first use, e.g. ``"cute/cublas"``."""
        kinds: dict[str, list[str]] = {}
        for k in self.kernels:
            seen = kinds.setdefault(k.op.kind, [])
            if k.impl not in seen:
                seen.append(k.impl)
        return {kind: "/".join(impls) for kind, impls in kinds.items()}

    def __repr__(self) -> str:
        return f"<Schedule of {self.spec.model.name}: {len(self.kernels)} kernels, {self.describe()}>"

    def describe(self) -> str:
        """One line for people: ``"33 PDL edges; embedding torch, linear cute/cublas, ..."``."""
        impls = ", ".join(f"{kind} {impl}" for kind, impl in self.implementation_summary().items())
        return f"{len(self.pdl_edges())} PDL edges; {impls}"


# --- the rule ---------------------------------------------------------------------------------

def known_complete(kernels, i: int) -> tuple[int, str]:
    """Index of the last kernel known complete when k_i launches, and why."""
    if kernels[i].edge == "full":
        return i - 1, f"{kernels[i].node} is entered through a full edge"
    for j in range(i - 1, -1, -1):
        k = kernels[j]
        if k.edge == "full":
            return j - 1, f"{k.node} was entered through a full edge"
        if k.traits.triggers_late:
            return j - 1, f"{k.node} triggers its dependents only after its own wait"
    return -1, "no earlier kernel is known complete"


def _producers(kernels) -> dict[str, int]:
    producer = {}
    for k in kernels:
        for v in k.op.writes.values():
            producer[v.name] = k.index
    return producer


def pdl_problems(kernels, i: int, producer: Mapping[str, int]) -> list[str]:
    """Why a pdl edge into k_i is unsafe (empty when it is safe)."""
    k = kernels[i]
    if i == 0:
        return ["the first kernel of the step has no predecessor to overlap"]
    problems = []
    if not k.traits.waits:
        problems.append(
            f"entered through a pdl edge but {k.impl} never executes griddepcontrol.wait, so it "
            f"could read its inputs (and exit) before {kernels[i - 1].node} has finished")
    if not k.traits.bypasses_l1:
        problems.append("overlaps its predecessor but may load step-written data through L1, "
                        "where a stale line can survive the wait")
    upto, because = known_complete(kernels, i)
    weights = k.op.weight_shapes()
    for role in k.traits.prologue:
        if role in weights:
            continue                  # weights are never written during the step
        value = k.op.reads.get(role)
        if value is None or value.name not in producer:
            continue                  # not read by this instance, or a step input
        p = producer[value.name]
        if p > upto:
            known = (f"only kernels up to #{upto} ({kernels[upto].node}) are known complete "
                     f"because {because}" if upto >= 0 else because)
            problems.append(
                f"reads {value.name} before its wait, but its writer {kernels[p].node} (#{p}) "
                f"may still be running at launch: {known}")
    return problems


def verify(schedule: Schedule) -> list[Refusal]:
    """Every violation of the PDL rule (DESIGN §4), and order violations of the graph."""
    kernels = schedule.kernels
    refusals = []
    position = {k.node: k.index for k in kernels}
    for src, dst, data in schedule.graph.edges(data=True):
        if position[src] >= position[dst]:
            refusals.append(Refusal(dst, f"runs before {src}, which it must follow "
                                         f"({data['hazard']} on {', '.join(data['values'])})"))
    producer = _producers(kernels)
    for k in kernels:
        if k.edge == "pdl":
            refusals += [Refusal(k.node, p) for p in pdl_problems(kernels, k.index, producer)]
        elif k.edge != "full":
            refusals.append(Refusal(k.node, f"unknown edge kind {k.edge!r}"))
    return refusals


# --- choosing implementations for a GPU --------------------------------------------------------

_ARCH_WORDS = {"sm_90a": "sm_90a (H100/H200)", "sm_90": "sm_90 or later"}


def not_installed(graph: nx.DiGraph, batches: tuple[int | None, ...] = (None,)) -> dict[str, list[str]]:
    """Op kind -> its implementations that this machine cannot load (Triton or CuTe DSL not
    installed) although some op of ``graph`` would get one of them at one of ``batches`` where
    they are: a build here schedules a later one instead, a machine that has them would not."""
    missing: dict[str, list[str]] = {}
    unavailable: dict[tuple[str, str], bool] = {}        # available() once per (kind, name)
    for op in ops_in_order(graph):
        for batch in batches:
            for name in op.preference(batch):
                if op.unsupported(name, batch) is not None:
                    continue
                key = (op.kind, name)
                if key not in unavailable:
                    unavailable[key] = not op.implementations[name].available()
                if not unavailable[key]:
                    break                                # what this build schedules
                if name not in missing.get(op.kind, []):
                    missing.setdefault(op.kind, []).append(name)
    return missing


def implementations_for_gpu(graph: nx.DiGraph, capability: tuple[int, int], gpu: str,
                            implementations: Mapping[str, str] | None = None,
                            batches: tuple[int | None, ...] = (None,)) -> tuple[dict[str, str], list[str]]:
    """The implementation choices to build with on a GPU of compute ``capability`` (named
    ``gpu`` in messages), and what was substituted, in words.

    The caller's choices stand (graphc/choices.py); a choice this GPU cannot run is refused,
    naming the node and what it needs, even at sizes not captured. Every op kind whose default
    at one of ``batches`` the caller leaves open cannot run here (graphc's CuTe DSL kernels are
    sm_90a code: H100/H200) gets the first of its implementations that can, for all such batch
    sizes: correct everywhere, without the Hopper kernels' speed."""
    choices = Choices(implementations)
    cc = f"sm_{capability[0]}{capability[1]}"
    substituted: dict[str, str] = {}
    notes = []

    def runnable(op) -> list[str]:
        return [n for n, i in op.implementations.items()
                if i.runs_on(capability) and i.available() and op.unsupported(n) is None]

    for op in ops_in_order(graph):
        for explicit in choices.names_for(op):
            impl = op.implementations.get(explicit)
            why = None
            if impl is not None and not impl.runs_on(capability):
                why = f"needs {_ARCH_WORDS[impl.arch]}; {gpu} is {cc}"
            elif impl is not None and not impl.available():
                why = "is not available here (its package is not installed)"
            if why:
                raise GraphcError(f"{op.name}: implementation {explicit!r} of {op.kind} {why}. Choose one of "
                                  f"{', '.join(runnable(op)) or 'none: no implementation runs there'}")
        if choices.everywhere(op) or op.kind in substituted:
            continue
        defaults = {op.default_implementation(b) for b in batches if choices.for_op(op, b) is None}
        blocked = sorted(d for d in defaults if not op.implementations[d].runs_on(capability))
        if not blocked:
            continue
        portable = next(iter(runnable(op)), None)
        if portable is None:
            raise GraphcError(f"{op.name}: no implementation of {op.kind} runs on {gpu} ({cc})")
        substituted[op.kind] = portable
        notes.append(f"{op.kind}: {portable} instead of "
                     + ", ".join(f"{d} ({op.implementations[d].arch})" for d in blocked))
    # The portable implementation is the kind's last resort: after the caller's own terms for
    # the kind (a kind entry that already ends in a bare name never falls through to it).
    merged = dict(choices.raw)
    for kind, portable in substituted.items():
        merged[kind] = f"{merged[kind]},{portable}" if kind in merged else portable
    return merged, notes


# --- choosing edges -----------------------------------------------------------------------------

def build_schedule(graph: nx.DiGraph, implementations: Mapping[str, str] | None = None,
                   use_pdl: bool = True, batch: int | None = None) -> Schedule:
    """Program order; a pdl edge into every kernel whose PDL rule holds, full otherwise.

    ``implementations`` maps a node name or an op kind to an implementation name, or to
    implementations per span of batch sizes (graphc/choices.py; the node's entry is read
    first); other ops get their default at this captured ``batch`` size
    (``Op.default_implementation``). Each batch size may
    therefore get a different schedule: the same kernels in the same order, with other
    implementations and so other edges.
    """
    choices = Choices(implementations)
    ops = ops_in_order(graph)
    nodes, kinds = [op.name for op in ops], {op.kind for op in ops}
    unknown = sorted(choices.unmatched(nodes, kinds))
    if unknown:
        raise GraphcError(f"implementations: {', '.join(map(repr, unknown))} is neither an op kind "
                          f"nor a node of this graph, nor a pattern matching one"
                          f"{did_you_mean(unknown[0], sorted(kinds | set(nodes)))}")
    kernels: list[Launch] = []
    producer: dict[str, int] = {}
    for i, op in enumerate(ops):
        # Every name the caller gives must exist, also at sizes this schedule is not for.
        for name in choices.names_for(op):
            if name not in op.implementations:
                raise GraphcError(f"{op.name}: no implementation {name!r} of {op.kind} "
                                  f"(have {', '.join(op.implementations)})"
                                  f"{did_you_mean(name, op.implementations)}")
        impl = choices.for_op(op, batch) or op.default_implementation(batch)
        why_not = op.unsupported(impl, batch)
        if why_not:
            raise GraphcError(f"{op.name}: implementation {impl!r} cannot run this {op.kind}: {why_not}")
        traits = op.traits(impl)
        launch = Launch(i, op, impl, traits, "pdl", "")
        kernels.append(launch)
        if not use_pdl:
            problems = ["PDL is switched off for this build"]
        elif i == 0:
            problems = ["the first kernel of the step has nothing to overlap"]
        elif not traits.waits:
            problems = [f"{impl} never executes griddepcontrol.wait, so it may start only once "
                        f"{kernels[i - 1].node} has completed"]
        else:
            problems = pdl_problems(kernels, i, producer)
        if problems:
            kernels[i] = replace(launch, edge="full", reason="; ".join(problems))
        else:
            kernels[i] = replace(launch, reason=_why_safe(kernels, i, producer))
        for v in op.writes.values():
            producer[v.name] = i
    schedule = Schedule(graph, tuple(kernels))
    refusals = verify(schedule)
    if refusals:
        raise UnsafeSchedule(refusals)
    return schedule


def _why_safe(kernels, i: int, producer) -> str:
    k = kernels[i]
    upto, because = known_complete(kernels, i)
    early = [r for r in k.traits.prologue if r in k.op.reads and k.op.reads[r].name in producer]
    read_before = ", ".join(k.op.reads[r].name for r in early)
    text = f"waits before reading step-written data; triggers {k.traits.trigger}"
    if read_before:
        text += (f"; reads {read_before} before its wait, complete at launch because {because}")
    elif any(r in k.op.weight_shapes() for r in k.traits.prologue):
        text += "; reads only weights before its wait"
    return text
