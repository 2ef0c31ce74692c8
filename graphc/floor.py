"""The floor of a decode step: bytes that must move through HBM, over measured bandwidth."""

from __future__ import annotations

from .schedule import Schedule

# Measured device-to-device copy on an H200 (bytes read + written per second); DESIGN §7.
H200_HBM_BYTES_PER_S = 4.3e12


def kernel_bytes(schedule: Schedule, batch: int, context: int) -> dict[str, int]:
    """Node -> the bytes its kernel must move: its weights once, the KV cache actually read
    (``context`` tokens per row), its activations."""
    sizes = {"T": batch, "context": context, "slots": batch + 1}
    return {k.node: k.op.bytes_moved(sizes) for k in schedule.kernels}


def step_bytes(schedule: Schedule, batch: int, context: int) -> int:
    return sum(kernel_bytes(schedule, batch, context).values())


def step_floor_s(schedule: Schedule, batch: int, context: int) -> float:
    return step_bytes(schedule, batch, context) / H200_HBM_BYTES_PER_S
