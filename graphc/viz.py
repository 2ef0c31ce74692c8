"""Pictures of a compiled step: the dataflow graph (DOT / SVG) and the schedule timeline (HTML).

* :func:`to_dot` -- the dataflow graph in Graphviz DOT: one node per op (name and kind, coloured
  by kind), one cluster per decoder layer, edges labelled with the SSA values that flow; ``war``
  hazard edges are dashed and grey.
* :func:`write_dataflow_svg` -- that graph as SVG, through Graphviz ``dot`` when it is installed
  and by a small built-in layered layout otherwise (no extra dependencies).
* :func:`schedule_html` / :func:`write_schedule_html` -- a self-contained HTML page (inline CSS
  and SVG, no scripts, no network references) with the kernels in launch order as a timeline:
  the edge into every kernel (``pdl`` and ``full`` in clearly different colours), AttnRes's
  ``pre``/``post`` phases (``prologue``/``main`` for other waiting kernels), and the reason for
  every edge (hover tooltip and a table). With a measured profile the bars are drawn to scale.
* :func:`write_viz` -- picks one of the above from the file suffix.

The timeline is split into one section per decoder layer (plus the step's start and its end),
each on its own time origin, so a 747-kernel step scrolls down instead of being squeezed into
one screen width. Each section repeats the previous section's last kernel as a dimmed "ghost"
row so the edge into its first kernel is drawn between two bars like every other edge.
"""

from __future__ import annotations

import html
import math
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import networkx as nx

from .errors import GraphcError

__all__ = [
    "to_dot",
    "dataflow_svg",
    "write_dataflow_svg",
    "schedule_html",
    "write_schedule_html",
    "write_viz",
    "KIND_COLORS",
    "EDGE_COLORS",
    "SUPPORTED_SUFFIXES",
]

# (strong, light) per op kind: strong for bars and swatches, light for node fills behind text.
KIND_COLORS: dict[str, tuple[str, str]] = {
    "embedding": ("#0d9488", "#ccfbf1"),
    "attn_res": ("#7c3aed", "#ede9fe"),
    "linear": ("#2563eb", "#dbeafe"),
    "decode_attention": ("#059669", "#d1fae5"),
}
_OTHER_KIND = ("#64748b", "#f1f5f9")
# Edge kinds of the schedule: deliberately not hues used by any op kind.
EDGE_COLORS = {"pdl": "#ea580c", "full": "#334155"}
_WAR_COLOR = "#94a3b8"
SUPPORTED_SUFFIXES = (".svg", ".dot", ".html")

_FONT = ("system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, "
         "'Liberation Sans', 'DejaVu Sans', sans-serif")
_MONO = ("ui-monospace, SFMono-Regular, Menlo, Consolas, 'Liberation Mono', 'DejaVu Sans Mono', "
         "monospace")


def _kind_color(kind: str) -> tuple[str, str]:
    return KIND_COLORS.get(kind, _OTHER_KIND)


def _esc(text: Any) -> str:
    """Text or attribute value for HTML/SVG (quotes escaped too)."""
    return html.escape(str(text), quote=True)


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


# ---------------------------------------------------------------------------------------------
# Sections: the step's start, one per decoder layer, the step's end
# ---------------------------------------------------------------------------------------------

def _nodes_in_order(graph: nx.DiGraph) -> list[str]:
    return sorted(graph.nodes, key=lambda n: graph.nodes[n].get("order", 0))


def _section_key(layer: int | None, seen_layer: bool) -> str:
    if layer is not None:
        return f"L{layer:02d}"
    return "final" if seen_layer else "start"


def _sections(names: list[str], layer_of: Mapping[str, int | None]) -> list[tuple[str, list[str]]]:
    """Consecutive runs of nodes by layer: ``[("start", [...]), ("L00", [...]), ...]``."""
    out: list[tuple[str, list[str]]] = []
    seen_layer = False
    for name in names:
        layer = layer_of.get(name)
        seen_layer = seen_layer or layer is not None
        key = _section_key(layer, seen_layer)
        if out and out[-1][0] == key:
            out[-1][1].append(name)
        else:
            out.append((key, [name]))
    return out


def _section_title(key: str) -> str:
    if key == "start":
        return "step start"
    if key == "final":
        return "final"
    return f"layer {int(key[1:])}" if key[1:].isdigit() else key


# ---------------------------------------------------------------------------------------------
# DOT
# ---------------------------------------------------------------------------------------------

def _dq(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: nx.DiGraph, *, title: str | None = None) -> str:
    """The dataflow graph in Graphviz DOT (one cluster ``cluster_LNN`` per decoder layer)."""
    if title is None:
        spec = graph.graph.get("spec")
        model = getattr(getattr(spec, "model", None), "name", None)
        title = f"{model}: dataflow" if model else "dataflow"
    names = _nodes_in_order(graph)
    layer_of = {n: graph.nodes[n].get("layer") for n in names}

    def node_line(n: str, indent: str) -> str:
        kind = graph.nodes[n].get("kind", "op")
        strong, light = _kind_color(kind)
        label = f"{n}\n{kind}"
        return (f"{indent}{_dq(n)} [label={_dq(label)}, fillcolor={_dq(light)}, "
                f"color={_dq(strong)}, tooltip={_dq(f'{n} ({kind})')}];")

    lines = [
        "digraph graphc {",
        f"  graph [label={_dq(title)}, labelloc=t, fontname=\"Helvetica\", fontsize=14, "
        "rankdir=TB, newrank=true, nodesep=0.3, ranksep=0.35];",
        "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, "
        "penwidth=1.2, margin=\"0.12,0.04\"];",
        f"  edge [fontname=\"Helvetica\", fontsize=8, color={_dq('#475569')}, "
        f"fontcolor={_dq('#334155')}, arrowsize=0.6];",
    ]
    by_layer: dict[int, list[str]] = {}
    for n in names:
        if layer_of[n] is None:
            lines.append(node_line(n, "  "))
        else:
            by_layer.setdefault(layer_of[n], []).append(n)
    for layer, members in sorted(by_layer.items()):
        key = f"L{layer:02d}"
        lines.append(f"  subgraph cluster_{key} {{")
        lines.append(f"    label={_dq(key)}; labeljust=l; style=\"rounded\"; "
                     f"color={_dq('#cbd5e1')}; fontcolor={_dq('#475569')}; fontsize=11;")
        lines += [node_line(n, "    ") for n in members]
        lines.append("  }")
    for src, dst in sorted(graph.edges, key=lambda e: (graph.nodes[e[1]].get("order", 0),
                                                       graph.nodes[e[0]].get("order", 0))):
        data = graph.edges[src, dst]
        values = list(data.get("values", ()))
        hazard = data.get("hazard", "raw")
        tip = f"{src} \u2192 {dst}: {hazard} on " + ", ".join(values)
        attrs = [f"label={_dq(chr(10).join(values))}", f"tooltip={_dq(tip)}"]
        if hazard == "war":
            attrs += ["style=dashed", f"color={_dq(_WAR_COLOR)}", f"fontcolor={_dq(_WAR_COLOR)}"]
        lines.append(f"  {_dq(src)} -> {_dq(dst)} [{', '.join(attrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Dataflow SVG
# ---------------------------------------------------------------------------------------------

def _find_dot() -> str | None:
    """The Graphviz ``dot`` program, or None (tests monkeypatch this to force the fallback)."""
    return shutil.which("dot")


# Above this many nodes, dot gets cheaper settings (straight edges, capped network simplex).
_BIG_GRAPH = 150


def _dot_svg(dot_program: str, dot_text: str, n_nodes: int, timeout: float) -> str:
    args = [dot_program, "-Tsvg"]
    if n_nodes > _BIG_GRAPH:
        args += ["-Gsplines=line", "-Gnslimit=1", "-Gnslimit1=1", "-Gmclimit=0.1",
                 "-Gremincross=false"]
    proc = subprocess.run(args, input=dot_text, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or "<svg" not in proc.stdout:
        raise RuntimeError(f"dot exited with {proc.returncode}: {proc.stderr.strip()[:500]}")
    return proc.stdout


def dataflow_svg(graph: nx.DiGraph, *, use_dot: bool | None = None, timeout: float = 120.0) -> str:
    """The dataflow graph as SVG text: Graphviz when available (``use_dot=None``: if installed),
    else the built-in layered layout. If dot fails or runs past ``timeout`` seconds, the
    built-in layout is used and a warning says why."""
    dot_program = _find_dot() if use_dot is not False else None
    if use_dot and dot_program is None:
        raise GraphcError("Graphviz `dot` is not installed (apt-get install graphviz); "
                          "leave use_dot unset to get the built-in layout instead")
    if dot_program is not None:
        try:
            return _dot_svg(dot_program, to_dot(graph), graph.number_of_nodes(), timeout)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            if use_dot:
                raise GraphcError(f"Graphviz dot failed: {err}") from err
            warnings.warn(f"Graphviz dot failed ({err}); using the built-in layout", stacklevel=2)
    return _fallback_svg(graph)


def write_dataflow_svg(graph: nx.DiGraph, path: str | Path, *, use_dot: bool | None = None,
                       timeout: float = 120.0) -> Path:
    """Write the dataflow graph as SVG (see :func:`dataflow_svg`); returns the path."""
    path = Path(path)
    path.write_text(dataflow_svg(graph, use_dot=use_dot, timeout=timeout), encoding="utf-8")
    return path


def _fallback_svg(graph: nx.DiGraph) -> str:
    """A layered picture without Graphviz: one column per section, nodes in program order."""
    names = _nodes_in_order(graph)
    layer_of = {n: graph.nodes[n].get("layer") for n in names}
    sections = _sections(names, layer_of)
    col_w, box_w, box_h, row_h = 230, 176, 38, 62
    left, top = 24, 92
    pos: dict[str, tuple[float, float, int]] = {}   # name -> (x, y, column)
    max_rows = max(len(m) for _, m in sections)
    for c, (_, members) in enumerate(sections):
        for r, n in enumerate(members):
            pos[n] = (left + c * col_w, top + r * row_h, c)
    width = left * 2 + len(sections) * col_w
    height = top + max_rows * row_h + 24
    spec = graph.graph.get("spec")
    model = getattr(getattr(spec, "model", None), "name", None)
    title = f"{model}: dataflow" if model else "dataflow"

    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="{_esc(_FONT)}">',
        f"<title>{_esc(title)}</title>",
        "<defs>",
        '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#475569"/></marker>',
        f'<marker id="arrow-war" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        f'fill="{_WAR_COLOR}"/></marker>',
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="30" font-size="18" font-weight="600" fill="#0f172a">'
        f"{_esc(title)}</text>",
    ]
    # legend
    lx = left
    for kind, (strong, light) in list(KIND_COLORS.items()):
        out.append(f'<rect x="{lx}" y="44" width="14" height="14" rx="3" fill="{light}" '
                   f'stroke="{strong}" stroke-width="1.5"/>')
        out.append(f'<text x="{lx + 20}" y="55" font-size="12" fill="#334155">{_esc(kind)}</text>')
        lx += 36 + 7 * len(kind)
    out.append(f'<line x1="{lx}" y1="51" x2="{lx + 30}" y2="51" stroke="#475569" '
               f'stroke-width="1.4" marker-end="url(#arrow)"/>')
    out.append(f'<text x="{lx + 36}" y="55" font-size="12" fill="#334155">reads (raw)</text>')
    lx += 130
    out.append(f'<line x1="{lx}" y1="51" x2="{lx + 30}" y2="51" stroke="{_WAR_COLOR}" '
               f'stroke-width="1.4" stroke-dasharray="4 3" marker-end="url(#arrow-war)"/>')
    out.append(f'<text x="{lx + 36}" y="55" font-size="12" fill="#334155">'
               f"overwrites after read (war)</text>")
    # column headers and frames
    for c, (key, members) in enumerate(sections):
        x = left + c * col_w - 12
        h = len(members) * row_h + 14
        out.append(f'<rect x="{x}" y="{top - 30}" width="{box_w + 24}" height="{h + 30}" rx="8" '
                   f'fill="#f8fafc" stroke="#e2e8f0"/>')
        out.append(f'<text x="{x + 10}" y="{top - 12}" font-size="12" font-weight="600" '
                   f'fill="#475569">{_esc(key if key.startswith("L") else _section_title(key))}'
                   f"</text>")
    # edges under the nodes
    for src, dst in graph.edges:
        data = graph.edges[src, dst]
        hazard = data.get("hazard", "raw")
        values = ", ".join(data.get("values", ()))
        sx, sy, sc = pos[src]
        dx, dy, dc = pos[dst]
        if sc == dc:
            if dy - sy == row_h:   # consecutive in the column: a short vertical arrow
                d = f"M{sx + box_w / 2},{sy + box_h} L{dx + box_w / 2},{dy}"
            else:                  # skips rows: bulge out to the right of the column
                bulge = sx + box_w + 8 + min(14, 3 * (dy - sy) / row_h)
                d = (f"M{sx + box_w},{sy + box_h / 2} C{bulge},{sy + box_h / 2} "
                     f"{bulge},{dy + box_h / 2} {dx + box_w},{dy + box_h / 2}")
        else:
            x1, y1, x2, y2 = sx + box_w, sy + box_h / 2, dx, dy + box_h / 2
            mid = (x2 - x1) / 2
            d = f"M{x1},{y1} C{x1 + mid},{y1} {x2 - mid},{y2} {x2},{y2}"
        if hazard == "war":
            style = (f'stroke="{_WAR_COLOR}" stroke-dasharray="4 3" '
                     f'marker-end="url(#arrow-war)"')
        else:
            style = 'stroke="#475569" marker-end="url(#arrow)"'
        out.append(f'<path class="edge {_esc(hazard)}" d="{d}" fill="none" stroke-width="1.2" '
                   f'stroke-opacity="0.8" {style}><title>{_esc(src)} \u2192 {_esc(dst)}: '
                   f"{_esc(hazard)} on {_esc(values)}</title></path>")
    # nodes
    for n in names:
        x, y, _ = pos[n]
        kind = graph.nodes[n].get("kind", "op")
        strong, light = _kind_color(kind)
        out.append(f'<g class="node {_esc(kind)}" data-node="{_esc(n)}">'
                   f"<title>{_esc(n)} ({_esc(kind)})</title>"
                   f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="6" '
                   f'fill="{light}" stroke="{strong}" stroke-width="1.5"/>'
                   f'<text x="{x + box_w / 2}" y="{y + 16}" font-size="12" text-anchor="middle" '
                   f'fill="#0f172a" font-family="{_esc(_MONO)}">{_esc(n)}</text>'
                   f'<text x="{x + box_w / 2}" y="{y + 31}" font-size="10.5" '
                   f'text-anchor="middle" fill="{strong}">{_esc(kind)}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Schedule timeline (HTML)
# ---------------------------------------------------------------------------------------------

_PRE_FRACTION = 0.35      # nominal share of a waiting kernel spent before its wait
_LAUNCH_GAP = 0.12        # nominal launch latency, in kernel lengths
_UNIT_PX = 76.0           # nominal kernel length in pixels
_ROW_H = 26
_BAR_Y = 5
_BAR_H = 16
_TRACK_PAD = 28           # room left of the first bar of a section for its incoming edge
_TRACK_TARGET = 860.0     # profile mode: the widest section is drawn about this wide ...
_MEDIAN_MIN_PX = 22.0     # ... unless the median kernel would be narrower than this ...
_TRACK_MAX = 20000.0      # ... or that would make a section wider than this (a profile whose
                          # starts lie far apart stays a page, not megabytes of SVG)
_PROFILE_MAX_US = 1e9     # 1000 s: no kernel of a decode step is longer or starts later
_PROFILE_MIN_US = 1e-3    # durations below a nanosecond are drawn as one
_MIN_BAR_PX = 2.0


@dataclass
class _Bar:
    """Where one kernel sits on the time axis (microseconds, or kernel lengths when nominal)."""

    start: float
    end: float
    split: float | None = None        # end of the first phase (pre / prologue)
    second: float | None = None       # start of the second phase (after waiting, nominal mode)
    duration_us: float | None = None
    split_measured: bool = False      # profile mode: split at the predecessor's measured end


def _nominal_bars(kernels) -> list[_Bar]:
    """Equal-length kernels; a PDL kernel launches at its predecessor's trigger, runs its first
    phase, and starts its second only once the predecessor has finished."""
    bars: list[_Bar] = []
    for i, k in enumerate(kernels):
        if i == 0:
            start = 0.0
        else:
            p, pb = kernels[i - 1], bars[i - 1]
            if k.edge == "pdl":
                trigger = _trigger_point(p, pb)
                start = trigger + _LAUNCH_GAP
            else:
                start = pb.end + _LAUNCH_GAP
        prev_end = bars[i - 1].end if i else 0.0
        if k.phases:
            split = start + _PRE_FRACTION
            second = max(split, prev_end)
            bars.append(_Bar(start, second + 1 - _PRE_FRACTION, split, second))
        else:
            bars.append(_Bar(start, start + 1.0))
    return bars


def _trigger_point(k, bar: _Bar) -> float:
    trigger = getattr(k.traits, "trigger", "exit")
    if trigger == "early":
        return bar.start
    if trigger == "late" and bar.second is not None:
        return bar.second
    return bar.end


def _profile_bars(kernels, profile: Mapping[str, Any]) -> list[_Bar]:
    rows = profile.get("kernels") if isinstance(profile, Mapping) else None
    if not isinstance(rows, list):
        raise GraphcError('profile: expected {"gpu": ..., "batch": ..., "kernels": '
                          '[{"node": ..., "duration_us": ...}, ...]}')
    by_node: dict[str, Mapping] = {}
    for j, row in enumerate(rows):
        if not isinstance(row, Mapping) or "node" not in row or "duration_us" not in row:
            raise GraphcError(f"profile: kernels[{j}] needs a node and a duration_us")
        dur = row["duration_us"]
        if not isinstance(dur, (int, float)) or isinstance(dur, bool) or not 0 <= dur <= _PROFILE_MAX_US:
            raise GraphcError(f"profile: kernels[{j}] ({row['node']}): duration_us must be a "
                              f"number from 0 to {_PROFILE_MAX_US:.0e} (1000 s), got {dur!r}")
        if "start_us" in row and row["start_us"] is not None and (
                not isinstance(row["start_us"], (int, float)) or isinstance(row["start_us"], bool)
                or not abs(row["start_us"]) <= _PROFILE_MAX_US):
            raise GraphcError(f"profile: kernels[{j}] ({row['node']}): start_us must be a "
                              f"number within +-{_PROFILE_MAX_US:.0e} (1000 s), got {row['start_us']!r}")
        by_node[str(row["node"])] = row
    scheduled = {k.node for k in kernels}
    unknown = [n for n in by_node if n not in scheduled]
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise GraphcError(f"profile: {', '.join(unknown[:5])}{more} is not a kernel of this schedule "
                          f"(a profile of another spec?)")
    missing = [k.node for k in kernels if k.node not in by_node]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise GraphcError(f"profile has no duration for {', '.join(missing[:5])}{more} "
                          f"(profiled {len(by_node)} kernels, the schedule has {len(kernels)})")
    use_starts = all(by_node[k.node].get("start_us") is not None for k in kernels)
    bars: list[_Bar] = []
    t = 0.0
    for i, k in enumerate(kernels):
        row = by_node[k.node]
        dur = float(row["duration_us"])
        start = float(row["start_us"]) if use_starts else t
        t = start + dur
        bar = _Bar(start, start + dur, duration_us=dur)
        if k.phases:
            prev_end = bars[i - 1].end if i else start
            if start < prev_end < bar.end:
                # Overlapped its predecessor: its wait could only return at that kernel's end.
                bar.split, bar.split_measured = prev_end, True
            else:
                bar.split = start + _PRE_FRACTION * dur
        bars.append(bar)
    return bars


def _nice_step(span: float, px_per: float, target_px: float = 110.0) -> float:
    raw = target_px / px_per
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


_CSS = """
:root { --ink: #0f172a; --muted: #64748b; --line: #e2e8f0; --pdl: %(pdl)s; --full: %(full)s; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 28px 40px; font-family: %(font)s; color: var(--ink);
       background: #f8fafc; font-size: 14px; line-height: 1.45; }
h1 { font-size: 20px; margin: 0 0 4px; font-weight: 650; }
h2 { font-size: 15px; margin: 26px 0 8px; font-weight: 650; }
.sub { color: var(--muted); margin: 0 0 14px; }
.mono, code { font-family: %(mono)s; font-size: 12.5px; }
.stats { display: flex; flex-wrap: wrap; gap: 10px; margin: 12px 0 14px; }
.stat { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 7px 12px; }
.stat b { display: block; font-size: 17px; font-weight: 650; }
.stat span { color: var(--muted); font-size: 12px; }
.legend { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 18px; background: #fff;
          border: 1px solid var(--line); border-radius: 8px; padding: 8px 12px; font-size: 12.5px; }
.legend .item { display: inline-flex; align-items: center; gap: 6px; white-space: nowrap; }
.legend svg { display: block; }
.note { color: var(--muted); font-size: 12.5px; margin: 8px 2px 0; max-width: 1100px; }
.timeline { margin-top: 12px; background: #fff; border: 1px solid var(--line); border-radius: 8px;
            max-height: 78vh; overflow: auto; }
.section-head { position: sticky; top: 0; z-index: 2; background: #f1f5f9;
                border-bottom: 1px solid var(--line); border-top: 1px solid var(--line);
                padding: 4px 12px; font-size: 12.5px; font-weight: 600; color: #334155; }
.section-head:first-child { border-top: 0; }
.section-head span { font-weight: 400; color: var(--muted); margin-left: 10px; }
.section svg { display: block; }
svg text { font-family: %(font)s; }
svg .name { font-family: %(mono)s; font-size: 12px; fill: var(--ink); }
svg .meta { font-size: 11px; fill: var(--muted); }
svg .idx { font-size: 11px; fill: #94a3b8; }
svg .seg-label { font-size: 10px; fill: #fff; font-weight: 600; pointer-events: none; }
svg .seg-label.light { fill: var(--ink); }
svg .tick { font-size: 10px; fill: #94a3b8; }
svg .ghost text { fill: #94a3b8; font-style: italic; }
svg .kernel:hover .rowbg { fill: #f1f5f9; }
svg a { cursor: pointer; }
table { border-collapse: collapse; background: #fff; border: 1px solid var(--line);
        border-radius: 8px; font-size: 12.5px; width: 100%%; max-width: 1400px; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { background: #f1f5f9; font-weight: 600; color: #334155; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; color: #475569; }
tr:target td { background: #fff7ed; }
.pill { display: inline-block; border-radius: 999px; padding: 0 8px; font-size: 11px;
        font-weight: 650; color: #fff; }
.pill.pdl { background: var(--pdl); }
.pill.full { background: var(--full); }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 3px;
          vertical-align: -1px; margin-right: 5px; }
td.reason { color: #334155; max-width: 760px; }
"""


def _legend_html(kinds: list[str], phase_names: set[str]) -> str:
    def line_icon(kind: str) -> str:
        color = EDGE_COLORS[kind]
        return (f'<svg width="38" height="14" aria-hidden="true">'
                f'<line x1="2" y1="7" x2="30" y2="7" '
                f'stroke="{color}" stroke-width="2.5"/><path d="M29,2 L36,7 L29,12 z" '
                f'fill="{color}"/></svg>')

    phase_text = "AttnRes phases: pre | wait | post"
    if {"prologue", "main"} & phase_names:
        phase_text += " (prologue | wait | main for other kernels that wait)"
    items = [
        f'<span class="item">{line_icon("pdl")}<span><b>PDL edge</b>: launches once the '
        f"predecessor triggers (overlaps it if it triggers early)</span></span>",
        f'<span class="item">{line_icon("full")}<span><b>full edge</b>: launches after the '
        f"predecessor completes</span></span>",
        '<span class="item"><svg width="46" height="14" aria-hidden="true">'
        '<rect x="1" y="1" width="16" height="12" rx="2" fill="#7c3aed" fill-opacity="0.35" '
        'stroke="#7c3aed"/><line x1="18" y1="7" x2="27" y2="7" stroke="#7c3aed" '
        'stroke-dasharray="2 2"/><rect x="28" y="1" width="17" height="12" rx="2" '
        f'fill="#7c3aed"/></svg><span>{_esc(phase_text)}</span></span>',
    ]
    for kind in kinds:
        strong, _ = _kind_color(kind)
        items.append(f'<span class="item"><span class="swatch" style="background:{strong}">'
                     f"</span>{_esc(kind)}</span>")
    return '<div class="legend">' + "".join(items) + "</div>"


def schedule_html(schedule, profile: Mapping[str, Any] | None = None, *,
                  title: str | None = None) -> str:
    """The schedule as a self-contained HTML timeline (see the module docstring).

    ``profile``: ``{"gpu": str, "batch": int, "kernels": [{"node", "duration_us",
    "start_us" (optional)}, ...]}``; with it, bar widths are proportional to the measured
    durations (starts from ``start_us`` when every kernel has one, else back to back).
    """
    kernels = list(schedule.kernels)
    if not kernels:
        raise GraphcError("the schedule has no kernels to draw")
    graph = schedule.graph
    spec = graph.graph.get("spec")
    model = getattr(getattr(spec, "model", None), "name", None)
    if title is None:
        title = f"{model}: decode-step schedule" if model else "decode-step schedule"
    measured = profile is not None
    bars = _profile_bars(kernels, profile) if measured else _nominal_bars(kernels)

    layer_of = {}
    for k in kernels:
        layer = graph.nodes[k.node].get("layer") if k.node in graph.nodes else None
        layer_of[k.node] = layer
    sections = _sections([k.node for k in kernels], layer_of)
    index_of = {k.node: i for i, k in enumerate(kernels)}

    # Horizontal scale: pixels per unit (kernel length when nominal, microsecond when measured).
    def section_span(members: list[str]) -> tuple[float, float]:
        first = index_of[members[0]]
        idx = [index_of[n] for n in members] + ([first - 1] if first > 0 else [])
        return min(bars[i].start for i in idx), max(bars[i].end for i in idx)

    spans = [section_span(m) for _, m in sections]
    if measured:
        widest = max(max((b - a for a, b in spans), default=0.0), _PROFILE_MIN_US)
        durations = sorted(b.end - b.start for b in bars)
        median = max(durations[len(durations) // 2] or max(durations), _PROFILE_MIN_US)
        px = min(max(_TRACK_TARGET / widest, _MEDIAN_MIN_PX / median), _TRACK_MAX / widest)
    else:
        px = _UNIT_PX

    name_chars = max(len(k.node) for k in kernels)
    meta_chars = max(len(f"{k.op.kind} \u00b7 {k.impl}") for k in kernels)
    x_idx = 12
    x_name = 52
    x_meta = x_name + int(7.3 * name_chars) + 16
    x_pill = x_meta + int(6.2 * meta_chars) + 14
    track_x0 = x_pill + 46 + 16

    n_pdl = sum(k.edge == "pdl" for k in kernels)
    kinds = list(dict.fromkeys([k for k in KIND_COLORS if any(x.op.kind == k for x in kernels)]
                               + [x.op.kind for x in kernels]))
    phase_names = {p for k in kernels for p in k.phases}

    parts: list[str] = []
    for ordinal, ((key, members), (t0, t1)) in enumerate(zip(sections, spans)):
        parts.append(_section_svg(ordinal, key, members, kernels, bars, index_of, t0, t1, px,
                                  measured, x_idx, x_name, x_meta, x_pill, track_x0))

    # --- header ---------------------------------------------------------------------------
    impls = ", ".join(f"{kind}: {impl}" for kind, impl in schedule.implementation_summary().items()) \
        if hasattr(schedule, "implementations") else ""
    stats = [(str(len(kernels)), "kernels"), (str(n_pdl), "PDL edges"),
             (str(len(kernels) - n_pdl), "full edges")]
    if measured:
        total = sum(b.duration_us or 0.0 for b in bars)
        span = max(b.end for b in bars) - min(b.start for b in bars)
        starts = _has_starts(profile, kernels)
        stats.insert(0, (f"{span:,.1f} \u00b5s", "step time (first start to last end)"
                         if starts else "step time (sum of kernel durations)"))
        if starts and abs(span - total) > 1e-6:
            stats.insert(1, (f"{total:,.1f} \u00b5s", "sum of kernel durations"))
        gpu = profile.get("gpu", "?") if isinstance(profile, Mapping) else "?"
        batch = profile.get("batch", "?") if isinstance(profile, Mapping) else "?"
        stats += [(_esc(gpu), "GPU"), (_esc(batch), "batch")]
        note = ("Bars are drawn to scale from the measured durations"
                + (" and start times" if starts else
                   ", back to back (not every kernel has a start_us)")
                + f"; 100 px = {_fmt(100 / px)} \u00b5s. The split between a kernel's two phases "
                "is its predecessor's measured end when the two overlapped, else a nominal "
                f"{int(_PRE_FRACTION * 100)}% (the phases are not measured separately).")
    else:
        note = ("No profile: every kernel is drawn the same length. A PDL kernel launches at its "
                "predecessor's trigger (at entry for an early trigger) and runs its first phase "
                "(pre / prologue) while the predecessor finishes; its second phase starts once the "
                "predecessor has completed. A full edge waits for completion. Hover a bar for "
                "details; click it to jump to its row in the table.")
    stats_html = "".join(f'<div class="stat"><b>{v}</b><span>{_esc(label)}</span></div>'
                         for v, label in stats)
    sub = f"{len(kernels)} kernels in launch order" + (f" \u00b7 {_esc(impls)}" if impls else "")

    # --- table ----------------------------------------------------------------------------
    rows = []
    dash = "\u2014"
    for i, k in enumerate(kernels):
        strong, _ = _kind_color(k.op.kind)
        b = bars[i]
        dur = (f'<td class="num">{b.duration_us:,.2f}</td><td class="num">{b.start:,.2f}</td>'
               if measured else "")
        rows.append(
            f'<tr id="k{i}"><td class="num">{i}</td><td class="mono">{_esc(k.node)}</td>'
            f'<td><span class="swatch" style="background:{strong}"></span>{_esc(k.op.kind)}</td>'
            f"<td>{_esc(k.impl)}</td>"
            f'<td><span class="pill {_esc(k.edge)}">{_esc(_edge_label(k.edge))}</span></td>'
            f"<td>{_esc(' | '.join(k.phases)) or dash}</td>{dur}"
            f'<td class="reason">{_esc(k.reason)}</td></tr>')
    dur_head = "<th>duration \u00b5s</th><th>start \u00b5s</th>" if measured else ""
    table = ("<table><thead><tr><th>#</th><th>kernel</th><th>kind</th><th>impl</th>"
             f"<th>edge in</th><th>phases</th>{dur_head}<th>why this edge</th></tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>")

    css = _CSS % {"pdl": EDGE_COLORS["pdl"], "full": EDGE_COLORS["full"], "font": _FONT,
                  "mono": _MONO}
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_esc(title)}</title>\n<style>{css}</style>\n</head>\n<body>\n"
        f"<h1>{_esc(title)}</h1>\n<p class=\"sub\">{sub}</p>\n"
        f'<div class="stats">{stats_html}</div>\n'
        f"{_legend_html(kinds, phase_names)}\n"
        f'<p class="note">{_esc(note)}</p>\n'
        f'<div class="timeline">\n{"".join(parts)}</div>\n'
        f"<h2>Edges and their reasons</h2>\n{table}\n</body>\n</html>\n"
    )


def _has_starts(profile, kernels) -> bool:
    rows = {str(r.get("node")): r for r in profile.get("kernels", []) if isinstance(r, Mapping)}
    return all(rows.get(k.node, {}).get("start_us") is not None for k in kernels)


def _edge_label(edge: str) -> str:
    return "PDL" if edge == "pdl" else edge


def _section_svg(ordinal, key, members, kernels, bars, index_of, t0, t1, px, measured,
                 x_idx, x_name, x_meta, x_pill, track_x0) -> str:
    first = index_of[members[0]]
    rows: list[int] = ([first - 1] if first > 0 else []) + [index_of[n] for n in members]
    has_ghost = first > 0
    axis_h = 18 if measured else 4
    height = axis_h + len(rows) * _ROW_H + 6
    track_w = (t1 - t0) * px + _TRACK_PAD + 24
    width = int(track_x0 + track_w + 8)

    def X(t: float) -> float:
        return track_x0 + _TRACK_PAD + (t - t0) * px

    n_pdl = sum(kernels[index_of[n]].edge == "pdl" for n in members)
    head_info = f"{len(members)} kernel{'s' if len(members) != 1 else ''} \u00b7 {n_pdl} PDL"
    if measured:
        span = max(bars[index_of[n]].end for n in members) - min(bars[index_of[n]].start
                                                                  for n in members)
        head_info += (f" \u00b7 {span:,.1f} \u00b5s \u00b7 starts at "
                      f"{bars[first].start:,.1f} \u00b5s")
    label = key if key.startswith("L") else ""
    sid = f"s{ordinal}"
    out = [f'<div class="section" id="sec-{ordinal}-{_esc(key)}"><div class="section-head">'
           f"{_esc(_section_title(key))}{(' (' + _esc(label) + ')') if label else ''}"
           f"<span>{_esc(head_info)}</span></div>",
           f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_esc(_section_title(key))}">',
           "<defs>" + "".join(
               f'<marker id="ah-{e}-{sid}" viewBox="0 0 10 10" refX="8" refY="5" '
               f'markerWidth="3.6" markerHeight="3.6" orient="auto"><path d="M0,0 L10,5 L0,10 z" '
               f'fill="{c}"/></marker>' for e, c in EDGE_COLORS.items()) + "</defs>"]
    if measured:
        step = _nice_step(t1 - t0, px)
        ticks = []
        t = math.ceil(t0 / step) * step
        while t <= t1 + 1e-9:
            ticks.append(t)
            t += step
        for t in ticks or [t0]:
            x = X(t)
            out.append(f'<line x1="{x:.1f}" y1="{axis_h - 4}" x2="{x:.1f}" y2="{height}" '
                       f'stroke="#f1f5f9"/><text class="tick" x="{x:.1f}" y="{axis_h - 6}" '
                       f'text-anchor="middle">{_fmt(round(t, 3))} \u00b5s</text>')
    for r, i in enumerate(rows):
        y = axis_h + r * _ROW_H
        ghost = has_ghost and r == 0
        out.append(_row_svg(i, kernels, bars, y, X, ghost, measured, sid,
                            x_idx, x_name, x_meta, x_pill, track_x0, width,
                            incoming=not ghost))
    out.append("</svg></div>\n")
    return "".join(out)


def _row_svg(i, kernels, bars, y, X, ghost, measured, sid, x_idx, x_name, x_meta, x_pill,
             track_x0, width, incoming) -> str:
    k, b = kernels[i], bars[i]
    kind = k.op.kind
    strong, light = _kind_color(kind)
    by = y + _BAR_Y
    mid = by + _BAR_H / 2 + 4
    x0, x1 = X(b.start), X(b.end)
    if x1 - x0 < _MIN_BAR_PX:
        x1 = x0 + _MIN_BAR_PX
    bar_w = x1 - x0

    # The bar: one segment, or two phases (with a dashed wait between them when nominal).
    segs: list[str] = []
    if k.phases and b.split is not None:
        first_end = X(b.split)
        second_start = X(b.second) if b.second is not None else first_end
        names = k.phases
        pieces = [(names[0], x0, max(first_end, x0 + 1), 0.38),
                  (names[1], second_start, max(x1, second_start + 1), 1.0)]
        if second_start > first_end + 0.5:
            segs.append(f'<line class="wait" x1="{first_end:.1f}" y1="{by + _BAR_H / 2:.1f}" '
                        f'x2="{second_start:.1f}" y2="{by + _BAR_H / 2:.1f}" stroke="{strong}" '
                        f'stroke-width="1.5" stroke-dasharray="2 2"/>')
        for name, a, z, opacity in pieces:
            segs.append(f'<rect class="phase {_esc(name)}" x="{a:.1f}" y="{by}" '
                        f'width="{z - a:.1f}" height="{_BAR_H}" rx="3" fill="{strong}" '
                        f'fill-opacity="{opacity}" stroke="{strong}" stroke-width="1"/>')
            if z - a >= 6 * len(name) + 5:
                light_cls = " light" if opacity < 1 else ""
                segs.append(f'<text class="seg-label{light_cls}" x="{(a + z) / 2:.1f}" '
                            f'y="{by + 12}" text-anchor="middle">{_esc(name)}</text>')
    else:
        segs.append(f'<rect class="bar" x="{x0:.1f}" y="{by}" width="{bar_w:.1f}" '
                    f'height="{_BAR_H}" rx="3" fill="{strong}"/>')

    if ghost:
        return (f'<g class="ghost" opacity="0.45"><text class="idx" x="{x_idx}" y="{mid}">'
                f'{i}</text><text x="{x_name}" y="{mid}" font-size="11.5">\u2191 {_esc(k.node)}'
                f"</text>{''.join(segs)}</g>")

    # The edge into this kernel, from the previous bar (the row above) to this one.
    edge_svg = ""
    if incoming and i > 0:
        p, pb = kernels[i - 1], bars[i - 1]
        color = EDGE_COLORS.get(k.edge, "#64748b")
        if k.edge == "pdl":
            from_t = _trigger_point(p, pb) if not measured else pb.start
            if measured:
                from_t = min(max(b.start, pb.start), pb.end)
        else:
            from_t = pb.end
        fx = min(X(from_t), X(pb.start) + max(X(pb.end) - X(pb.start), _MIN_BAR_PX))
        if k.edge == "pdl" and measured:
            fx = max(fx, X(pb.start) + 1)
        fy = y - _ROW_H + _BAR_Y + _BAR_H     # bottom of the previous bar
        if x0 - fx >= 6:    # down to this bar's middle, then right into its start
            d = f"M{fx:.1f},{fy:.1f} V{by + _BAR_H / 2:.1f} H{x0 - 1:.1f}"
        else:               # this bar starts at (or before) that point: straight down onto it
            ex = max(fx, x0 + 3)
            d = f"M{ex:.1f},{fy:.1f} V{by - 1:.1f}"
        why = f"{_edge_label(k.edge)} edge from {p.node} into {k.node}: {k.reason}"
        edge_svg = (f'<path class="edge {_esc(k.edge)}" d="{d}" fill="none" '
                    f'stroke="{color}" stroke-width="2" stroke-linejoin="round" '
                    f'marker-end="url(#ah-{_esc(k.edge)}-{sid})"><title>{_esc(why)}</title>'
                    f"</path>")

    lines = [f"#{i} {k.node} \u2014 {kind} ({k.impl})",
             f"edge in: {_edge_label(k.edge)} \u2014 {k.reason}"]
    if k.phases:
        lines.append("phases: " + " | ".join(k.phases)
                     + ("" if not measured else
                        (" (split at the predecessor's measured end)" if b.split_measured
                         else " (nominal split, not measured)")))
    if measured:
        lines.append(f"measured: {b.duration_us:,.2f} \u00b5s, {b.start:,.2f} \u2192 "
                     f"{b.end:,.2f} \u00b5s")
    tip = "\n".join(lines)
    phases_attr = f' data-phases="{_esc(" ".join(k.phases))}"' if k.phases else ""
    dur_attr = f' data-duration-us="{b.duration_us}"' if measured else ""
    classes = f"kernel kind-{kind} edge-{k.edge} impl-{k.impl}" + (" phased" if k.phases else "")
    pill_color = EDGE_COLORS.get(k.edge, "#64748b")
    label = _edge_label(k.edge)
    return (
        f'<g class="{_esc(classes)}" data-node="{_esc(k.node)}" data-index="{i}" '
        f'data-kind="{_esc(kind)}" data-impl="{_esc(k.impl)}" data-edge="{_esc(k.edge)}"'
        f'{phases_attr}{dur_attr} data-width="{bar_w:.3f}">'
        f"<title>{_esc(tip)}</title>"
        f'<a href="#k{i}">'
        f'<rect class="rowbg" x="0" y="{y}" width="{width}" height="{_ROW_H}" fill="transparent"/>'
        f'<text class="idx" x="{x_idx}" y="{mid}">{i}</text>'
        f'<text class="name" x="{x_name}" y="{mid}">{_esc(k.node)}</text>'
        f'<text class="meta" x="{x_meta}" y="{mid}">{_esc(kind)} \u00b7 {_esc(k.impl)}</text>'
        f'<rect x="{x_pill}" y="{by + 1}" width="40" height="{_BAR_H - 2}" rx="7" '
        f'fill="{pill_color}"/><text x="{x_pill + 20}" y="{by + 11.5}" font-size="10" '
        f'font-weight="650" fill="#fff" text-anchor="middle">{_esc(label)}</text>'
        f'<line x1="{track_x0 - 6}" y1="{y}" x2="{track_x0 - 6}" y2="{y + _ROW_H}" '
        f'stroke="#e2e8f0"/>'
        f"{''.join(segs)}</a>{edge_svg}</g>"
    )


def write_schedule_html(schedule, path: str | Path, profile: Mapping[str, Any] | None = None,
                        *, title: str | None = None) -> Path:
    """Write :func:`schedule_html` to ``path``; returns the path."""
    path = Path(path)
    path.write_text(schedule_html(schedule, profile, title=title), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

def picture_suffix(path: str | Path) -> str:
    """The suffix of ``path`` (lower case) if it names a picture graphc draws, else refuse."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise GraphcError(f"cannot write a picture to {str(path)!r}: unsupported suffix "
                          f"{suffix or '(none)'!r}; supported: {', '.join(SUPPORTED_SUFFIXES)} "
                          "(.svg, .dot: dataflow graph; .html: schedule timeline)")
    return suffix


def picture(schedule, path: str | Path, profile: Mapping[str, Any] | None = None) -> str:
    """The text of the picture of ``schedule`` that the suffix of ``path`` names: ``.svg``
    (dataflow graph), ``.dot`` (dataflow graph, Graphviz source) or ``.html`` (schedule
    timeline; ``profile`` draws it to scale)."""
    suffix = picture_suffix(path)
    if suffix == ".svg":
        return dataflow_svg(schedule.graph)
    if suffix == ".dot":
        return to_dot(schedule.graph)
    return schedule_html(schedule, profile)


def write_viz(schedule, path: str | Path, profile: Mapping[str, Any] | None = None) -> Path:
    """Write :func:`picture` to ``path``; returns the path."""
    path = Path(path)
    text = picture(schedule, path, profile)      # an unsupported suffix is refused before writing
    path.write_text(text, encoding="utf-8")
    return path
