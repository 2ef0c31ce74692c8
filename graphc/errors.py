"""Errors a user can cause. The CLI prints them in one line and exits with code 2."""


class GraphcError(Exception):
    """Bad input or an unsupported request: the message says what and where."""
