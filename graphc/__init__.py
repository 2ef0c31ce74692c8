"""graphc: compile the decode step of an Attention-Residual transformer into CUDA graphs.

Pipeline (one module per stage, data flows one way):
    spec -> graph -> schedule -> plan -> reference / capture -> runtime (DecodeStep)

    import graphc
    step = graphc.build("layer_specs/kimi_k3_dense_8l.yaml", batch_sizes=[1, 8, 64])
    logits = step(tokens, seq_lens)          # a view of a static buffer
"""

__version__ = "0.1.0"

from .errors import GraphcError  # noqa: E402  (every refusal graphc makes; the CLI prints it in one line)

__all__ = ["build", "GraphcError", "__version__"]   # and graphc.SpecError, loaded on first use


def __getattr__(name: str):
    # graphc.SpecError (a GraphcError naming the spec file, line and field) without importing
    # the spec module, and with it torch, at ``import graphc``.
    if name == "SpecError":
        from .spec import SpecError

        return SpecError
    raise AttributeError(f"module 'graphc' has no attribute {name!r}")


def build(*args, **kwargs):
    from .runtime import build as _build

    return _build(*args, **kwargs)


build.__doc__ = "See graphc.runtime.build."
