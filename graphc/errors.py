"""Errors a user can cause. The CLI prints them in one line and exits with code 2."""


class GraphcError(Exception):
    """Bad input or an unsupported request: the message says what and where."""


class GraphcValueError(GraphcError, ValueError):
    """A bad argument to a graphc function (``Spec.with_residual("attnres")``): a GraphcError
    like every refusal, and a ValueError as Python's convention for bad arguments has it."""
