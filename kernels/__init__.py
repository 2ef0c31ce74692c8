"""CuTe DSL kernels, imported as ``graphc.kernels``.

Importing this package does not import ``cutlass``: each kernel module does that itself,
so the CPU-only stages of graphc never pay for (or need) the DSL.
"""
