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
    """Build a ``DecodeStep``: validate the spec, schedule and verify every batch size's kernels,
    compile the kernels and capture one CUDA graph per batch size.

    ``build(spec, batch_sizes=(1, 2, 4, 8), weights=None, device="cuda", implementations=None,
    use_pdl=True, seed=0, progress=print_to_stderr, compile_jobs=None, block_weights=True,
    block_rows=64)``

    spec:            a layer spec path (``layer_specs/*.yaml``, docs/spec.md) or a loaded ``Spec``.
    batch_sizes:     the batch sizes to capture (1 to 512); a call with b rows replays the
                     smallest captured size >= b.
    weights:         None (seeded random, ``seed``), a ``.safetensors`` path whose names and
                     shapes ``graphc build SPEC --write-weight-names FILE`` lists, or a ``Weights``.
    device:          "cuda", "cuda:N", or "cpu" (the op-by-op reference executor, no graphs).
    implementations: overrides by op kind or node name, e.g. ``{"linear": "cublas"}`` or
                     ``{"L03.mlp.down": "cute"}`` or a pattern of node names
                     (``{"L*.attn.qkv": ...}``), for every size or per captured batch size
                     with ``NAME@SIZES`` terms and an optional bare name last:
                     ``{"linear": "cute@1-64,cublas"}``, ``{"L*.attn.qkv": "cute@1-192"}``
                     (graphc/choices.py); the default is what was measured fastest at each
                     batch size.
    use_pdl:         False puts full edges everywhere (for A/B comparisons).
    progress:        called with one line per build stage; None for silence.
    compile_jobs:    processes compiling uncached kernels while the weights load (None:
                     ``GRAPHC_COMPILE_JOBS``, else the CPU count up to 8; 0 or 1: none).
    block_weights:   on a GPU, store each weight that only the decode GEMM reads (at every
                     captured batch size) in 64 x 64 blocks, the order it streams 2-7% faster;
                     ``step.plan.weights.matrix(name)`` gives it back as [N, K]. False keeps
                     every weight row-major. A ``Weights`` object passed in is reordered in
                     place, except weights another build already reads row-major.
    block_rows:      rows per block of those weights: 64 (the default), or 16 (2 KB blocks,
                     bench/gemm_notes.md §35).

    Every refusal (a spec mistake, an unsupported shape, a build that cannot fit, a bad weights
    file) raises a ``graphc.GraphcError`` naming the problem, before anything is allocated.
    """
    from .runtime import build as _build

    _refuse_arguments_it_does_not_take(_build, args, kwargs)
    return _build(*args, **kwargs)


def _refuse_arguments_it_does_not_take(function, args, kwargs) -> None:
    """A misspelt keyword (``batch_size=``), one positional too many or one given twice is a
    GraphcError, before any work: for a misspelt keyword it names the argument meant."""
    import inspect

    from .errors import GraphcTypeError, did_you_mean

    signature = inspect.signature(function)
    names = list(signature.parameters)
    for name in kwargs:
        if name not in names:
            raise GraphcTypeError(f"build() takes no argument {name!r}{did_you_mean(name, names)}; "
                                  f"it takes {', '.join(names)}")
    try:
        signature.bind(*args, **kwargs)
    except TypeError as refused:
        raise GraphcTypeError(f"build(): {refused}; it takes {', '.join(names)}") from None
