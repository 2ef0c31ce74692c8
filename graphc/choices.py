"""Implementation choices a caller makes: ``graphc.build(..., implementations={...})``,
``graphc build SPEC --impl KEY=VALUE``.

A key is an op kind (``linear``), a node name (``L03.mlp.down``), or a pattern of node names
with ``*``, ``?`` or ``[...]`` (``L*.attn.qkv``: every layer's qkv; fnmatch). A value is an
implementation name for every captured batch size (``"cublas"``), or terms separated by
commas, each ``NAME@SPANS`` (that implementation at those captured batch sizes) or, last, a
bare ``NAME`` (at every other size): ``"cute@1-160+192,cublas"``. SPANS are ``N`` or
``N-M`` joined by ``+``, in increasing order and apart, e.g. ``1-96+192+224``.

For an op at a captured batch size the node's entry is read first, then the patterns that
match its name (in the order given), then its kind's; the first term that covers the size
decides. A size no term covers gets the default, what was measured fastest there
(``Op.default_implementation``). So ``{"L*.attn.qkv": "cute@1-192"}`` moves qkv's crossover and
leaves every other size and node as shipped: the per-size form exists because the measured
crossovers differ between boards (bench/gemm_notes.md §51-§53).

No torch here: the CLI parses ``--impl`` with it before importing anything heavy.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping

from .errors import GraphcError

Span = tuple[int, int]


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()      # not "１", which int() would also take


def parse_spans(text: str) -> tuple[Span, ...]:
    """``"1-96+192"`` -> ((1, 96), (192, 192)); ValueError naming what is wrong."""
    spans: list[Span] = []
    for item in text.split("+"):
        first, dash, last = item.partition("-")
        if not _is_number(first) or (dash and not _is_number(last)):
            raise ValueError(f"{item!r} is not N or N-M")
        spans.append((int(first), int(last) if dash else int(first)))
    for i, (first, last) in enumerate(spans):
        if not 1 <= first <= last or (i and first <= spans[i - 1][1] + 1):
            raise ValueError(f"{text!r}: spans must be increasing, apart and from 1 "
                             f"(e.g. 1-96+192)")
    return tuple(spans)


def covers(spans: tuple[Span, ...], batch: int) -> bool:
    return any(first <= batch <= last for first, last in spans)


def _overlap(a: tuple[Span, ...], b: tuple[Span, ...]) -> bool:
    return any(a0 <= b1 and b0 <= a1 for a0, a1 in a for b0, b1 in b)


@dataclass(frozen=True)
class Term:
    """One implementation at some captured batch sizes (``spans``), or at every size (None)."""

    name: str
    spans: tuple[Span, ...] | None = None

    def applies(self, batch: int | None) -> bool:
        # With no batch size known (a schedule for no particular size) only a bare name applies.
        return self.spans is None or (batch is not None and covers(self.spans, batch))

    def __str__(self) -> str:
        if self.spans is None:
            return self.name
        return self.name + "@" + "+".join(f"{a}" if a == b else f"{a}-{b}" for a, b in self.spans)


def parse_choice(key: str, value: str, max_batch: int | None = None) -> tuple[Term, ...]:
    """``"cute@1-160+192,cublas"`` -> its terms; a GraphcError naming the key and value (and,
    with ``max_batch``, a size past the largest a build captures)."""
    terms = []
    items = value.split(",")
    for i, item in enumerate(items):
        name, at, spans = item.strip().partition("@")
        try:
            if not name:
                raise ValueError("an implementation name is missing")
            if not at and i != len(items) - 1:
                raise ValueError(f"only the last term may be a bare name (every other size); "
                                 f"{name!r} comes before {items[i + 1].strip()!r}")
            term = Term(name, parse_spans(spans) if at else None)
            if max_batch is not None and term.spans and term.spans[-1][1] > max_batch:
                raise ValueError(f"{spans!r} goes past {max_batch}, the largest batch size a build captures")
            overlap = next((t for t in terms if t.spans and term.spans and _overlap(t.spans, term.spans)), None)
            if overlap is not None:
                raise ValueError(f"{item.strip()!r} covers sizes {str(overlap)!r} already takes, and the first "
                                 f"term that covers a size decides it")
            terms.append(term)
        except ValueError as e:
            raise GraphcError(f"implementations[{key!r}] = {value!r}: {e}. Expected NAME, or "
                              f"NAME@SPANS terms separated by commas with an optional bare NAME "
                              f"last, e.g. 'cute@1-160+192,cublas'") from None
    return tuple(terms)


def is_pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


class Choices:
    """A caller's implementation choices, parsed once and read per (op, batch size)."""

    def __init__(self, implementations: Mapping[str, str] | None = None, max_batch: int | None = None):
        self.raw = dict(implementations or {})
        self.terms = {key: parse_choice(key, value, max_batch) for key, value in self.raw.items()}

    def __bool__(self) -> bool:
        return bool(self.terms)

    def unmatched(self, nodes, kinds) -> list[str]:
        """The keys that are neither a kind nor a node of these, nor a pattern matching a node."""
        return [key for key in self.terms if key not in kinds and key not in nodes
                and not (is_pattern(key) and fnmatch.filter(nodes, key))]

    def _terms_for(self, op):
        """``op``'s terms in the order they are read: its node's, matching patterns', its kind's."""
        patterns = [k for k in self.terms if is_pattern(k) and fnmatch.fnmatchcase(op.name, k)]
        for key in (op.name, *patterns, op.kind):
            yield from self.terms.get(key, ())

    def names_for(self, op) -> list[str]:
        """Every implementation the caller names for ``op`` at some size."""
        return [t.name for t in self._terms_for(op)]

    def for_op(self, op, batch: int | None) -> str | None:
        """The implementation the caller chose for ``op`` at this captured batch size, or None
        where the default decides."""
        return next((t.name for t in self._terms_for(op) if t.applies(batch)), None)

    def idle(self, sizes) -> list[str]:
        """``key=TERM`` for each term whose spans cover none of these batch sizes: it decides
        nothing in a build that captures only them (worth saying: a mistyped span looks so)."""
        return [f"{key}={term}" for key, terms in self.terms.items() for term in terms
                if term.spans is not None and not any(covers(term.spans, b) for b in sizes)]

    def everywhere(self, op) -> bool:
        """Whether the caller decides ``op`` at every batch size (a bare name reached)."""
        return any(t.spans is None for t in self._terms_for(op))
