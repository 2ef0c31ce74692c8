"""``graphc bench``: the captured step against its HBM floor and against the obvious ways to
run the same model (DESIGN §7). Times are medians of CUDA-event-timed graph replays."""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from .errors import GraphcError
from .floor import floor_bandwidth, floor_flops, step_floor_s
from .reference import run_kernels


def time_replays(fn: Callable[[], None], warmup: int = 5, replays: int = 50) -> float:
    """Median seconds of ``fn`` (one graph replay or one eager step), timed with events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _bytes_per_s(call: Callable[[], int], device, calls: int, rounds: int, warmup_s: float) -> float:
    """The median over ``rounds`` event-timed runs of ``calls`` back-to-back ``call()``s (each
    returns the bytes it moves), after ``warmup_s`` of them: an idle GPU measured cold copies
    at 5% of its bandwidth while its clocks came up."""
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        for _ in range(calls):
            call()
        torch.cuda.synchronize(device)
    rates = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        moved = sum(call() for _ in range(calls))
        end.record()
        end.synchronize()
        rates.append(moved / (begin.elapsed_time(end) / 1e3))
    return statistics.median(rates)


def copy_bytes_per_s(device="cuda", nbytes: int = 256 << 20, copies: int = 10, rounds: int = 7,
                     warmup_s: float = 0.3) -> float:
    """The GPU's device-to-device copy bandwidth, bytes read + written per second, over
    ``nbytes`` (far past the 50 MB L2)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> int:
        dst.copy_(src)
        return 2 * nbytes

    rate = _bytes_per_s(copy, device, copies, rounds, warmup_s)
    del src, dst
    return rate


def read_bytes_per_s(device="cuda", nbytes: int = 1 << 30, calls: int = 10, rounds: int = 7,
                     warmup_s: float = 0.3) -> float:
    """How fast this board's HBM reads: ``kernels/hbm_read.py`` summing an ``nbytes`` buffer
    (far past the L2), bytes read per second. A decode step almost only reads, and HBM reads
    faster than it copies."""
    from .kernels import hbm_read

    words = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs, iters = hbm_read.read_grid(words.numel(), sms)
    partial_sums = torch.empty(programs, dtype=torch.int32, device=device)
    rate = _bytes_per_s(lambda: hbm_read.read_sum(words, partial_sums, programs, iters), device, calls,
                        rounds, warmup_s)
    del words, partial_sums
    return rate


def device_floor_bandwidth(device="cuda") -> dict:
    """The bandwidth the floors use on this GPU and where it comes from, with the copy and read
    rates this board measures now (boards differ by a few percent)."""
    name = torch.cuda.get_device_name(device)
    measured = copy_bytes_per_s(device)
    bytes_per_s, source = floor_bandwidth(name, measured)
    try:
        read = read_bytes_per_s(device)
    except (ImportError, torch.cuda.OutOfMemoryError):   # no Triton; a model that fills the GPU
        read = None
    return {"hbm_bytes_per_s": bytes_per_s, "source": source, "copy_bytes_per_s": measured,
            "read_bytes_per_s": read, "flops_per_s": floor_flops(name)}


def _inputs(step, batch: int, context: int):
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, step.spec.model.vocab, (batch,), generator=gen).cuda()
    seq_lens = torch.full((batch,), context - 1, dtype=torch.int32).cuda()   # reads `context` tokens
    return tokens, seq_lens


def bench_step(spec, batch_sizes, context: int, weights=None, use_pdl: bool = True,
               progress=lambda s: None, step=None, power: bool = False,
               bandwidth: dict | None = None, implementations: dict | None = None) -> list[dict]:
    """One row per batch size: the replayed step's median time against its floor (at the
    rates of ``bandwidth``; default: ``device_floor_bandwidth``; also at the board's read
    rate where that was measured), and with ``power`` what the board drew meanwhile
    (``power.py``: 1.5 s of back-to-back replays per batch size, so a power-capped batch size
    shows as one)."""
    from .power import measure_power, nvidia_smi_id
    from .runtime import build

    step = step or build(spec, batch_sizes, weights=weights, device="cuda", use_pdl=use_pdl,
                         implementations=implementations, progress=progress)
    bandwidth = bandwidth or device_floor_bandwidth(step.device)
    flops_per_s, read = bandwidth.get("flops_per_s"), bandwidth.get("read_bytes_per_s")
    rows = []
    stats = step.stats()
    for b in batch_sizes:
        tokens, seq_lens = _inputs(step, b, context)
        step(tokens, seq_lens)
        t = time_replays(lambda: step.graphs[b].replay())
        floor = step_floor_s(step.schedule, b, context, bandwidth["hbm_bytes_per_s"], flops_per_s)
        row = {"batch": b, "step_us": t * 1e6, "floor_us": floor * 1e6, "ratio": t / floor, **stats[b]}
        if read:        # the same floor with the bytes at the rate this board reads
            row["read_floor_us"] = step_floor_s(step.schedule, b, context, read, flops_per_s) * 1e6
        if power:
            summary = measure_power(step.graphs[b].replay, nvidia_smi_id(step.device))
            row["power"] = None
            if summary is not None:
                # Board energy per generated token: median draw x median step time / rows.
                row["power"] = {**summary.as_dict(), "energy_per_token_j": summary.power_w * t / b}
        rows.append(row)
    return rows


AB_ROUNDS = 5          # round-robin passes of an A/B timed in turns (interleaved_rounds)


def interleaved_rounds(replays: dict[str, Callable[[], None]], rounds: int = AB_ROUNDS,
                       per_pass: int = 50) -> dict[str, list[float]]:
    """Seconds of each of ``replays`` (name -> one graph replay) in each of ``rounds``
    round-robin passes (``time_replays``, the median of ``per_pass`` replays), so that a board
    whose clock drifts meanwhile slows every one of them alike. Compare the medians."""
    passes: dict[str, list[float]] = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            passes[name].append(time_replays(replay, replays=per_pass))
    return passes


# graphc bench's hand-written baselines (results key -> implementations; no PDL in either):
# cuBLAS for every linear layer, then also PyTorch ops for AttnRes.
LIBRARY_BASELINES = {"cublas_step_us": {"linear": "cublas"},
                     "library_step_us": {"linear": "cublas", "attn_res": "torch"}}


def format_step_table(rows: list[dict]) -> str:
    with_power = any(r.get("power") for r in rows)
    head = f"{'batch':>6} {'step us':>10} {'floor us':>10} {'ratio':>7} {'kernels':>8} {'PDL':>5} {'capture ms':>11} {'graph MB':>9}"
    if with_power:
        head += f" {'power W':>8} {'SM MHz':>7} {'capped':>7} {'mJ/token':>9}"
    lines = [head]
    for r in rows:
        line = (f"{r['batch']:6d} {r['step_us']:10.1f} {r['floor_us']:10.1f} {r['ratio']:7.3f} "
                f"{r['kernels']:8d} {r['pdl_edges']:5d} {r['capture_s'] * 1e3:11.1f} "
                f"{r['graph_memory_bytes'] / 1e6:9.1f}")
        p = r.get("power")
        if with_power:
            line += (f" {p['power_w']:8.0f} {p['sm_mhz']:7.0f} {p['limited_share'] * 100:6.0f}%"
                     f" {p['energy_per_token_j'] * 1e3:9.1f}" if p else f" {'-':>8} {'-':>7} {'-':>7} {'-':>9}")
        lines.append(line)
    bound = [p for r in rows if (p := r.get("power")) and p["power_bound"]]
    if bound:
        lines.append(f"capped: share of power samples with the SM clock held down by the board's "
                     f"{bound[0]['power_limit_w']:.0f} W budget ({', '.join(sorted({x for p in bound for x in p['reasons']}))}); "
                     f"at >= 50% the step is power-bound there, not bandwidth-bound")
    return "\n".join(lines)


def _choices_in(spec, implementations: dict | None) -> dict | None:
    """The caller's implementation choices whose key is an op kind, a node or a pattern matching
    a node of ``spec``'s graph: the plain-residual model has the same nodes except its residual
    ones (``L03.residual.mlp`` for ``L03.attn_res.mlp``), so the A/B runs the same choices
    wherever both models have the node."""
    from .choices import Choices
    from .graph import build_graph

    if not implementations:
        return None
    graph = build_graph(spec)
    unmatched = set(Choices(implementations).unmatched(list(graph.nodes),
                                                       {op.kind for _, op in graph.nodes(data="op")}))
    return {key: value for key, value in implementations.items() if key not in unmatched} or None


def run_bench(spec_path, batch_sizes, context=1024, out=None, weights=None, compare=True,
              progress=lambda s: None, say=print, power: bool = True,
              implementations: dict | None = None) -> dict:
    from .runtime import build
    from .spec import load_spec

    spec = load_spec(spec_path)
    context = min(context, spec.model.max_context)
    if not torch.cuda.is_available():
        raise GraphcError("graphc bench needs a CUDA GPU")
    step = build(spec, batch_sizes, weights=weights, device="cuda", implementations=implementations,
                 progress=progress)
    bandwidth = device_floor_bandwidth(step.device)
    rows = bench_step(spec, batch_sizes, context, step=step, power=power,
                      bandwidth=bandwidth)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "spec": str(spec_path), "context": context, "floor_bandwidth": bandwidth,
              "implementations": {b: step.schedules[b].implementation_summary() for b in batch_sizes},
              "implementation_choices": implementations or {}, "rows": rows}
    if compare:
        for r in rows:
            b = r["batch"]
            prof = step.profile(b, context=context)
            total = sum(k["duration_us"] for k in prof["kernels"])
            attn_res = sum(k["duration_us"] for k in prof["kernels"] if k["kind"] == "attn_res")
            r["attn_res_share"] = attn_res / total
            r["profile"] = prof
            tokens, seq_lens = _inputs(step, b, context)
            step(tokens, seq_lens)
            r["torch_eager_us"] = time_replays(lambda: run_kernels(step.plan, b), 2, 10) * 1e6
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            with torch.cuda.graph(g, stream=side):
                run_kernels(step.plan, b)
            r["reference_graph_us"] = time_replays(g.replay, 3, 20) * 1e6
            del g
            progress(f"baselines at batch {b} done")
        # What AttnRes costs over a plain residual: the same model with a plain pre-norm residual,
        # built beside this one and timed in turns with it (a board drifts by a percent or more
        # over minutes, as much as the difference); one after the other where both do not fit.
        plain_spec = spec.with_residual("plain")
        plain_choices = _choices_in(plain_spec, implementations)
        try:
            plain = build(plain_spec, batch_sizes, device="cuda", implementations=plain_choices,
                          progress=progress)
        except (GraphcError, torch.cuda.OutOfMemoryError) as e:
            progress(f"the plain-residual model does not fit beside this one ({e}); timing it afterwards")
            plain = None
        in_turns = plain is not None
        if in_turns:
            for r in rows:
                b = r["batch"]
                step(*_inputs(step, b, context))
                plain(*_inputs(plain, b, context))
                passes = interleaved_rounds({"attn_res": step.graphs[b].replay, "plain": plain.graphs[b].replay})
                t = {name: statistics.median(p) for name, p in passes.items()}
                r["attn_res_ab"] = {"attn_res_us": t["attn_res"] * 1e6, "plain_us": t["plain"] * 1e6,
                                    "rounds": AB_ROUNDS}
                r["plain_step_us"] = t["plain"] * 1e6
                r["attn_res_overhead"] = (t["attn_res"] - t["plain"]) / t["attn_res"]
            del plain
        del step
        torch.cuda.empty_cache()
        if not in_turns:
            plain = build(plain_spec, batch_sizes, device="cuda", implementations=plain_choices,
                          progress=progress)
            for r, p in zip(rows, bench_step(spec, batch_sizes, context, step=plain,
                                             bandwidth=bandwidth)):
                r["plain_step_us"] = p["step_us"]
                r["attn_res_overhead"] = (r["step_us"] - p["step_us"]) / r["step_us"]
            del plain
            torch.cuda.empty_cache()
        # Hand-written alternatives, each in one CUDA graph with no PDL edge (LIBRARY_BASELINES):
        # every linear layer on cuBLAS (bf16 torch.mm, silu·mul as one Triton kernel), then also
        # AttnRes as PyTorch ops. Attention stays graphc's kernel: the torch reference attention
        # reads the whole cache in fp32, which would flatter graphc.
        for key, library_implementations in LIBRARY_BASELINES.items():
            library = build(spec, batch_sizes, weights=weights, device="cuda", use_pdl=False,
                            implementations=library_implementations, progress=progress)
            for r, p in zip(rows, bench_step(spec, batch_sizes, context, step=library,
                                             bandwidth=bandwidth)):
                r[key] = p["step_us"]
            del library
            torch.cuda.empty_cache()
    say(format_bench_table(result))
    out = Path(out or Path("bench/results") /
               f"step_{Path(str(spec_path)).stem}_{result['gpu'].replace(' ', '_')}_{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    say(f"wrote {out}")
    return result


def format_bench_table(result: dict) -> str:
    lines = [f"{result['spec']} on {result['gpu']} ({result['date']}), context {result['context']}"]
    if "floor_bandwidth" in result:        # results written before it was recorded lack it
        bw = result["floor_bandwidth"]
        flops = (f" or FLOPs / {bw['flops_per_s'] / 1e12:.0f} TFLOP/s, the longer per kernel"
                 if bw.get("flops_per_s") else "")
        lines.append(f"floor: bytes / {bw['hbm_bytes_per_s'] / 1e12:.2f} TB/s ({bw['source']}){flops}; this board "
                     f"copies at {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    lines.append(format_step_table(result["rows"]))
    read = result.get("floor_bandwidth", {}).get("read_bytes_per_s")
    if read:        # the same bytes at the rate this board reads (kernels/hbm_read.py)
        scale = read / result["floor_bandwidth"]["hbm_bytes_per_s"]    # results from before read_floor_us
        lines.append(f"against this board's read rate ({read / 1e12:.2f} TB/s, a read-only kernel): "
                     + ", ".join(f"{r['step_us'] / r['read_floor_us'] if 'read_floor_us' in r else r['ratio'] * scale:.3f}x"
                                 f" at batch {r['batch']}" for r in result["rows"]))
    if "torch_eager_us" in result["rows"][0]:
        # Baselines a result has (files from before session 21 have neither).
        shown = [(key, label) for key, label in (("cublas_step_us", "cuBLAS us"), ("library_step_us", "cuBLAS+torch us"))
                 if key in result["rows"][0]]
        ab = "attn_res_ab" in result["rows"][0]     # the plain model timed in turns with this one
        lines.append(f"{'batch':>6} {'graphc us':>10}" + (f" {'A/B: graphc us':>15}" if ab else "")
                     + f" {'plain us':>10} {'AttnRes ovh':>12} {'AttnRes share':>14}"
                     + "".join(f" {label:>16} {'vs it':>6}" for _, label in shown)
                     + f" {'fp32 ref graph us':>18} {'fp32 ref eager us':>18}")
        for r in result["rows"]:
            lines.append(f"{r['batch']:6d} {r['step_us']:10.1f}"
                         + (f" {r['attn_res_ab']['attn_res_us']:15.1f}" if ab else "")
                         + f" {r['plain_step_us']:10.1f} "
                         f"{r['attn_res_overhead'] * 100:11.1f}% {r['attn_res_share'] * 100:13.1f}%"
                         + "".join(f" {r[key]:16.1f} {r[key] / r['step_us']:5.2f}x" for key, _ in shown)
                         + f" {r['reference_graph_us']:18.1f} {r['torch_eager_us']:18.1f}")
        if ab:
            lines.append(f"A/B: this step and the same model with a plain residual (plain us), timed in turns "
                         f"({result['rows'][0]['attn_res_ab']['rounds']} rounds, medians); AttnRes ovh from that pair")
        if shown:
            lines.append("cuBLAS: the same step in one CUDA graph, no PDL, every linear layer on cuBLAS; "
                         "cuBLAS+torch: also AttnRes as PyTorch ops (attention: graphc's kernel in both)")
        lines.append("fp32 ref: the reference executor, a correctness oracle (weights upcast to fp32 "
                     "every step, attention over the whole cache), not a speed baseline")
    return "\n".join(lines)
