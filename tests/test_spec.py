"""graphc.spec: the shipped specs load, and every bad input gets one clear SpecError."""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from pathlib import Path

import pytest

from graphc.errors import GraphcError
from graphc.ops.attn_res_math import SUPPORTED_HIDDEN_RULE
from graphc.spec import (
    AttentionBody,
    MlpBody,
    ResidualSpec,
    Spec,
    SpecError,
    load_spec,
    parse_spec,
)

SPECS = Path(__file__).resolve().parents[1] / "layer_specs"

# A valid spec whose line numbers the mistakes below refer to.
BASE = """\
model:
  name: t
  hidden: 1024
  vocab: 4096
  dtype: bfloat16
  rms_eps: 1.0e-6
  max_context: 256
residual:
  kind: attn_res
  block_size: 2
bodies:
  attn:
    kind: attention
    heads: 8
    kv_heads: 2
    head_dim: 128
  mlp:
    kind: mlp
    intermediate: 2816
  mlp_wide:
    kind: mlp
    intermediate: 4096
layers:
  - repeat: 3
    attention: attn
    mlp: mlp
  - attention: attn
    mlp: mlp_wide
"""
BASE_LINES = BASE.count("\n")  # 28: text appended to BASE starts on line 29


def edit(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, f"{old!r} must occur exactly once"
    return text.replace(old, new)


LINE_SEPARATOR_IN_A_STRING = edit("  name: t\n", '  name: "t\u2028u"\n')


def spec_error(text: str, path: str = "bad.yaml") -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(text, path)
    return info.value


# ---------------------------------------------------------------------------------------------
# Positive tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, layers, block_size, blocks, hidden, vocab, max_context",
    [
        ("tiny", 4, 2, 2, 1024, 4096, 256),
        ("kimi_k3_dense_8l", 8, 2, 4, 7168, 163840, 2048),
        ("kimi_k3_dense", 93, 12, 8, 7168, 163840, 4096),
    ],
)
def test_shipped_specs_load(name, layers, block_size, blocks, hidden, vocab, max_context):
    spec = load_spec(SPECS / f"{name}.yaml")
    assert spec.path == str(SPECS / f"{name}.yaml")
    assert spec.model.name == name
    assert (spec.model.hidden, spec.model.vocab, spec.model.max_context) == (hidden, vocab, max_context)
    assert spec.model.dtype == "bfloat16" and spec.model.rms_eps == 1e-6
    assert spec.residual == ResidualSpec("attn_res", block_size)
    assert len(spec.layers) == spec.num_layers == layers
    assert [l.index for l in spec.layers] == list(range(layers))
    assert spec.num_blocks() == blocks
    assert spec.final_norm_eps == 1e-6 and spec.tie_embeddings is False
    assert list(spec.bodies) == ["attn", "mlp"]


def test_tiny_widths():
    spec = load_spec(SPECS / "tiny.yaml")
    attn, mlp = spec.bodies["attn"], spec.bodies["mlp"]
    assert attn == AttentionBody("attn", heads=8, kv_heads=2, head_dim=128)
    assert mlp == MlpBody("mlp", intermediate=2816)
    assert (attn.q_dim, attn.kv_dim, attn.qkv_dim, attn.group_size) == (1024, 256, 1536, 4)
    assert mlp.gate_up_dim == 5632
    assert all(l.attention is attn and l.mlp is mlp for l in spec.layers)


def test_kimi_widths():
    spec = load_spec(str(SPECS / "kimi_k3_dense.yaml"))
    assert spec.bodies["attn"] == AttentionBody("attn", 64, 8, 128)
    assert spec.bodies["mlp"] == MlpBody("mlp", 18432)


def test_repeats_and_groups_expand_in_order():
    spec = parse_spec(BASE)
    assert [l.mlp.name for l in spec.layers] == ["mlp", "mlp", "mlp", "mlp_wide"]
    assert [l.index for l in spec.layers] == [0, 1, 2, 3]
    assert list(spec.bodies) == ["attn", "mlp", "mlp_wide"]
    assert spec.path == "<string>"


def test_overrides_replace_single_layers():
    text = BASE + "overrides:\n  1:\n    mlp: mlp_wide\n  3:\n    mlp: mlp\n"
    spec = parse_spec(text)
    assert [l.mlp.name for l in spec.layers] == ["mlp", "mlp_wide", "mlp", "mlp"]
    assert all(l.attention.name == "attn" for l in spec.layers)
    assert spec.layers[1].index == 1


def test_override_of_the_attention_slot():
    text = edit("  mlp_wide:\n", "  attn_small:\n    kind: attention\n    heads: 4\n    kv_heads: 4\n"
                "    head_dim: 64\n  mlp_wide:\n") + "overrides:\n  0: {attention: attn_small}\n"
    spec = parse_spec(text)
    assert [l.attention.name for l in spec.layers] == ["attn_small", "attn", "attn", "attn"]


def test_optional_sections_and_defaults():
    spec = parse_spec(edit("  dtype: bfloat16\n", ""))
    assert spec.model.dtype == "bfloat16"
    assert spec.final_norm_eps == spec.model.rms_eps == 1e-6
    assert spec.tie_embeddings is False
    spec = parse_spec(BASE + "embedding: {}\nfinal_norm:\n  eps: 1.0e-5\nlm_head:\n  tied: true\noverrides:\n")
    assert spec.final_norm_eps == 1e-5 and spec.tie_embeddings is True
    plain = parse_spec(edit("  kind: attn_res\n  block_size: 2\n", "  kind: plain\n"))
    assert plain.residual == ResidualSpec("plain", 1) and plain.num_blocks() == 0


def test_exponent_without_dot_is_a_number():
    # YAML 1.1 reads a plain 1e-6 as a string; float fields accept it anyway.
    assert parse_spec(edit("rms_eps: 1.0e-6", "rms_eps: 1e-6")).model.rms_eps == 1e-6
    assert parse_spec(edit("rms_eps: 1.0e-6", "rms_eps: 1")).model.rms_eps == 1.0


def test_flow_and_block_style_are_the_same_spec():
    flow = """\
model: {name: t, hidden: 1024, vocab: 4096, dtype: bfloat16, rms_eps: 1.0e-6, max_context: 256}
residual: {kind: attn_res, block_size: 2}
bodies:
  attn: {kind: attention, heads: 8, kv_heads: 2, head_dim: 128}
  mlp: {kind: mlp, intermediate: 2816}
  mlp_wide: {kind: mlp, intermediate: 4096}
layers:
  - {repeat: 3, attention: attn, mlp: mlp}
  - {attention: attn, mlp: mlp_wide}
"""
    assert parse_spec(flow) == parse_spec(BASE)


def test_fingerprint_is_stable_and_ignores_path_names_and_comments():
    a = parse_spec(BASE, "a.yaml")
    b = parse_spec("# a comment\n" + BASE, "elsewhere/b.yaml")
    assert a.fingerprint() == b.fingerprint() == parse_spec(BASE).fingerprint()
    assert len(a.fingerprint()) == 64 and int(a.fingerprint(), 16) >= 0
    renamed = parse_spec(BASE.replace("name: t", "name: other").replace("attn:", "self_attn:").replace("attention: attn", "attention: self_attn"))
    assert renamed.fingerprint() == a.fingerprint()
    unused = parse_spec(edit("layers:\n", "  unused:\n    kind: mlp\n    intermediate: 64\nlayers:\n"))
    assert unused.fingerprint() == a.fingerprint()


@pytest.mark.parametrize(
    "old, new",
    [
        ("rms_eps: 1.0e-6", "rms_eps: 1.0e-5"),
        ("max_context: 256", "max_context: 512"),
        ("vocab: 4096", "vocab: 8192"),
        ("hidden: 1024", "hidden: 2048"),
        ("block_size: 2", "block_size: 4"),
        ("kv_heads: 2", "kv_heads: 4"),
        ("intermediate: 2816", "intermediate: 2880"),
        ("repeat: 3", "repeat: 4"),
        ("  - attention: attn\n    mlp: mlp_wide\n", "  - attention: attn\n    mlp: mlp\n"),
        ("kind: attn_res\n  block_size: 2", "kind: plain"),
    ],
)
def test_fingerprint_changes_with_anything_that_shapes_the_step(old, new):
    assert parse_spec(edit(old, new)).fingerprint() != parse_spec(BASE).fingerprint()


def test_fingerprint_takes_any_block_size_past_the_layer_count_as_one_block():
    layers = len(parse_spec(BASE).layers)
    whole = parse_spec(edit("block_size: 2", f"block_size: {layers}"))
    assert whole.num_blocks() == 1
    for past in (layers + 1, 2 * layers + 3):
        assert parse_spec(edit("block_size: 2", f"block_size: {past}")).fingerprint() == whole.fingerprint()
    assert parse_spec(edit("block_size: 2", f"block_size: {layers - 1}")).fingerprint() != whole.fingerprint()


def test_fingerprint_sees_final_norm_tied_and_overrides():
    base = parse_spec(BASE).fingerprint()
    assert parse_spec(BASE + "final_norm: {eps: 1.0e-5}\n").fingerprint() != base
    assert parse_spec(BASE + "final_norm: {eps: 1.0e-6}\n").fingerprint() == base
    assert parse_spec(BASE + "lm_head: {tied: true}\n").fingerprint() != base
    assert parse_spec(BASE + "overrides: {0: {mlp: mlp_wide}}\n").fingerprint() != base


def test_with_residual():
    spec = load_spec(SPECS / "kimi_k3_dense.yaml")
    plain = spec.with_residual("plain")
    assert plain.residual.kind == "plain" and plain.num_blocks() == 0
    assert plain.layers == spec.layers and plain.model == spec.model
    assert plain.fingerprint() != spec.fingerprint()
    assert plain.with_residual("attn_res") == spec
    assert spec.with_residual("attn_res", block_size=31).num_blocks() == 3
    # block_size is ignored for plain, so it does not move the fingerprint
    assert spec.with_residual("plain", block_size=5).fingerprint() == plain.fingerprint()
    with pytest.raises(ValueError, match="residual kind"):
        spec.with_residual("attnres")
    with pytest.raises(GraphcError, match="residual kind"):    # like every refusal graphc makes
        spec.with_residual("attnres")
    with pytest.raises(ValueError, match="block_size >= 8"):
        spec.with_residual("attn_res", block_size=1)
    with pytest.raises(ValueError, match="block_size"):
        spec.with_residual("attn_res", block_size=0)


def test_spec_is_frozen_and_hashable():
    spec = parse_spec(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.model = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.layers[0].mlp = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.bodies["x"] = spec.bodies["mlp"]  # type: ignore[index]
    assert hash(spec) == hash(parse_spec(BASE))
    assert isinstance(spec, Spec)


def test_summary_mentions_the_shape():
    text = load_spec(SPECS / "tiny.yaml").summary()
    assert "4 layers" in text and "block_size 2" in text and "layers 0-3" in text


# ---------------------------------------------------------------------------------------------
# The error itself
# ---------------------------------------------------------------------------------------------


def test_spec_error_format_and_attributes():
    err = SpecError("a.yaml", 3, "model.hidden", "an integer", "'x' (a string)")
    assert str(err) == "a.yaml:3: model.hidden: expected an integer, found 'x' (a string)"
    assert str(SpecError("a.yaml", None, "<document>", "x", "y")) == "a.yaml: <document>: expected x, found y"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.file, copy.line, copy.field, copy.expected, copy.found) == ("a.yaml", 3, "model.hidden",
                                                                             "an integer", "'x' (a string)")


def test_load_spec_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(edit("heads: 8", "heads: eight"))
    err = pytest.raises(SpecError, load_spec, path).value
    assert err.file == str(path) and err.line == 14 and err.field == "bodies.attn.heads"
    assert str(err).startswith(f"{path}:14: bodies.attn.heads: expected")


def test_unreadable_files(tmp_path):
    err = pytest.raises(SpecError, load_spec, tmp_path / "missing.yaml").value
    assert err.line is None and "readable" in err.expected
    # A device would read until memory runs out, a pipe may never end: a regular file only.
    err = pytest.raises(SpecError, load_spec, "/dev/zero").value
    assert (err.expected, err.found) == ("a regular file", "a device, pipe or socket")
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)                                  # opening it would wait for a writer
    assert pytest.raises(SpecError, load_spec, fifo).value.expected == "a regular file"
    assert pytest.raises(SpecError, load_spec, tmp_path).value.found == "a folder"
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (17 * 2**20))
    assert str(pytest.raises(SpecError, load_spec, big).value) == \
        f"{big}: <file>: expected a spec of at most 16 MiB (16777216 bytes), found 17825792 bytes"
    big.write_bytes(b"#" * (16 * 2**20 + 1))         # just past the limit: not "16 MiB, found 16 MiB"
    assert pytest.raises(SpecError, load_spec, big).value.found == "16777217 bytes"
    with pytest.raises(GraphcError, match="a spec is the path of a YAML file .*found int 123"):
        load_spec(123)
    with pytest.raises(GraphcError, match=r"found text of several lines \(graphc.spec.parse_spec"):
        load_spec(BASE)
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model:\n  name: caf\xe9\n")
    err = pytest.raises(SpecError, load_spec, path).value
    assert (err.line, err.expected) == (2, "UTF-8 text")


# ---------------------------------------------------------------------------------------------
# Each distinct mistake: its own error, naming field and line
# ---------------------------------------------------------------------------------------------

MISTAKES = [
    # id, text, field, line, fragments that must appear in the message
    ("malformed_yaml", edit("  vocab: 4096\n", "   vocab: 4096\n"), "<document>", 4, ["well-formed YAML"]),
    ("unclosed_flow", "model: {name: t, hidden: 1024\n", "<document>", 2, ["well-formed YAML", "flow mapping"]),
    ("tab_indent", edit("  vocab: 4096\n", "\tvocab: 4096\n"), "<document>", 4, ["'\\t'"]),
    ("two_documents", BASE + "---\nmodel: {}\n", "<document>", 29, ["another document"]),
    ("anchor", edit("  attn:\n", "  attn: &a\n"), "<document>", 12, ["anchors or aliases", "&a"]),
    ("alias", edit("  - attention: attn\n    mlp: mlp_wide\n",
                   "  - attention: attn\n    mlp: *m\n"), "<document>", 28, ["anchors or aliases", "*m"]),
    ("tag", edit("hidden: 1024", "hidden: !!int 1024"), "<document>", 3, ["without tags", "!!int"]),
    ("python_tag", "model: !!python/object/apply:os.system ['true']\n", "<document>", 1, ["without tags"]),
    ("top_level_list", "- model\n- layers\n", "<document>", 1, ["a mapping with the sections", "a list"]),
    ("unknown_section", BASE + "embeding: {}\n", "embeding", 29,
     ["did you mean 'embedding'?", "unknown section 'embeding'"]),
    ("missing_section", edit("layers:\n  - repeat: 3\n    attention: attn\n    mlp: mlp\n"
                             "  - attention: attn\n    mlp: mlp_wide\n", ""), "layers", 1,
     ["the required section 'layers' (a list of layer groups)", "no 'layers' section"]),
    ("missing_field", edit("  vocab: 4096\n", ""), "model.vocab", 2, ["the required field 'vocab' (a positive multiple of 64)", "no 'vocab' field"]),
    ("unknown_field_typo", edit("kv_heads: 2", "kv_head: 2"), "bodies.attn.kv_head", 15,
     ["one of kind, heads, kv_heads, head_dim (did you mean 'kv_heads'?)", "unknown field 'kv_head'"]),
    ("unknown_field_in_group", edit("    mlp: mlp_wide\n", "    mlp: mlp_wide\n    mpl: mlp\n"),
     "layers[1].mpl", 29, ["did you mean 'mlp'?"]),
    ("duplicate_field", edit("  vocab: 4096\n", "  vocab: 4096\n  hidden: 2048\n"), "model.hidden", 5,
     ["at most once", "duplicate key 'hidden' (first at line 3)"]),
    ("duplicate_body", edit("  mlp_wide:\n", "  attn:\n    kind: mlp\n    intermediate: 64\n  mlp_wide:\n"),
     "bodies.attn", 20, ["duplicate key 'attn' (first at line 12)"]),
    ("duplicate_override", BASE + "overrides:\n  1: {mlp: mlp}\n  0x1: {mlp: mlp}\n", "overrides.1", 31,
     ["duplicate key '0x1' (first at line 30)"]),
    ("bool_as_int", edit("hidden: 1024", "hidden: true"), "model.hidden", 3, ["true (a boolean)"]),
    ("float_as_int", edit("heads: 8", "heads: 8.0"), "bodies.attn.heads", 14, ["8.0 (a float)"]),
    ("string_as_int", edit("max_context: 256", "max_context: '256'"), "model.max_context", 7,
     ["'256' (a string)"]),
    ("string_as_float", edit("rms_eps: 1.0e-6", "rms_eps: small"), "model.rms_eps", 6,
     ["positive finite number", "'small' (a string)"]),
    ("list_as_int", edit("vocab: 4096", "vocab: [4096]"), "model.vocab", 4, ["a list"]),
    ("dtype", edit("dtype: bfloat16", "dtype: float16"), "model.dtype", 5, ["bfloat16", "'float16'"]),
    ("hidden_not_multiple_of_64", edit("hidden: 1024", "hidden: 1000"), "model.hidden", 3,
     ["multiple of 64", "1000"]),
    ("hidden_unsupported_by_kernel", edit("hidden: 1024", "hidden: 1088"), "model.hidden", 3,
     [SUPPORTED_HIDDEN_RULE, "found 1088"]),
    ("vocab_zero", edit("vocab: 4096", "vocab: 0"), "model.vocab", 4, ["positive multiple of 64", "found 0"]),
    ("vocab_not_multiple_of_64", edit("vocab: 4096", "vocab: 4000"), "model.vocab", 4, ["multiple of 64"]),
    ("rms_eps_zero", edit("rms_eps: 1.0e-6", "rms_eps: 0.0"), "model.rms_eps", 6, ["positive finite"]),
    ("rms_eps_negative", edit("rms_eps: 1.0e-6", "rms_eps: -1.0e-6"), "model.rms_eps", 6, ["positive"]),
    ("rms_eps_nan", edit("rms_eps: 1.0e-6", "rms_eps: .nan"), "model.rms_eps", 6, ["finite"]),
    ("max_context_zero", edit("max_context: 256", "max_context: 0"), "model.max_context", 7, ["positive"]),
    ("max_context_past_int32", edit("max_context: 256", "max_context: 2147483648"), "model.max_context", 7,
     ["at most 2147483647 (positions are int32)", "2147483648"]),
    ("model_name", edit("name: t", "name: 'my model'"), "model.name", 2, ["'my model'"]),
    ("model_not_mapping", "model: tiny\nresidual:" + BASE.split("residual:", 1)[1], "model", 1,
     ["a mapping", "'tiny' (a string)"]),
    ("residual_kind", edit("kind: attn_res", "kind: attnres"), "residual.kind", 9,
     ["one of attn_res, plain (did you mean 'attn_res'?)", "'attnres'"]),
    ("block_size_zero", edit("block_size: 2", "block_size: 0"), "residual.block_size", 10, ["positive"]),
    ("block_size_float", edit("block_size: 2", "block_size: 2.5"), "residual.block_size", 10, ["2.5 (a float)"]),
    ("too_many_blocks", edit("repeat: 3", "repeat: 30"), "residual.block_size", 10,
     ["at most 12 AttnRes blocks", "block_size >= 3 for 31 layers", "2 (16 blocks)"]),
    ("unknown_op_kind", edit("kind: mlp\n    intermediate: 2816", "kind: mpl\n    intermediate: 2816"),
     "bodies.mlp.kind", 18, ["one of attention, mlp (did you mean 'mlp'?)", "unknown op kind 'mpl'"]),
    ("missing_op_kind", edit("    kind: mlp\n    intermediate: 2816\n", "    intermediate: 2816\n"),
     "bodies.mlp.kind", 18, ["the op kind", "no 'kind' field"]),
    ("field_of_other_kind", edit("intermediate: 2816", "intermediate: 2816\n    heads: 8"),
     "bodies.mlp.heads", 20, ["one of kind, intermediate", "unknown field 'heads'"]),
    ("empty_bodies", BASE.split("bodies:", 1)[0] + "bodies: {}\nlayers:" + BASE.split("layers:", 1)[1],
     "bodies", 11, ["at least one body", "an empty mapping"]),
    ("body_name", edit("  mlp_wide:\n", "  mlp-wide:\n"), "bodies.mlp-wide", 20, ["letters, digits and '_'"]),
    ("heads_not_divisible_by_kv_heads", edit("kv_heads: 2", "kv_heads: 3"), "bodies.attn.kv_heads", 15,
     ["a divisor of heads (8)", "found 3"]),
    ("head_dim_not_multiple_of_8", edit("head_dim: 128", "head_dim: 100"), "bodies.attn.head_dim", 16,
     ["multiple of 8"]),
    ("head_dim_too_large", edit("head_dim: 128", "head_dim: 512"), "bodies.attn.head_dim", 16,
     ["no larger than 256", "found 512"]),
    ("q_width_not_multiple_of_64", edit("heads: 8\n    kv_heads: 2\n    head_dim: 128",
                                        "heads: 3\n    kv_heads: 1\n    head_dim: 8"),
     "bodies.attn.heads", 14, ["heads x head_dim a multiple of 64", "3 x 8 = 24"]),
    ("intermediate_not_multiple_of_64", edit("intermediate: 2816", "intermediate: 2800"),
     "bodies.mlp.intermediate", 19, ["multiple of 64", "2800"]),
    ("layers_not_a_list", BASE.split("layers:", 1)[0] + "layers: {attention: attn, mlp: mlp}\n", "layers", 23,
     ["a list of layer groups", "a mapping"]),
    ("no_layers", BASE.split("layers:", 1)[0] + "layers: []\n", "layers", 23,
     ["at least one layer group", "an empty list"]),
    ("group_not_a_mapping", edit("  - attention: attn\n    mlp: mlp_wide\n", "  - attn\n"), "layers[1]", 27,
     ["a layer group mapping", "'attn' (a string)"]),
    ("repeat_zero", edit("repeat: 3", "repeat: 0"), "layers[0].repeat", 24, ["positive integer", "found 0"]),
    ("repeat_bomb", edit("repeat: 3", "repeat: 1000000000"), "layers[0].repeat", 24, ["at most 1024 layers"]),
    ("unknown_body", edit("    mlp: mlp_wide\n", "    mlp: mlp_wdie\n"), "layers[1].mlp", 28,
     ["did you mean 'mlp_wide'?", "'mlp_wdie', which is not a declared body"]),
    ("wrong_body_kind", edit("  - attention: attn\n    mlp: mlp_wide\n", "  - attention: mlp\n    mlp: mlp_wide\n"),
     "layers[1].attention", 27, ["the name of an attention body, one of attn", "'mlp', an mlp body"]),
    ("missing_layer_slot", edit("  - attention: attn\n    mlp: mlp_wide\n", "  - attention: attn\n"),
     "layers[1].mlp", 27, ["the required field 'mlp'", "no 'mlp' field"]),
    ("override_out_of_range", BASE + "overrides:\n  4:\n    mlp: mlp\n", "overrides.4", 30,
     ["a layer index in 0..3", "found 4"]),
    ("override_negative", BASE + "overrides:\n  -1: {mlp: mlp}\n", "overrides.-1", 30, ["0..3"]),
    ("override_key_not_int", BASE + "overrides:\n  '2': {mlp: mlp}\n", "overrides.2", 30,
     ["an integer layer index", "'2' (a string)"]),
    ("override_wrong_kind", BASE + "overrides:\n  2:\n    mlp: attn\n", "overrides.2.mlp", 31,
     ["an mlp body", "'attn', an attention body"]),
    ("override_empty", BASE + "overrides:\n  2: {}\n", "overrides.2", 30, ["at least one of attention, mlp"]),
    ("override_unknown_field", BASE + "overrides:\n  2: {repeat: 2}\n", "overrides.2.repeat", 30,
     ["one of attention, mlp"]),
    ("embedding_field", BASE + "embedding:\n  dim: 3\n", "embedding.dim", 30, ["no fields", "'dim'"]),
    ("final_norm_not_mapping", BASE + "final_norm: 1.0e-6\n", "final_norm", 29, ["a mapping", "(a float)"]),
    ("final_norm_eps", BASE + "final_norm:\n  eps: -1.0\n", "final_norm.eps", 30, ["positive"]),
    ("tied_not_bool", BASE + "lm_head:\n  tied: 'yes'\n", "lm_head.tied", 30, ["true or false", "'yes'"]),
    ("non_string_key", edit("  vocab: 4096\n", "  4096: vocab\n"), "model.4096", 4,
     ["a field name (a string)"]),
    ("kind_typo", edit("    kind: mlp\n    intermediate: 4096", "    knd: mlp\n    intermediate: 4096"),
     "bodies.mlp_wide.knd", 21, ["did you mean 'kind'?", "unknown field 'knd'"]),
    ("octal_integer", edit("max_context: 256", "max_context: 0256"), "model.max_context", 7,
     ["found 0256 (YAML 1.1 reads it as 174; write a decimal integer)"]),
    ("base_60_integer", edit("max_context: 256", "max_context: 4:16"), "model.max_context", 7,
     ["found 4:16 (YAML 1.1 reads it as 256; write a decimal integer)"]),
    ("octal_override_key", BASE + "overrides:\n  03: {mlp: mlp_wide}\n", "overrides.03", 30,
     ["found 03 (YAML 1.1 reads it as 3; write a decimal integer)"]),
    ("octal_float", edit("rms_eps: 1.0e-6", "rms_eps: 010"), "model.rms_eps", 6,
     ["found 010 (YAML 1.1 reads it as 8; write a decimal number)"]),
    ("base_60_float", edit("rms_eps: 1.0e-6", "rms_eps: 1:30.5"), "model.rms_eps", 6,
     ["found 1:30.5 (YAML 1.1 reads it as 90.5; write a decimal number)"]),
    ("float_past_range", edit("rms_eps: 1.0e-6", "rms_eps: 1" + "0" * 400), "model.rms_eps", 6,
     ["a positive finite number", "(401 digits)"]),
    ("control_character", edit("  vocab: 4096\n", "  vocab: 4096 \x00\n"), "<document>", 4,
     ["printable YAML text", "the character '\\x00'"]),
    # PyYAML breaks lines at U+2028 too, even inside a quoted string; lines are counted as an
    # editor and `grep -n` count them, by newlines.
    ("syntax_after_a_line_separator", LINE_SEPARATOR_IN_A_STRING + "x: y: z\n", "<document>", BASE_LINES + 1,
     ["mapping values are not allowed here"]),
    # Past Python's 4300-digit limit for decimal text, int() raises ValueError, not a spec error.
    ("vocab_of_5000_digits", edit("  vocab: 4096\n", "  vocab: " + "1" * 5000 + "\n"), "model.vocab", 4,
     ["a positive multiple of 64", "11111111111111111111... (5000 digits)"]),
    ("rms_eps_of_5001_digits", edit("  rms_eps: 1.0e-6\n", "  rms_eps: 1" + "0" * 5000 + "\n"), "model.rms_eps", 6,
     ["a positive finite number", "(5001 digits)"]),
    ("override_key_of_5000_digits", BASE + "overrides:\n  ? " + "9" * 5000 + "\n  : {mlp: mlp}\n",
     "overrides.99999999999999999999", BASE_LINES + 2, ["an integer layer index as the key", "(5000 digits)"]),
    # An old Mac file breaks lines with a lone CR; PyYAML reads it so, and so do editors.
    ("cr_only_line_endings", edit("  hidden: 1024\n", "  hidden: 1088\n").replace("\n", "\r"), "model.hidden", 3,
     ["found 1088"]),
    ("crlf_line_endings", edit("  hidden: 1024\n", "  hidden: 1088\n").replace("\n", "\r\n"), "model.hidden", 3,
     ["found 1088"]),
    ("duplicate_after_a_line_separator",
     edit("  vocab: 4096\n", "  vocab: 4096\n  hidden: 2048\n", LINE_SEPARATOR_IN_A_STRING), "model.hidden", 5,
     ["duplicate key 'hidden' (first at line 3)"]),
]


@pytest.mark.parametrize("text, field, line, fragments", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_each_mistake_gets_one_clear_error(text, field, line, fragments):
    err = spec_error(text)
    assert (err.file, err.field, err.line) == ("bad.yaml", field, line), str(err)
    message = str(err)
    assert message == f"bad.yaml:{line}: {field}: expected {err.expected}, found {err.found}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_mistake_ids_are_distinct():
    ids = [m[0] for m in MISTAKES]
    assert len(ids) == len(set(ids)) >= 15


def test_nesting_too_deep_is_one_error():
    err = spec_error("model: " + "[" * 5000 + "]" * 5000 + "\n")
    assert (err.field, err.line) == ("<document>", None) and "nested at most" in str(err)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "\n\n"])
def test_empty_document(text):
    err = spec_error(text)
    assert err.line is None and err.field == "<document>" and "an empty document" in err.found
    assert str(err).startswith("bad.yaml: <document>: expected a mapping")


def test_alias_bomb_is_refused_before_expansion():
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    start = time.perf_counter()
    err = spec_error("\n".join(lines) + "\n")
    assert time.perf_counter() - start < 0.5
    assert err.line == 1 and "anchors or aliases" in err.expected


def test_unknown_field_suggestion_names_all_choices():
    err = spec_error(edit("hidden: 1024", "hiden: 1024"))
    assert err.expected.startswith("one of name, hidden, vocab, dtype, rms_eps, max_context")
    assert err.expected.endswith("(did you mean 'hidden'?)")
