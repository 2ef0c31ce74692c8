"""graphc: compile the decode step of an Attention-Residual transformer into CUDA graphs.

Pipeline (one module per stage, data flows one way):
    spec -> graph -> schedule -> plan -> reference / capture -> runtime (DecodeStep)

    import graphc
    step = graphc.build("layer_specs/kimi_k3_dense_8l.yaml", batch_sizes=[1, 8, 64])
    logits = step(tokens, seq_lens)          # a view of a static buffer
"""

__version__ = "0.1.0"


def build(*args, **kwargs):
    from .runtime import build as _build

    return _build(*args, **kwargs)


build.__doc__ = "See graphc.runtime.build."
