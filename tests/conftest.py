import os

# CuTe DSL must know the target before `import cutlass`; without a GPU it would silently
# compile for sm_100a. Harmless on the GPU machine (an H200 is sm_90a).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # The marker, not item.keywords: those also hold parametrize ids (device="gpu").
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """How the CuTe DSL variants were obtained (memory / disk cache / compiled here)."""
    import sys

    for name in ("graphc.kernels.gemm_stream_k", "graphc.kernels.gemm_wide", "graphc.kernels.attn_res",
                 "graphc.kernels.decode_attention_tma"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "compile_cache"):
            terminalreporter.write_line(f"compile cache {name}: {module.compile_cache().stats}")
