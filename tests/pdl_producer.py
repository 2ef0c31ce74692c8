"""A deliberately slow producer kernel for the PDL race test (CuTe DSL).

``slow_copy(src, dst, spin_ns)`` triggers ``griddepcontrol.launch_dependents`` at entry, so a
PDL-launched successor starts right away, then spins ``spin_ns`` nanoseconds on the global
timer and only then copies ``src`` into ``dst``. A successor that read ``dst`` before its own
``griddepcontrol.wait`` would see the old contents of ``dst``.

It executes ``griddepcontrol.wait`` (a no-op unless it is itself launched with PDL) so that it
obeys the design's rule that every kernel waits before it exits.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Boolean, Int32, Int64  # noqa: E402

THREADS = 128


class SlowCopy:
    @cute.jit
    def __call__(self, src: Int64, dst: Int64, vectors: Int32, spin_ns: Int64,
                 stream: cuda.CUstream, use_pdl: Boolean):
        self.kernel(src, dst, vectors, spin_ns).launch(
            grid=[(vectors + THREADS - 1) // THREADS, 1, 1],
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=use_pdl,
        )

    @cute.kernel
    def kernel(self, src: Int64, dst: Int64, vectors: Int32, spin_ns: Int64):
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        start = cute.arch.globaltimer()
        now = start
        while now - start < spin_ns:
            now = cute.arch.globaltimer()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = bid * THREADS + tid
        if i < vectors:
            src_ptr = cute.make_ptr(cutlass.BFloat16, src, cute.AddressSpace.gmem, assumed_align=16) + Int64(i) * 8
            dst_ptr = cute.make_ptr(cutlass.BFloat16, dst, cute.AddressSpace.gmem, assumed_align=16) + Int64(i) * 8
            w0, w1, w2, w3 = cute.arch.inline_ptx(
                "ld.global.cg.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                write_only_types=[Int32, Int32, Int32, Int32],
                read_only_args=[src_ptr],
            )
            cute.arch.inline_ptx(
                "st.global.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                read_only_args=[dst_ptr, w0, w1, w2, w3],
            )


_COMPILED = None


def compile_slow_copy():
    global _COMPILED
    if _COMPILED is None:
        z = Int64(0)
        _COMPILED = cute.compile(SlowCopy(), z, z, Int32(1), Int64(0), cuda.CUstream(0), Boolean(False))
    return _COMPILED


def slow_copy(src, dst, spin_ns: int = 20_000, *, stream=None, use_pdl: bool = False) -> None:
    """dst <- src after spinning ``spin_ns`` ns (torch bf16 tensors of equal numel, a multiple of
    8 elements, 16-byte aligned, contiguous)."""
    import torch

    assert src.is_contiguous() and dst.is_contiguous() and src.numel() == dst.numel()
    assert src.numel() % 8 == 0 and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0
    if stream is None:
        stream = torch.cuda.current_stream(dst.device)
    compile_slow_copy()(src.data_ptr(), dst.data_ptr(), src.numel() // 8, int(spin_ns),
                        cuda.CUstream(stream.cuda_stream), bool(use_pdl))
