"""The floor of a decode step (DESIGN §7): per kernel, the bytes it must move through HBM over
measured bandwidth or its FLOPs over the measured matrix rate, whichever is larger, summed.
Below ~128 rows every kernel of the shipped specs is byte-bound, so the FLOP term changes
nothing there; from 256 rows the large GEMMs are compute-bound."""

from __future__ import annotations

from .schedule import Schedule

# Measured device-to-device copy on an H200 (bytes read + written per second); DESIGN §7.
H200_HBM_BYTES_PER_S = 4.3e12
# GPU name (torch.cuda.get_device_name) -> the bandwidth its floors use. The ratios of every
# table in README.md and bench/ are against this constant, so it stays fixed for the H200 even
# though boards copy a few percent apart; any other GPU is measured when it is benchmarked.
HBM_BYTES_PER_S = {"NVIDIA H200": H200_HBM_BYTES_PER_S}
# Measured dense bf16 matrix rate on an H200 (KINDS.md; the datasheet's 989 TFLOP/s is not
# reached); bench/gemm.py's floors use it too. Other GPUs: the byte term alone (FLOPs None).
H200_BF16_FLOPS_PER_S = 790e12
BF16_FLOPS_PER_S = {"NVIDIA H200": H200_BF16_FLOPS_PER_S}


def _sizes(batch: int, context: int) -> dict[str, int]:
    return {"T": batch, "context": context, "slots": batch + 1}


def kernel_bytes(schedule: Schedule, batch: int, context: int) -> dict[str, int]:
    """Node -> the bytes its kernel must move: its weights once, the KV cache actually read
    (``context`` tokens per row), its activations."""
    sizes = _sizes(batch, context)
    return {k.node: k.op.bytes_moved(sizes) for k in schedule.kernels}


def step_bytes(schedule: Schedule, batch: int, context: int) -> int:
    return sum(kernel_bytes(schedule, batch, context).values())


def kernel_floor_s(schedule: Schedule, batch: int, context: int,
                   bytes_per_s: float = H200_HBM_BYTES_PER_S,
                   flops_per_s: float | None = H200_BF16_FLOPS_PER_S) -> dict[str, float]:
    """Node -> the least time its kernel can take: its bytes over ``bytes_per_s``, or its
    FLOPs over ``flops_per_s`` where that is longer (None: bytes only)."""
    sizes = _sizes(batch, context)
    floors = {node: n / bytes_per_s for node, n in kernel_bytes(schedule, batch, context).items()}
    if flops_per_s:
        for k in schedule.kernels:
            floors[k.node] = max(floors[k.node], k.op.flops(sizes) / flops_per_s)
    return floors


def step_floor_s(schedule: Schedule, batch: int, context: int,
                 bytes_per_s: float = H200_HBM_BYTES_PER_S,
                 flops_per_s: float | None = H200_BF16_FLOPS_PER_S) -> float:
    return sum(kernel_floor_s(schedule, batch, context, bytes_per_s, flops_per_s).values())


def floor_flops(gpu_name: str) -> float | None:
    """The matrix rate for the FLOP term of ``gpu_name``'s floors, where one was measured."""
    return BF16_FLOPS_PER_S.get(gpu_name)


def floor_bandwidth(gpu_name: str, measured_bytes_per_s: float | None) -> tuple[float, str]:
    """(bytes per second, where it comes from) for the floors on ``gpu_name``: the fixed
    measurement of ``HBM_BYTES_PER_S`` where there is one, else this GPU's own copy."""
    if gpu_name in HBM_BYTES_PER_S:
        return HBM_BYTES_PER_S[gpu_name], f"{gpu_name} lab measurement"
    if measured_bytes_per_s is None:
        from .errors import GraphcError

        raise GraphcError(f"no HBM bandwidth known for {gpu_name}; measure its copy bandwidth first")
    return measured_bytes_per_s, f"device-to-device copy measured on this {gpu_name}"
