"""Board power and SM clock while a captured step replays: is this batch size limited by HBM
bandwidth or by the board's power limit?

The HBM floor (``floor.py``) assumes the weights and KV cache stream at full bandwidth. On an
H200 that holds at small batches, but from ~32 rows the step draws the board's 700 W limit and
the driver lowers the SM clock to stay under it (the "SW power cap" clock-event reason): the
tensor-core work grows with the batch while the bytes do not, so the step becomes power-bound
and no kernel tuning brings it to the byte floor (bench/step_notes.md, session 10:
`kimi_k3_dense_8l` at 64 rows, 693 W median, SM clock median 1860 of 1980 MHz, every sample
capped; at 1-8 rows ~600 W and no capping). ``graphc bench`` reports it per batch size.

Sampling goes through ``nvidia-smi --query-gpu ... -lms`` in a child process (no Python NVML
binding is required); without nvidia-smi there is simply no power column.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

QUERY = ("power.draw", "power.limit", "clocks.sm", "clocks.max.sm", "clocks_event_reasons.active")
SAMPLE_MS = 50

# NVML clock-event reasons (nvmlClocksEventReasons) that mean the clock is held down by the
# board's power or thermal budget, rather than chosen (idle, application clocks, sync boost).
LIMITING_REASONS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
}


@dataclass(frozen=True)
class PowerSample:
    power_w: float
    power_limit_w: float
    sm_mhz: float
    sm_max_mhz: float
    reasons: int


def parse_sample(line: str) -> PowerSample | None:
    """One ``--format=csv,noheader,nounits`` line of QUERY; None if it is not one (a warning,
    ``[N/A]`` on a board that does not report a field)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(QUERY):
        return None
    try:
        return PowerSample(float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]),
                           int(parts[4], 16))
    except ValueError:
        return None


@dataclass(frozen=True)
class PowerSummary:
    """What the board did while the step replayed back to back."""

    samples: int
    power_w: float          # median draw
    power_limit_w: float
    sm_mhz: float           # median SM clock
    sm_max_mhz: float
    limited_share: float    # share of samples whose clock a power / thermal limit held down
    reasons: tuple[str, ...]

    @property
    def power_bound(self) -> bool:
        """Most of the time at a power / thermal limit: the step is not bandwidth-bound."""
        return self.limited_share >= 0.5

    def as_dict(self) -> dict:
        return {**asdict(self), "reasons": list(self.reasons), "power_bound": self.power_bound}


def summarize(samples: list[PowerSample]) -> PowerSummary | None:
    if not samples:
        return None
    held = [s for s in samples if s.reasons & sum(LIMITING_REASONS)]
    names = sorted({name for s in held for bit, name in LIMITING_REASONS.items() if s.reasons & bit})
    return PowerSummary(
        samples=len(samples),
        power_w=statistics.median(s.power_w for s in samples),
        power_limit_w=max(s.power_limit_w for s in samples),
        sm_mhz=statistics.median(s.sm_mhz for s in samples),
        sm_max_mhz=max(s.sm_max_mhz for s in samples),
        limited_share=len(held) / len(samples),
        reasons=tuple(names),
    )


class PowerSampler:
    """``with PowerSampler(device) as s: ...`` samples every SAMPLE_MS ms; ``s.summary()``
    after the block. ``available`` is False (and the summary None) without nvidia-smi."""

    def __init__(self, device_id: str | int = 0):
        self.device_id = str(device_id)
        self.available = shutil.which("nvidia-smi") is not None
        self._samples: list[PowerSample] = []
        self._proc = None
        self._reader = None

    def __enter__(self) -> "PowerSampler":
        if self.available:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits",
                 "-i", self.device_id, f"-lms={SAMPLE_MS}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self._samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._reader.join(timeout=5)

    def summary(self, skip_first: float = 0.3) -> PowerSummary | None:
        """Summary of the samples after the first ``skip_first`` of them (the clock and the
        power controller take a few hundred ms to settle on a new load)."""
        return summarize(self._samples[int(len(self._samples) * skip_first):])


def measure_power(replay: Callable[[], None], device_id: str | int = 0,
                  seconds: float = 1.5) -> PowerSummary | None:
    """Replay back to back for ``seconds`` while sampling; None without nvidia-smi or samples."""
    import torch

    with PowerSampler(device_id) as sampler:
        if not sampler.available:
            return None
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                replay()
            torch.cuda.synchronize()
    return sampler.summary()


def nvidia_smi_id(device) -> str:
    """The ``-i`` argument naming this torch device for nvidia-smi: its UUID, which does not
    depend on CUDA_VISIBLE_DEVICES renumbering (the index, if torch does not expose it)."""
    import torch

    index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return str(index)
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
