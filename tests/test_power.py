"""graphc.power: parsing nvidia-smi's samples, deciding power-bound, and the bench table's power
columns. CPU only; the sampler against a real board runs in tests/test_step_gpu.py."""

from __future__ import annotations

import pytest

from graphc import power
from graphc.bench import format_step_table
from graphc.power import PowerSampler, parse_sample, summarize

# Lines as `nvidia-smi --query-gpu=<power.QUERY> --format=csv,noheader,nounits` prints them on
# an H200 (session 10): a 64-row step at the power cap, and an 8-row step below it.
CAPPED = ["693.41, 700.00, 1860, 1980, 0x0000000000000004",
          "701.02, 700.00, 1275, 1980, 0x0000000000000004",
          "688.90, 700.00, 1905, 1980, 0x0000000000000004"]
FREE = ["614.20, 700.00, 1980, 1980, 0x0000000000000000",
        "616.05, 700.00, 1980, 1980, 0x0000000000000000"]


def test_parse_sample():
    s = parse_sample(CAPPED[1])
    assert (s.power_w, s.power_limit_w, s.sm_mhz, s.sm_max_mhz, s.reasons) == (701.02, 700.0, 1275, 1980, 4)
    assert parse_sample("[N/A], 700.00, 1980, 1980, 0x0") is None
    assert parse_sample("Failed to initialize NVML: Driver/library version mismatch") is None
    assert parse_sample("") is None


def test_summary_power_bound_or_not():
    capped = summarize([parse_sample(l) for l in CAPPED])
    assert capped.power_bound and capped.limited_share == 1.0 and capped.reasons == ("power cap",)
    assert (capped.power_w, capped.sm_mhz, capped.power_limit_w) == (693.41, 1860, 700.0)
    free = summarize([parse_sample(l) for l in FREE])
    assert not free.power_bound and free.limited_share == 0.0 and free.reasons == ()
    # Idle (0x1) and application clocks (0x2) do not count as a limit.
    idle = summarize([parse_sample("80.0, 700.00, 345, 1980, 0x0000000000000003")])
    assert idle.limited_share == 0.0
    mixed = summarize([parse_sample(l) for l in CAPPED[:1] + FREE])
    assert mixed.limited_share == pytest.approx(1 / 3) and not mixed.power_bound
    assert summarize([]) is None


def test_sampler_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(power.shutil, "which", lambda name: None)
    with PowerSampler(0) as sampler:
        pass
    assert not sampler.available and sampler.summary() is None
    assert power.measure_power(lambda: None, 0, seconds=0.01) is None


def test_sampler_reads_a_stream(monkeypatch, tmp_path):
    """The sampler as a child process: a stand-in nvidia-smi that prints the recorded lines."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo '{l}'\n" for l in FREE + CAPPED * 3) + "exec sleep 5\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    import time

    with PowerSampler("GPU-test") as sampler:
        deadline = time.time() + 5
        while len(sampler._samples) < 11 and time.time() < deadline:
            time.sleep(0.02)
    s = sampler.summary()
    assert s.samples == 8 and s.power_bound        # the first 30% (warm-up) dropped


def _row(batch, p=None):
    if p is not None:
        p = {**p, "energy_per_token_j": p["power_w"] * 3228e-6 / batch}
    return {"batch": batch, "step_us": 3228.0, "floor_us": 3062.0, "ratio": 3228 / 3062, "kernels": 59,
            "pdl_edges": 33, "capture_s": 0.007, "graph_memory_bytes": 3.36e7, "power": p}


def test_step_table_power_columns():
    capped = summarize([parse_sample(l) for l in CAPPED]).as_dict()
    free = summarize([parse_sample(l) for l in FREE]).as_dict()
    text = format_step_table([_row(8, free), _row(64, capped)])
    head, r8, r64, note = text.splitlines()
    assert head.split()[-6:] == ["power", "W", "SM", "MHz", "capped", "mJ/token"]
    assert r8.split()[-4:] == ["615", "1980", "0%", "248.2"]   # median 615.125 W x 3228 us / 8
    assert r64.split()[-4:] == ["693", "1860", "100%", "35.0"]
    assert "700 W" in note and "power cap" in note and "power-bound" in note
    # Without samples (no nvidia-smi), no power columns at all; a missing row prints dashes.
    assert "power" not in format_step_table([_row(8), _row(64)])
    assert format_step_table([_row(8), _row(64, free)]).splitlines()[1].split()[-4:] == ["-", "-", "-", "-"]
