"""A read-only stream over a large buffer, in one Triton kernel: how fast this board's HBM reads.

The step floors divide by 4.3 TB/s, a device-to-device copy measured on our H200s. A decode
step almost only reads (its weights and KV cache), and HBM reads faster than it copies (a copy
turns the bus around between reads and writes), so ``graphc bench`` also prints the step
against the rate measured here. cuBLAS's matrix-vector product was tried as that probe first
and read *slower* than the copy (bench/step_notes.md, session 21), so the probe is a kernel made for
it: every program sums its own contiguous run of 32-bit words, in 16-byte loads
with ``.cg`` (L2 only), and writes one int32; nothing else is written.

Sizes tried on an H200 (bench/results/read_probe_*_session22.txt): 1024-8192 words per load,
4-16 warps, 4-32 programs per SM, contiguous or strided runs: 4.33-4.47 TB/s, against a copy of
4.17 on the same board. The defaults below are the fastest of those. It is a lower bound on
what a board reads: graphc's decode GEMM streamed lm_head 1.3% faster on one board (4.61
against 4.55 TB/s, bench/gemm_notes.md §31).
"""

from __future__ import annotations

import triton
import triton.language as tl

WORDS = 8192               # int32 words one program loads per iteration
NUM_WARPS = 16
PROGRAMS_PER_SM = 32


@triton.jit
def _read_sum(src, partial_sums, ITERS: tl.constexpr, WORDS: tl.constexpr):
    run = tl.program_id(0).to(tl.int64) * ITERS * WORDS
    offsets = tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], dtype=tl.int32)
    for i in range(ITERS):
        acc += tl.load(src + run + i * WORDS + offsets, cache_modifier=".cg")
    tl.store(partial_sums + tl.program_id(0), tl.sum(acc))


def read_grid(words: int, sms: int) -> tuple[int, int]:
    """(programs, iterations each) for reading the first programs * iterations * WORDS of
    ``words`` int32 words: PROGRAMS_PER_SM programs per SM, each at least one iteration."""
    programs = sms * PROGRAMS_PER_SM
    iters = words // (programs * WORDS)
    if iters < 1:
        raise ValueError(f"{words * 4} bytes is too small to read with {programs} programs of {WORDS * 4} bytes")
    return programs, iters


def read_sum(src, partial_sums, programs: int, iters: int) -> int:
    """Launch one read of ``src`` (int32, contiguous) by ``programs`` programs of ``iters``
    iterations; program p writes the int32 (wrapping) sum of its run to ``partial_sums[p]``.
    Returns the bytes read."""
    _read_sum[(programs,)](src, partial_sums, ITERS=iters, WORDS=WORDS, num_warps=NUM_WARPS)
    return programs * iters * WORDS * 4
