"""One CUDA graph per batch size, captured from the schedule, and the edge check (DESIGN §5).

Every kernel is compiled and warmed up before any capture; the graphs are captured largest
batch first into one shared memory pool; every launch gets the capturing stream. Each batch
size has its own schedule (the same kernels in the same order, possibly other
implementations and edges); after each capture the graph's edges are read back with their
types and compared with that batch size's schedule: the programmatic edges must be exactly
its PDL edges.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .errors import GraphcError
from .plan import Plan
from .schedule import Schedule


class EdgeMismatch(GraphcError):
    pass


@dataclass
class CapturedGraph:
    batch: int
    graph: torch.cuda.CUDAGraph
    capture_s: float
    memory_bytes: int
    kernel_nodes: int
    pdl_edges: int                    # programmatic edges found in the captured graph
    # What the graph was captured on; held so that no later stream takes its address (and
    # so its cuBLAS workspace) while the graph lives. graphc/capture_stream.py.
    capture_stream: object = None
    stats: dict = field(default_factory=dict)

    def replay(self) -> None:
        self.graph.replay()


def launch_all(plan: Plan, batch: int, stream: torch.cuda.Stream,
               after_each: Callable[[int], None] | None = None,
               edge_override: Mapping[str, str] | None = None,
               schedule: Schedule | None = None) -> None:
    """Enqueue every kernel of ``schedule`` (default: the plan's) on ``stream``, eagerly or
    under capture."""
    schedule = schedule or plan.schedule
    for k, b in zip(plan.kernels_of(schedule), plan.bindings(batch)):
        edge = (edge_override or {}).get(k.node, k.edge)
        k.op.implementations[k.impl].launch(k.op, b.tensors, b.weights, stream, edge == "pdl",
                                            plan.workspaces)
        if after_each is not None:
            after_each(k.index)


def prepare(plan: Plan, schedules: Mapping[int, Schedule],
            progress: Callable[[str], None] = lambda s: None) -> None:
    """Compile every kernel and run each batch size once with its schedule, outside any capture."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i, batch in enumerate(sorted(schedules, reverse=True)):
            plan.view("cache_slots", batch).fill_(plan.scratch_slot)   # warm-up writes no live slot
            plan.view("seq_lens", batch).zero_()
            launch_all(plan, batch, side, schedule=schedules[batch])
            progress(f"warm-up batch {batch} ({i + 1}/{len(schedules)}, "
                     f"{time.perf_counter() - t0:.1f} s)")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_all(plan: Plan, schedules: Mapping[int, Schedule],
                progress: Callable[[str], None] = lambda s: None,
                edge_override: Mapping[str, str] | None = None) -> dict[int, CapturedGraph]:
    """One graph per batch size (the keys of ``schedules``), largest first, one memory pool."""
    prepare(plan, schedules, progress)
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for batch in sorted(schedules, reverse=True):
        graphs[batch] = capture_one(plan, batch, pool, edge_override, schedules[batch])
        g = graphs[batch]
        progress(f"captured batch {batch}: {g.kernel_nodes} kernels, {g.pdl_edges} PDL edges, "
                 f"{g.capture_s * 1e3:.0f} ms")
    return graphs


def capture_one(plan: Plan, batch: int, pool, edge_override=None,
                schedule: Schedule | None = None) -> CapturedGraph:
    from . import graph_edges

    schedule = schedule or plan.schedule
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    capture_stream = plan.capture_stream()      # the plan's own: its cuBLAS workspace too
    created: list[set[int]] = []       # graph nodes enqueued by each kernel of the schedule
    seen: set[int] = set()

    def record(i: int) -> None:
        nodes = graph_edges.capture_nodes(current)
        created.append(nodes - seen)
        seen.update(nodes)

    with torch.cuda.graph(g, pool=pool, stream=capture_stream.stream):
        # Entering the capture empties the allocator's cache: measure from here.
        reserved = torch.cuda.memory_reserved()
        current = torch.cuda.current_stream()
        launch_all(plan, batch, current, after_each=record, edge_override=edge_override,
                   schedule=schedule)
    edges = graph_edges.read_edges(g.raw_cuda_graph())
    g.instantiate()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    found = check_programmatic_edges(schedule, edges, created)
    return CapturedGraph(batch, g, capture_s, torch.cuda.memory_reserved() - reserved,
                         edges.kernel_nodes, found, capture_stream)


def check_programmatic_edges(schedule: Schedule, edges, created: list[set[int]]) -> int:
    """Fail unless the captured programmatic edges between kernels of the schedule are exactly
    the schedule's PDL edges. Returns how many were found.

    ``created[i]`` holds the graph nodes kernel i enqueued. A library call may enqueue several
    kernels and link them with programmatic edges of its own (cuBLAS split-K does): such an
    edge inside one op is the library's business and is not counted.
    """
    kernels = schedule.kernels
    owner = {node: i for i, nodes in enumerate(created) for node in nodes}
    expected = {(kernels[i - 1].node, kernels[i].node) for i in range(1, len(kernels))
                if kernels[i].edge == "pdl"}
    found = set()
    for src, dst in edges.programmatic:
        if src not in owner or dst not in owner:
            raise EdgeMismatch(f"captured graph has a programmatic edge {src:#x} -> {dst:#x} "
                               f"between nodes no kernel of the schedule enqueued")
        a, b = owner[src], owner[dst]
        if a != b:
            found.add((kernels[a].node, kernels[b].node))
    if found != expected:
        missing = sorted(expected - found)
        extra = sorted(found - expected)
        raise EdgeMismatch(
            "captured graph does not match the schedule: "
            f"PDL edges not captured as programmatic: {missing[:5]}{'...' if len(missing) > 5 else ''}; "
            f"programmatic edges the schedule did not choose: {extra[:5]}{'...' if len(extra) > 5 else ''}")
    return len(found)
