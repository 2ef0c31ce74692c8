"""The 93-layer Kimi K3-width model (layer_specs/kimi_k3_dense.yaml, 103 GB of weights) on one
GPU, and the device-level numbers the builds and the floors rest on."""

import pytest
import torch

import graphc
from graphc.errors import GraphcError
from graphc.floor import H200_HBM_BYTES_PER_S

from test_step_gpu import check_logits, reference_call, reference_twin

pytestmark = pytest.mark.gpu

FULL = "layer_specs/kimi_k3_dense.yaml"


def test_a_build_too_large_for_the_gpu_is_refused_before_allocating():
    """64 rows at 4096 tokens of context need ~101 GB of KV cache beside the weights."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with pytest.raises(GraphcError, match=r"needs 2\d\d\.\d GB of GPU memory.*Capture batch sizes up to \d+"):
        graphc.build(FULL, [1, 64], progress=None)
    assert torch.cuda.memory_allocated() == before


def test_copy_bandwidth_of_an_h200_is_the_floor_constant():
    """The floors divide by 4.3 TB/s, a device-to-device copy measured on our H200s; this board's
    copy must be within 10% of it (boards differ by a few percent)."""
    from graphc.bench import copy_bytes_per_s

    if torch.cuda.get_device_name() != "NVIDIA H200":
        pytest.skip("the constant is an H200's")
    measured = copy_bytes_per_s()
    print(f"device-to-device copy: {measured / 1e12:.3f} TB/s")
    assert 0.9 * H200_HBM_BYTES_PER_S < measured < 1.1 * H200_HBM_BYTES_PER_S


def test_kimi_93_layers_against_reference():
    """Every layer of the real depth, AttnRes blocks of 12 (up to 8 saved blocks): the captured
    step's logits against the all-torch reference executor, three steps at 1 and 6 rows (the
    batch-8 graph, padded)."""
    torch.cuda.empty_cache()
    step = graphc.build(FULL, [1, 8], progress=print)
    gen = torch.Generator().manual_seed(93)
    for batch in (1, 6):
        step.reset()
        ref = reference_twin(step)          # its own KV cache, empty like the step's
        slots = torch.randperm(8, generator=gen)[:batch].to(torch.int32).cuda()
        start = torch.randint(0, 40, (batch,), generator=gen, dtype=torch.int32).cuda()
        for s in range(3):
            tokens = torch.randint(0, 163840, (batch,), generator=gen).cuda()
            got = step(tokens, start + s, slots).clone()
            want = reference_call(ref, tokens, start + s, slots).clone()
            rel, same = check_logits(got, want)
            print(f"93 layers, batch {batch} step {s}: rel {rel:.2e} argmax agree {same.float().mean():.3f}")
        del ref
        torch.cuda.empty_cache()
    del step
    torch.cuda.empty_cache()
