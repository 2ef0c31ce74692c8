"""Scratch memory of the split-K kernels: fp32 partials and arrival counters.

The decode GEMM (kernels/gemm.py) and the two split-KV attentions (kernels/decode_attention.py,
kernels/decode_attention_tma.py) reduce partial results between CTAs through global memory.
Each launch leaves its counters at zero, so one workspace serves every launch of one kernel
configuration, on one condition: the launches that share it are ordered. Launches on one
stream are (the two CuTe kernels touch it only after their PDL wait, i.e. after the previous
kernel completed; the Triton attention has no PDL and starts after it); launches on two
streams at once are not, and would mix each other's partials.

So a workspace belongs to an owner: each DecodeStep's plan has its own ``Workspaces`` (two
steps may run on two streams at once), and a kernel called on its own, without one, uses the
process's ``SHARED``. Imports only torch: the plan creates one on machines without cutlass.
"""

from __future__ import annotations

import threading
from typing import Callable


class Workspaces:
    """One owner's workspaces, allocated at first use and kept: one per (kernel, device,
    configuration) key. A captured graph holds their addresses, so they live as long as the
    owner does."""

    def __init__(self):
        self._buffers: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, make: Callable[[], tuple], what: Callable[[], str]) -> tuple:
        """The tensors of ``key`` (which names the kernel, the device and the configuration),
        made by ``make()`` at the first request. That first request must not come during a CUDA
        graph capture: the allocation would belong to the graph's memory pool. ``what()`` names
        the call in that error (a callable: this runs at every eager launch, and formatting a
        configuration costs microseconds)."""
        found = self._buffers.get(key)
        if found is not None:
            return found
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{what()}: first call happened during CUDA graph capture; call it once before "
                "capturing (warm-up) so its workspace is allocated outside the graph")
        with self._lock:
            found = self._buffers.get(key)
            if found is None:
                found = self._buffers[key] = make()
        return found

    def find(self, key: tuple) -> tuple | None:
        """The tensors of ``key`` if a launch asked for them, else None (never allocates: for
        tools that read what a launch left there)."""
        return self._buffers.get(key)

    def of(self, kernel: str) -> list[tuple]:
        """Every workspace of ``kernel`` (the first entry of its keys), for tests that check the
        counters went back to zero."""
        return [ws for key, ws in self._buffers.items() if key[0] == kernel]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ws in self._buffers.values() for t in ws)


# The workspaces of kernels launched without an owner's (tests, benchmarks, direct calls).
SHARED = Workspaces()


def workspace(owner: Workspaces | None, key: tuple, make: Callable[[], tuple],
              what: Callable[[], str]) -> tuple:
    """``owner.get(key, make, what)``, from the process's SHARED workspaces when ``owner`` is
    None. (Tested against None, not for truth: an owner is an owner from its first request on.)"""
    return (SHARED if owner is None else owner).get(key, make, what)
