"""Reading a CUDA graph's nodes and typed edges through cuda-bindings (the driver API).

``cudaGraphDebugDotPrint`` does not show edge types, so the edge check reads them with
``cuGraphGetEdges`` (edge data carries the dependency type) on the graph that
``torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph()`` exposes.
"""

from __future__ import annotations

from dataclasses import dataclass


def _driver():
    from cuda.bindings import driver
    return driver


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    cu = _driver()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return result[1:] if isinstance(result, tuple) else ()


@dataclass
class GraphEdges:
    kernel_nodes: int
    programmatic: list[tuple[int, int]]
    total_edges: int


def read_edges(raw_graph) -> GraphEdges:
    cu = _driver()
    graph = cu.CUgraph(int(raw_graph))
    _, count = _check(cu.cuGraphGetNodes(graph, 0))
    nodes, _ = _check(cu.cuGraphGetNodes(graph, count))
    kernel_nodes = 0
    for n in nodes:
        (kind,) = _check(cu.cuGraphNodeGetType(n))
        kernel_nodes += kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    out = _check(cu.cuGraphGetEdges(graph, 0))
    count = out[-1]
    out = _check(cu.cuGraphGetEdges(graph, count))
    frm, to, data = out[0], out[1], out[2]
    programmatic = []
    for a, b, d in zip(frm, to, data):
        if d.type == cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC:
            programmatic.append((int(a), int(b)))
    return GraphEdges(kernel_nodes, programmatic, len(frm))


def capture_nodes(stream) -> set[int]:
    """Every node captured so far into the graph that ``stream`` is capturing."""
    cu = _driver()
    out = _check(cu.cuStreamGetCaptureInfo(cu.CUstream(stream.cuda_stream)))
    # (status, id, graph, dependencies, edge data, count)
    graph = out[2]
    _, count = _check(cu.cuGraphGetNodes(graph, 0))
    nodes, _ = _check(cu.cuGraphGetNodes(graph, count))
    return {int(n) for n in nodes}
