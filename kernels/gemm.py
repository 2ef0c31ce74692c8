"""The decode GEMM op for Hopper (sm_90a): ``y[M, N] = x[M, K] @ W[N, K]^T``. DESIGN.md §3-§4.

bf16 in and out, fp32 accumulation, M from 1 to 256 (the captured batch size), K and N
multiples of 64 (kernels/gemm_contract.py), optionally with the ``silu_mul`` epilogue over
the two halves of a fused [gate; up] weight. ``linear`` checks a call and launches it;
``plan`` says which of two kernels runs it:

* kernels/gemm_stream_k.py (the default): W rows on wgmma's M side, K split between CTAs of a
  persistent grid so every SM streams the same weight bytes; what streams weights fastest at
  a few batch rows, and starts streaming them before ``griddepcontrol.wait`` under PDL.
* kernels/gemm_wide.py: for plain shapes from 116-128 batch rows whose whole-K output tiles
  fill the SMs' waves and their batch rows without re-reading more than twice W's bytes of x
  (on 132 SMs: qkv and lm_head at 116-128 rows, down at 128, all four at 231-256; qkv from
  205, where the stream-K kernel would split K): x as wgmma's A operand, W tiles sized so the
  tile count matches the SMs, no K split (bench/gemm_notes.md §21-§23, §45).

Both kernels keep the same PDL contract (DESIGN §4): only weight loads before the wait,
``launch_dependents`` at entry, a wait on every thread; the op's traits below are theirs.
Reasoning and numbers: bench/gemm_notes.md.
"""

from __future__ import annotations

import functools
import tempfile

from . import gemm_stream_k, gemm_wide, weight_blocks
from .gemm_contract import DEFAULT_SMS, EPILOGUES, MAX_M, check_shape  # noqa: F401  (the op's API)
from .gemm_stream_k import GemmConfig
from .workspaces import Workspaces

# PDL traits of this op, read by the scheduler (DESIGN §4): those of both kernels, which agree.
PROLOGUE_INPUTS = gemm_stream_k.PROLOGUE_INPUTS
WAITS = gemm_stream_k.WAITS
TRIGGER = gemm_stream_k.TRIGGER
assert (PROLOGUE_INPUTS, WAITS, TRIGGER) == (gemm_wide.PROLOGUE_INPUTS, gemm_wide.WAITS, gemm_wide.TRIGGER), \
    "the decode GEMM's two kernels must declare the same PDL traits"

# Every knob ``plan`` (and so ``linear``) accepts besides ``ctas``.
LINEAR_KNOBS = ("wide", *gemm_stream_k.TUNING_KNOBS,
                *(k for k in gemm_wide.TUNING_KNOBS if k not in gemm_stream_k.TUNING_KNOBS))


def plan(m: int, k: int, n: int, epilogue: str | None = None, ctas: int = DEFAULT_SMS, **tuning):
    """The kernel configuration ``linear`` runs for this call: the stream-K GemmConfig, or from
    WIDE_MIN_M batch rows on plain shapes the whole-K tiles of kernels/gemm_wide.py
    (``gemm_wide.default_applies``, which asks less of them where the stream-K kernel would
    split K). ``tuning``: ``wide`` (0 / 1: force one kernel), knobs of
    gemm_stream_k.TUNING_KNOBS (which imply the stream-K kernel) or of gemm_wide.TUNING_KNOBS (which imply
    the whole-K one; ``stages``, ``cluster``, ``x_trim`` and ``w_blocked`` belong to both and
    imply neither, though with W in blocks the whole-K tiles are the default at fewer shapes:
    ``gemm_wide.default_applies``)."""
    wide = tuning.pop("wide", None)
    stream_k_knobs = set(tuning) - set(gemm_wide.TUNING_KNOBS)
    wide_only_knobs = set(tuning) - set(gemm_stream_k.TUNING_KNOBS)
    if wide is None:
        wide = int(bool(wide_only_knobs))
        if not wide and not stream_k_knobs:
            default = GemmConfig(m, k, n, epilogue, ctas)
            # Up to one whole-K batch tile's rows, one whole-K unit per CTA, where it applies,
            # beats the whole-K tiles too (o_proj at 128 rows: 36.4 against 40.3 µs,
            # bench/gemm_notes.md §23); above, the tiles take the rows where their own rule
            # holds (down at 256: 114.5 against 126.6 µs for the units).
            if not (default.unit_per_cta and m <= gemm_wide.MAX_BATCH_TILE):
                wide = int(gemm_wide.default_applies(m, k, n, epilogue, ctas, against_split=default.max_segs > 1,
                                                     w_blocked=bool(tuning.get("w_blocked"))))
    if wide not in (0, 1):
        raise ValueError(f"wide={wide} unsupported: 0 or 1")
    if wide:
        if stream_k_knobs:
            raise ValueError(f"{', '.join(sorted(stream_k_knobs))}: knobs of the stream-K kernel, not of wide=1")
        check_shape(m, k, n, epilogue)
        return gemm_wide.WideGemmConfig(m, k, n, ctas, epilogue, **tuning)
    if wide_only_knobs:
        raise ValueError(f"{', '.join(sorted(wide_only_knobs))}: knobs of wide=1 only")
    return GemmConfig(m, k, n, epilogue, ctas, **tuning)


def cache_of(cfg):
    """The compile cache that holds ``cfg``'s kernel (``plan``'s two kernels have one each)."""
    return gemm_wide.compile_cache() if isinstance(cfg, gemm_wide.WideGemmConfig) else gemm_stream_k.compile_cache()


def reads_blocks(m: int, k: int, n: int, epilogue: str | None = None, ctas: int = DEFAULT_SMS) -> bool:
    """Whether the default for this call reads the weight in blocks (kernels/weight_blocks.py)
    at least as fast as in rows: where the blocks leave ``plan``'s choice of kernel as it is.
    Both kernels read blocks (the stream-K one in 64-row boxes, 2-7% faster than rows; the
    whole-K tiles of gemm_wide.py in 16-row pieces, faster only with tiles of a multiple of 32
    rows, bench/gemm_notes.md §34). Where the whole-K tiles with 80 or 112 rows run on rows
    (qkv at 116-128 rows, down at 128 and 231-256, o_proj at 231-256), blocks would hand the call to the
    stream-K kernel, measured up to 5% slower there than those tiles on rows. A build stores a
    weight in blocks only where this holds at every batch size it captures (graphc/plan.py)."""
    if not weight_blocks.blockable((n, k)):
        return False
    rows = _config(m, k, n, epilogue, ctas, ())
    return type(_config(m, k, n, epilogue, ctas, (("w_blocked", 1),))) is type(rows)


def _order_knobs(block_rows: int) -> tuple:
    """The tuning that says W's memory order: () for row-major, else w_blocked (and
    w_block_rows where the blocks are not of the default rows), as ``plan`` takes them."""
    if not block_rows:
        return ()
    return (("w_blocked", 1),) + ((("w_block_rows", int(block_rows)),) if block_rows != weight_blocks.BLOCK else ())


def weight_order_knobs(weight) -> tuple:
    """``_order_knobs`` of a weight tensor: row-major [N, K], or its blocks (4-D)."""
    return _order_knobs(weight_blocks.block_rows(weight) if weight_blocks.is_blocked(weight) else 0)


def compiled_variant(m: int, k: int, n: int, epilogue: str | None = None, ctas: int = DEFAULT_SMS,
                     w_block_rows: int = 0, **tuning) -> tuple[str, tuple]:
    """(kernel module, compile-cache key) of the kernel ``linear`` loads for this call on
    ``ctas`` SMs, the weight row-major (``w_block_rows`` 0) or in blocks of that many rows, with
    default tuning or ``tuning`` (``plan``'s knobs, as ``linear`` passes them), so that a build
    or a benchmark can compile it ahead (graphc/compile_ahead.py)."""
    cfg = _tuned_config(m, k, n, epilogue, ctas, tuning, _order_knobs(w_block_rows))
    module = (gemm_wide if isinstance(cfg, gemm_wide.WideGemmConfig) else gemm_stream_k).__name__
    return module, cfg.key()


def _tuned_config(m: int, k: int, n: int, epilogue: str | None, ctas: int, tuning: dict, order: tuple):
    """``plan`` with these knobs and the weight order's (``_order_knobs``), cached per call shape."""
    return _config(m, k, n, epilogue, ctas, tuple(sorted({**tuning, **dict(order)}.items())))


@functools.lru_cache(maxsize=None)
def _config(m: int, k: int, n: int, epilogue: str | None, ctas: int, tuning: tuple):
    return plan(m, k, n, epilogue, ctas, **dict(tuning))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device) -> int:
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = torch.cuda.get_device_properties(idx).multi_processor_count
        _SM_COUNT[idx] = n
    return n


def compile_linear(m: int, k: int, n: int, epilogue: str | None = None, *, ctas: int = DEFAULT_SMS,
                   options: str | None = None, **tuning):
    """The compiled stream-K kernel (kernels/gemm_stream_k.py) for one static configuration.
    Without ``options`` it comes from the compile cache (in process, then on disk); with
    options (e.g. ``--keep-ptx --dump-dir D``) it is compiled afresh, so ``.__ptx__`` is there.
    Works without a GPU when ``CUTE_DSL_ARCH=sm_90a``. ``ctas`` is the persistent grid: the
    device's SM count; ``tuning`` sets knobs of its TUNING_KNOBS for the benchmark (unset: the
    defaults)."""
    return gemm_stream_k.compile_stream_k(GemmConfig(m, k, n, epilogue, ctas, **tuning), options)


def linear_ptx(m: int, k: int, n: int, epilogue: str | None = None, *, ctas: int = DEFAULT_SMS,
               **tuning) -> str:
    """PTX text of one stream-K configuration (compiled afresh with --keep-ptx, not cached)."""
    with tempfile.TemporaryDirectory() as dump_dir:
        return compile_linear(m, k, n, epilogue, ctas=ctas,
                              options=f"--keep-ptx --dump-dir {dump_dir}", **tuning).__ptx__



# ------------------------------------------------------------------------------------------------
# Torch entry point.
# ------------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, shape: tuple, device) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (TMA needs it)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like weight")


def validate(x, weight, out, epilogue: str | None = None) -> tuple[int, int, int]:
    """Check a ``linear`` call; returns (M, K, N). Raises ValueError naming the rule. The
    weight is W [N, K] row-major, or its blocks [N/64, K/64, 64, 64] (kernels/weight_blocks.py)."""
    import torch

    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 4):
        raise ValueError("weight must be a 2-D [N, K] tensor, or its [N/64, K/64, 64, 64] blocks "
                         "(kernels/weight_blocks.py)")
    if weight.dim() == 4 and (weight.shape[2] not in weight_blocks.ROW_BLOCKS or weight.shape[3] != weight_blocks.BLOCK):
        raise ValueError(f"blocked weight must have shape [N/64, K/64, 64, 64] (or [N/16, K/64, 16, 64]), "
                         f"got {list(weight.shape)}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D [M, K] tensor")
    n, k = weight_blocks.matrix_shape(weight)
    m = x.shape[0]
    check_shape(int(m), int(k), int(n), epilogue)
    device = weight.device
    if device.type != "cuda":
        raise ValueError(f"tensors must be on a CUDA device, got {device}")
    n_out = n // 2 if epilogue == "silu_mul" else n
    _check_tensor("weight", weight, tuple(weight.shape), device)
    _check_tensor("x", x, (m, k), device)
    _check_tensor("out", out, (m, n_out), device)
    return int(m), int(k), int(n)


def linear(x, weight, out, *, epilogue: str | None = None, stream=None, use_pdl: bool = True,
           workspaces: Workspaces | None = None, ctas: int | None = None, **tuning) -> None:
    """``out = x @ weight.T`` (bf16 in/out, fp32 accumulation), or with ``epilogue="silu_mul"``
    ``out = silu(g) * u`` where ``[g | u] = x @ weight.T`` split in halves (weight is the fused
    [gate; up] matrix). Launches on ``stream`` (default: the current stream at call time) with
    the PDL attribute when ``use_pdl``. Capturable in a CUDA graph once it has been called
    outside capture for this shape (that first call allocates the split-K workspace or loads
    the kernel). ``workspaces``: whose split-K workspace it uses (kernels/workspaces.py; default
    the process's shared one, which suits launches on one stream).
    ``weight`` is W [N, K] row-major or, faster, its blocks from kernels/weight_blocks.py
    (``to_blocks``), which both of ``plan``'s kernels read.
    ``ctas`` (the persistent grid; None: one CTA per SM) and ``tuning`` (``plan``'s knobs) are
    for the benchmark (bench/gemm.py); leave them unset. Which kernel runs: ``plan``."""
    import torch

    m, k, n = validate(x, weight, out, epilogue)
    device = weight.device
    for knob in ("w_blocked", "w_block_rows"):
        if knob in tuning:
            raise ValueError(f"linear: {knob} follows from the weight's shape (4-D: blocks); do not pass it")
    # Knobs of both kernels (plan weighs w_blocked in choosing between them).
    order = weight_order_knobs(weight)
    cfg = _tuned_config(m, k, n, epilogue, ctas or _sm_count(device), tuning, order)
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if isinstance(cfg, gemm_wide.WideGemmConfig):
        # No workspace to allocate, but loading the kernel does not belong in a capture either.
        if cfg.key() not in gemm_wide.compile_cache() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"linear: first call of {cfg} happened during CUDA graph capture; call "
                               "it once before capturing (warm-up) so its kernel is loaded outside the graph")
        gemm_wide.launch(cfg, x, weight, out, stream, use_pdl)
        return
    gemm_stream_k.launch(cfg, x, weight, out, stream, use_pdl, workspaces)
