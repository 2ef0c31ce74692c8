"""Layer specs: YAML -> typed, validated, frozen dataclasses (the first stage of the pipeline).

A spec file declares the model's widths, the residual scheme, a set of named op *bodies*
(attention, mlp) and the decoder layers as groups that reference those bodies by name. The
format is documented for users in ``docs/spec.md``.

Every bad input raises exactly one :class:`SpecError` naming the file, the 1-based line, the
dotted field path, what was expected and what was found. To know lines, the file is not loaded
into Python objects: it is *composed* into a node tree (``yaml.SafeLoader``) and walked here, so
each value still carries its position. Two PyYAML behaviours are deliberately overridden:

* anchors and aliases are refused while parsing, before any node is built, so an alias bomb
  costs nothing;
* duplicate keys (which PyYAML silently resolves to the last one) are an error in every mapping.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Union

import yaml
from yaml.events import AliasEvent, NodeEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from graphc.errors import GraphcError, GraphcValueError
from graphc.ops.attn_res_math import MAX_SAVED_BLOCKS, SUPPORTED_HIDDEN_RULE, cluster_shape

__all__ = [
    "AttentionBody",
    "Body",
    "LayerSpec",
    "MlpBody",
    "ModelSpec",
    "ResidualSpec",
    "Spec",
    "SpecError",
    "load_spec",
    "parse_spec",
    "DTYPES",
    "RESIDUAL_KINDS",
    "BODY_KINDS",
    "MAX_LAYERS",
    "MAX_HEAD_DIM",
]

DTYPES = ("bfloat16",)
RESIDUAL_KINDS = ("attn_res", "plain")
BODY_KINDS = ("attention", "mlp")
WIDTH_MULTIPLE = 64        # hidden, intermediate, heads x head_dim, vocab: whole 64-column tiles
HEAD_DIM_MULTIPLE = 8      # one 16-byte bf16 vector
MAX_HEAD_DIM = 256
MAX_SPEC_BYTES = 16 * 2**20  # a spec is a page of YAML; a bigger file is not one
MAX_CONTEXT = 2**31 - 1      # token positions and sequence lengths are int32 on the GPU
MAX_LAYERS = 1024          # guards against `repeat: 1000000000` expanding into memory
FINGERPRINT_VERSION = "graphc-spec/1"

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
# YAML 1.1 integers that do not mean what they look like: octal (0256 is 174) and base 60 (4:16 is 256).
_SURPRISING_INT_RE = re.compile(r"[-+]?(?:0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+)\Z")
# YAML 1.1 (PyYAML) only resolves floats that contain a dot, so a plain `1e-6` arrives as a
# string. For float fields we accept such plain (unquoted) decimal literals as numbers.
_DECIMAL_RE = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\Z")

_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))


# ---------------------------------------------------------------------------------------------
# The error
# ---------------------------------------------------------------------------------------------


class SpecError(GraphcError):
    """One mistake in a spec file: where it is, which field, what was expected and found.

    ``str(err) == f"{file}:{line}: {field}: expected {expected}, found {found}"``, with
    ``:{line}`` left out when ``line`` is None (an empty or unreadable file).
    """

    def __init__(self, file: str, line: int | None, field: str, expected: str, found: str):
        self.file = file
        self.line = line
        self.field = field
        self.expected = expected
        self.found = found
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.field}: expected {self.expected}, found {self.found}"

    def __reduce__(self):  # picklable despite the keyword-rich constructor
        return (type(self), (self.file, self.line, self.field, self.expected, self.found))


# ---------------------------------------------------------------------------------------------
# The typed spec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    vocab: int
    dtype: str
    rms_eps: float
    max_context: int


@dataclass(frozen=True)
class ResidualSpec:
    kind: str            # "attn_res" | "plain"
    block_size: int = 1  # decoder layers per AttnRes block; ignored for "plain"


@dataclass(frozen=True)
class AttentionBody:
    """qkv linear -> GQA decode attention over a KV cache -> o_proj."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def kind(self) -> str:
        return "attention"

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        """Output width of the fused qkv projection: q, then k, then v."""
        return self.q_dim + 2 * self.kv_dim

    @property
    def group_size(self) -> int:
        """Query heads that share one kv head."""
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class MlpBody:
    """gate_up linear -> silu(gate) * up -> down linear."""

    name: str
    intermediate: int

    @property
    def kind(self) -> str:
        return "mlp"

    @property
    def gate_up_dim(self) -> int:
        """Output width of the fused gate_up projection: gate, then up."""
        return 2 * self.intermediate


Body = Union[AttentionBody, MlpBody]


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: AttentionBody
    mlp: MlpBody


class _FrozenMap(Mapping):
    """A read-only, hashable, insertion-ordered mapping (so a frozen Spec stays hashable)."""

    __slots__ = ("_data",)

    def __init__(self, items):
        object.__setattr__(self, "_data", dict(items))

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __setattr__(self, name, value):
        raise AttributeError("spec bodies are read-only")

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{k!r}: {v!r}' for k, v in self._data.items())}}}"


@dataclass(frozen=True)
class Spec:
    path: str                        # the file it came from ("<string>" when parsed from text)
    model: ModelSpec
    residual: ResidualSpec
    bodies: Mapping[str, Body]       # by name, in file order (including unused bodies)
    layers: tuple[LayerSpec, ...]    # fully expanded: repeats and overrides applied
    final_norm_eps: float            # defaults to model.rms_eps
    tie_embeddings: bool = False     # lm_head shares the embedding matrix

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_blocks(self) -> int:
        """AttnRes blocks: ceil(L / block_size) for attn_res; 0 for plain."""
        if self.residual.kind != "attn_res":
            return 0
        return -(-len(self.layers) // self.residual.block_size)

    def with_residual(self, kind: str, block_size: int | None = None) -> "Spec":
        """The same model with another residual scheme (for A/B benchmarks).

        ``block_size`` defaults to the current one, so ``s.with_residual("plain")
        .with_residual("attn_res") == s``. Raises GraphcValueError (a GraphcError and a
        ValueError) for an unknown kind or a block size the AttnRes kernel cannot serve.
        """
        if kind not in RESIDUAL_KINDS:
            raise GraphcValueError(f"residual kind must be one of {', '.join(RESIDUAL_KINDS)}, got {kind!r}")
        size = self.residual.block_size if block_size is None else block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise GraphcValueError(f"block_size must be an integer >= 1, got {size!r}")
        if kind == "attn_res":
            blocks = -(-len(self.layers) // size)
            if blocks > MAX_SAVED_BLOCKS:
                raise GraphcValueError(
                    f"block_size {size} gives {blocks} AttnRes blocks for {len(self.layers)} "
                    f"layers; the kernel serves at most {MAX_SAVED_BLOCKS} "
                    f"(block_size >= {_min_block_size(len(self.layers))})"
                )
        return dataclasses.replace(self, residual=ResidualSpec(kind, size))

    def canonical(self) -> dict[str, Any]:
        """Everything that shapes the compiled step, as plain JSON-able data.

        Left out on purpose: the path, the model name and body names (labels only), unused
        bodies, and ``block_size`` when the residual is plain (it is ignored there). A
        ``block_size`` of at least the layer count is one block whatever its value, so it is
        recorded as the layer count.
        """
        residual: dict[str, Any] = {"kind": self.residual.kind}
        if self.residual.kind == "attn_res":
            residual["block_size"] = min(self.residual.block_size, len(self.layers))
        return {
            "format": FINGERPRINT_VERSION,
            "model": {
                "hidden": self.model.hidden,
                "vocab": self.model.vocab,
                "dtype": self.model.dtype,
                "rms_eps": repr(float(self.model.rms_eps)),
                "max_context": self.model.max_context,
            },
            "residual": residual,
            "layers": [
                {
                    "attention": [l.attention.heads, l.attention.kv_heads, l.attention.head_dim],
                    "mlp": [l.mlp.intermediate],
                }
                for l in self.layers
            ],
            "final_norm_eps": repr(float(self.final_norm_eps)),
            "tie_embeddings": self.tie_embeddings,
        }

    def fingerprint(self) -> str:
        """sha256 hex of :meth:`canonical`: equal for specs that compile to the same step."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def summary(self) -> str:
        """A few human-readable lines (for ``graphc inspect``)."""
        m, r = self.model, self.residual
        res = f"attn_res, block_size {r.block_size}, {self.num_blocks()} blocks" if r.kind == "attn_res" else "plain"
        lines = [
            f"{m.name}: {len(self.layers)} layers, hidden {m.hidden}, vocab {m.vocab}, {m.dtype}, "
            f"max_context {m.max_context}, rms_eps {m.rms_eps:g}",
            f"residual: {res}",
        ]
        for body in self.bodies.values():
            used = [l.index for l in self.layers if body in (l.attention, l.mlp)]
            if isinstance(body, AttentionBody):
                shape = f"attention heads {body.heads}, kv_heads {body.kv_heads}, head_dim {body.head_dim}"
            else:
                shape = f"mlp intermediate {body.intermediate}"
            lines.append(f"body {body.name}: {shape}; layers {_ranges(used) or 'none'}")
        lines.append(
            f"final_norm eps {self.final_norm_eps:g}; lm_head {'tied to' if self.tie_embeddings else 'separate from'} the embedding"
        )
        return "\n".join(lines)


def _ranges(indices: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def _min_block_size(layers: int) -> int:
    return -(-layers // MAX_SAVED_BLOCKS)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def load_spec(path: str | os.PathLike) -> Spec:
    """Read, validate and expand a spec file. Raises SpecError (also for an unreadable file)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise GraphcError(f"a spec is the path of a YAML file (str or os.PathLike), found "
                          f"{type(path).__name__} {path!r:.60}")
    name = os.fspath(path)
    name = name.decode() if isinstance(name, bytes) else name
    if not name:
        raise GraphcError("a spec is the path of a YAML file, found an empty path")
    if "\n" in name:
        raise GraphcError("a spec is the path of a YAML file, found text of several lines "
                          "(graphc.spec.parse_spec(text) reads a spec given as text)")
    try:
        # A regular file only: /dev/zero would read until memory runs out, and opening a pipe
        # waits for a writer that may never come.
        mode = os.stat(name).st_mode
        if not stat.S_ISREG(mode):
            raise SpecError(name, None, "<file>", "a regular file",
                            "a folder" if stat.S_ISDIR(mode) else "a device, pipe or socket")
        with open(name, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(name, None, "<file>", "a readable spec file", e.strerror or str(e)) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(name, None, "<file>", f"a spec of at most {MAX_SPEC_BYTES // 2**20} MiB "
                        f"({MAX_SPEC_BYTES} bytes)", f"{os.path.getsize(name)} bytes")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = _lines_before(raw, e.start) + 1
        raise SpecError(name, line, "<file>", "UTF-8 text", f"the byte 0x{raw[e.start]:02x}") from None
    return parse_spec(text, name)


def parse_spec(text: str, path: str = "<string>") -> Spec:
    """Validate and expand a spec given as YAML text; ``path`` is only used in messages."""
    return _Parser(str(path)).parse(text)


# ---------------------------------------------------------------------------------------------
# YAML -> node tree, refusing anchors, aliases and tags before anything is built
# ---------------------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, event, expected: str, found: str):
        self.event, self.expected, self.found = event, expected, found


class _Loader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            raise _Refused(event, "plain YAML without anchors or aliases", f"the alias *{event.anchor}")
        if isinstance(event, NodeEvent) and event.anchor is not None:
            raise _Refused(event, "plain YAML without anchors or aliases", f"the anchor &{event.anchor}")
        tag = getattr(event, "tag", None)
        if tag is not None and tag != "!":
            shown = "!!" + tag[len(_TAG):] if tag.startswith(_TAG) else tag
            raise _Refused(event, "plain YAML without tags", f"the tag {shown}")
        return super().compose_node(parent, index)


def _many_digits(text: str) -> str:
    return f"{text[:20]}... ({len(text)} digits)"


def _line_of(mark) -> int:
    """The 1-based line of a PyYAML mark as an editor counts it: PyYAML also breaks lines at
    U+0085, U+2028 and U+2029, which may stand inside a quoted string, so it counts the line
    breaks before the mark in the text itself."""
    if mark.buffer is None:
        return mark.line + 1
    return _lines_before(mark.buffer, mark.index) + 1


def _lines_before(text: str | bytes, end: int) -> int:
    """Line breaks in text[:end] as editors count them: LF, CRLF or a lone CR (old Mac files),
    each one break."""
    lf, cr = ("\n", "\r") if isinstance(text, str) else (b"\n", b"\r")
    return text.count(lf, 0, end) + text.count(cr, 0, end) - text.count(cr + lf, 0, end)


def _compose(text: str, file: str) -> Node | None:
    loader = None
    try:
        loader = _Loader(text)           # PyYAML refuses unprintable characters here already
        return loader.get_single_node()
    except _Refused as e:
        raise SpecError(file, _line_of(e.event.start_mark), "<document>", e.expected, e.found) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = re.sub(r"^(but )?found ", "", e.problem or "a parse error")
        if e.context:
            problem = f"{problem} ({e.context}" + (
                f" at line {_line_of(e.context_mark)})" if e.context_mark and e.context_mark is not mark else ")"
            )
        raise SpecError(file, _line_of(mark) if mark else None, "<document>", "well-formed YAML", problem) from None
    except yaml.reader.ReaderError as e:
        line = _lines_before(text, e.position) + 1 if isinstance(e.position, int) else None
        char = chr(e.character) if isinstance(e.character, int) else e.character
        raise SpecError(file, line, "<document>", "printable YAML text", f"the character {char!r}") from None
    except yaml.YAMLError as e:
        raise SpecError(file, None, "<document>", "well-formed YAML", str(e)) from None
    except RecursionError:
        raise SpecError(file, None, "<document>", "YAML nested at most a few hundred levels deep",
                        "deeper nesting") from None
    finally:
        if loader is not None:
            loader.dispose()


# ---------------------------------------------------------------------------------------------
# The node-tree walker
# ---------------------------------------------------------------------------------------------


def _join(field: str, key) -> str:
    return str(key) if not field else f"{field}.{key}"


def _one_of(options, found: str | None = None) -> str:
    text = f"one of {', '.join(options)}"
    if found is not None:
        close = difflib.get_close_matches(found, list(options), n=1, cutoff=0.6)
        if close:
            text += f" (did you mean '{close[0]}'?)"
    return text


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" or noun == "mlp" else f"a {noun}"


def _found(node: Node) -> str:
    """What a node is, in words, for the `found ...` part of a message."""
    if isinstance(node, MappingNode):
        return "an empty mapping" if not node.value else "a mapping"
    if isinstance(node, SequenceNode):
        return "an empty list" if not node.value else "a list"
    value = node.value
    if node.tag == _NULL:
        return "nothing (null)"
    if node.tag == _STR:
        if node.style is None and _DECIMAL_RE.match(value):
            return f"{value} (a float)"
        return f"'{value}' (a string)"
    kind = {_INT: "integer", _FLOAT: "float", _BOOL: "boolean"}.get(node.tag, node.tag.rsplit(":", 1)[-1])
    return f"{value} ({_a(kind)})"


class _Parser:
    def __init__(self, file: str):
        self.file = file
        self._constructor = yaml.constructor.SafeConstructor()

    # -- errors ---------------------------------------------------------------------------

    def fail(self, where: Node | int | None, field: str, expected: str, found: str) -> NoReturn:
        line = _line_of(where.start_mark) if isinstance(where, Node) else where
        raise SpecError(self.file, line, field, expected, found)

    # -- scalars --------------------------------------------------------------------------

    def scalar(self, node: ScalarNode):
        return self._constructor.construct_object(node, deep=True)

    def integer(self, node: Node, field: str, what: str) -> int:
        if not (isinstance(node, ScalarNode) and node.tag == _INT):
            self.fail(node, field, what, _found(node))
        self.refuse_surprising_number(node, field, what, "a decimal integer")
        try:
            return self.scalar(node)
        except ValueError:     # past Python's 4300-digit limit for converting decimal text
            self.fail(node, field, what, _many_digits(node.value))

    def refuse_surprising_number(self, node: ScalarNode, field: str, what: str, write: str) -> None:
        """YAML 1.1 reads 0256 as octal 174, 4:16 as base 60 (256) and 1:30.5 as 90.5: never
        what was meant, so a number field refuses them."""
        if node.tag in (_INT, _FLOAT) and (_SURPRISING_INT_RE.match(node.value) or ":" in node.value):
            self.fail(node, field, what, f"{node.value} (YAML 1.1 reads it as {self.scalar(node)}; write "
                                         f"{write})")

    def positive_int(self, node: Node, field: str, what: str = "a positive integer", *, multiple: int = 1) -> int:
        value = self.integer(node, field, what)
        if value < 1:
            self.fail(node, field, what, str(value))
        if value % multiple:
            self.fail(node, field, what, f"{value} ({value} % {multiple} = {value % multiple})")
        return value

    def positive_float(self, node: Node, field: str) -> float:
        what = "a positive finite number"
        if isinstance(node, ScalarNode) and node.tag in (_INT, _FLOAT):
            self.refuse_surprising_number(node, field, what, "a decimal number")
            try:
                value = float(self.scalar(node))
            except (OverflowError, ValueError):   # an integer past float's range (1 and 400 zeros)
                self.fail(node, field, what, _many_digits(node.value))     # or past 4300 digits
        elif isinstance(node, ScalarNode) and node.tag == _STR and node.style is None and _DECIMAL_RE.match(node.value):
            value = float(node.value)
        else:
            self.fail(node, field, what, _found(node))
        if not (math.isfinite(value) and value > 0):
            self.fail(node, field, what, node.value)
        return value

    def boolean(self, node: Node, field: str) -> bool:
        if not (isinstance(node, ScalarNode) and node.tag == _BOOL):
            self.fail(node, field, "true or false", _found(node))
        return self.scalar(node)

    def string(self, node: Node, field: str, what: str = "a string") -> str:
        if not (isinstance(node, ScalarNode) and node.tag == _STR):
            self.fail(node, field, what, _found(node))
        return node.value

    def choice(self, node: Node, field: str, options, unknown: str = "") -> str:
        value = self.string(node, field, _one_of(options))
        if value not in options:
            self.fail(node, field, _one_of(options, value), f"{unknown}'{value}'")
        return value

    # -- mappings -------------------------------------------------------------------------

    def entries(self, node: Node, field: str, what: str = "a mapping", *, int_keys: bool = False,
                allow_null: bool = False) -> dict:
        """key -> (key node, value node), in file order; refuses duplicates and odd keys."""
        if allow_null and isinstance(node, ScalarNode) and node.tag == _NULL:
            return {}
        if not isinstance(node, MappingNode):
            self.fail(node, field or "<document>", what, _found(node))
        out: dict = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                self.fail(key_node, field or "<document>", "a plain key", _found(key_node))
            if int_keys:
                # integer() also refuses the octal and base-60 forms: `010:` is layer 8 in YAML 1.1.
                key = self.integer(key_node, _join(field, key_node.value[:20]), "an integer layer index as the key")
            elif key_node.tag != _STR:
                self.fail(key_node, _join(field, key_node.value), "a field name (a string) as the key",
                          _found(key_node))
            else:
                key = key_node.value
            if key in out:
                first = _line_of(out[key][0].start_mark)
                self.fail(key_node, _join(field, key), "each key at most once",
                          f"a duplicate key '{key_node.value}' (first at line {first})")
            out[key] = (key_node, value_node)
        return out

    def fields(self, node: Node, field: str, entries: dict, known: dict[str, str], required=(),
               noun: str = "field") -> None:
        """Unknown fields first (a typo also makes a field 'missing'), then missing ones."""
        for key, (key_node, _) in entries.items():
            if key not in known:
                expected = _one_of(known, key) if known else f"no {noun}s"
                self.fail(key_node, _join(field, key), expected, f"unknown {noun} '{key}'")
        for key in required:
            if key not in entries:
                self.fail(node, _join(field, key), f"the required {noun} '{key}' ({known[key]})",
                          f"no '{key}' {noun}")

    # -- the document ---------------------------------------------------------------------

    SECTIONS = {
        "model": "a mapping with name, hidden, vocab, rms_eps, max_context",
        "residual": "{kind: attn_res, block_size: N} or {kind: plain}",
        "bodies": "a mapping of named attention and mlp bodies",
        "layers": "a list of layer groups",
        "overrides": "a mapping from layer index to replacements",
        "embedding": "an empty mapping",
        "final_norm": "a mapping with eps",
        "lm_head": "a mapping with tied",
    }

    def parse(self, text: str) -> Spec:
        root = _compose(text, self.file)
        if root is None or (isinstance(root, ScalarNode) and root.tag == _NULL and not root.value):
            self.fail(None, "<document>", "a mapping with the sections model, residual, bodies and layers",
                      "an empty document")
        top = self.entries(root, "", "a mapping with the sections model, residual, bodies and layers")
        self.fields(root, "", top, self.SECTIONS, ("model", "residual", "bodies", "layers"), noun="section")

        model = self.model(*top["model"])
        residual_node, residual, block_size_node = self.residual(*top["residual"])
        bodies = self.bodies(*top["bodies"])
        layers = self.layers(top["layers"][1], bodies)
        if "overrides" in top:
            layers = self.overrides(top["overrides"][1], bodies, layers)

        if residual.kind == "attn_res":
            blocks = -(-len(layers) // residual.block_size)
            if blocks > MAX_SAVED_BLOCKS:
                self.fail(block_size_node or residual_node, "residual.block_size",
                          f"at most {MAX_SAVED_BLOCKS} AttnRes blocks, i.e. block_size >= "
                          f"{_min_block_size(len(layers))} for {len(layers)} layers",
                          f"{residual.block_size} ({blocks} blocks)")

        if "embedding" in top:
            node = top["embedding"][1]
            self.fields(node, "embedding", self.entries(node, "embedding", allow_null=True), {})

        final_norm_eps = model.rms_eps
        if "final_norm" in top:
            node = top["final_norm"][1]
            entries = self.entries(node, "final_norm", allow_null=True)
            self.fields(node, "final_norm", entries, {"eps": "a positive finite number"})
            if "eps" in entries:
                final_norm_eps = self.positive_float(entries["eps"][1], "final_norm.eps")

        tied = False
        if "lm_head" in top:
            node = top["lm_head"][1]
            entries = self.entries(node, "lm_head", allow_null=True)
            self.fields(node, "lm_head", entries, {"tied": "true or false"})
            if "tied" in entries:
                tied = self.boolean(entries["tied"][1], "lm_head.tied")

        return Spec(
            path=self.file,
            model=model,
            residual=residual,
            bodies=_FrozenMap(bodies),
            layers=tuple(layers),
            final_norm_eps=final_norm_eps,
            tie_embeddings=tied,
        )

    # -- sections -------------------------------------------------------------------------

    MODEL_FIELDS = {
        "name": "a model name: letters, digits, '_', '.', '-', starting with a letter or digit",
        "hidden": f"a positive multiple of {WIDTH_MULTIPLE} that the AttnRes kernel supports",
        "vocab": f"a positive multiple of {WIDTH_MULTIPLE}",
        "dtype": "bfloat16",
        "rms_eps": "a positive finite number",
        "max_context": "a positive integer",
    }

    def model(self, key_node: Node, node: Node) -> ModelSpec:
        f = "model"
        e = self.entries(node, f)
        self.fields(node, f, e, self.MODEL_FIELDS, ("name", "hidden", "vocab", "rms_eps", "max_context"))

        name = self.string(e["name"][1], "model.name", self.MODEL_FIELDS["name"])
        if not _MODEL_NAME_RE.match(name):
            self.fail(e["name"][1], "model.name", self.MODEL_FIELDS["name"], f"'{name}'")

        hidden_node = e["hidden"][1]
        hidden = self.positive_int(hidden_node, "model.hidden", f"a positive multiple of {WIDTH_MULTIPLE}",
                                   multiple=WIDTH_MULTIPLE)
        if cluster_shape(hidden) is None:
            self.fail(hidden_node, "model.hidden", f"a width the AttnRes kernel supports: {SUPPORTED_HIDDEN_RULE}",
                      str(hidden))

        vocab = self.positive_int(e["vocab"][1], "model.vocab", f"a positive multiple of {WIDTH_MULTIPLE}",
                                  multiple=WIDTH_MULTIPLE)

        dtype = "bfloat16"
        if "dtype" in e:
            dtype_node = e["dtype"][1]
            dtype = self.string(dtype_node, "model.dtype", "bfloat16 (the only supported dtype)")
            if dtype not in DTYPES:
                self.fail(dtype_node, "model.dtype", "bfloat16 (the only supported dtype)", f"'{dtype}'")

        rms_eps = self.positive_float(e["rms_eps"][1], "model.rms_eps")
        context_node = e["max_context"][1]
        max_context = self.positive_int(context_node, "model.max_context", "a positive integer")
        if max_context > MAX_CONTEXT:
            self.fail(context_node, "model.max_context", f"at most {MAX_CONTEXT} (positions are int32)", str(max_context))
        return ModelSpec(name, hidden, vocab, dtype, rms_eps, max_context)

    RESIDUAL_FIELDS = {"kind": _one_of(RESIDUAL_KINDS), "block_size": "a positive integer"}

    def residual(self, key_node: Node, node: Node):
        f = "residual"
        e = self.entries(node, f)
        self.fields(node, f, e, self.RESIDUAL_FIELDS, ("kind",))
        kind = self.choice(e["kind"][1], "residual.kind", RESIDUAL_KINDS)
        block_size, size_node = 1, None
        if "block_size" in e:
            size_node = e["block_size"][1]
            block_size = self.positive_int(size_node, "residual.block_size",
                                           "a positive integer (decoder layers per AttnRes block)")
        return node, ResidualSpec(kind, block_size), size_node

    BODY_FIELDS = {
        "attention": {
            "kind": _one_of(BODY_KINDS),
            "heads": "a positive integer",
            "kv_heads": "a positive integer dividing heads",
            "head_dim": f"a multiple of {HEAD_DIM_MULTIPLE} no larger than {MAX_HEAD_DIM}",
        },
        "mlp": {"kind": _one_of(BODY_KINDS), "intermediate": f"a positive multiple of {WIDTH_MULTIPLE}"},
    }

    def bodies(self, key_node: Node, node: Node) -> dict[str, Body]:
        entries = self.entries(node, "bodies", "a mapping from body name to body")
        if not entries:
            self.fail(node, "bodies", "at least one body", "an empty mapping")
        bodies: dict[str, Body] = {}
        for name, (name_node, body_node) in entries.items():
            f = f"bodies.{name}"
            if not _NAME_RE.match(name):
                self.fail(name_node, f, "a body name made of letters, digits and '_' (not starting with a digit)",
                          f"'{name}'")
            e = self.entries(body_node, f)
            if "kind" not in e:
                # Unknown fields first, as everywhere, so that a misspelt 'kind' is named as such
                # (against the fields of either kind: which one was meant is not known yet).
                self.fields(body_node, f, e, {k: v for fields in self.BODY_FIELDS.values() for k, v in fields.items()})
                self.fail(body_node, f"{f}.kind", f"the required field 'kind' (the op kind, {_one_of(BODY_KINDS)})",
                          "no 'kind' field")
            kind = self.choice(e["kind"][1], f"{f}.kind", BODY_KINDS, unknown="unknown op kind ")
            known = self.BODY_FIELDS[kind]
            self.fields(body_node, f, e, known, tuple(k for k in known if k != "kind"))
            if kind == "attention":
                bodies[name] = self.attention(name, e, f)
            else:
                bodies[name] = MlpBody(name, self.positive_int(
                    e["intermediate"][1], f"{f}.intermediate", f"a positive multiple of {WIDTH_MULTIPLE}",
                    multiple=WIDTH_MULTIPLE))
        return bodies

    def attention(self, name: str, e: dict, f: str) -> AttentionBody:
        heads_node, kv_node, dim_node = e["heads"][1], e["kv_heads"][1], e["head_dim"][1]
        heads = self.positive_int(heads_node, f"{f}.heads")
        kv_heads = self.positive_int(kv_node, f"{f}.kv_heads")
        if heads % kv_heads:
            self.fail(kv_node, f"{f}.kv_heads", f"a divisor of heads ({heads})", str(kv_heads))
        dim_what = f"a multiple of {HEAD_DIM_MULTIPLE} no larger than {MAX_HEAD_DIM}"
        head_dim = self.positive_int(dim_node, f"{f}.head_dim", dim_what, multiple=HEAD_DIM_MULTIPLE)
        if head_dim > MAX_HEAD_DIM:
            self.fail(dim_node, f"{f}.head_dim", dim_what, str(head_dim))
        if (heads * head_dim) % WIDTH_MULTIPLE:
            self.fail(heads_node, f"{f}.heads", f"heads x head_dim a multiple of {WIDTH_MULTIPLE}",
                      f"{heads} x {head_dim} = {heads * head_dim}")
        return AttentionBody(name, heads, kv_heads, head_dim)

    def reference(self, node: Node, field: str, slot: str, bodies: dict[str, Body]) -> Body:
        """A body name in the `attention` or `mlp` slot of a layer group or override."""
        right = {n: b for n, b in bodies.items() if b.kind == slot}
        what = f"the name of {_a(slot)} body, " + (_one_of(right) if right else "but none is declared")
        name = self.string(node, field, what)
        if name not in bodies:
            hint = difflib.get_close_matches(name, list(right) or list(bodies), n=1, cutoff=0.6)
            self.fail(node, field, what + (f" (did you mean '{hint[0]}'?)" if hint else ""),
                      f"'{name}', which is not a declared body")
        body = bodies[name]
        if body.kind != slot:
            self.fail(node, field, what, f"'{name}', {_a(body.kind)} body")
        return body

    GROUP_FIELDS = {
        "repeat": "a positive integer",
        "attention": "the name of an attention body",
        "mlp": "the name of an mlp body",
    }

    def layers(self, node: Node, bodies: dict[str, Body]) -> list[LayerSpec]:
        if not isinstance(node, SequenceNode):
            self.fail(node, "layers", "a list of layer groups", _found(node))
        if not node.value:
            self.fail(node, "layers", "at least one layer group", "an empty list")
        layers: list[LayerSpec] = []
        for i, group in enumerate(node.value):
            f = f"layers[{i}]"
            e = self.entries(group, f, "a layer group mapping with attention, mlp and optional repeat")
            self.fields(group, f, e, self.GROUP_FIELDS, ("attention", "mlp"))
            repeat = 1
            if "repeat" in e:
                repeat = self.positive_int(e["repeat"][1], f"{f}.repeat")
                if len(layers) + repeat > MAX_LAYERS:
                    self.fail(e["repeat"][1], f"{f}.repeat", f"at most {MAX_LAYERS} layers in all",
                              f"{repeat} ({len(layers) + repeat} layers in all)")
            elif len(layers) + 1 > MAX_LAYERS:
                self.fail(group, f, f"at most {MAX_LAYERS} layers in all", f"layer {len(layers)}")
            attention = self.reference(e["attention"][1], f"{f}.attention", "attention", bodies)
            mlp = self.reference(e["mlp"][1], f"{f}.mlp", "mlp", bodies)
            for _ in range(repeat):
                layers.append(LayerSpec(len(layers), attention, mlp))
        return layers

    OVERRIDE_FIELDS = {"attention": "the name of an attention body", "mlp": "the name of an mlp body"}

    def overrides(self, node: Node, bodies: dict[str, Body], layers: list[LayerSpec]) -> list[LayerSpec]:
        entries = self.entries(node, "overrides", "a mapping from layer index to replacements",
                               int_keys=True, allow_null=True)
        layers = list(layers)
        for index, (key_node, value_node) in entries.items():
            f = f"overrides.{index}"
            if not 0 <= index < len(layers):
                self.fail(key_node, f, f"a layer index in 0..{len(layers) - 1}", str(index))
            e = self.entries(value_node, f, "a mapping with attention and/or mlp")
            self.fields(value_node, f, e, self.OVERRIDE_FIELDS)
            if not e:
                self.fail(value_node, f, "at least one of attention, mlp", "an empty mapping")
            layer = layers[index]
            if "attention" in e:
                layer = dataclasses.replace(
                    layer, attention=self.reference(e["attention"][1], f"{f}.attention", "attention", bodies))
            if "mlp" in e:
                layer = dataclasses.replace(layer, mlp=self.reference(e["mlp"][1], f"{f}.mlp", "mlp", bodies))
            layers[index] = layer
        return layers
