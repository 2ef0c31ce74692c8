"""DecodeStep on the CPU (reference executor behind the same API): batch selection, padding
into the scratch slot, and every refused input leaving the KV cache untouched."""

import contextlib
import os
import re
import statistics

import numpy as np
import pytest
import torch

import graphc
from graphc.errors import GraphcError
from graphc.bench import format_bench_table


@pytest.fixture(scope="module")
def step():
    return graphc.build("layer_specs/tiny.yaml", batch_sizes=[1, 4], device="cpu", progress=None)


def kv_state(step):
    return {n: t.clone() for n, t in step.plan.storage.items() if n.endswith(".kv")}


def test_smallest_captured_size_that_holds_the_batch(step):
    assert step.batch_sizes == [1, 4]
    assert [step.padded_size(b) for b in (1, 2, 3, 4)] == [1, 4, 4, 4]


def test_padded_batch_matches_unpadded_and_spares_live_slots(step):
    step.reset()
    tokens, lens = torch.tensor([3, 14, 15]), torch.tensor([0, 0, 0], dtype=torch.int32)
    logits = step(tokens, lens).clone()
    assert logits.shape == (3, 4096)
    kv = step.plan.storage["L00.kv"]
    assert kv[3].abs().sum() == 0            # slot 3 belongs to nobody in this batch
    assert kv[step.plan.scratch_slot].abs().sum() > 0   # the padding row wrote here
    # Rows are independent: a real fourth row instead of the padding changes nothing in rows 0-2.
    step.reset()
    full = step(torch.tensor([3, 14, 15, 92]), torch.zeros(4, dtype=torch.int32)).clone()
    assert torch.equal(full[:3], logits)
    # And one row alone (the size-1 path) agrees to rounding.
    step.reset()
    one = step(tokens[1:2], lens[1:2], torch.tensor([1], dtype=torch.int32)).clone()
    rel = (one[0].float() - logits[1].float()).norm() / logits[1].float().norm()
    assert rel < 1e-2


def test_logits_are_a_view_of_a_static_buffer(step):
    a = step(torch.tensor([1, 2]), torch.tensor([0, 0], dtype=torch.int32))
    b = step(torch.tensor([5, 6]), torch.tensor([0, 0], dtype=torch.int32))
    assert a.data_ptr() == b.data_ptr()


BAD = [
    ("larger than every captured", lambda: (torch.arange(5), torch.zeros(5, dtype=torch.int32)), {}),
    ("int32 or int64", lambda: (torch.ones(2), torch.zeros(2, dtype=torch.int32)), {}),
    ("shape \\[2\\]", lambda: (torch.ones(2, dtype=torch.long), torch.zeros(3, dtype=torch.int32)), {}),
    ("past the maximum context", lambda: (torch.ones(2, dtype=torch.long), torch.tensor([0, 256], dtype=torch.int32)), {}),
    ("seq_lens .* must be >= 0, found -1", lambda: (torch.ones(2, dtype=torch.long), torch.tensor([0, -1], dtype=torch.int32)), {}),
    ("token ids must be in", lambda: (torch.tensor([0, 4096]), torch.zeros(2, dtype=torch.int32)), {}),
    ("is on meta", lambda: (torch.ones(2, dtype=torch.long, device="meta"), torch.zeros(2, dtype=torch.int32)), {}),
    ("distinct", lambda: (torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.int32)),
     {"cache_slots": torch.tensor([1, 1], dtype=torch.int32)}),
    ("cache_slots must be in", lambda: (torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.int32)),
     {"cache_slots": torch.tensor([0, 4], dtype=torch.int32)}),
    ("tokens must be a dense tensor, found layout torch.sparse_coo",
     lambda: (torch.tensor([1, 2]).to_sparse(), torch.zeros(2, dtype=torch.int32)), {}),
    ("cache_slots must be a dense tensor", lambda: (torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.int32)),
     {"cache_slots": torch.tensor([0, 1]).to_sparse()}),
]


@pytest.mark.parametrize("message,inputs,kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_the_cache_is_untouched(step, message, inputs, kwargs):
    step.reset()
    step(torch.tensor([7, 8]), torch.tensor([0, 0], dtype=torch.int32))
    before = kv_state(step)
    with pytest.raises(GraphcError, match=message):
        step(*inputs(), **kwargs)
    after = kv_state(step)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_reset_clears_chosen_slots(step):
    step(torch.tensor([7, 8]), torch.tensor([0, 0], dtype=torch.int32))
    step.reset([1])
    kv = step.plan.storage["L00.kv"]
    assert kv[0].abs().sum() > 0 and kv[1].abs().sum() == 0


@pytest.mark.parametrize("slots", [1, np.int64(1), np.array([1]), torch.tensor([1]), (1,), range(1, 2)])
def test_reset_takes_slots_in_the_forms_a_caller_has(step, slots):
    """One integer, a sequence, a numpy array or integer, or a tensor as ``__call__`` takes
    them: slot 1 is cleared, slot 0 kept."""
    step(torch.tensor([7, 8]), torch.tensor([0, 0], dtype=torch.int32))
    step.reset(slots)
    kv = step.plan.storage["L00.kv"]
    assert kv[0].abs().sum() > 0 and kv[1].abs().sum() == 0
    before = kv_state(step)
    step.reset([])                       # nothing to clear
    assert all(torch.equal(before[n], t) for n, t in kv_state(step).items())


def test_batch_sizes_are_integers_of_any_kind(step):
    assert step.schedule_for(np.int64(3)) is step.schedules[4]
    assert step.padded_size(torch.tensor(2)) == 4
    for bad, message in [(0, "at least one row, found 0"), (2.5, "an integer number of rows, found 2.5"),
                         (True, "an integer number of rows, found True")]:
        with pytest.raises(GraphcError, match=message):
            step.schedule_for(bad)


def test_the_cpu_is_cpu_or_cpu_0():
    from graphc.runtime import run_device

    assert run_device("cpu:0") == torch.device("cpu") == run_device("cpu")
    with pytest.raises(GraphcError, match="the CPU is 'cpu'"):
        run_device("cpu:1")


@pytest.mark.parametrize("slots", [[99], [-1], ["0"], [0.5], "0", torch.tensor([0.5]), [True],
                                   np.array([[0, 1]]), [torch.tensor(1.5)], torch.tensor([1]).to_sparse(),
                                   torch.tensor([1], device="meta")])
def test_reset_refuses_slots_the_step_does_not_have(step, slots):
    step(torch.tensor([7, 8]), torch.tensor([0, 0], dtype=torch.int32))
    before = kv_state(step)
    with pytest.raises(GraphcError, match=r"reset: cache slots are integers in \[0, 4\)"):
        step.reset(slots)                # -1 would be the scratch slot by Python's indexing
    assert all(torch.equal(before[n], t) for n, t in kv_state(step).items())


@pytest.mark.parametrize("batch_sizes, message", [
    (["a"], "list of integers"), (8, "list of integers"), ([1.5], "list of integers"), ([], "list of integers"),
    ([True], "list of integers"), ([0, 4], "between 1 and 512"), ([1, 513], "between 1 and 512"),
])
def test_build_refuses_batch_sizes_that_are_not_a_list_of_sizes(batch_sizes, message):
    with pytest.raises(GraphcError, match=message):
        graphc.build("layer_specs/tiny.yaml", batch_sizes, device="cpu", progress=None)


def test_batch_sizes_may_be_an_integer_tensor_or_array_as_a_list_may():
    from graphc.runtime import batch_size_list

    assert batch_size_list(torch.tensor([8, 1, 8])) == batch_size_list(np.array([8, 1])) == [1, 8]
    for bad in (torch.tensor([1.0, 8.0]), torch.tensor([[1, 8]]), torch.tensor([True])):
        with pytest.raises(GraphcError, match="list of integers"):
            batch_size_list(bad)


@pytest.mark.parametrize("device", ["gpu", "mps", "tpu:0"])
def test_build_refuses_a_device_graphc_does_not_run_on(device):
    with pytest.raises(GraphcError, match=f"device {device!r}: graphc runs on 'cuda'"):
        graphc.build("layer_specs/tiny.yaml", [1], device=device, progress=None)


@pytest.mark.parametrize("kwargs, message", [
    ({"implementations": "cute"}, "implementations: expected a mapping from op kinds or node names"),
    ({"implementations": {"linear": 1}}, "implementations: expected a mapping"),
    ({"weights": 123}, "weights: expected None .random., a .safetensors path or a Weights, found int 123"),
    ({"use_pdl": "no"}, "use_pdl: expected True or False, found 'no'"),
    ({"block_weights": 1}, "block_weights: expected True or False, found 1"),
    ({"seed": "1"}, r"seed: expected an integer in 0..2\*\*63-1, found '1'"),
    ({"seed": 2**64}, r"seed: expected an integer in 0..2\*\*63-1"),
    ({"seed": 1.5}, r"seed: expected an integer"),
    ({"progress": "x"}, "progress: expected a callable taking one line, or None; found 'x'"),
    ({"compile_jobs": "a"}, "compile_jobs: expected None or a count of processes >= 0, found 'a'"),
    ({"compile_jobs": -1}, "compile_jobs: expected None or a count"),
    ({"block_rows": 64.0}, r"block_rows=64.0 unsupported: rows per weight block are 64 or 16"),
    ({"block_rows": 32}, r"block_rows=32 unsupported"),
    ({"block_rows": np.array([64, 16])}, r"block_rows=array\(\[64, 16\]\) unsupported"),
])
def test_build_refuses_mistyped_arguments_before_any_work(kwargs, message, monkeypatch):
    """A wrong type is a GraphcError up front: found late, a bad ``progress`` would fail only
    after the weights had loaded."""
    import graphc.runtime

    def work(*args, **kwargs):
        raise AssertionError("the build began its work before checking its arguments")

    monkeypatch.setattr(graphc.runtime, "load_spec", work)
    with pytest.raises(GraphcError, match=message):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", **{"progress": None, **kwargs})


@pytest.mark.parametrize("args, kwargs, message", [
    ((), {"batch_size": [1], "device": "cpu"}, r"build\(\) takes no argument 'batch_size' \(did you mean batch_sizes\?\); "
                              r"it takes spec, batch_sizes, weights, device"),
    ((), {"frobnicate": 1, "device": "cpu"}, r"build\(\) takes no argument 'frobnicate'; it takes spec"),
    (([1], None, "cpu"), {"device": "cpu"}, r"build\(\): multiple values for argument 'device'; it takes spec, "),
    (([1], None, "cpu") + tuple(range(9)), {}, r"build\(\): too many positional arguments; it takes spec, "),
])
def test_build_names_the_argument_a_misspelt_keyword_meant(args, kwargs, message, monkeypatch):
    """Python would say only "unexpected keyword argument"; graphc names the argument meant, as a
    GraphcError that is still a TypeError, before any work."""
    import graphc.runtime

    def work(*a, **k):
        raise AssertionError("the build began its work before checking its arguments")

    monkeypatch.setattr(graphc.runtime, "load_spec", work)
    with pytest.raises(GraphcError, match=message) as refused:
        graphc.build("layer_specs/tiny.yaml", *args, **kwargs)
    assert isinstance(refused.value, TypeError)


def test_a_weights_file_this_user_cannot_read_is_named_as_such(tmp_path, monkeypatch, step):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\xff" * 64)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(path) else real_access(p, mode))
    message = f"{path}: this user cannot read the weights file \\(permission denied\\)"
    with pytest.raises(GraphcError, match=message):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights=path)
    with pytest.raises(GraphcError, match=message):
        step.load_weights(path)
    with pytest.raises(GraphcError, match="weights: expected the path of a .safetensors file, found NoneType"):
        step.load_weights(None)


def test_build_refuses_a_gpu_index_the_machine_does_not_have(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(GraphcError, match=r"device 'cuda:2': this machine has 2 CUDA GPUs \(cuda:0 \.\. cuda:1\)"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cuda:2", progress=None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(GraphcError, match=r"device 'cuda:1': this machine has 1 CUDA GPU \(cuda:0\)$"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cuda:1", progress=None)


def test_a_cpu_build_applies_and_checks_implementation_choices():
    """The choices mean the same on the CPU as on a GPU: the schedules say what a GPU would run,
    and a misspelt kind or implementation is refused rather than ignored."""
    chosen = graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None,
                          implementations={"linear": "cublas", "L01.attn.attention": "torch"})
    kernels = chosen.schedule_for(1).kernels
    assert {k.impl for k in kernels if k.op.kind == "linear"} == {"cublas"}
    assert [k.impl for k in kernels if k.node == "L01.attn.attention"] == ["torch"]   # by node name
    others = {k.impl for k in kernels if k.op.kind == "decode_attention" and k.node != "L01.attn.attention"}
    assert others and "torch" not in others
    # Per batch size: cuBLAS for qkv at 4 rows only; the other size keeps the kind's choice.
    per_size = graphc.build("layer_specs/tiny.yaml", [1, 4], device="cpu", progress=None,
                            implementations={"L00.attn.qkv": "cublas@4", "linear": "cute"})
    assert [per_size.schedule_for(b).kernel("L00.attn.qkv").impl for b in (1, 4)] == ["cute", "cublas"]
    for bad, message in [({"lienar": "cublas"}, "did you mean linear"),
                         ({"linear": "cublass"}, "no implementation 'cublass'"),
                         ({"linear": "cute@4,cublass"}, "no implementation 'cublass'"),
                         ({"linear": "cublas@0-4"}, "spans must be increasing"),
                         ({"linear": "cute@1-600"}, "'1-600' goes past 512, the largest batch size"),
                         ({"L09.mlp.down": "cute"}, "neither an op kind nor a node")]:
        with pytest.raises(GraphcError, match=message):
            graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, implementations=bad)


def test_a_gpu_device_on_a_machine_without_one_is_refused_naming_it():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(GraphcError, match=r"device 'cuda:3' requested but no CUDA GPU is available"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cuda:3", progress=None)


def test_a_cpu_build_larger_than_host_memory_is_refused_before_allocating(tmp_path):
    spec = tmp_path / "huge_context.yaml"
    spec.write_text(open("layer_specs/tiny.yaml").read().replace("max_context: 256", "max_context: 100000000"))
    with pytest.raises(GraphcError, match=r"needs \d+\.\d GB of host memory: .*KV cache .*this host has "
                                          r".* GB free\. No batch size fits: lower model\.max_context"):
        graphc.build(spec, [1], device="cpu", progress=None)


def test_a_weights_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(GraphcError, match="w.safetensors: not a readable safetensors file"):
        graphc.build("layer_specs/tiny.yaml", [1], weights=tmp_path / "w.safetensors", device="cpu",
                     progress=None)


def test_weight_reload_is_seen_by_the_next_step(tmp_path, step):
    from graphc.graph import weight_shapes
    from graphc.weights import Weights

    tokens, lens = torch.tensor([1, 2]), torch.zeros(2, dtype=torch.int32)
    before = step(tokens, lens).clone()
    other = Weights.random(weight_shapes(step.schedule.graph), seed=7)
    other.save(tmp_path / "w.safetensors")
    step.load_weights(tmp_path / "w.safetensors")
    after = step(tokens, lens).clone()
    assert not torch.equal(before, after)
    fresh = graphc.build("layer_specs/tiny.yaml", [4], weights=tmp_path / "w.safetensors",
                         device="cpu", progress=None)
    assert torch.equal(fresh(tokens, lens), after)


def test_weight_reload_with_a_bad_tensor_changes_nothing(tmp_path, step):
    """Every name, dtype and shape is checked before the first weight is replaced (the reload
    then copies one tensor at a time), so a bad file leaves the step exactly as it was."""
    from graphc.graph import weight_shapes
    from graphc.weights import Weights

    tokens, lens = torch.tensor([3, 4]), torch.zeros(2, dtype=torch.int32)
    before = step(tokens, lens).clone()
    shapes = weight_shapes(step.schedule.graph)
    bad = Weights.random(shapes, seed=9).tensors
    last = list(shapes)[-1]
    bad[last] = bad[last].float()                 # the last weight in the wrong dtype
    from safetensors.torch import save_file

    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(GraphcError, match=f"{last}: expected bfloat16 .*, found float32"):
        step.load_weights(tmp_path / "bad.safetensors")
    assert torch.equal(step(tokens, lens), before)


def test_weight_file_with_wrong_names_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"nope": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(GraphcError, match="missing L00.attn.*; not in the spec nope \\(graphc build"):
        graphc.build("layer_specs/tiny.yaml", [1], weights=tmp_path / "w.safetensors", device="cpu",
                     progress=None)


def test_another_models_weights_are_named_as_such(tmp_path):
    """A file whose shared names have other shapes is another model's: the refusal says so,
    not only which names are missing."""
    from safetensors.torch import save_file

    from graphc.graph import build_graph, weight_shapes
    from graphc.spec import load_spec

    shapes = weight_shapes(build_graph(load_spec("layer_specs/tiny.yaml")))
    names = list(shapes)
    other = {n: torch.zeros([2 * d for d in shapes[n]], dtype=torch.bfloat16) for n in names[1:4]}
    save_file(other, str(tmp_path / "other.safetensors"))
    first = sorted(other)[0]
    with pytest.raises(GraphcError, match=rf"missing .*; 3 of the names in both have other "
                                          rf"shapes \(e\.g\. {first}: \[\d+\], the spec needs \[\d+\]\), so the file is probably for "
                                          rf"another model"):
        graphc.build("layer_specs/tiny.yaml", [1], weights=tmp_path / "other.safetensors", device="cpu",
                     progress=None)


def test_cuda_requested_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(GraphcError, match="no CUDA GPU"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cuda", progress=None)


def test_bench_table_formats_recorded_numbers():
    row = {"batch": 8, "step_us": 2700.0, "floor_us": 2580.0, "ratio": 2700 / 2580, "kernels": 67,
           "pdl_edges": 17, "capture_s": 0.4, "graph_memory_bytes": 2e6, "plain_step_us": 2650.0,
           "attn_res_overhead": 50 / 2700, "attn_res_share": 0.031, "reference_graph_us": 4650.0,
           "torch_eager_us": 6100.0}
    text = format_bench_table({"spec": "x.yaml", "gpu": "NVIDIA H200", "date": "2026-11-30",
                               "context": 1024, "rows": [row],
                               "floor_bandwidth": {"hbm_bytes_per_s": 4.3e12, "copy_bytes_per_s": 4.21e12,
                                                   "source": "NVIDIA H200 lab measurement"}})
    assert "NVIDIA H200" in text
    assert "floor: bytes / 4.30 TB/s (NVIDIA H200 lab measurement); this board copies at 4.21 TB/s" in text
    line = [l for l in text.splitlines() if l.split() and l.split()[0] == "8"]
    assert "2700.0" in line[0] and "1.047" in line[0]
    assert line[1].split() == ["8", "2700.0", "2650.0", "1.9%", "3.1%", "4650.0", "6100.0"]
    assert "fp32 ref: the reference executor, a correctness oracle" in text
    assert "cuBLAS+torch" not in text                 # recorded before that baseline existed
    assert "read rate" not in text                    # recorded before the read rate existed
    # The same bytes at the board's read rate: 2700 / (2580 * 4.3 / 4.47) = 1.088.
    text = format_bench_table({"spec": "x.yaml", "gpu": "NVIDIA H200", "date": "2026-12-01",
                               "context": 1024, "rows": [row],
                               "floor_bandwidth": {"hbm_bytes_per_s": 4.3e12, "copy_bytes_per_s": 4.21e12,
                                                   "read_bytes_per_s": 4.47e12, "source": "x"}})
    assert "against this board's read rate (4.47 TB/s, a read-only kernel): 1.088x at batch 8" in text
    row["attn_res_ab"] = {"attn_res_us": 2702.0, "plain_us": 2650.0, "rounds": 5}
    row["cublas_step_us"], row["library_step_us"] = 2781.0, 4590.0
    text = format_bench_table({"spec": "x.yaml", "gpu": "NVIDIA H200", "date": "2026-12-01",
                               "context": 1024, "rows": [row]})
    line = [l for l in text.splitlines() if l.split() and l.split()[0] == "8"]
    assert line[1].split() == ["8", "2700.0", "2702.0", "2650.0", "1.9%", "3.1%", "2781.0", "1.03x", "4590.0",
                               "1.70x", "4650.0", "6100.0"]
    assert "cuBLAS: the same step in one CUDA graph, no PDL, every linear layer on cuBLAS" in text
    assert ("A/B: this step and the same model with a plain residual (plain us), timed in turns (5 rounds, "
            "medians); AttnRes ovh from that pair") in text


def test_ab_timing_alternates_its_candidates_and_takes_medians(monkeypatch):
    import graphc.bench as gb

    order, times = [], iter([3.0, 1.0, 2.0, 5.0, 1.5, 4.0])     # (a, b) per round

    def timed(replay, replays):
        order.append((replay(), replays))
        return next(times)

    monkeypatch.setattr(gb, "time_replays", timed)
    passes = gb.interleaved_rounds({"a": lambda: "a", "b": lambda: "b"}, rounds=3, per_pass=100)
    assert passes == {"a": [3.0, 2.0, 1.5], "b": [1.0, 5.0, 4.0]}
    assert {name: statistics.median(p) for name, p in passes.items()} == {"a": 2.0, "b": 4.0}
    assert order == [("a", 100), ("b", 100)] * 3


def _weights_like(step, change):
    from graphc.weights import Weights

    return Weights({n: change(n, t) for n, t in step.plan.weights.tensors.items()}, "changed")


@pytest.mark.parametrize("change, message", [
    (lambda n, t: t.float(), r"weight embed.weight: expected bfloat16, found torch.float32"),
    (lambda n, t: t.half() if n == "lm_head.weight" else t, r"weight lm_head.weight: expected bfloat16, found torch.float16"),
    (lambda n, t: t.to("meta") if n == "L01.mlp.down.weight" else t, r"weight L01.mlp.down.weight: on meta, the step runs on cpu"),
    (lambda n, t: t.t().contiguous().t() if n == "L00.attn.qkv.weight" else t,
     r"weight L00.attn.qkv.weight: expected a dense contiguous tensor .*found strides \(1, 1536\)"),
    (lambda n, t: t[:-1] if n == "L00.attn.o_proj.weight" else t, r"weight L00.attn.o_proj.weight: expected shape \[1024, 1024\], found \[1023, 1024\]"),
])
def test_a_weights_object_the_kernels_cannot_read_is_refused_by_the_build(step, change, message):
    """A Weights passed to build is checked like a file: dtype, layout, device and shape, at
    build time, not as a torch error at the first call."""
    with pytest.raises(GraphcError, match=message):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights=_weights_like(step, change))
    weights = _weights_like(step, lambda n, t: t)
    del weights.tensors["L02.attn_res.mlp.query"]
    with pytest.raises(GraphcError, match=r"weight L02.attn_res.mlp.query: missing from the Weights given \(changed\)"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights=weights)


def test_a_weights_object_with_other_weights_or_nan_values_is_refused_as_a_file_is(step):
    """A Weights of another model (extra names) or holding a NaN is refused by the build, as the
    same tensors in a file are, not run into NaN logits or silently trimmed."""
    import torch

    weights = _weights_like(step, lambda n, t: t.clone())
    weights.tensors["L04.attn.qkv.weight"] = weights.tensors["L00.attn.qkv.weight"]
    with pytest.raises(GraphcError, match=r"weights \(changed\): 1 not in the spec \(L04.attn.qkv.weight\), "
                                          r"so they are probably another model's"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights=weights)
    del weights.tensors["L04.attn.qkv.weight"]
    weights.tensors["L01.mlp.down.weight"][3, 5] = float("nan")
    with pytest.raises(GraphcError, match=r"weights \(changed\): L01.mlp.down.weight: 1 value NaN or Inf "
                                          r"\(the first at index \[3, 5\], nan\)"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights=weights)
    weights.tensors["L01.mlp.down.weight"][3, 5] = 0.0
    ok = graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights=weights)
    assert torch.isfinite(ok(torch.tensor([3]), torch.tensor([0])).float()).all()


def test_weights_save_refuses_a_missing_folder_or_a_folder_and_replaces_only_when_whole(step, tmp_path, monkeypatch):
    from graphc.weights import Weights, read_weights

    with pytest.raises(GraphcError, match=r"weights file .*nodir/w.safetensors: the folder .*nodir does not exist"):
        step.plan.weights.save(tmp_path / "nodir" / "w.safetensors")
    with pytest.raises(GraphcError, match=r"weights file .*: that is a folder; give a file name"):
        step.plan.weights.save(tmp_path)
    target = tmp_path / "w.safetensors"
    target.write_text("old")
    import safetensors.torch

    def fail(tensors, filename):
        open(filename, "w").write("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(GraphcError, match=r"cannot write it \(No space left on device\); nothing was written or replaced"):
        step.plan.weights.save(target)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    monkeypatch.undo()
    step.plan.weights.save(target)
    shapes = {n: step.plan.weights.shape(n) for n in step.plan.weights.tensors}
    loaded = dict(read_weights(target, shapes))
    assert all(loaded[n].equal(step.plan.weights.matrix(n)) for n in shapes)
    assert isinstance(step.plan.weights, Weights)


@pytest.mark.parametrize("progress", [lambda: None, lambda a, b: None])
def test_a_progress_callable_that_cannot_take_one_line_is_refused_up_front(progress):
    with pytest.raises(GraphcError, match="progress: expected a callable taking one line"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=progress)


def test_a_term_that_covers_no_built_size_is_named_in_the_progress_output():
    lines = []
    graphc.build("layer_specs/tiny.yaml", [1, 8], device="cpu", progress=lines.append,
                 implementations={"linear": "cute@16,cublas", "L*.attn.qkv": "cublas@1-4"})
    assert "implementations: linear=cute@16 covers none of the batch sizes built (1, 8), so decides nothing here" in lines
    assert not any("cublas@1-4" in line for line in lines)


def test_step_refuses_a_validate_that_is_not_a_bool(step):
    import torch

    for bad in ("no", 0, None):
        with pytest.raises(GraphcError, match="validate: expected True or False"):
            step(torch.tensor([3]), torch.tensor([0]), validate=bad)


def test_profile_refuses_bad_arguments_before_it_times_anything(step, tmp_path):
    for kwargs, message in [({"context": 0}, "context must be an integer >= 1, found 0"),
                            ({"context": -5}, "context must be an integer >= 1"),
                            ({"context": 10**6}, "context 1000000 is past the model's max_context"),
                            ({"replays": 0}, "replays must be an integer >= 1"),
                            ({"repeat": 2.5}, "repeat must be an integer >= 1"),
                            ({"path": tmp_path / "no" / "p.json"}, "the folder .* does not exist"),
                            ({"path": tmp_path}, "profile .*: that is a folder; give a file name")]:
        with pytest.raises(GraphcError, match=message):
            step.profile(1, **kwargs)
    with pytest.raises(GraphcError, match="profile needs a CUDA device"):
        step.profile(1, tmp_path / "p.json", context=16, replays=3, repeat=2)
    assert not (tmp_path / "p.json").exists()


def test_a_mapping_is_not_a_list_of_batch_sizes():
    with pytest.raises(GraphcError, match="batch_sizes must be a list of integers"):
        graphc.build("layer_specs/tiny.yaml", {1: "a", 8: "b"}, device="cpu", progress=None)


def test_empty_paths_are_named_as_empty():
    with pytest.raises(GraphcError, match="a spec is the path of a YAML file, found an empty path"):
        graphc.build("", [1], device="cpu", progress=None)
    with pytest.raises(GraphcError, match=r"weights: an empty path \(give the .safetensors file\)"):
        graphc.build("layer_specs/tiny.yaml", [1], device="cpu", progress=None, weights="")


def test_an_unknown_weight_name_is_a_graphc_error_with_suggestions(step):
    with pytest.raises(GraphcError, match=r"no weight named 'L00.attn.qkv.weigth'; did you mean L00.attn.qkv.weight"):
        step.plan.weights.matrix("L00.attn.qkv.weigth")


def test_a_call_that_fails_after_its_checks_is_not_counted_as_served(monkeypatch):
    """padding() counts the calls that ran: one that fails mid-way is not among them."""
    import graphc.runtime

    step = graphc.build("layer_specs/tiny.yaml", batch_sizes=[1, 4], device="cpu", progress=None)

    def fail(plan, size):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(graphc.runtime, "run_kernels", fail)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        step(torch.arange(3), torch.zeros(3, dtype=torch.int32))
    assert step.padding()[4]["calls"] == 0
    monkeypatch.undo()
    step(torch.arange(3), torch.zeros(3, dtype=torch.int32))
    assert step.padding()[4] == {"calls": 1, "rows": 3, "padded_rows": 1, "waste": 0.25}


def test_a_step_built_in_inference_mode_runs_outside_it_and_inside():
    with torch.inference_mode():
        step = graphc.build("layer_specs/tiny.yaml", batch_sizes=[1], device="cpu", progress=None)
    tokens, lens = torch.tensor([5]), torch.zeros(1, dtype=torch.int32)
    outside = step(tokens, lens).clone()
    step.reset()
    with torch.inference_mode():
        inside = step(tokens, lens).clone()
    assert torch.equal(outside, inside)


def test_padding_waste_is_reported_per_size():
    step = graphc.build("layer_specs/tiny.yaml", batch_sizes=[1, 4], device="cpu", progress=None)
    assert step.padding()[4] == {"calls": 0, "rows": 0, "padded_rows": 0, "waste": 0.0}
    for b in (3, 2, 4, 1):
        step(torch.arange(b), torch.zeros(b, dtype=torch.int32))
    pad = step.padding()
    assert pad[4] == {"calls": 3, "rows": 9, "padded_rows": 3, "waste": 0.25}
    assert pad[1] == {"calls": 1, "rows": 1, "padded_rows": 0, "waste": 0.0}


def test_a_build_on_a_gpu_other_than_hopper_says_what_it_runs_instead(monkeypatch):
    """On an sm_80 GPU (faked: this test never touches one) graphc.build names the portable
    implementations it substitutes, before it asks for memory or creates a weight."""
    class Stop(Exception):
        pass

    def no_memory_query(*_):
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_memory_query)
    said = []
    with pytest.raises(Stop):
        graphc.build("layer_specs/tiny.yaml", batch_sizes=[1, 8], device="cuda", progress=said.append)
    assert len(said) == 1, said
    assert said[0].startswith("NVIDIA A100-SXM4-80GB (cuda:0) is sm_80; graphc's Hopper kernels need "
                              "sm_90a (H100/H200), so this build runs portable ones: ")
    assert "linear: cublas instead of cute (sm_90a)" in said[0]
    assert "attn_res: torch instead of cute (sm_90a)" in said[0]
    with pytest.raises(GraphcError, match="needs sm_90a"):
        graphc.build("layer_specs/tiny.yaml", device="cuda", implementations={"attn_res": "cute"},
                      progress=None)


def test_bench_library_baselines_are_cublas_then_torch_ops_without_pdl():
    """graphc bench's hand-written baselines schedule every linear layer on cuBLAS (then also
    AttnRes as PyTorch ops), with no PDL edge, and keep graphc's attention."""
    from graphc.bench import LIBRARY_BASELINES
    from graphc.graph import build_graph
    from graphc.schedule import build_schedule
    from graphc.spec import load_spec

    graph = build_graph(load_spec("layer_specs/kimi_k3_dense_8l.yaml"))
    attn_res = {}
    for key, implementations in LIBRARY_BASELINES.items():
        schedule = build_schedule(graph, implementations, use_pdl=False, batch=8)
        assert schedule.pdl_edges() == []
        kinds = schedule.implementation_summary()
        assert kinds["linear"] == "cublas" and kinds["decode_attention"] in ("tma", "triton")
        attn_res[key] = kinds["attn_res"]
    assert attn_res == {"cublas_step_us": "cute", "library_step_us": "torch"}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_weights_holding_nan_or_inf_are_refused_and_a_reload_changes_nothing(tmp_path, step, value):
    """A weight file with two NaN or Inf values: a build refuses it naming the weight, the count
    and the first; a reload refuses it before replacing anything (it checks every value first)."""
    from safetensors.torch import save_file

    from graphc.graph import weight_shapes
    from graphc.weights import Weights

    shapes = weight_shapes(step.schedule.graph)
    tensors = Weights.random(shapes, seed=5).tensors
    last = list(shapes)[-1]                       # read last: every other weight passes first
    tensors[last].view(-1)[7] = value
    tensors[last].view(-1)[11] = value
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    row, col = divmod(7, tensors[last].shape[-1])
    index = [row, col] if tensors[last].dim() == 2 else [7]
    with pytest.raises(GraphcError, match=re.escape(f"bad.safetensors: {last}: 2 values NaN or Inf "
                                                    f"(the first at index {index}, {value})")):
        graphc.build("layer_specs/tiny.yaml", [1], weights=tmp_path / "bad.safetensors", device="cpu",
                     progress=None)
    tokens, lens = torch.tensor([5, 6]), torch.zeros(2, dtype=torch.int32)
    before = step(tokens, lens).clone()
    with pytest.raises(GraphcError, match=f"{last}: 2 values NaN or Inf"):
        step.load_weights(tmp_path / "bad.safetensors")
    assert torch.equal(step(tokens, lens), before)
    assert torch.isfinite(step.plan.weights[last]).all()


def test_the_finiteness_test_counts_across_chunks(monkeypatch):
    """Values are tested a chunk at a time (bounded temporaries on a full GPU): the count sums
    every chunk and the first bad value is found in whichever chunk holds it."""
    import graphc.weights
    from graphc.weights import _refuse_non_finite

    t = torch.ones(4, 6, dtype=torch.bfloat16)
    _refuse_non_finite("w", "ok", t)                    # finite: no error, whatever the chunk
    t[1, 5], t[3, 0] = float("inf"), float("nan")       # flat 11 and 18
    for chunk in (5, 7, 1 << 25):
        monkeypatch.setattr(graphc.weights, "_FINITE_CHUNK", chunk)
        with pytest.raises(GraphcError, match=re.escape("w: x: 2 values NaN or Inf (the first at index [1, 5], inf)")):
            _refuse_non_finite("w", "x", t)


def test_every_launch_gets_its_plans_own_workspaces(monkeypatch):
    """Two steps of one process may run on two streams at once only if their split-K kernels
    keep their partials apart: each plan has its own kernels/workspaces.Workspaces, and every
    launch, eager or captured, is handed its plan's (the GPU test
    test_two_steps_run_on_two_streams_at_once runs two steps so)."""
    import dataclasses

    from graphc.capture import launch_all
    from graphc.kernels.workspaces import SHARED
    from graphc.ops.elementwise import EmbeddingOp

    # Implementations whose launches run on the CPU too.
    portable = {"linear": "cublas", "attn_res": "torch", "decode_attention": "torch"}
    first, second = (graphc.build("layer_specs/tiny.yaml", batch_sizes=[2], device="cpu", progress=None,
                                  implementations=portable) for _ in range(2))
    assert first.plan.workspaces is not second.plan.workspaces
    assert SHARED not in (first.plan.workspaces, second.plan.workspaces)
    seen = []
    torch_impl = EmbeddingOp.implementations["torch"]

    def recording(op, t, w, stream, use_pdl, workspaces):
        seen.append(workspaces)
        torch_impl.launch(op, t, w, stream, use_pdl, workspaces)

    monkeypatch.setitem(EmbeddingOp.implementations, "torch", dataclasses.replace(torch_impl, launch=recording))
    for step in (first, second):
        step.plan.write_inputs(2, torch.tensor([1, 2]), torch.tensor([0, 0], dtype=torch.int32),
                               torch.tensor([0, 1], dtype=torch.int32))
        launch_all(step.plan, 2, None)
    assert seen == [first.plan.workspaces, second.plan.workspaces]


def test_step_methods_on_another_stream_wait_for_the_previous_stream(monkeypatch):
    """The ordering of a step's calls across streams (runtime._in_step_order), with CUDA's
    streams and events faked so it runs on the CPU: the same stream again waits for nothing;
    another stream waits for an event recorded, at that moment, on the previous one; inside a
    stream capture nothing is recorded or awaited. (On a GPU: test_step_gpu.py's
    test_calls_of_one_step_from_two_streams_run_one_after_the_other.)"""
    from graphc import runtime

    log, current, capturing = [], ["a"], [False]

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def __eq__(self, other):
            return self.name == other.name

        def wait_event(self, event):
            log.append(("wait", self.name, event.on))

    streams = {name: FakeStream(name) for name in "ab"}

    class FakeEvent:
        on = None

        def record(self, stream):
            self.on = stream.name

    monkeypatch.setattr(runtime, "_device_guard", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(runtime.torch.cuda, "current_stream", lambda *a: streams[current[0]])
    monkeypatch.setattr(runtime.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(runtime.torch.cuda, "Event", FakeEvent)

    class Step:
        device = torch.device("cuda")
        _last_stream = None

        @runtime._in_step_order
        def call(self, tag):
            log.append(("run", current[0], tag))

    step = Step()
    step.call(1)                 # first call: nothing to wait for
    step.call(2)                 # same stream
    current[0] = "b"
    step.call(3)                 # another stream: waits for what a holds
    step.call(4)
    current[0] = "a"
    capturing[0] = True
    step.call(5)                 # inside a capture the caller orders its streams
    capturing[0] = False
    step.call(6)                 # the last stream it ran on is still b
    assert log == [("run", "a", 1), ("run", "a", 2), ("wait", "b", "a"), ("run", "b", 3), ("run", "b", 4),
                   ("run", "a", 5), ("wait", "a", "b"), ("run", "a", 6)]
