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


def holds_the_full_model(rows: int) -> bool:
    """Whether this GPU's whole memory holds the 93-layer model at ``rows`` rows, by graphc's
    own account (plan.memory_layout: weights, KV cache, activations, and the device headroom).
    Its 103 GB of weights fit an H200, not an 80 GB H100."""
    from graphc.graph import build_graph
    from graphc.plan import DEVICE_HEADROOM_BYTES, memory_layout
    from graphc.schedule import build_schedule
    from graphc.spec import load_spec

    layout = memory_layout(build_schedule(build_graph(load_spec(FULL))), rows)
    return layout.total_bytes + DEVICE_HEADROOM_BYTES <= torch.cuda.get_device_properties(0).total_memory


def test_a_build_too_large_for_the_gpu_is_refused_before_allocating():
    """64 rows at 4096 tokens of context need ~101 GB of KV cache beside the weights: an H200
    is told the largest batch size that fits; a GPU that cannot hold even the weights, that the
    model needs a device with more memory."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    if holds_the_full_model(1):
        refusal = r"needs 2\d\d\.\d GB of GPU memory.*Capture batch sizes up to \d+"
    else:
        refusal = (r"needs 2\d\d\.\d GB of GPU memory.*The weights alone \(103\.0 GB.*do not fit: "
                   r"this model needs a device with more memory")
    with pytest.raises(GraphcError, match=refusal):
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


def test_the_read_probe_reads_every_word_and_faster_than_a_copy():
    """graphc bench's read rate (kernels/hbm_read.py): each program's partial sum is the sum of
    its own run of words (so every word was read), and on an H200 HBM reads faster than it
    copies (4.33-4.47 against 4.17 TB/s on one board) and never faster than its 4.8 TB/s peak."""
    from graphc.bench import copy_bytes_per_s, read_bytes_per_s
    from graphc.kernels import hbm_read

    gen = torch.Generator(device="cuda").manual_seed(0)
    words = torch.randint(-1000, 1000, (3 << 22,), dtype=torch.int32, device="cuda", generator=gen)
    programs, iters = hbm_read.read_grid(words.numel(), 4)
    partial_sums = torch.full((programs + 1,), -7, dtype=torch.int32, device="cuda")     # poisoned
    read = hbm_read.read_sum(words, partial_sums, programs, iters)
    assert read == programs * iters * hbm_read.WORDS * 4
    expected = words[: read // 4].view(programs, -1).to(torch.int64).sum(1).to(torch.int32)
    assert torch.equal(partial_sums[:programs], expected)
    assert int(partial_sums[programs]) == -7                    # nothing written past the grid
    assert hbm_read.read_grid((512 << 20) // 4, 132) == (132 * hbm_read.PROGRAMS_PER_SM, 3)
    with pytest.raises(ValueError, match="too small"):
        hbm_read.read_grid(1000, 132)

    if torch.cuda.get_device_name() != "NVIDIA H200":
        pytest.skip("the bounds are an H200's")
    copy, read_rate = copy_bytes_per_s(), read_bytes_per_s()
    print(f"device-to-device copy {copy / 1e12:.3f} TB/s, read {read_rate / 1e12:.3f} TB/s")
    assert copy < read_rate < 4.8e12


def test_kimi_93_layers_against_reference():
    """Every layer of the real depth, AttnRes blocks of 12 (up to 8 saved blocks): the captured
    step's logits against the all-torch reference executor, three steps at 1 and 6 rows (the
    batch-8 graph, padded)."""
    if not holds_the_full_model(8):
        pytest.skip(f"the 93-layer model's 103 GB of weights need a larger GPU than this "
                    f"{torch.cuda.get_device_name()} (an H200); the refusal is tested above")
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
