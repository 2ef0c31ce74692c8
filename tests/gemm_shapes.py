"""The decode GEMM shapes of the shipped specs, shared by the compile-only and GPU tests."""

# (K, N, epilogue): Kimi K3 (hidden 7168) and tiny.yaml (hidden 1024, intermediate 2816).
BIG_SHAPES = [
    (7168, 36864, "silu_mul"),   # gate_up
    (18432, 7168, None),         # down
    (7168, 10240, None),         # qkv
    (8192, 7168, None),          # o_proj
]
TINY_SHAPES = [
    (1024, 1536, None),
    (1024, 5632, "silu_mul"),
    (2816, 1024, None),
    (1024, 1024, None),
]
SPEC_SHAPES = BIG_SHAPES + TINY_SHAPES
