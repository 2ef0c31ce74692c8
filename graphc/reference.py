"""The numerical oracle: run a Schedule op by op with the torch reference ops.

It uses the plan's real buffers and the schedule's real order, so every numerical test of a
faster path compares against exactly the computation the GPU graph performs. Works on CPU
and, captured whole into one CUDA graph, serves as the "plain PyTorch" baseline on the GPU.
"""

from __future__ import annotations

import torch

from .plan import Plan


def run_kernels(plan: Plan, batch: int) -> torch.Tensor:
    """Every kernel of the schedule with its torch reference; returns the logits view."""
    for k, b in zip(plan.schedule.kernels, plan.bindings(batch)):
        k.op.reference(b.tensors, b.weights)
    return plan.output(batch)


def reference_step(plan: Plan, tokens, seq_lens, cache_slots=None) -> torch.Tensor:
    """One decode step for ``len(tokens)`` rows (no padding)."""
    batch = tokens.shape[0]
    if cache_slots is None:
        cache_slots = torch.arange(batch, dtype=torch.int32)
    plan.write_inputs(batch, tokens, seq_lens, cache_slots)
    return run_kernels(plan, batch)
