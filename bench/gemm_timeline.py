"""Per-CTA timeline of the decode GEMM: when each CTA entered, passed its PDL wait, finished
its last k-block and ended (``%globaltimer``), for finding tails and imbalance
(bench/gemm_notes.md §7).

    source .gpu/setup.sh && python3 bench/gemm_timeline.py gate_up:64 o_proj:8
    # CPU, to put the instrumented kernels in the disk cache first:
    CUTE_DSL_ARCH=sm_90a python3 bench/gemm_timeline.py --precompile gate_up:64 o_proj:8

The instrumented kernel is generated from ``kernels/gemm_stream_k.py`` by inserting four timer
stores at fixed anchors (written to ``kernels/_gemm_stream_k_timeline.py``, git-ignored) so the shipped
kernel carries no instrumentation; if an anchor moved, this script says which. The times go
to extra int32 words after the split-tile counters (``WORDS`` per CTA, including the phases
of the CTA's last split-tile reduction). Each argument is ``shape:M`` with a shape
of bench/gemm.py, or ``shape:M:knob=v,...`` with knobs of the kernel's TUNING_KNOBS; the kernel runs 3 x 6 times eagerly with PDL over 6 weight copies and the
last call's timeline is printed (in µs from the first CTA's entry).
"""

from __future__ import annotations

import importlib
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

def bench_shapes() -> dict[str, tuple]:
    """name -> (K, N, epilogue): bench/gemm.py's rows (imported here: it loads torch)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm import BIG_SHAPES

    return {name: (k, n, e) for name, k, n, e in BIG_SHAPES}

# Timer words per CTA after the split-tile counters: entry, PDL wait passed, last k-block
# done, end, and for the CTA's last split-tile reduction: arrived, published (a contributor)
# or partials ready (the reducer), summed (the reducer), role (1 contributor, 2 reducer);
# then the SM the CTA ran on (%smid).
WORDS = 9
_T = "cute.arch.globaltimer_lo()"
_AT = f"mCount[2 * cfg.tiles + {WORDS} * cta + {{}}]"

# (anchor in kernels/gemm_stream_k.py, replacement): the instrumentation, one timer word per point.
PATCHES = [
    ("cute.make_layout(2 * cfg.tiles),      # arrived[tiles], ready[tiles]",
     f"cute.make_layout(2 * cfg.tiles + {WORDS} * cfg.ctas),"),
    ("torch.zeros(2 * cfg.tiles, dtype=torch.int32, device=device))",
     f"torch.zeros(2 * cfg.tiles + {WORDS} * cfg.ctas, dtype=torch.int32, device=device))"),
    # Its own workspaces (longer counters), apart from the shipped kernel's in the same pool.
    ('workspace(workspaces, ("gemm", index', 'workspace(workspaces, ("gemm_timeline", index'),
    ("            cute.arch.griddepcontrol_launch_dependents()\n\n        tidx, _, _ = cute.arch.thread_idx()\n",
     "            cute.arch.griddepcontrol_launch_dependents()\n"
     f"        t_entry = {_T}\n\n        tidx, _, _ = cute.arch.thread_idx()\n"),
    ("            cute.arch.griddepcontrol_wait()\n            if const_expr(cfg.trigger_at == 1):",
     "            cute.arch.griddepcontrol_wait()\n            if tidx == 0:\n"
     f"                {_AT.format(0)} = t_entry\n"
     f"                {_AT.format(1)} = {_T}\n"
     f"                {_AT.format(8)} = cute.arch.smid()\n"
     "            if const_expr(cfg.trigger_at == 1):"),
    ("            warpgroup.wait_group(0)\n",
     "            warpgroup.wait_group(0)\n            if tidx == 0:\n"
     f"                {_AT.format(2)} = {_T}\n"),
    # After the consumer's tile loop (whose last statement releases the stage held for y).
    ("                    release_stage(empty + s_last, cfg.cluster)\n\n    @cute.jit\n    def store_tile(",
     "                    release_stage(empty + s_last, cfg.cluster)\n"
     f"        if tidx == 0:\n            {_AT.format(3)} = {_T}\n\n    @cute.jit\n    def store_tile("),
    # Role 1 (contributor) at arrival; the reducer overwrites it with 2. Publishing first, a
    # contributor's "published" word stays 0 (it published before arriving).
    ("        arrived = flag[0]\n",
     f"        arrived = flag[0]\n        if leader:\n            {_AT.format(4)} = {_T}\n"
     f"            {_AT.format(7)} = Int32(1)\n"),
    ('                    cute.arch.red(p_ready, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")\n',
     '                    cute.arch.red(p_ready, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")\n'
     f"                    {_AT.format(5)} = {_T}\n"),
    ("            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)\n            if const_expr(cfg.bulk_reduce):\n",
     "            cute.arch.barrier(barrier_id=1, number_of_threads=consumers)\n            if leader:\n"
     f"                {_AT.format(5)} = {_T}\n                {_AT.format(7)} = Int32(2)\n"
     "            if const_expr(cfg.bulk_reduce):\n"),
    ("            self.store_tile(accs, tCcAcc, mY, tile, wg // cfg.col_wgs, wg % cfg.col_wgs, ybuf, wg_tid,\n",
     f"            if leader:\n                {_AT.format(6)} = {_T}\n"
     "            self.store_tile(accs, tCcAcc, mY, tile, wg // cfg.col_wgs, wg % cfg.col_wgs, ybuf, wg_tid,\n"),
    # The fix-up shared out by warpgroup (fixup_split): arrived when the CTA's warpgroups
    # meet after the main loop; an owning warpgroup stamps ready (its parts' count came),
    # summed and role 2, and in a CTA that owns no part of the tile a publishing warpgroup
    # stamps published and role 1.
    ("        cute.arch.barrier(barrier_id=1, number_of_threads=128 * cfg.wgs)\n        if owner != cta:\n",
     "        cute.arch.barrier(barrier_id=1, number_of_threads=128 * cfg.wgs)\n"
     f"        if wg_leader and wg == 0:\n            {_AT.format(4)} = {_T}\n"
     "        if owner != cta:\n"),
    ('                cute.arch.red(p_parts, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")\n',
     '                cute.arch.red(p_parts, Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")\n'
     "                if cta > late_hi or cta - c_lo >= cfg.wgs:\n"
     f"                    {_AT.format(5)} = {_T}\n                    {_AT.format(7)} = Int32(1)\n"),
    ("                mCount[tile * cfg.wgs + wg] = Int32(0)    # for the next launch; nobody else reads it\n",
     "                mCount[tile * cfg.wgs + wg] = Int32(0)    # for the next launch; nobody else reads it\n"
     f"                {_AT.format(5)} = {_T}\n                {_AT.format(7)} = Int32(2)\n"),
    ("                              part_of=lambda c: self.staged_slot(c, c_lo, cta))\n",
     "                              part_of=lambda c: self.staged_slot(c, c_lo, cta))\n"
     f"            if wg_leader:\n                {_AT.format(6)} = {_T}\n"),
    ('_CACHE = CompileCache("gemm_stream_k", _build', '_CACHE = CompileCache("gemm_timeline", _build'),
]


def patched_source(kernel: str, patches, tool: str) -> str:
    """kernels/<kernel>.py with each (anchor, replacement) of ``patches`` applied, every anchor
    exactly once (SystemExit naming a moved anchor and the ``tool`` whose list to update)."""
    src = open(os.path.join(ROOT, "kernels", f"{kernel}.py")).read()
    for anchor, replacement in patches:
        if src.count(anchor) != 1:
            raise SystemExit(f"kernels/{kernel}.py changed: anchor {anchor.strip()[:70]!r} found "
                             f"{src.count(anchor)} times; update the patches in {tool}")
        src = src.replace(anchor, replacement)
    return src


def patched_module(kernel: str, patches, tool: str):
    """The patched kernel as module ``graphc.kernels._<kernel>_timeline`` (its file, git-ignored,
    rewritten only when the source changed, so its compile-cache entries stay valid)."""
    src = patched_source(kernel, patches, tool)
    path = os.path.join(ROOT, "kernels", f"_{kernel}_timeline.py")
    if not os.path.exists(path) or open(path).read() != src:
        with open(path, "w") as f:
            f.write(src)
    return importlib.import_module(f"graphc.kernels._{kernel}_timeline")


def instrumented_source() -> str:
    """kernels/gemm_stream_k.py with the timer stores inserted."""
    return patched_source("gemm_stream_k", PATCHES, "bench/gemm_timeline.py")


class InstrumentedGemm:
    """The instrumented stream-K kernel (``kernel``: the patched module), with the calls of
    kernels/gemm.py the timeline tools make; ``linear`` always runs this kernel (the shipped
    one may hand a call to the whole-K tiles, which carry no timers)."""

    def __init__(self, kernel):
        from graphc.kernels import gemm

        self.kernel = kernel
        self.GemmConfig = kernel.GemmConfig
        self.compile_cache = kernel.compile_cache
        self._workspace = kernel._workspace
        self.reads_blocks = gemm.reads_blocks

    def linear(self, x, weight, out, *, epilogue=None, stream=None, use_pdl: bool = True, workspaces=None,
               ctas: int | None = None, **tuning) -> None:
        """kernels/gemm.py ``linear`` on the instrumented kernel: the same checks, the weight's
        order from its shape, the persistent grid one CTA per SM unless ``ctas``."""
        import torch

        from graphc.kernels import gemm

        m, k, n = gemm.validate(x, weight, out, epilogue)
        sms = ctas or gemm._sm_count(weight.device)
        cfg = self.GemmConfig(m, k, n, epilogue, sms, **tuning, **dict(gemm.weight_order_knobs(weight)))
        self.kernel.launch(cfg, x, weight, out, stream or torch.cuda.current_stream(weight.device), use_pdl,
                           workspaces)


def instrumented_module() -> InstrumentedGemm:
    return InstrumentedGemm(patched_module("gemm_stream_k", PATCHES, "bench/gemm_timeline.py"))


def timeline(g, name: str, m: int, verbose: bool = True, tuning: dict | None = None) -> dict:
    """Run shape ``name`` at M rows alone (3 x 6 eager PDL calls) with the knobs ``tuning``
    and print its last timeline."""
    import torch

    from graphc.kernels.weight_blocks import to_blocks

    k, n, e = bench_shapes()[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copies = 6
    knobs = dict(tuning or {})
    rows, order = weight_order(g, knobs, m, k, n, e, sms)
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    ws = [to_blocks(w, rows) for w in ws] if rows else ws
    xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    outs = [torch.empty(m, n // 2 if e else n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    cfg = g.GemmConfig(m, k, n, e, sms, **knobs, **order)
    for _ in range(3):
        for j in range(copies):
            g.linear(xs[j], ws[j], outs[j], epilogue=e, **knobs)
    torch.cuda.synchronize()
    return report(g, cfg, f"{name}:{m}", verbose)


def weight_order(g, knobs: dict, m: int, k: int, n: int, e, sms: int) -> tuple[int, dict]:
    """The weights in the order a build stores them (blocks where gemm.reads_blocks says so),
    unless the knobs say w_blocked=0 / 1, or w_block_rows=16 (16-row blocks): (rows per block,
    0 for row-major; the order's knobs for GemmConfig). Takes those two knobs out of ``knobs``
    (``linear`` reads them from the weight's shape)."""
    rows = knobs.pop("w_block_rows", 64)
    if not knobs.pop("w_blocked", int(rows != 64 or g.reads_blocks(m, k, n, e, sms))):
        return 0, {}
    return rows, {"w_blocked": 1, **({"w_block_rows": rows} if rows != 64 else {})}


def parse_case(arg: str) -> tuple[str, int, dict]:
    """``shape:M`` or ``shape:M:knob=v,knob=v`` -> (shape, M, knobs), the knobs read (and
    checked) as one alternative of bench/gemm.py's ``--tunings``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm import parse_tunings

    name, m, *rest = arg.split(":")
    alternatives = parse_tunings(rest[0]) if rest else []
    return name, int(m), alternatives[0][1] if alternatives else {}


def read_words(g, cfg, workspaces=None):
    """(entry, waited, loop_end, end, arrived, ready, summed) in µs from the first CTA's entry,
    the role and the SM of each CTA, of the last launch of ``cfg`` with ``workspaces`` (a
    step's ``plan.workspaces``; None: the process's shared ones, as ``timeline`` launches).
    The timer words live in the configuration's counters, shared by those launches."""
    import torch

    from graphc.kernels import workspaces as pool

    key = ("gemm_timeline", torch.cuda.current_device(), cfg.key())
    found = (pool.SHARED if workspaces is None else workspaces).find(key)
    if found is None:
        raise SystemExit(f"no instrumented launch of {cfg} ran with these workspaces: its timeline "
                         "would read zeros (was the step routed to the instrumented module?)")
    w = found[1][2 * cfg.tiles:].view(cfg.ctas, WORDS).cpu().long()
    t = (w[:, :7] - w[:, 0].min()) % (1 << 32)              # globaltimer_lo wraps every 4.3 s
    return tuple(t[:, i].float() / 1000 for i in range(7)), w[:, 7], w[:, 8]


def report(g, cfg, label: str, verbose: bool = True, workspaces=None) -> dict:
    """Print the last launch's timeline of ``cfg`` (with ``workspaces``: see ``read_words``);
    returns the medians and spans printed, and the per-CTA times."""
    import torch

    (entry, waited, loop_end, end, arrived, ready, summed), role, sm = read_words(g, cfg, workspaces)
    stream = loop_end - waited
    summary = {"wait_passed_max": float(waited.max()), "streaming_median": float(stream.median()),
               "streaming_max": float(stream.max()), "end_max": float(end.max()),
               "wait_to_end": float(end.max() - waited.min()),
               "entries_after_wait": int((entry > waited.min()).sum()),
               "per_cta": {"sm": sm.tolist(), "entry": entry.tolist(), "waited": waited.tolist(),
                           "loop_end": loop_end.tolist(), "end": end.tolist(), "role": role.tolist()}}
    if not verbose:
        return summary

    def q(v):
        return f"min {v.min():7.2f}  median {v.median():7.2f}  max {v.max():7.2f}" if v.numel() else "none"

    print(f"{label} {cfg}")
    print(f"  entry                  {q(entry)} us from the first CTA's entry")
    print(f"  PDL wait passed        {q(waited)}")
    print(f"  last k-block done      {q(loop_end)}")
    print(f"  end                    {q(end)}")
    print(f"  streaming (wait->last) {q(stream)}")
    print(f"  tail (last->end)       {q(end - loop_end)}")
    fast = sorted(int(sm[c]) for c in range(cfg.ctas) if stream[c] < 0.93 * stream.median())
    print(f"  SMs streaming in < 93% of the median time ({len(fast)}): {fast}")
    order = torch.argsort(loop_end)
    print("  first CTAs done:", [(int(c), round(float(loop_end[c]), 1)) for c in order[:6]])
    print("  last CTAs done: ", [(int(c), round(float(loop_end[c]), 1)) for c in order[-6:]])
    # The CTA's last split-tile reduction, if its last tile was split (the end of its range).
    last_split = (role > 0) & (arrived >= loop_end)
    for r, name in ((1, "contributors"), (2, "reducers")):
        sel = last_split & (role == r)
        print(f"  {name:12s} ({int(sel.sum())}): last k-block->arrived {q((arrived - loop_end)[sel])}")
        if r == 1 and cfg.publish_first:          # it published before arriving: no later stamp
            print(f"  {'':12s}       (publish first: the partial was written before the arrival)")
        elif r == 1:
            print(f"  {'':12s}       arrived->published {q((ready - arrived)[sel])}, published->end {q((end - ready)[sel])}")
        else:
            print(f"  {'':12s}       arrived->partials ready {q((ready - arrived)[sel])}, ready->summed "
                  f"{q((summed - ready)[sel])}, summed->end (y stores) {q((end - summed)[sel])}")
    worst = torch.argsort(end, descending=True)[:4]
    print("  latest ends (cta, role, last k-block, arrived, ready, summed, end):",
          [(int(c), int(role[c]), *(round(float(v[c]), 1) for v in (loop_end, arrived, ready, summed, end)))
           for c in worst])
    return summary


def main() -> None:
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__)
        return
    unknown = [a for a in args if a.startswith("-") and a != "--precompile"]
    if unknown:
        raise SystemExit(f"gemm_timeline.py: unknown option {unknown[0]} (only --precompile)\n\n{__doc__}")
    precompile = "--precompile" in args
    cases = [parse_case(a) for a in args if not a.startswith("-")]
    shapes = bench_shapes()
    if not cases or any(name not in shapes for name, _, _ in cases):
        raise SystemExit(__doc__)
    g = instrumented_module()
    for name, m, tuning in cases:
        if precompile:
            k, n, e = shapes[name]
            knobs = dict(tuning)
            _, order = weight_order(g, knobs, m, k, n, e, 132)
            g.compile_cache().get(g.GemmConfig(m, k, n, e, 132, **knobs, **order).key())
            print(f"compiled {name}:{m} {tuning}")
        else:
            timeline(g, name, m, tuning=tuning)


if __name__ == "__main__":
    main()
