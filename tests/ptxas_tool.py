"""Assemble a kernel's PTX with the local ``ptxas`` for the compile-only tests that read its
register / spill report or its SASS (no torch import here)."""

from __future__ import annotations

import subprocess

import pytest


def run_ptxas(src, cubin, *flags) -> str:
    """ptxas's report (stdout + stderr) for ``src``. Skips the calling test when this ptxas is
    older than the PTX ISA the installed CuTe DSL emits (the GPU bundle's DSL writes .version
    9.4, a CUDA 13.0 ptxas reads up to 9.0): that says nothing about the kernel."""
    out = subprocess.run(["ptxas", "-arch=sm_90a", *flags, str(src), "-o", str(cubin)],
                         capture_output=True, text=True)
    if out.returncode and "Unsupported .version" in out.stderr:
        pytest.skip(f"local ptxas too old for this PTX: {out.stderr.strip().splitlines()[0]}")
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr
