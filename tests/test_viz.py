"""graphc.viz: the dataflow DOT/SVG and the schedule timeline HTML (CPU only, fast)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from graphc import viz
from graphc.errors import GraphcError
from graphc.graph import build_graph
from graphc.schedule import build_schedule
from graphc.spec import load_spec

SPECS = Path(__file__).resolve().parent.parent / "layer_specs"


@pytest.fixture(scope="module")
def tiny_graph():
    return build_graph(load_spec(SPECS / "tiny.yaml"))


@pytest.fixture(scope="module")
def tiny(tiny_graph):
    return build_schedule(tiny_graph)


@pytest.fixture(scope="module")
def tiny_cute(tiny_graph):
    """Decode GEMMs that wait: more PDL edges, and ("prologue", "main") phases."""
    return build_schedule(tiny_graph, {"linear": "cute"})


@pytest.fixture(scope="module")
def big():
    return build_schedule(build_graph(load_spec(SPECS / "kimi_k3_dense.yaml")))


# --- helpers ----------------------------------------------------------------------------------

class _Collect(HTMLParser):
    """Every start tag with its attributes, and which data-node element encloses it."""

    VOID = {"meta", "link", "br", "hr", "img", "input", "col", "area", "base", "source", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict, str | None]] = []   # (tag, attrs, enclosing data-node)
        self.stack: list[tuple[str, str | None, str | None]] = []    # (tag, data-node, class)
        self.text: list[str] = []
        self.classed_text: list[tuple[str | None, str | None, str]] = []  # (node, class, text)

    def _node(self):
        return self.stack[-1][1] if self.stack else None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        node = a.get("data-node") or self._node()
        self.tags.append((tag, a, self._node()))
        if tag not in self.VOID:
            self.stack.append((tag, node, a.get("class")))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs), self._node()))

    def handle_endtag(self, tag):
        for j in range(len(self.stack) - 1, -1, -1):
            if self.stack[j][0] == tag:
                del self.stack[j:]
                break

    def handle_data(self, data):
        self.text.append(data)
        if self.stack:
            self.classed_text.append((self.stack[-1][1], self.stack[-1][2], data))


def _parse(text: str) -> _Collect:
    p = _Collect()
    p.feed(text)
    p.close()
    return p


def _kernel_elements(p: _Collect) -> list[dict]:
    return [a for _, a, _ in p.tags if "data-node" in a]


def _profile(schedule, *, starts: bool):
    rows, t = [], 0.0
    for k in schedule.kernels:
        d = 40.0 if k.op.kind == "linear" else 10.0
        row = {"node": k.node, "duration_us": d}
        if starts:
            row["start_us"] = t
        t += d + 1.0
        rows.append(row)
    return {"gpu": "NVIDIA H200", "batch": 8, "kernels": rows}


def _chromium() -> str | None:
    if os.path.exists("/usr/bin/chromium"):
        return "/usr/bin/chromium"
    return shutil.which("chromium")


# --- DOT --------------------------------------------------------------------------------------

def test_dot_has_every_node_cluster_and_edge_label(tiny_graph):
    text = viz.to_dot(tiny_graph)
    assert text.startswith("digraph")
    for n in tiny_graph.nodes:
        assert f'"{n}" [label="{n}\\n{tiny_graph.nodes[n]["kind"]}"' in text
    layers = sorted({d["layer"] for _, d in tiny_graph.nodes(data=True) if d["layer"] is not None})
    assert layers == [0, 1, 2, 3]
    for layer in layers:
        assert text.count(f"subgraph cluster_L{layer:02d} {{") == 1
    # each edge once, labelled with its values; war edges dashed grey
    assert text.count(" -> ") == tiny_graph.number_of_edges()
    for src, dst, data in tiny_graph.edges(data=True):
        line = next(l for l in text.splitlines() if l.strip().startswith(f'"{src}" -> "{dst}"'))
        for v in data["values"]:
            assert v in line
        assert ("style=dashed" in line) == (data["hazard"] == "war")
    assert any(d["hazard"] == "war" for _, _, d in tiny_graph.edges(data=True))
    # a kind colour per kind
    assert viz.KIND_COLORS["attn_res"][1] in text and viz.KIND_COLORS["linear"][1] in text


def test_dot_is_valid_for_graphviz(tiny_graph, tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz is not installed")
    proc = subprocess.run(["dot", "-Tcanon"], input=viz.to_dot(tiny_graph), text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --- SVG --------------------------------------------------------------------------------------

def _check_svg(path: Path, graph) -> str:
    text = path.read_text(encoding="utf-8")
    root = ET.fromstring(text.encode("utf-8"))
    assert root.tag.endswith("svg")
    for n in graph.nodes:
        assert n in text, n
    return text


def test_svg_with_graphviz(tiny_graph, tmp_path):
    if viz._find_dot() is None:
        pytest.skip("Graphviz is not installed")
    path = viz.write_dataflow_svg(tiny_graph, tmp_path / "g.svg", use_dot=True)
    text = _check_svg(path, tiny_graph)
    assert "cluster_L03" in text      # Graphviz keeps cluster names as <title>s


def test_svg_fallback_without_graphviz(tiny_graph, tmp_path, monkeypatch):
    monkeypatch.setattr(viz, "_find_dot", lambda: None)
    path = viz.write_dataflow_svg(tiny_graph, tmp_path / "g.svg")
    text = _check_svg(path, tiny_graph)
    root = ET.fromstring(text.encode("utf-8"))
    ns = "{http://www.w3.org/2000/svg}"
    nodes = [g for g in root.iter(f"{ns}g") if "data-node" in g.attrib]
    assert sorted(g.attrib["data-node"] for g in nodes) == sorted(tiny_graph.nodes)
    edges = [p for p in root.iter(f"{ns}path") if "edge" in p.attrib.get("class", "")]
    assert len(edges) == tiny_graph.number_of_edges()
    war = [p for p in edges if "war" in p.attrib["class"]]
    assert war and all("stroke-dasharray" in p.attrib for p in war)
    with pytest.raises(GraphcError, match="not installed"):
        viz.write_dataflow_svg(tiny_graph, tmp_path / "h.svg", use_dot=True)


def test_svg_fallback_when_dot_fails(tiny_graph, tmp_path, monkeypatch):
    monkeypatch.setattr(viz, "_find_dot", lambda: "/bin/false")
    with pytest.warns(UserWarning, match="built-in layout"):
        path = viz.write_dataflow_svg(tiny_graph, tmp_path / "g.svg")
    _check_svg(path, tiny_graph)


@pytest.mark.slow
def test_svg_of_the_93_layer_model(big, tmp_path, monkeypatch):
    graph = big.graph
    # built-in layout: instant
    monkeypatch.setattr(viz, "_find_dot", lambda: None)
    _check_svg(viz.write_dataflow_svg(graph, tmp_path / "fallback.svg"), graph)
    monkeypatch.undo()
    if viz._find_dot() is None:
        pytest.skip("Graphviz is not installed")
    # Graphviz with the big-graph settings: seconds, not minutes
    _check_svg(viz.write_dataflow_svg(graph, tmp_path / "dot.svg", use_dot=True, timeout=60),
               graph)


# --- HTML timeline ----------------------------------------------------------------------------

def test_html_one_element_per_kernel_in_launch_order(tiny):
    p = _parse(viz.schedule_html(tiny))
    elems = _kernel_elements(p)
    assert [a["data-node"] for a in elems] == [k.node for k in tiny.kernels]
    for a, k in zip(elems, tiny.kernels):
        classes = a["class"].split()
        assert classes[0] == "kernel"
        assert f"edge-{k.edge}" in classes and f"kind-{k.op.kind}" in classes
        assert a["data-impl"] == k.impl
    # name, kind and implementation are visible text in each row, in that row's own labels
    for k in tiny.kernels:
        labels = {cls: text for node, cls, text in p.classed_text if node == k.node and cls in ("name", "meta")}
        assert labels == {"name": k.node, "meta": f"{k.op.kind} \u00b7 {k.impl}"}, k.node


def test_html_pdl_and_full_edges_are_distinct(tiny_cute):
    p = _parse(viz.schedule_html(tiny_cute))
    paths = [(a, node) for tag, a, node in p.tags if tag == "path"
             and "edge" in a.get("class", "").split()]
    by_node = {node: a for a, node in paths}
    # one edge drawn into every kernel but the first, coloured and classed by its kind
    assert set(by_node) == {k.node for k in tiny_cute.kernels[1:]}
    colors = {}
    for k in tiny_cute.kernels[1:]:
        a = by_node[k.node]
        assert k.edge in a["class"].split()
        colors.setdefault(k.edge, set()).add(a["stroke"])
    assert colors["pdl"] == {viz.EDGE_COLORS["pdl"]} and colors["full"] == {viz.EDGE_COLORS["full"]}
    assert viz.EDGE_COLORS["pdl"] != viz.EDGE_COLORS["full"]
    # the legend names both
    body = "".join(p.text)
    assert "PDL edge" in body and "full edge" in body


def test_html_reasons_in_tooltips_and_table(tiny):
    text = viz.schedule_html(tiny)
    p = _parse(text)
    import html as _html
    plain = _html.unescape(text)
    for k in tiny.kernels:
        assert plain.count(k.reason) >= 2, k.node   # the <title> tooltip(s) and the table
    assert len([1 for tag, a, _ in p.tags if tag == "tr" and a.get("id", "").startswith("k")]) \
        == len(tiny.kernels)


def test_html_phases(tiny, tiny_cute):
    for schedule in (tiny, tiny_cute):
        p = _parse(viz.schedule_html(schedule))
        phases: dict[str, set[str]] = {}
        for tag, a, node in p.tags:
            cls = a.get("class", "").split()
            if tag == "rect" and "phase" in cls and node:
                phases.setdefault(node, set()).update(c for c in cls if c != "phase")
        for k in schedule.kernels:
            if k.op.kind == "attn_res":
                assert k.phases == ("pre", "post")
                assert phases[k.node] == {"pre", "post"}, k.node
            else:
                assert phases.get(k.node, set()) == set(k.phases), k.node
    assert any(k.phases == ("prologue", "main") for k in tiny_cute.kernels)


@pytest.mark.parametrize("starts", [True, False])
def test_html_measured_durations(tiny, starts):
    profile = _profile(tiny, starts=starts)
    p = _parse(viz.schedule_html(tiny, profile))
    elems = {a["data-node"]: a for a in _kernel_elements(p)}
    linear = next(k.node for k in tiny.kernels if k.op.kind == "linear")
    other = next(k.node for k in tiny.kernels if k.op.kind == "attn_res")
    ratio = float(elems[linear]["data-width"]) / float(elems[other]["data-width"])
    assert ratio == pytest.approx(4.0, rel=0.02)
    assert float(elems[linear]["data-duration-us"]) == 40.0
    total = sum(r["duration_us"] for r in profile["kernels"])
    text = "".join(p.text)
    assert f"{total:,.1f} \u00b5s" in text
    assert "NVIDIA H200" in text
    # without a profile every bar has the same length
    widths = {float(a["data-width"]) for a in _kernel_elements(_parse(viz.schedule_html(tiny)))}
    assert len(widths) == 1


def test_html_draws_measured_starts_and_overlap(tiny_cute):
    """With measured starts, each bar sits where its kernel started, and a phased kernel that
    started before its predecessor ended (PDL overlap) is split at that measured end."""
    import html as _html

    rows, end, overlapped, apart = [], 0.0, [], []
    for i, k in enumerate(tiny_cute.kernels):
        # Every other phased kernel overlaps its predecessor by 1 us; the rest start 1 us after it.
        overlaps = bool(k.phases and i) and len([x for x in tiny_cute.kernels[:i] if x.phases]) % 2 == 0
        start = end - 1.0 if overlaps else end + 1.0
        rows.append({"node": k.node, "duration_us": 10.0, "start_us": start})
        (overlapped if overlaps else apart if k.phases else []).append(k)
        end = start + 10.0
    plain = _html.unescape(viz.schedule_html(tiny_cute, {"gpu": "NVIDIA H200", "kernels": rows}))
    for row in rows:
        start = row["start_us"]
        assert f"measured: 10.00 \u00b5s, {start:,.2f} \u2192 {start + 10:,.2f} \u00b5s" in plain, row["node"]
    assert overlapped and apart
    assert plain.count("(split at the predecessor's measured end)") == len(overlapped)
    assert plain.count("(nominal split, not measured)") == len(apart)


def test_html_profile_errors(tiny):
    profile = _profile(tiny, starts=False)
    profile["kernels"] = profile["kernels"][1:]
    with pytest.raises(GraphcError, match="no duration for embed"):
        viz.schedule_html(tiny, profile)
    with pytest.raises(GraphcError, match="duration_us"):
        viz.schedule_html(tiny, {"kernels": [{"node": "embed", "duration_us": -1}]})
    with pytest.raises(GraphcError, match=r'profile: expected \{"gpu": \.\.\., "batch": \.\.\., "kernels"'):
        viz.schedule_html(tiny, {"gpu": "x"})


@pytest.mark.parametrize("duration, start, message", [
    (1e308, None, r"duration_us must be a number from 0 to 1e\+09 \(1000 s\), got 1e\+308"),
    (1.0, 2e9, r"start_us must be a number within \+-1e\+09 \(1000 s\), got 2000000000.0"),
    (float("nan"), None, "duration_us must be a number"),
])
def test_a_profile_past_any_real_step_is_refused(tiny, duration, start, message):
    profile = _profile(tiny, starts=start is not None)
    profile["kernels"][3]["duration_us"] = duration
    if start is not None:
        profile["kernels"][3]["start_us"] = start
    with pytest.raises(GraphcError, match=message):
        viz.schedule_html(tiny, profile)


@pytest.mark.parametrize("edit", ["far apart starts", "one long kernel", "sub-nanosecond durations"])
def test_a_profile_of_extreme_but_valid_times_draws_a_page_of_bounded_size(tiny, edit):
    """The scale follows the median kernel unless a section would grow past _TRACK_MAX pixels:
    a profile whose starts lie seconds apart (a hand edit, or a pause) stays a page."""
    profile = _profile(tiny, starts=edit == "far apart starts")
    rows = profile["kernels"]
    if edit == "far apart starts":
        for i, row in enumerate(rows):
            row["start_us"] = i * 2e7           # 20 s apart
    elif edit == "one long kernel":
        rows[5]["duration_us"] = 1e9
    else:
        for row in rows:
            row["duration_us"] = 1e-320
    html = viz.schedule_html(tiny, profile)
    assert len(html) < 2_000_000
    widths = [float(w) for w in re.findall(r'<svg width="([0-9.]+)"', html)]
    assert widths and max(widths) < viz._TRACK_MAX + 2000


def test_html_is_self_contained(tiny, tiny_cute):
    for text in (viz.schedule_html(tiny), viz.schedule_html(tiny_cute, _profile(tiny_cute,
                                                                               starts=True))):
        stripped = text.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert "http://" not in stripped and "https://" not in stripped
        assert not re.search(r"<script[^>]*\bsrc=", text, re.I)
        assert not re.search(r"<link\b", text, re.I)
        assert "@import" not in text and "url(http" not in text
        assert "<img" not in text.lower()


def test_html_654_kernels(big, tmp_path):
    path = viz.write_schedule_html(big, tmp_path / "big.html")
    p = _parse(path.read_text(encoding="utf-8"))
    assert len(_kernel_elements(p)) == len(big.kernels) == 654
    # scrolls: bars keep their nominal width instead of shrinking to fit
    widths = {float(a["data-width"]) for a in _kernel_elements(p)}
    assert widths == {viz._UNIT_PX}
    measured = viz.schedule_html(big, _profile(big, starts=False))
    assert len(re.findall(r' data-node="', measured)) == 654


# --- dispatch ---------------------------------------------------------------------------------

def test_write_viz_dispatch(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(viz, "_find_dot", lambda: None)     # keep this one instant
    svg = viz.write_viz(tiny, tmp_path / "g.svg")
    ET.parse(svg)
    dot = viz.write_viz(tiny, tmp_path / "g.dot")
    assert dot.read_text().startswith("digraph")
    page = viz.write_viz(tiny, tmp_path / "t.HTML")
    assert len(_kernel_elements(_parse(page.read_text()))) == len(tiny.kernels)
    for bad in ("g.png", "g.json", "noext"):
        with pytest.raises(GraphcError, match=r"\.svg.*\.dot.*\.html"):
            viz.write_viz(tiny, tmp_path / bad)
        assert not (tmp_path / bad).exists()


# --- a real browser ---------------------------------------------------------------------------

def test_html_in_headless_chromium(tiny_cute, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed")
    page = viz.write_schedule_html(tiny_cute, tmp_path / "t.html",
                                   _profile(tiny_cute, starts=True))
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(base + ["--dump-dom", page.resolve().as_uri()], capture_output=True,
                         text=True, timeout=60)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = set(re.findall(r'data-node="([^"]+)"', dom.stdout))
    assert found == {k.node for k in tiny_cute.kernels}
    shot = tmp_path / "s.png"
    run = subprocess.run(base + [f"--screenshot={shot}", "--window-size=1400,900",
                                 page.resolve().as_uri()], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000        # a blank 1400x900 page compresses to a few kB
