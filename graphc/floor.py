"""The floor of a decode step: bytes that must move through HBM, over measured bandwidth."""

from __future__ import annotations

from .schedule import Schedule

# Measured device-to-device copy on an H200 (bytes read + written per second); DESIGN §7.
H200_HBM_BYTES_PER_S = 4.3e12
# GPU name (torch.cuda.get_device_name) -> the bandwidth its floors use. The ratios of every
# table in README.md and bench/ are against this constant, so it stays fixed for the H200 even
# though boards copy a few percent apart; any other GPU is measured when it is benchmarked.
HBM_BYTES_PER_S = {"NVIDIA H200": H200_HBM_BYTES_PER_S}


def kernel_bytes(schedule: Schedule, batch: int, context: int) -> dict[str, int]:
    """Node -> the bytes its kernel must move: its weights once, the KV cache actually read
    (``context`` tokens per row), its activations."""
    sizes = {"T": batch, "context": context, "slots": batch + 1}
    return {k.node: k.op.bytes_moved(sizes) for k in schedule.kernels}


def step_bytes(schedule: Schedule, batch: int, context: int) -> int:
    return sum(kernel_bytes(schedule, batch, context).values())


def step_floor_s(schedule: Schedule, batch: int, context: int,
                 bytes_per_s: float = H200_HBM_BYTES_PER_S) -> float:
    return step_bytes(schedule, batch, context) / bytes_per_s


def floor_bandwidth(gpu_name: str, measured_bytes_per_s: float | None) -> tuple[float, str]:
    """(bytes per second, where it comes from) for the floors on ``gpu_name``: the fixed
    measurement of ``HBM_BYTES_PER_S`` where there is one, else this GPU's own copy."""
    if gpu_name in HBM_BYTES_PER_S:
        return HBM_BYTES_PER_S[gpu_name], f"{gpu_name} lab measurement"
    if measured_bytes_per_s is None:
        from .errors import GraphcError

        raise GraphcError(f"no HBM bandwidth known for {gpu_name}; measure its copy bandwidth first")
    return measured_bytes_per_s, f"device-to-device copy measured on this {gpu_name}"
