"""Spec -> dataflow graph: one node per op instance, SSA values on the edges.

Node names are what a person searches for: ``embed``, ``L07.attn_res.attn`` (the AttnRes call
before layer 7's attention), ``L07.attn.qkv``, ``L07.attn.attention``, ``L07.attn.o_proj``,
``L07.attn_res.mlp``, ``L07.mlp.gate_up`` (with silu(gate)·up fused), ``L07.mlp.down``,
``final.attn_res``, ``lm_head``. With ``residual: plain`` the residual nodes are named
``L07.residual.attn`` / ``final.residual``.

Edges carry the values that flow (``values``) and their hazard kind: ``raw`` (the consumer
reads what the producer wrote) or ``war`` (the consumer overwrites a version the producer
still reads). Node order (``order``) is program order.
"""

from __future__ import annotations

import math

import networkx as nx

from .ops.attention import DecodeAttentionOp
from .ops.attn_res import AttnResOp
from .ops.base import Buffer, Op, Value
from .ops.elementwise import EmbeddingOp
from .ops.linear import LinearOp, output_width
from .spec import Spec


class _Builder:
    def __init__(self, spec: Spec):
        self.spec = spec
        self.ops: list[Op] = []
        self.buffers: dict[str, Buffer] = {}
        self.current: dict[str, Value] = {}

    def buffer(self, name, dims, dtype="bfloat16", kind="activation") -> Buffer:
        buf = Buffer(name, tuple(dims), dtype, kind)
        self.buffers[name] = buf
        if kind != "activation":
            self.current[name] = Value(buf, 0)
        return buf

    def activation(self, op_name: str, width: int) -> Value:
        return Value(self.buffer(f"{op_name}.out", ("T", width)))

    def bump(self, name: str) -> Value:
        """A new version of a state buffer (an in-place update)."""
        old = self.current[name]
        self.current[name] = Value(old.buffer, old.version + 1)
        return self.current[name]

    def add(self, op: Op) -> Op:
        self.ops.append(op)
        return op


def build_graph(spec: Spec) -> nx.DiGraph:
    m = spec.model
    D = m.hidden
    attn_res = spec.residual.kind == "attn_res"
    S = spec.residual.block_size if attn_res else 1
    NB = spec.num_blocks() if attn_res else 0
    res_name = "attn_res" if attn_res else "residual"
    b = _Builder(spec)

    tokens = b.buffer("tokens", ("T",), "int64", "input")
    seq_lens = b.buffer("seq_lens", ("T",), "int32", "input")
    cache_slots = b.buffer("cache_slots", ("T",), "int32", "input")
    b.buffer("prefix", ("T", D), kind="state")
    if NB:
        b.buffer("blocks", ("T", NB, D), kind="state")

    embed = b.add(EmbeddingOp("embed", reads={"tokens": Value(tokens)},
                              writes={"out": b.activation("embed", D)}, vocab=m.vocab, hidden=D))
    incoming = embed.writes["out"]

    def residual(name, delta, *, nb, has_delta, write, final=False, eps=m.rms_eps):
        reads = {"delta": delta}
        if has_delta:
            reads["prefix"] = b.current["prefix"]
        if nb:
            reads["blocks"] = b.current["blocks"]
        writes = {"prefix": b.bump("prefix"), "out": b.activation(name, D)}
        if write >= 0:
            writes["blocks"] = b.bump("blocks")
        op = AttnResOp(name, reads=reads, writes=writes, hidden=D, nb=nb, has_delta=has_delta,
                       write=write, final=final, eps=m.rms_eps, out_eps=eps,
                       learned_mixing=attn_res)
        return b.add(op).writes["out"]

    def linear(name, x, k, n, weight_name="", epilogue=None):
        writes = {"out": b.activation(name, output_width(n, epilogue))}
        if epilogue is not None:        # the unfused path's bf16 projection (cuBLAS)
            writes["scratch"] = b.activation(f"{name}.scratch", n)
        op = LinearOp(name, reads={"x": x}, writes=writes, k=k, n=n, weight_name=weight_name,
                      epilogue=epilogue)
        return b.add(op).writes["out"]

    for layer in spec.layers:
        l, at, mlp = layer.index, layer.attention, layer.mlp
        p = f"L{l:02d}"
        start = attn_res and l % S == 0
        nb_before = math.ceil(l / S) if attn_res else 0

        # AttnRes before attention: a block start saves the finished block (or, at layer 0,
        # the embedding) into its slot.
        h = residual(f"{p}.{res_name}.attn", incoming, nb=nb_before, has_delta=l > 0,
                     write=l // S if start else -1)
        qkv = linear(f"{p}.attn.qkv", h, D, at.qkv_dim)
        # Head-major KV cache: one (slot, K|V, head) is a contiguous [max_context, head_dim]
        # run, so attention streams each head's cached tokens as one block of memory.
        kv = b.buffer(f"{p}.kv", ("slots", 2, at.kv_heads, m.max_context, at.head_dim), kind="state")
        attn = b.add(DecodeAttentionOp(
            f"{p}.attn.attention",
            reads={"qkv": qkv, "kv": b.current[kv.name], "seq_lens": Value(seq_lens),
                   "cache_slots": Value(cache_slots)},
            writes={"out": b.activation(f"{p}.attn.attention", at.q_dim), "kv": b.bump(kv.name)},
            heads=at.heads, kv_heads=at.kv_heads, head_dim=at.head_dim, max_context=m.max_context,
        )).writes["out"]
        a = linear(f"{p}.attn.o_proj", attn, at.q_dim, D)

        # AttnRes before the MLP: at a block start the attention output opens the new block.
        h = residual(f"{p}.{res_name}.mlp", a, nb=nb_before + int(start), has_delta=not start,
                     write=-1)
        act = linear(f"{p}.mlp.gate_up", h, D, mlp.gate_up_dim, epilogue="silu_mul")
        incoming = linear(f"{p}.mlp.down", act, mlp.intermediate, D)

    out = residual(f"final.{res_name}", incoming, nb=NB, has_delta=True, write=-1, final=True,
                   eps=spec.final_norm_eps)
    linear("lm_head", out, D, m.vocab, weight_name="embed.weight" if spec.tie_embeddings else "")
    return _to_networkx(spec, b)


def _to_networkx(spec: Spec, b: _Builder) -> nx.DiGraph:
    g = nx.DiGraph(spec=spec, buffers=b.buffers, outputs=["lm_head.out"])
    producer: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    for order, op in enumerate(b.ops):
        layer = int(op.name.split(".")[0][1:]) if op.name.startswith("L") else None
        g.add_node(op.name, op=op, kind=op.kind, order=order, layer=layer)
        for value in op.reads.values():
            if value.name in producer:
                _link(g, producer[value.name], op.name, value.name, "raw")
            readers.setdefault(value.name, []).append(op.name)
        for value in op.writes.values():
            if value.version > 0:   # overwrites the previous version: its readers go first
                previous = Value(value.buffer, value.version - 1).name
                for reader in readers.get(previous, []):
                    if reader != op.name:
                        _link(g, reader, op.name, previous, "war")
            producer[value.name] = op.name
    g.graph["inputs"] = sorted({v.name for op in b.ops for v in op.reads.values()
                                if v.name not in producer})
    assert nx.is_directed_acyclic_graph(g)
    return g


def _link(g: nx.DiGraph, src: str, dst: str, value: str, hazard: str) -> None:
    if g.has_edge(src, dst):
        data = g.edges[src, dst]
        if value not in data["values"]:
            data["values"].append(value)
        if hazard == "raw":
            data["hazard"] = "raw"
    else:
        g.add_edge(src, dst, values=[value], hazard=hazard)


def ops_in_order(g: nx.DiGraph) -> list[Op]:
    return [g.nodes[n]["op"] for n in sorted(g.nodes, key=lambda n: g.nodes[n]["order"])]


def weight_shapes(g: nx.DiGraph) -> dict[str, tuple[int, ...]]:
    """Every weight the step reads, by name (tied weights appear once)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for op in ops_in_order(g):
        for name, shape in op.weight_shapes().values():
            if shapes.setdefault(name, shape) != shape:
                raise ValueError(f"weight {name} is used with shapes {shapes[name]} and {shape}")
    return shapes


def weight_bytes(g: nx.DiGraph) -> int:
    return sum(2 * math.prod(s) for s in weight_shapes(g).values())


def describe_node(g: nx.DiGraph, name: str) -> str:
    """A few lines about one node for ``graphc inspect SPEC NODE``."""
    op: Op = g.nodes[name]["op"]
    lines = [f"{name}  ({op.kind})"]
    for key, val in op.params().items():
        lines.append(f"  {key:10} {val}")
    for role, v in op.reads.items():
        lines.append(f"  reads  {role:11} {v.name:32} {format_dims(v.buffer.dims)}")
    for role, v in op.writes.items():
        lines.append(f"  writes {role:11} {v.name:32} {format_dims(v.buffer.dims)}")
    for role, (wname, shape) in op.weight_shapes().items():
        lines.append(f"  weight {role:11} {wname:32} {list(shape)}")
    preds = [f"{p} ({','.join(g.edges[p, name]['values'])}, {g.edges[p, name]['hazard']})"
             for p in g.predecessors(name)]
    succs = [f"{s} ({g.edges[name, s]['hazard']})" for s in g.successors(name)]
    lines.append(f"  after  {', '.join(preds) or '-'}")
    lines.append(f"  before {', '.join(succs) or '-'}")
    return "\n".join(lines)


def format_dims(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"
