"""graphc: compile the decode step of an Attention-Residual transformer into CUDA graphs.

Pipeline (one module per stage, data flows one way):
    spec -> graph -> schedule -> plan -> reference / capture -> runtime (DecodeStep)
"""

__version__ = "0.1.0"
