import dataclasses
import json
import os
import subprocess
import sys

import pytest

from graphc.cli import main

TINY = "layer_specs/tiny.yaml"
KIMI_8L = "layer_specs/kimi_k3_dense_8l.yaml"


def run_cli(*argv, unset: tuple[str, ...] = ()):
    """The CLI in a fresh process, as a user runs it, without the environment variables
    ``unset`` (unset there, not in this process: a CuTe DSL first imported here without
    CUTE_DSL_ARCH would target sm_100a for every later test)."""
    env = {name: value for name, value in os.environ.items() if name not in unset}
    return subprocess.run([sys.executable, "-m", "graphc.cli", *argv], capture_output=True,
                          text=True, timeout=300, env={**env, "CUDA_VISIBLE_DEVICES": ""})


def test_build_writes_every_artifact_and_summary(tmp_path, capsys):
    from graphc.ops.linear import DECODE_GEMM_MAX_BATCH, LinearOp

    assert main(["build", TINY, "--out", str(tmp_path), "--batch-sizes", "1,3,64",
                 "--write-weight-names", str(tmp_path / "names.txt")]) == 0
    out = capsys.readouterr().out
    assert "4 layers, residual attn_res (block size 2, 2 blocks)" in out
    assert "kernels 31," in out
    # Small batches get the decode GEMM where CuTe DSL is installed (PDL edges into every
    # linear), large ones cuBLAS (full edges): one schedule per group of batch sizes.
    assert DECODE_GEMM_MAX_BATCH < 64
    # Where CuTe DSL is installed the attention is entered through a PDL edge too (4 more than
    # without): the cluster kernel up to CLUSTER_MAX_BATCH rows, the TMA kernel from
    # TMA_MIN_BATCH rows; both trigger after their wait, so no AttnRes loses its PDL edge.
    from graphc.ops.attention import CLUSTER_MAX_BATCH, TMA_MIN_BATCH, DecodeAttentionOp

    assert CLUSTER_MAX_BATCH == 1 < TMA_MIN_BATCH <= 3
    if DecodeAttentionOp.implementations["tma"].available():
        assert "batch 1: 30 PDL edges; embedding torch, attn_res cute, linear cute, decode_attention cluster" in out
        assert "batch 3: 30 PDL edges; embedding torch, attn_res cute, linear cute, decode_attention tma" in out
        assert "batch 64: 13 PDL edges; embedding torch, attn_res cute, linear cublas, decode_attention tma" in out
    else:
        if LinearOp.implementations["cute"].available():
            assert "batch 1, 3: 26 PDL edges; embedding torch, attn_res cute, linear cute" in out
        assert "batch 64: 9 PDL edges; embedding torch, attn_res cute, linear cublas" in out
    for b in (1, 3, 64):
        assert f"batch {b:4d}:" in out
    assert "reference step on CPU (batch 1)" in out        # small spec: runs by default
    graph = json.loads((tmp_path / "graph.json").read_text())
    assert len(graph["nodes"]) == 31
    assert {"from": "L01.attn.qkv", "to": "L01.attn.attention", "values": ["L01.attn.qkv.out"],
            "hazard": "raw"} in graph["edges"]
    sections = (tmp_path / "schedule.txt").read_text().split("## batch sizes ")[1:]
    assert sections[-1].startswith("64\n")
    lines = sections[-1].splitlines()
    assert len(lines) == 33
    assert any(l.split()[1:3] == ["pdl", "L01.attn_res.attn"] for l in lines[2:])
    assert any(l.split()[1:3] == ["full", "L01.attn.qkv"] for l in lines[2:])
    assert (tmp_path / "graph.svg").read_text().lstrip().startswith(("<?xml", "<svg", "<!DOCTYPE"))
    assert "L03.mlp.down" in (tmp_path / "schedule.html").read_text()
    names = (tmp_path / "names.txt").read_text().splitlines()
    assert "L00.attn.qkv.weight\t[1536, 1024]" in names
    import torch

    if not torch.cuda.is_available():     # what was not done is said, not left out
        assert "no GPU capture: no CUDA GPU on this machine" in out


@pytest.mark.parametrize("argv,message", [
    (["build", "missing.yaml"], "missing.yaml"),
    (["inspect", TINY, "L09.attn.qkv"], "no node 'L09.attn.qkv'"),
    (["viz", TINY, "--out", "x.png"], "unsupported suffix '.png'; supported: .svg, .dot, .html"),
])
def test_user_errors_exit_2_with_one_line_and_no_traceback(argv, message, tmp_path):
    if argv[0] == "viz":        # into a folder that does not exist yet: a refusal creates none
        argv = argv[:3] + [str(tmp_path / "new" / "x.png")]
    r = run_cli(*argv)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("graphc: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv,message", [
    (["build", TINY, "--context", "300"], "--context 300 is more than layer_specs/tiny.yaml holds (model.max_context 256)"),
    (["bench", TINY, "--context", "300"], "model.max_context 256"),
    (["run", TINY, "--steps", "257", "--device", "cpu"], "--steps 257: step i writes position i"),
    (["viz", TINY, "--out", "g.svg", "--profile", "p.json"], "write it to an .html file, not g.svg"),
])
def test_options_the_model_cannot_hold_are_refused(argv, message):
    r = run_cli(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith("graphc: error: ") and message in last


@pytest.mark.parametrize("argv,message", [
    (["inspect", TINY, "--batch", "0"], "a batch size is between 1 and 512, found 0"),
    (["viz", TINY, "--out", "x.svg", "--batch", "1000"], "a batch size is between 1 and 512, found 1000"),
    (["run", TINY, "--steps", "0"], "expected a positive integer, found 0"),
    (["build", TINY, "--context", "-5"], "expected a positive integer, found -5"),
    (["build", TINY, "--batch-sizes", "1,,2"], "comma-separated integers"),
    (["build", TINY, "--batch-sizes", "4,0,8"], "between 1 and 512, found 0 in '4,0,8'"),
    (["build", TINY, "--batch-sizes", "\uff11,\uff12"], "comma-separated integers"),
    (["run", TINY, "--seed", str(2**64)], "a seed is an integer in 0..2**63-1"),
    (["run", TINY, "--seed", "-1"], "a seed is an integer in 0..2**63-1"),
    (["build", TINY, "--out", ""], "expected a path, found an empty one"),
    (["build", TINY, "--write-weight-names", ""], "expected a path, found an empty one"),
])
def test_numbers_out_of_range_are_usage_errors(argv, message):
    r = run_cli(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr and message in r.stderr


def test_the_cli_and_the_api_take_the_same_batch_sizes():
    from graphc import cli, runtime

    assert cli.MAX_BATCH == runtime.MAX_BATCH
    assert cli.MAX_SEED == runtime.MAX_SEED


def _garbage_weights(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\xff" * 64)
    return path


@pytest.mark.parametrize("case", ["not safetensors", "wrong names", "a NaN the reference would read",
                                  "names folder missing", "names is a folder", "out is a file",
                                  "reference too large"])
def test_a_refused_build_writes_nothing(tmp_path, case):
    """Whatever a build needs is checked before its first file is written, with or without the
    reference step that reads the weights."""
    out = tmp_path / "out"
    argv = ["build", TINY, "--out", str(out), "--no-reference"]
    if case == "not safetensors":
        argv += ["--weights", str(_garbage_weights(tmp_path))]
        message = "not a readable safetensors file"
    elif case == "wrong names":
        import torch
        from safetensors.torch import save_file

        save_file({"nope": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "w.safetensors"))
        argv += ["--weights", str(tmp_path / "w.safetensors")]
        message = "weight names do not match the spec"
    elif case == "a NaN the reference would read":
        import torch
        from safetensors.torch import save_file

        from graphc.graph import build_graph, weight_shapes
        from graphc.spec import load_spec

        weights = {n: torch.zeros(s, dtype=torch.bfloat16)
                   for n, s in weight_shapes(build_graph(load_spec(TINY))).items()}
        weights["lm_head.weight"][3, 5] = float("nan")
        save_file(weights, str(tmp_path / "w.safetensors"))
        argv = ["build", TINY, "--out", str(out), "--reference", "--weights", str(tmp_path / "w.safetensors")]
        message = "lm_head.weight: 1 value NaN or Inf (the first at index [3, 5], nan)"
    elif case == "names folder missing":
        argv += ["--write-weight-names", str(tmp_path / "nowhere" / "names.txt")]
        message = f"no folder {tmp_path / 'nowhere'}"
    elif case == "names is a folder":
        argv += ["--write-weight-names", str(tmp_path)]
        message = f"--write-weight-names {tmp_path}: that is a folder; give a file name"
    elif case == "out is a file":
        out.write_text("a file")
        message = f"--out {out}: a file of that name is in the way"
    else:                               # the reference step's KV cache: 820 GB of host memory
        spec = tmp_path / "huge_context.yaml"
        spec.write_text(open(TINY).read().replace("max_context: 256", "max_context: 100000000"))
        argv = ["build", str(spec), "--out", str(out), "--reference"]
        message = "GB of host memory"
    r = run_cli(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert message in r.stderr.splitlines()[-1]
    assert not out.is_dir()


@pytest.mark.parametrize("victim", ["spec", "weights", "output"])
def test_the_weight_names_never_replace_an_input_or_an_output(tmp_path, victim):
    """`--write-weight-names` pointed at the spec, the weights file or one of the build's own
    outputs is refused, and the file is left as it was."""
    import torch
    from safetensors.torch import save_file

    from graphc.graph import build_graph, weight_shapes
    from graphc.spec import load_spec

    spec = tmp_path / "mine.yaml"
    spec.write_text(open(TINY).read())
    weights = tmp_path / "w.safetensors"
    save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in weight_shapes(build_graph(load_spec(spec))).items()},
              str(weights))
    out = tmp_path / "out"
    out.mkdir()
    (out / "graph.json").write_text("{}")
    target = {"spec": spec, "weights": weights, "output": out / "graph.json"}[victim]
    before = target.read_bytes()
    r = run_cli("build", str(spec), "--out", str(out), "--no-reference", "--weights", str(weights),
                "--write-weight-names", str(target))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    what = {"spec": "the spec", "weights": "the --weights file", "output": "an output of this build"}[victim]
    assert r.stderr.splitlines()[-1] == (f"graphc: error: --write-weight-names {target}: that is {what}; "
                                         f"writing there would replace it")
    assert target.read_bytes() == before


@pytest.mark.parametrize("case", ["an output is a folder", "the spec is an output", "the weights are an output",
                                  "names into the out folder", "names into a pipe"])
def test_a_refused_build_replaces_no_earlier_output_and_no_input(tmp_path, case):
    """Each output is checked before the first is written: one that cannot be replaced by a
    file, one that is an input, and weight names into the --out folder itself or into a
    special file (a rename would put a regular file in place of a pipe or a device)."""
    import torch
    from safetensors.torch import save_file

    from graphc.graph import build_graph, weight_shapes
    from graphc.spec import load_spec

    out = tmp_path / "out"
    out.mkdir()
    for name in ("graph.json", "schedule.txt"):
        (out / name).write_text("OLD")
    spec = tmp_path / "mine.yaml"
    spec.write_text(open(TINY).read())
    argv = ["build", str(spec), "--out", str(out), "--no-reference"]
    if case == "an output is a folder":
        (out / "schedule.html").mkdir()
        message = f"--out {out / 'schedule.html'}: that is a folder; give a file name"
    elif case == "the spec is an output":
        spec = out / "schedule.txt"
        spec.write_text(open(TINY).read())
        argv[1] = str(spec)
        message = f"--out {spec}: that is the spec; writing there would replace it"
    elif case == "the weights are an output":
        weights = out / "graph.json"
        save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in weight_shapes(build_graph(load_spec(spec))).items()},
                  str(weights))
        argv += ["--weights", str(weights)]
        message = f"--out {weights}: that is the --weights file; writing there would replace it"
    elif case == "names into the out folder":
        fresh = tmp_path / "fresh"
        argv[3] = str(fresh)
        argv += ["--write-weight-names", str(fresh)]
        message = f"--write-weight-names {fresh}: that is the --out folder; writing there would replace it"
    else:
        os.mkfifo(tmp_path / "names.fifo")
        argv += ["--write-weight-names", str(tmp_path / "names.fifo")]
        message = f"--write-weight-names {tmp_path / 'names.fifo'}: not a regular file"
    before = {p: (p.read_bytes() if p.is_file() else None) for p in [*out.iterdir(), spec]}
    r = run_cli(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert message in r.stderr.splitlines()[-1], r.stderr
    assert {p: (p.read_bytes() if p.is_file() else None) for p in [*out.iterdir(), spec]} == before
    assert not (tmp_path / "fresh").exists()
    if case == "names into a pipe":
        import stat

        assert stat.S_ISFIFO((tmp_path / "names.fifo").stat().st_mode)


def test_inspect_of_an_empty_node_name_is_refused(capsys):
    assert main(["inspect", TINY, ""]) == 2
    assert "no node '' in" in capsys.readouterr().err


def test_inspect_shows_the_output_norm_eps_the_kernel_uses(tmp_path, capsys):
    spec = tmp_path / "eps.yaml"
    spec.write_text(open(TINY).read().replace("final_norm:\n  eps: 1.0e-6\n", "final_norm:\n  eps: 0.5\n"))
    assert main(["inspect", str(spec), "final.attn_res"]) == 0
    assert "  out_eps    0.5" in capsys.readouterr().out.splitlines()


def test_a_disk_that_fills_up_leaves_the_old_outputs_and_no_partial_file(tmp_path, monkeypatch, capsys):
    """A write that fails half-way (ENOSPC has no file name) is one line, and every earlier
    output is left as it was: the new ones are written under temporary names first."""
    import pathlib

    out = tmp_path / "out"
    assert main(["build", TINY, "--out", str(out), "--no-reference"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write_text = pathlib.Path.write_text

    def fill_up(path, text, *args, **kwargs):
        if path.name.startswith(".schedule.html"):      # the third of four outputs
            real_write_text(path, text[:100], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real_write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", fill_up)
    capsys.readouterr()
    assert main(["build", TINY, "--out", str(out), "--no-reference", "--batch-sizes", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"graphc: error: {out / 'schedule.html'}: cannot write it (No space left on device); "
        f"no output was written or replaced")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(["build", TINY, "--out", str(tmp_path / "new" / "a" / "b"), "--no-reference"]) == 2
    assert not (tmp_path / "new").exists()        # the folders it made for them are gone too
    (tmp_path / "kept").mkdir()
    assert main(["viz", TINY, "--out", str(tmp_path / "kept" / "c" / "schedule.html")]) == 2
    assert list(tmp_path.joinpath("kept").iterdir()) == []      # what was there before stays


def test_a_rebuild_keeps_the_permissions_of_the_files_it_replaces(tmp_path):
    out = tmp_path / "out"
    assert main(["build", TINY, "--out", str(out), "--no-reference"]) == 0
    os.chmod(out / "schedule.txt", 0o640)
    os.chmod(out / "graph.svg", 0o604)
    fresh = (out / "graph.json").stat().st_mode & 0o777
    assert main(["build", TINY, "--out", str(out), "--no-reference", "--batch-sizes", "2"]) == 0
    assert (out / "schedule.txt").stat().st_mode & 0o777 == 0o640
    assert (out / "graph.svg").stat().st_mode & 0o777 == 0o604
    assert (out / "graph.json").stat().st_mode & 0o777 == fresh
    assert (out / "schedule.txt").read_text().startswith("## batch sizes 2\n")     # replaced


def test_a_build_without_a_gpu_says_when_no_h200_holds_the_model(tmp_path):
    """Without a GPU nothing is allocated, so a model too large for any H200 is described, not
    refused; the summary says a GPU build would refuse it."""
    spec = tmp_path / "long.yaml"
    spec.write_text(open(TINY).read().replace("max_context: 256", "max_context: 4000000"))
    r = run_cli("build", str(spec), "--out", str(tmp_path / "out"), "--no-reference", "--no-capture",
                "--context", "1024")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if "GPU memory at batch sizes up to 8" in l)
    assert line.endswith("; more than an H200's 141 GB, so a GPU build there refuses it")
    r = run_cli("build", TINY, "--out", str(tmp_path / "tiny"), "--no-reference", "--no-capture")
    assert r.returncode == 0 and "more than an H200" not in r.stdout


def test_a_default_reference_step_that_cannot_fit_is_skipped_and_said(tmp_path, capsys, monkeypatch):
    """The reference step runs by default for small weights; a KV cache the host cannot hold
    (model.max_context) must not fail a build nobody asked to step through, and the summary says
    why no step ran. Asked for with --reference, the refusal stands."""
    from graphc import runtime

    spec = tmp_path / "long.yaml"
    spec.write_text(open(TINY).read().replace("max_context: 256", "max_context: 4000000"))
    monkeypatch.setattr(runtime, "host_free_bytes", lambda: 8 << 30)      # the same on any host
    assert main(["build", str(spec), "--batch-sizes", "1", "--out", str(tmp_path / "a"), "--no-capture"]) == 0
    out = capsys.readouterr().out
    assert "no reference step on CPU: it does not fit in host memory: tiny at batch sizes up to 1 needs" in out
    assert (tmp_path / "a" / "graph.json").exists()
    assert main(["build", str(spec), "--batch-sizes", "1", "--out", str(tmp_path / "b"), "--reference"]) == 2
    assert "needs" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert main(["build", "layer_specs/kimi_k3_dense.yaml", "--batch-sizes", "1", "--out", str(tmp_path / "k"),
                 "--no-capture"]) == 0
    assert ("no reference step on CPU: the weights are 103.00 GB, above the 512 MiB a build steps through "
            "by default (--reference runs one)") in capsys.readouterr().out


def test_the_weight_names_may_go_into_the_out_folder_the_build_creates(tmp_path, capsys):
    out = tmp_path / "new"
    assert main(["build", TINY, "--out", str(out), "--no-reference", "--no-capture",
                 "--write-weight-names", str(out / "names.txt")]) == 0
    assert "L00.attn.qkv.weight\t[1536, 1024]" in (out / "names.txt").read_text().splitlines()
    other = tmp_path / "other"
    assert main(["build", TINY, "--out", str(other), "--write-weight-names", str(other / "graph.json")]) == 2
    assert "that is an output of this build" in capsys.readouterr().err and not other.exists()
    if os.path.exists("/dev/null"):
        assert main(["build", TINY, "--out", "/dev/null"]) == 2
        assert "--out /dev/null: a device, a pipe or a socket, not a folder" in capsys.readouterr().err


def test_viz_never_replaces_its_spec_or_profile(tmp_path, capsys):
    spec = tmp_path / "s.svg"            # a spec whose name is a picture's
    spec.write_text(open(TINY).read())
    assert main(["viz", str(spec), "--out", str(spec)]) == 2
    assert "that is the spec; writing there would replace it" in capsys.readouterr().err
    assert spec.read_text() == open(TINY).read()


def test_viz_creates_the_output_folder_and_checks_the_profile(tmp_path):
    assert main(["viz", TINY, "--out", str(tmp_path / "new" / "g.svg")]) == 0
    assert (tmp_path / "new" / "g.svg").stat().st_size > 1000
    for text, message in [("[1, 2]", "expected a JSON object"), ("{nope", "not a JSON profile"),
                          ('{"batch": "eight", "kernels": []}', "batch must be an integer in 1..512"),
                          ('{"implementations": ["cute"]}', "implementations must map"),
                          ('{"implementations": {"linear": "bogus"}}',
                           f"--profile {tmp_path / 'p.json'}: L00.attn.qkv: no implementation 'bogus' of linear")]:
        (tmp_path / "p.json").write_text(text)
        r = run_cli("viz", TINY, "--out", str(tmp_path / "t.html"), "--profile", str(tmp_path / "p.json"))
        assert r.returncode == 2 and "Traceback" not in r.stderr and message in r.stderr, r.stderr
    r = run_cli("viz", TINY, "--out", str(tmp_path / "t.html"), "--profile", str(tmp_path / "none.json"))
    assert r.returncode == 2 and "none.json: no such file" in r.stderr


def test_a_profile_that_does_not_fit_the_schedule_is_named_by_its_option(tmp_path, capsys):
    """Every refusal of a --profile starts with the option and the file; a kernel the schedule
    lacks is named (a profile of another spec), and no output folder is left behind."""
    p = tmp_path / "p.json"
    out = tmp_path / "new" / "t.html"
    for text, message in [('{"batch": 1}', "expected {\"gpu\""),
                          ('{"kernels": [{"node": "nope", "duration_us": 3}]}',
                           "nope is not a kernel of this schedule (a profile of another spec?)"),
                          ('{"kernels": [{"node": "embed", "duration_us": -1}]}', "kernels[0] (embed): duration_us"),
                          ('{"kernels": [{"node": "embed", "duration_us": 3}]}', "profile has no duration for L00")]:
        p.write_text(text)
        assert main(["viz", TINY, "--out", str(out), "--profile", str(p)]) == 2
        err = capsys.readouterr().err
        error = err.splitlines()[-1]
        assert error.startswith(f"graphc: error: --profile {p}: ") and message in error, err
        assert not out.parent.exists()


def test_inspect_into_a_closed_pipe_stops_quietly():
    """`graphc inspect SPEC | head -1`: the reader is gone. Here it is gone before the first
    write (its end of the pipe closed), so the first print meets EPIPE every time."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "graphc.cli", "inspect", TINY], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=300,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    finally:
        os.close(write_end)
    assert r.returncode == 141 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_bad_spec_error_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((open(TINY).read()).replace("hidden: 1024", "hidden: 1000"))
    r = run_cli("build", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == (f"graphc: error: {bad}:7: model.hidden: expected a positive multiple "
                                         f"of 64, found 1000 (1000 % 64 = 40)")


def test_bad_batch_sizes_argument():
    r = run_cli("build", TINY, "--batch-sizes", "1,x")
    assert r.returncode == 2 and "comma-separated integers" in r.stderr


def test_inspect_lists_kernels_and_one_node(capsys):
    assert main(["inspect", TINY]) == 0
    out = capsys.readouterr().out
    assert "L02.attn_res.attn" in out and "blocks@2[T, 2, 1024]" in out
    assert main(["inspect", TINY, "L02.attn_res.attn"]) == 0
    out = capsys.readouterr().out
    assert "write      1" in out and "pdl edge" in out
    # The node may also come after the options, as users type it.
    assert main(["inspect", TINY, "--batch", "1", "L02.attn_res.attn"]) == 0
    assert capsys.readouterr().out == out
    with pytest.raises(SystemExit) as refused:
        main(["inspect", TINY, "--batch", "2", "L02.attn_res.attn", "L03.attn.qkv"])
    assert refused.value.code == 2
    assert "unrecognized arguments: L02.attn_res.attn L03.attn.qkv" in capsys.readouterr().err


def test_inspect_says_which_implementation_each_batch_size_gets(capsys):
    """The node's default per captured batch size, as spans: down on the decode GEMM up to 96 rows,
    at 192 and at 224 (graphc/ops/linear.py DECODE_GEMM_ROWS) where CuTe DSL is installed, else cuBLAS."""
    from graphc.ops.linear import LinearOp

    assert main(["inspect", KIMI_8L, "L00.mlp.down"]) == 0
    out = capsys.readouterr().out
    if LinearOp.implementations["cute"].available():
        assert ("by default at batch sizes: cute 1-96, 192, 224; cublas 97-191, 193-223, 225-512 "
                "(with what is installed here)") in out
    else:
        assert "by default at batch sizes: cublas 1-512 (with what is installed here)" in out
    assert main(["inspect", TINY, "L00.attn_res.attn"]) == 0
    assert "by default at batch sizes: " in capsys.readouterr().out


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    """A folder where a file is wanted is refused by name, before the work that would write it
    (a bench's results come after minutes of timing: refused here on a machine without a GPU,
    before the GPU is even looked for)."""
    for argv in (["viz", TINY, "--out", str(tmp_path)], ["bench", TINY, "--out", str(tmp_path)]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip() == f"graphc: error: --out {tmp_path}: that is a folder; give a file name"


def test_folders_this_user_cannot_write_are_refused_by_name(tmp_path, monkeypatch, capsys):
    """(The tests may run as root, for whom every folder is writable: os.access is faked.)"""
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    (tmp_path / "out").mkdir()
    assert main(["build", TINY, "--out", str(tmp_path / "out"), "--no-reference"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"graphc: error: --out {tmp_path / 'out'}: this user "
                                                        "cannot write into it")
    assert main(["build", TINY, "--out", str(tmp_path / "a" / "b"), "--no-reference"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"graphc: error: --out {tmp_path / 'a' / 'b'}: this user "
                                                        f"cannot write into {tmp_path}")
    assert not (tmp_path / "a").exists()
    assert main(["viz", TINY, "--out", str(tmp_path / "new" / "g.svg")]) == 2
    assert capsys.readouterr().err.strip() == (f"graphc: error: --out {tmp_path / 'new' / 'g.svg'}: this user "
                                               f"cannot write into {tmp_path}")
    assert not (tmp_path / "new").exists()


def test_a_file_system_refusal_is_one_line(tmp_path, monkeypatch, capsys):
    """What no check foresaw (a special folder, a full disk) still ends in one line, exit 2,
    and leaves no partial picture."""
    import pathlib

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "write_text", refuse)
    assert main(["viz", TINY, "--out", str(tmp_path / "g.svg")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"graphc: error: {tmp_path / 'g.svg'}: cannot write it "
                                                        f"(Permission denied); no output was written or replaced")
    assert list(tmp_path.iterdir()) == []


def test_every_command_says_what_its_spec_argument_is(capsys):
    for command in ("build", "inspect", "viz", "run", "compile", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "layer spec YAML file, e.g. layer_specs/tiny.yaml" in capsys.readouterr().out


def test_version(capsys):
    import graphc

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"graphc {graphc.__version__}"


def test_long_batches_show_their_first_tokens():
    from graphc.cli import _shown_tokens

    assert _shown_tokens([5, 6]) == "[5, 6]"
    assert _shown_tokens(list(range(12))) == "[0, 1, 2, 3, 4, 5, 6, 7] ... (12 rows)"


@pytest.mark.parametrize("suffix", ["svg", "html", "dot"])
def test_viz_writes_each_format(tmp_path, suffix):
    path = tmp_path / f"g.{suffix}"
    assert main(["viz", TINY, "--out", str(path)]) == 0
    assert path.stat().st_size > 1000


def test_run_on_cpu(capsys):
    """`graphc run` feeds each step's argmax to the next; every printed token is the independent
    eager model's argmax for the tokens printed before it (wherever its top two logits are
    apart), with the run's own seeded weights and first tokens."""
    import re

    import torch

    from graphc.graph import build_graph, weight_shapes
    from graphc.spec import load_spec
    from graphc.weights import Weights
    from oracle import EagerModel

    assert main(["run", TINY, "--batch", "2", "--steps", "3", "--device", "cpu"]) == 0
    printed = [[int(t) for t in m.group(1).split(", ")]
               for m in re.finditer(r"^step \d+: .* next tokens \[(.*)\]$", capsys.readouterr().out, re.M)]
    assert len(printed) == 3
    spec = load_spec(TINY)
    oracle = EagerModel(spec, Weights.random(weight_shapes(build_graph(spec)), seed=0).tensors)
    tokens = torch.randint(0, spec.model.vocab, (2,), generator=torch.Generator().manual_seed(0))
    decided = 0
    for i, got in enumerate(printed):
        logits = oracle.step(tokens, torch.full((2,), i, dtype=torch.int32), torch.arange(2))
        top2 = logits.topk(2, -1).values
        for row in range(2):
            if top2[row, 0] - top2[row, 1] > 0.02 * logits.abs().max():
                assert got[row] == int(logits[row].argmax()), (i, row)
                decided += 1
        tokens = torch.tensor(got)
    assert decided >= 4


def test_full_depth_build_is_fast_and_allocates_no_weights(tmp_path):
    code = ("import resource, sys, time; from graphc.cli import main; t=time.time(); "
            f"rc=main(['build', 'layer_specs/kimi_k3_dense.yaml', '--out', {str(tmp_path)!r}]); "
            "print('ELAPSED', time.time()-t, 'RSS_MB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss//1024); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    fields = r.stdout.split("ELAPSED")[1].split()
    elapsed, rss_mb = float(fields[0]), int(fields[2])
    assert elapsed < 60
    assert rss_mb < 3000          # ~100 GB of weights never materialise
    assert "93 layers" in r.stdout and "reference step on CPU (batch" not in r.stdout   # none ran
    assert "no reference step on CPU: the weights are 103.00 GB" in r.stdout               # and why


def test_build_on_a_gpu_other_than_hopper_writes_the_schedule_that_runs(tmp_path, monkeypatch, capsys):
    """On an sm_80 GPU (faked; the capture itself is stubbed out) the schedule files name the
    portable implementations the build captures, not the Hopper kernels."""
    import torch

    import graphc.bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(graphc.bench, "bench_step", lambda *a, **k: [])
    monkeypatch.setattr(graphc.bench, "format_step_table", lambda rows: "(capture stubbed)")
    assert main(["build", TINY, "--out", str(tmp_path), "--batch-sizes", "1,8", "--no-reference"]) == 0
    text = (tmp_path / "schedule.txt").read_text()
    assert "linear/cublas" in text and "attn_res/torch" in text
    assert "/cute" not in text and "/tma" not in text and "/triton" not in text
    assert "(capture stubbed)" in capsys.readouterr().out


def test_help_names_every_environment_variable_graphc_reads(capsys):
    """Every GRAPHC_* variable the package or its kernels read is listed in `graphc --help`."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    read = set()
    for path in [*root.glob("graphc/**/*.py"), *root.glob("kernels/**/*.py")]:
        if path.name != "cli.py":
            read |= set(re.findall(r"GRAPHC_[A-Z_]+", path.read_text()))
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = set(re.findall(r"^  (GRAPHC_[A-Z_]+)", capsys.readouterr().out, re.M))
    assert read and listed == read


def test_compile_fills_the_kernel_cache_without_a_gpu(tmp_path, monkeypatch):
    """`graphc compile` compiles, for sm_90a, every CuTe DSL variant a GPU build at those batch
    sizes loads (graphc.compile_ahead.schedule_variants at 132 SMs) into GRAPHC_CACHE_DIR; a
    second run finds them all."""
    from graphc.compile_ahead import not_on_disk, schedule_variants
    from graphc.graph import build_graph
    from graphc.schedule import build_schedule
    from graphc.spec import load_spec

    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    graph = build_graph(load_spec(TINY))
    want = schedule_variants({b: build_schedule(graph, None, batch=b) for b in (1, 2)}, 132)
    # The command sets CUTE_DSL_ARCH itself where there is no GPU.
    r = run_cli("compile", TINY, "--batch-sizes", "1,2", "--jobs", "2", unset=("CUTE_DSL_ARCH",))
    assert r.returncode == 0, r.stderr
    assert f"tiny at batch sizes 1, 2: {len(want)} kernel variants for sm_90a, 132 SMs" in r.stdout
    assert f"compiled {len(want)}, 0 already cached" in r.stdout
    assert len(list(tmp_path.glob("*.o"))) == len(want)
    assert not_on_disk(want) == []          # the very variants a build loads, not as many others
    again = run_cli("compile", TINY, "--batch-sizes", "2,1", unset=("CUTE_DSL_ARCH",))
    assert again.returncode == 0 and f"compiled 0, {len(want)} already cached" in again.stdout


@pytest.mark.parametrize("env, message", [
    ({"GRAPHC_KERNEL_CACHE": "0"}, "graphc compile fills the disk kernel cache, which GRAPHC_KERNEL_CACHE=0 switches off"),
    ({"CUTE_DSL_ARCH": "sm_100a"}, "CUTE_DSL_ARCH=sm_100a: graphc's kernels are sm_90a code (H100/H200)"),
])
def test_compile_refuses_what_cannot_fill_the_cache(env, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["compile", TINY]) == 2
    assert capsys.readouterr().err.strip() == f"graphc: error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_compile_refuses_a_cache_it_cannot_fill_and_a_bad_job_count(tmp_path, monkeypatch, capsys):
    """Nothing is compiled into a cache that cannot keep it (compiling would only be lost), and
    a GRAPHC_COMPILE_JOBS that is no number is named, not a traceback."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    blocker = tmp_path / "cache"
    blocker.write_text("a file")
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(blocker))
    assert main(["compile", TINY]) == 2
    assert capsys.readouterr().err.strip() == (f"graphc: error: kernel cache (GRAPHC_CACHE_DIR) {blocker}: "
                                               "a file of that name is in the way")
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "new" / "kernels"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(TINY).read().replace("vocab: 4096", "vocab: -1"))
    assert main(["compile", str(bad)]) == 2           # a bad spec creates no cache folder
    assert "model.vocab" in capsys.readouterr().err and not (tmp_path / "new").exists()
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("GRAPHC_COMPILE_JOBS", "abc")
    assert main(["compile", TINY, "--batch-sizes", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "graphc: error: GRAPHC_COMPILE_JOBS='abc': expected a number of processes, e.g. 4")
    assert list((tmp_path / "kernels").iterdir()) == []


def test_compile_fails_when_a_kernel_did_not_reach_the_disk(tmp_path, monkeypatch, capsys):
    """A cache that takes nothing (a full disk: the object's final rename is faked to fail as
    one does) is a failure that names the OS's reason, not 'compiled 1': a build would compile
    the kernel again."""
    import errno

    import graphc.compile_ahead as ca
    import graphc.kernels.compile_cache as cc

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    real = ca.schedule_variants
    monkeypatch.setattr(ca, "schedule_variants", lambda schedules, sms: [
        v for v in real(schedules, sms) if v[0].endswith("attn_res")][:1])

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(cc.os, "replace", disk_full)
    assert main(["compile", TINY, "--batch-sizes", "1", "--jobs", "1"]) == 2
    *progress, err = capsys.readouterr().err.strip().splitlines()
    reason = "OSError: [Errno 28] No space left on device"
    assert err.startswith(f"graphc: error: 1 of 1 kernel variant compiled but not written to {tmp_path} "
                          "(the first: attn_res-") and err.endswith("a build would compile them again")
    assert reason in err
    said = [line for line in progress if "could not write to the kernel cache" in line]   # as it happened
    assert len(said) == 1 and f"cache: {tmp_path}" in said[0] and reason in said[0]
    assert list(tmp_path.iterdir()) == []           # no half-written object left behind


def test_build_names_the_implementations_this_machine_cannot_load(tmp_path, monkeypatch, capsys):
    """A build on a machine without CuTe DSL and Triton plans the torch attention at one row; it
    says so, since a GPU machine with them would run their kernels there instead. It names only
    implementations some batch size would have chosen."""
    from graphc.ops.attention import DecodeAttentionOp

    triton, cluster = DecodeAttentionOp.implementations["triton"], DecodeAttentionOp.implementations["cluster"]
    monkeypatch.setitem(DecodeAttentionOp.implementations, "cluster",
                        dataclasses.replace(cluster, available=lambda: False))
    monkeypatch.setitem(DecodeAttentionOp.implementations, "triton",
                        dataclasses.replace(triton, available=lambda: False))
    assert main(["build", TINY, "--out", str(tmp_path), "--batch-sizes", "1", "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert "decode_attention torch" in out
    line = [l for l in out.splitlines() if "not installed here:" in l]
    assert len(line) == 1 and "decode_attention cluster/triton" in line[0], out
    monkeypatch.setitem(DecodeAttentionOp.implementations, "triton",
                        dataclasses.replace(triton, available=lambda: True))
    assert main(["build", TINY, "--out", str(tmp_path), "--batch-sizes", "1", "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert "batch 1: " in out and "decode_attention triton" in out
    line = [l for l in out.splitlines() if "not installed here:" in l]
    assert len(line) == 1 and "decode_attention cluster (" in line[0], out
    # Where the cluster kernel loads, nothing else is preferred at one row: nothing to name,
    # whether Triton is installed or not.
    monkeypatch.setitem(DecodeAttentionOp.implementations, "cluster",
                        dataclasses.replace(cluster, available=lambda: True))
    for triton_here in (False, True):
        monkeypatch.setitem(DecodeAttentionOp.implementations, "triton",
                            dataclasses.replace(triton, available=lambda: triton_here))
        assert main(["build", TINY, "--out", str(tmp_path), "--batch-sizes", "1", "--no-reference"]) == 0
        out = capsys.readouterr().out
        assert "decode_attention cluster" in out and "not installed here" not in out, out


def test_inspect_names_the_decode_gemm_configuration_a_node_runs(capsys, monkeypatch):
    """A linear node on the decode GEMM: which kernel and tiling kernels/gemm.py's plan picks at
    that batch size, on this GPU's SMs or, without one, an H100 / H200 SXM's 132; a node on
    cuBLAS says nothing more than its kernel line."""
    pytest.importorskip("cutlass")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = KIMI_8L
    assert main(["inspect", spec, "L01.attn.o_proj", "--batch", "128"]) == 0
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  runs ")]
    assert runs == [f"  runs {gemm_plan(128, 8192, 7168)} (on 132 SMs, an H100 / H200 SXM: no GPU here)"]
    assert "ctas=112, tiles=112" in runs[0]              # one whole-K 64-row unit per CTA
    assert main(["inspect", spec, "L01.attn.qkv", "--batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "kernel #9: cublas" in out and "  runs " not in out


def gemm_plan(m, k, n):
    from graphc.kernels import gemm

    return repr(gemm.plan(m, k, n, None, 132))


def test_impl_choices_reach_inspect_and_the_build_files(tmp_path, capsys):
    """``--impl`` takes graphc.build's implementation choices, per batch size too: inspect says
    what a node then gets at each size, and build writes the schedules it makes."""
    from graphc.ops.linear import LinearOp

    cute = LinearOp.implementations["cute"].available()
    assert main(["inspect", KIMI_8L, "L03.attn.qkv", "--batch", "192", "--impl", "L03.attn.qkv=cute@1-192"]) == 0
    out = capsys.readouterr().out
    if cute:
        assert "by default at batch sizes: cute 1-160; cublas 161-512" in out
        assert "with --impl at batch sizes: cute 1-192; cublas 193-512" in out
        assert ": cute, pdl edge: waits before reading" in out
    assert main(["build", TINY, "--batch-sizes", "1,32", "--impl", "linear=cublas@32", "--out", str(tmp_path),
                 "--no-reference", "--no-capture"]) == 0
    schedules = (tmp_path / "schedule.txt").read_text()
    at1, at32 = schedules.split("## batch sizes 32\n")
    assert "L00.attn.qkv" in at32 and all("cublas" in l for l in at32.splitlines() if ".attn.qkv " in l)
    if cute:
        assert all("cute" in l for l in at1.splitlines() if ".attn.qkv " in l)


def test_impl_mistakes_are_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", TINY, "--impl", "linear"])
    assert e.value.code == 2 and "expected KIND=NAME or NODE=NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["build", TINY, "--impl", "linear=cute@1-8+4"])
    assert "spans must be increasing, apart and from 1" in capsys.readouterr().err
    assert main(["build", TINY, "--impl", "linear=cublas", "--impl", "linear=cute", "--out", str(tmp_path)]) == 2
    assert "--impl linear=... is given more than once" in capsys.readouterr().err
    assert main(["build", TINY, "--impl", "L00.attn.qvk=cublas", "--out", str(tmp_path)]) == 2
    assert "'L00.attn.qvk' is neither an op kind nor a node of this graph, nor a pattern matching one " \
        "(did you mean L00.attn.qkv" \
        in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
