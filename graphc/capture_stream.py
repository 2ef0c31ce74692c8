"""The CUDA stream a plan's graphs are captured on: one of the plan's own, shared with no other.

torch keeps one cuBLAS workspace per (cuBLAS handle, stream), and a cuBLAS call captured in a
graph keeps the workspace of the stream it was captured on, whichever stream the graph is later
replayed on. ``torch.cuda.Stream()`` hands out one of 32 pooled streams in turn, so two steps'
graphs captured on pooled streams may have been captured on the same one, and then share that
scratch memory: replayed on two streams at once, their split-K cuBLAS GEMMs mix partials
(bench/cublas_shared_workspace.py: down at 64 and 128 rows, every concurrent replay wrong when
the two graphs were captured on one stream, none on two). A stream created for the plan gives
its cuBLAS calls a workspace of their own, as ``Workspaces`` does for graphc's split-K kernels.
The plan's graphs share it, and they never run at once: a step's calls run one after another,
from whichever streams they come (graphc/runtime.py ``_in_step_order``).

The stream lives as long as the plan or any graph captured on it holds this object: torch
keys its workspaces by the stream's address, which a later stream may reuse only after every
graph that captured the old one is gone.
"""

from __future__ import annotations

import weakref

import torch

from .errors import GraphcError


def _destroy(handle) -> None:
    from cuda.bindings import runtime

    runtime.cudaStreamDestroy(handle)       # work still queued on it completes first


class CaptureStream:
    """A non-blocking stream on ``device`` outside torch's stream pool (``.stream`` is its
    torch view), destroyed when nothing holds this object any more."""

    def __init__(self, device: torch.device):
        from cuda.bindings import runtime

        with torch.cuda.device(device):
            err, handle = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
        if err != runtime.cudaError_t.cudaSuccess:
            raise GraphcError(f"could not create a capture stream on {device}: {err.name}")
        self.stream = torch.cuda.ExternalStream(int(handle), device=device)
        weakref.finalize(self, _destroy, handle)
