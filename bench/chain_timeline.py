"""Per-CTA timeline of one link of bench/chain.py's chain: GEMM n -> AttnRes -> GEMM n+1, in µs
from GEMM n's last CTA end (bench/gemm_notes.md §18). Where does an AttnRes's time go between
two GEMMs: its wait release, its post phase, the next GEMM's release, late GEMM CTAs?

    source .gpu/setup.sh && python3 bench/chain_timeline.py --m 1,8,64 --rounds 2
    # CPU, to put the instrumented kernels in the disk cache first:
    CUTE_DSL_ARCH=sm_90a python3 bench/chain_timeline.py --m 1,8,64 --precompile

The GEMM is bench/gemm_timeline.py's instrumented kernel. Its timer words are shared by every
launch of one configuration, so the chain's links alternate between two configurations that
differ only in a negligible knob (``l2_prefetch`` 0, the default, / 1; 2 for the last link), and the pair read
back is links 21 -> 22 of 24, with a link after them as in a step. AttnRes is
``kernels/attn_res.py`` with ``%globaltimer`` stamps inserted at fixed anchors (written to
``kernels/_attn_res_timeline.py``, git-ignored): entry, pre phase done, wait passed, delta and
prefix loaded (after the first store that needs them), output computed (after exchange round
1), end, and %smid; thread 0 of each CTA writes them to the ``aux1`` address, which a call
with no aux streams never stores to, and every link gets its own buffer. Single launches are
noisy (a wait release of 0.4 µs in one round, 2.5 in the next): use ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

import gemm_timeline  # noqa: E402  (bench/gemm_timeline.py)
from chain import D, EPS, LINKS, NB, capture_graph, chain_inputs  # noqa: E402  (bench/chain.py)
from gemm import parse_tunings  # noqa: E402  (bench/gemm.py)

ATTN_RES_WORDS = 8      # entry, pre done, wait passed, end, smid, loaded, computed, (unused)
_T = "cute.arch.globaltimer_lo()"


def _store(slot: int, value: str) -> str:
    """Thread 0's store of one timer word to aux1[(token * ctas + rank) * WORDS + slot]."""
    return ('            cute.arch.inline_ptx("st.global.u32 [{$r0}], {$r1};", read_only_args=['
            f"Int64(aux1) + (Int64(token) * self.ctas + Int64(rank)) * {4 * ATTN_RES_WORDS} + {4 * slot}, "
            f"Int32({value})])\n")


# (anchor in kernels/attn_res.py, replacement).
ATTN_RES_PATCHES = [
    ("        cute.arch.griddepcontrol_launch_dependents()\n\n        tid, _, _ = cute.arch.thread_idx()\n",
     f"        cute.arch.griddepcontrol_launch_dependents()\n        t_entry = {_T}\n\n"
     "        tid, _, _ = cute.arch.thread_idx()\n"),
    ("        cute.arch.griddepcontrol_wait()\n\n        # ---------------- post",
     f"        t_pre = {_T}\n        cute.arch.griddepcontrol_wait()\n        t_wait = {_T}\n\n"
     "        # ---------------- post"),
    # In-order issue: the timer after the first store that needs delta and prefix cannot be read
    # before both loads have landed.
    ("        _store16(self._ptr(prefix, row), new_words)\n",
     f"        _store16(self._ptr(prefix, row), new_words)\n        t_loaded = {_T}\n"),
    ("        _store16(self._ptr(output, row), _pack_bf16x8(result))\n",
     f"        out_words = _pack_bf16x8(result)\n        t_computed = {_T}\n"
     "        _store16(self._ptr(output, row), out_words)\n"),
    ("            # still write into its shared memory.\n            cute.arch.cluster_wait()\n",
     "            # still write into its shared memory.\n            cute.arch.cluster_wait()\n"
     f"        t_end = {_T}\n        if tid == 0:\n"
     + "".join(_store(i, v) for i, v in enumerate(
         ("t_entry", "t_pre", "t_wait", "t_end", "cute.arch.smid()", "t_loaded", "t_computed")))),
    ('_CACHE = CompileCache("attn_res", _build', '_CACHE = CompileCache("attn_res_timeline", _build'),
]


def attn_res_source() -> str:
    """kernels/attn_res.py with the timer stores inserted."""
    return gemm_timeline.patched_source("attn_res", ATTN_RES_PATCHES, "bench/chain_timeline.py")


def attn_res_module():
    return gemm_timeline.patched_module("attn_res", ATTN_RES_PATCHES, "bench/chain_timeline.py")


def l2_prefetch_of(link: int) -> int:
    """Each link's GEMM configuration: alternating, the last one apart (see the docstring)."""
    return 2 if link == LINKS - 1 else (0 if link % 2 == 0 else 1)


def _rel(words, t0):
    """µs from t0 of 32-bit %globaltimer_lo words (wrapping every 4.3 s)."""
    d = (words - t0) % (1 << 32)
    return torch.where(d >= (1 << 31), d - (1 << 32), d).float() / 1000


def _q(v) -> str:
    return f"min {v.min():6.2f}  median {v.median():6.2f}  max {v.max():6.2f}"


def link_timeline(g, ar, m: int, knobs: dict | None = None) -> dict:
    """Run the chain at M rows (a CUDA graph of 24 links, replayed) with the GEMM built with
    ``knobs`` (TUNING_KNOBS of kernels/gemm_stream_k.py, besides l2_prefetch), print and return the
    timeline of links 21 -> 22."""
    knobs = knobs or {}
    t = chain_inputs(m)
    ctas = ar.cluster_shape(D)[0]
    words = [torch.zeros(m * ctas * ATTN_RES_WORDS, dtype=torch.int32, device="cuda") for _ in range(LINKS)]
    launcher = ar._launcher(ar.static_key(D, NB, True, False))

    def chain(stream):
        for i in range(LINKS):
            # attn_res's own argument list, with no aux streams (aux_count 0) and aux1 = the
            # link's timer words.
            launcher(0, [t.ys[i].data_ptr(), t.prefix.data_ptr(), t.blocks.data_ptr(), t.key_norm.data_ptr(),
                         t.query.data_ptr(), t.out_norm.data_ptr(), t.xs[i].data_ptr(), 0,
                         words[i].data_ptr(), 0, m, NB, -1, EPS, EPS, stream.cuda_stream, True])
            g.linear(t.xs[i], t.ws[i % t.copies], t.ys[i + 1], stream=stream, use_pdl=True,
                     l2_prefetch=l2_prefetch_of(i), **knobs)

    graph = capture_graph(chain)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()

    def gemm_words(link):
        cfg = g.GemmConfig(m, D, D, None, 132, l2_prefetch=l2_prefetch_of(link), **knobs)
        w = g._workspace(cfg, torch.device("cuda", torch.cuda.current_device()))[1]
        return w[2 * cfg.tiles:].view(cfg.ctas, gemm_timeline.WORDS).cpu().long()

    before, after = gemm_words(21), gemm_words(22)
    t0 = before[:, 3].max()
    a = words[22].view(m * ctas, ATTN_RES_WORDS).cpu().long()
    rows = {
        "GEMM n: last k-block": _rel(before[:, 2], t0), "GEMM n: end": _rel(before[:, 3], t0),
        "AttnRes: entry": _rel(a[:, 0], t0), "AttnRes: pre phase done": _rel(a[:, 1], t0),
        "AttnRes: wait passed": _rel(a[:, 2], t0), "AttnRes: delta, prefix loaded": _rel(a[:, 5], t0),
        "AttnRes: output computed": _rel(a[:, 6], t0), "AttnRes: end": _rel(a[:, 3], t0),
        "GEMM n+1: entry": _rel(after[:, 0], t0), "GEMM n+1: wait passed": _rel(after[:, 1], t0),
        "GEMM n+1: last k-block": _rel(after[:, 2], t0), "GEMM n+1: end": _rel(after[:, 3], t0),
    }
    link_us = start.elapsed_time(end) * 1e3 / LINKS
    print(f"M = {m}{' ' + str(knobs) if knobs else ''}: {link_us:.2f} µs per link; AttnRes {m * ctas} CTAs; "
          "µs from GEMM n's last CTA end")
    for name, v in rows.items():
        print(f"  {name:30s} {_q(v)}")
    late = rows["GEMM n+1: entry"] > 1.0
    print(f"  GEMM n+1 CTAs entering > 1 µs after GEMM n's end: {int(late.sum())}"
          + (f" (SMs {sorted(after[late, 8].tolist())})" if 0 < int(late.sum()) <= 16 else ""), flush=True)
    return {"m": m, "knobs": knobs, "link_us": link_us, **{k: v.tolist() for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,8,64", help="batch rows, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="timelines per M (single launches are noisy)")
    ap.add_argument("--gemm", type=parse_tunings, default=[], metavar="KNOB=V,...;...",
                    help="also time the chain with the GEMM built with each of these knob sets "
                         "(bench/gemm.py --tunings syntax), e.g. publish_first=0")
    ap.add_argument("--precompile", action="store_true", help="only compile the instrumented kernels")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    variants = [{}] + [tuning for _, tuning in args.gemm]
    g = gemm_timeline.instrumented_module()
    ar = attn_res_module()
    if args.precompile:
        ar.compile_cache().get(ar.static_key(D, NB, True, False))
        for m in ms:
            for knobs in variants:
                for pf in (6, 7, 8):
                    g.compile_cache().get(g.GemmConfig(m, D, D, None, 132, l2_prefetch=pf, **knobs).key())
            print(f"compiled M = {m}")
        return
    for _ in range(args.rounds):
        for m in ms:
            for knobs in variants:
                link_timeline(g, ar, m, knobs)


if __name__ == "__main__":
    main()
