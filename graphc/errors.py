"""Errors a user can cause. The CLI prints them in one line and exits with code 2."""


class GraphcError(Exception):
    """Bad input or an unsupported request: the message says what and where."""


class GraphcValueError(GraphcError, ValueError):
    """A bad argument to a graphc function (``Spec.with_residual("attnres")``): a GraphcError
    like every refusal, and a ValueError as Python's convention for bad arguments has it."""


class GraphcTypeError(GraphcError, TypeError):
    """A call graphc's signature cannot take (``graphc.build(spec, batch_size=[8])``): a
    GraphcError that names the argument meant, and a TypeError as Python's convention has it."""


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean a, b?)`` for the up-to-three choices closest to a mistyped word, or ``""``
    when none is close: the tail of every "no such name" refusal."""
    import difflib

    near = difflib.get_close_matches(str(word), list(choices), n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""
