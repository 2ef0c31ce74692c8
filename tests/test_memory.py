"""What a build needs on the device, computed before anything is allocated, and the refusal
of a build that cannot fit (graphc/plan.py: memory_layout, check_fits)."""

import pytest

from graphc.errors import GraphcError
from graphc.graph import build_graph, weight_bytes, weight_shapes
from graphc.plan import DEVICE_HEADROOM_BYTES, Plan, check_fits, memory_layout
from graphc.schedule import build_schedule
from graphc.spec import load_spec
from graphc.weights import Weights, random_init_temporary_bytes


def schedule_of(path):
    return build_schedule(build_graph(load_spec(path)), None, True, batch=8)


def test_layout_of_the_93_layer_model():
    schedule = schedule_of("layer_specs/kimi_k3_dense.yaml")
    layout = memory_layout(schedule, 16)
    # K and V of 93 layers, 8 KV heads of 128, 4096 tokens, bf16, for 16 rows + the scratch slot.
    assert layout.kv_cache_bytes == 17 * 93 * 2 * 8 * 4096 * 128 * 2
    assert layout.weight_bytes == weight_bytes(schedule.graph)
    assert layout.slots == 17
    assert layout.total_bytes == (layout.weight_bytes + layout.kv_cache_bytes + layout.other_state_bytes
                                  + layout.activation_bytes)
    assert "KV cache 26.52 GB (17 slots: batch 16 + 1 for padding)" in layout.describe()


def test_layout_is_what_the_plan_allocates():
    schedule = schedule_of("layer_specs/tiny.yaml")
    shapes = weight_shapes(schedule.graph)
    plan = Plan(schedule, 5, Weights.random(shapes))
    layout = memory_layout(schedule, 5)
    assert plan.activation_bytes == layout.activation_bytes
    # Buffers in one slab share one tensor; every other buffer has its own.
    tensors = {}
    for name, t in plan.storage.items():
        tensors.setdefault(id(t), set()).add(name)
    by_slab = {}
    for name, i in layout.slab_of.items():
        by_slab.setdefault(i, set()).add(name)
    assert sorted(map(sorted, by_slab.values())) == sorted(
        sorted(names) for names in tensors.values() if names & set(layout.slab_of))
    assert sum(t.numel() * t.element_size() for name, t in plan.storage.items()
               if name not in layout.slab_of) == layout.kv_cache_bytes + layout.other_state_bytes


def test_a_build_that_fits_passes():
    schedule = schedule_of("layer_specs/kimi_k3_dense.yaml")
    layout = memory_layout(schedule, 8)
    assert check_fits(schedule, 8, layout.total_bytes + DEVICE_HEADROOM_BYTES, "GPU") == layout
    # Weights already on the device are not counted again.
    check_fits(schedule, 8, layout.total_bytes - layout.weight_bytes + DEVICE_HEADROOM_BYTES, "GPU",
               new_weight_bytes=0)


def test_a_build_that_does_not_fit_is_refused_with_what_would():
    schedule = schedule_of("layer_specs/kimi_k3_dense.yaml")
    free = 150 * 10**9
    transient = random_init_temporary_bytes(weight_shapes(schedule.graph))
    assert transient == 4 * 163840 * 7168          # the lm_head's (and embedding's) fp32 draw
    with pytest.raises(GraphcError) as err:
        check_fits(schedule, 64, free, "NVIDIA H200 (cuda:0)", transient_bytes=transient)
    msg = str(err.value)
    # By hand: per layer qkv, o_proj, gate_up, down and two AttnRes calls' three vectors; the
    # final AttnRes; embedding and lm_head. K and V for 64 rows + the scratch slot.
    per_layer = 7168 * 10240 + 8192 * 7168 + 7168 * 36864 + 18432 * 7168 + 2 * 3 * 7168
    weights = 2 * (93 * per_layer + 3 * 7168 + 2 * 163840 * 7168)
    kv = 65 * 93 * 2 * 8 * 4096 * 128 * 2
    layout = memory_layout(schedule, 64)
    assert (layout.weight_bytes, layout.kv_cache_bytes) == (weights, kv)
    need = weights + kv + layout.other_state_bytes + layout.activation_bytes + transient + DEVICE_HEADROOM_BYTES
    assert f"kimi_k3_dense at batch sizes up to 64 needs {need / 1e9:.1f} GB" in msg
    assert f"weights {weights / 1e9:.2f} GB, KV cache {kv / 1e9:.2f} GB (65 slots" in msg
    assert "NVIDIA H200 (cuda:0) has 150.0 GB free" in msg
    assert "model.max_context (4096) in layer_specs/kimi_k3_dense.yaml" in msg
    fits = int(msg.split("Capture batch sizes up to ")[1].split(",")[0])

    def need(b):
        return memory_layout(schedule, b).total_bytes + transient + DEVICE_HEADROOM_BYTES

    assert need(fits) <= free < need(fits + 1)
    check_fits(schedule, fits, free, "GPU", transient_bytes=transient)


def test_nothing_fits_on_a_small_device():
    schedule = schedule_of("layer_specs/kimi_k3_dense.yaml")
    # 103 GB of weights on an 80 GB GPU: no smaller KV cache can help, and the advice says so.
    weights = memory_layout(schedule, 4).weight_bytes
    with_workspace = (weights + DEVICE_HEADROOM_BYTES) / 1e9
    with pytest.raises(GraphcError, match=rf"80\.0 GB free\. The weights alone \({weights / 1e9:.1f} GB, "
                                          rf"{with_workspace:.1f} GB with the workspace\) do not fit: this model "
                                          r"needs a device with more memory\.$"):
        check_fits(schedule, 4, 80 * 10**9, "NVIDIA H100 80GB HBM3 (cuda:0)")


def test_a_device_whose_memory_is_in_use_is_not_called_too_small():
    """The same 103 GB of weights on an H200 with 25.8 GB free (another model built beside this
    one holds the rest, as in graphc bench's A/B on the 93-layer model): the device is large
    enough when idle, so the advice names the memory in use, not a larger device."""
    schedule = schedule_of("layer_specs/kimi_k3_dense.yaml")
    total = 150 * 10**9
    with pytest.raises(GraphcError) as err:
        check_fits(schedule, 8, 25_800_000_000, "NVIDIA H200 (cuda:0)", total_bytes=total)
    msg = str(err.value)
    assert msg.endswith("do not fit in what is free: 124.2 GB of its 150.0 GB are in use (by this process "
                        "or another); free them, or build on an idle device."), msg
    assert "needs a device with more memory" not in msg
    # On a device smaller than the model, the total changes nothing.
    with pytest.raises(GraphcError, match=r"this model needs a device with more memory\.$"):
        check_fits(schedule, 4, 80 * 10**9, "NVIDIA H100 80GB HBM3 (cuda:0)", total_bytes=85 * 10**9)


def test_memory_torch_holds_for_freed_tensors_counts_as_free(monkeypatch):
    """graphc.runtime.check_memory on a GPU (faked: this test never touches one) whose driver
    reports less free than a build needs, where torch's caching allocator holds the rest for
    tensors this process already freed (an earlier step dropped): the allocator hands that
    memory out again, so the build is not refused; where part of it is pieces of segments still
    in use, it is, naming what is free."""
    import torch

    from graphc.runtime import check_memory

    schedule = schedule_of("layer_specs/kimi_k3_dense_8l.yaml")
    layout = memory_layout(schedule, 64)
    need = (layout.total_bytes + random_init_temporary_bytes(weight_shapes(schedule.graph))
            + DEVICE_HEADROOM_BYTES)
    gb = 10**9
    stats = {"reserved_bytes.all.current": 30 * gb, "allocated_bytes.all.current": 25 * gb,
             "inactive_split_bytes.all.current": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (need - 4 * gb, 85 * gb))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H100 80GB HBM3")
    check_memory(schedule, 64, torch.device("cuda:0"), None)        # 5 GB cached covers the 4 missing
    # 2 of those 5 GB are free pieces of segments still partly in use, which a large buffer
    # cannot take: 1 GB short.
    stats["inactive_split_bytes.all.current"] = 2 * gb
    with pytest.raises(GraphcError, match=r"NVIDIA H100 80GB HBM3 \(cuda:0\) has (\d+\.\d+) GB free") as err:
        check_memory(schedule, 64, torch.device("cuda:0"), None)
    assert f"has {(need - gb) / gb:.1f} GB free" in str(err.value)
