"""Model weights by node name: seeded random initialisation or a safetensors file.

Names follow the graph (``L03.attn.qkv.weight``, ``L03.attn_res.mlp.query``, ``embed.weight``);
``graphc build SPEC --write-weight-names FILE`` lists them with their shapes. Nothing is
ever fetched from a network.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
import zlib
from pathlib import Path
from typing import Iterator, Mapping

import torch

from .errors import GraphcError
from .files import replace_file
from .kernels import weight_blocks


class Weights:
    """Every weight of one model, bf16, on one device. Read-only during a step.

    A matrix is stored row-major [N, K], or in 64 x 64 blocks [N/64, K/64, 64, 64]
    (kernels/weight_blocks.py), the order the decode GEMM streams fastest: a build on a GPU
    stores there the weights that only such kernels read (graphc/plan.py, ``blocked_weights``).
    ``tensors`` holds what is stored; ``matrix`` gives a weight back as [N, K] whatever its
    order. Once a build has captured kernels that read a weight row-major, it can no longer
    go to blocks (``pinned_rows``): another build sharing this object must not change the
    memory under the first one's graphs.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], origin: str):
        self.tensors = tensors
        self.origin = origin
        self.pinned_rows: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        """The stored tensor (blocks for a blocked weight; ``matrix`` for [N, K])."""
        try:
            return self.tensors[name]
        except KeyError:
            near = difflib.get_close_matches(str(name), self.tensors, n=3)
            raise GraphcError(f"no weight named {name!r}"
                              + (f"; did you mean {', '.join(near)}?" if near else
                                 f" ({len(self.tensors)} weights, e.g. {next(iter(self.tensors), '-')})")) from None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def shape(self, name: str) -> tuple[int, ...]:
        """The weight's shape as the model has it ([N, K] also when stored in blocks)."""
        t = self[name]
        return weight_blocks.matrix_shape(t) if weight_blocks.is_blocked(t) else tuple(t.shape)

    def is_blocked(self, name: str) -> bool:
        return weight_blocks.is_blocked(self[name])

    def blocked(self) -> set[str]:
        """Names of the weights stored in blocks."""
        return {name for name, t in self.tensors.items() if weight_blocks.is_blocked(t)}

    def matrix(self, name: str) -> torch.Tensor:
        """The weight as the model has it: the stored tensor, or a row-major copy of blocks."""
        return weight_blocks.as_matrix(self[name])

    def check(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> None:
        """Refuse these weights for a model of ``shapes`` on ``device`` unless every weight is
        there, bf16, dense and contiguous on that device, with its shape, and nothing else is:
        a kernel would otherwise read them wrongly or fail only at the step's first call, and
        weights the model does not have mean another model's (as a weights file's extra names
        do, ``_checked_file``)."""
        extra = sorted(set(self.tensors) - set(shapes))
        if extra:
            raise GraphcError(f"weights ({self.origin}): {len(extra)} not in the spec ({_few(extra)}), so they "
                              f"are probably another model's (graphc build SPEC --write-weight-names FILE "
                              f"lists the spec's)")
        for name, shape in shapes.items():
            t = self.tensors.get(name)
            if t is None:
                raise GraphcError(f"weight {name}: missing from the Weights given ({self.origin})")
            if not isinstance(t, torch.Tensor):
                raise GraphcError(f"weight {name}: expected a tensor, found {type(t).__name__}")
            if self.shape(name) != tuple(shape):
                raise GraphcError(f"weight {name}: expected shape {list(shape)}, found {list(self.shape(name))}")
            if t.dtype != torch.bfloat16:
                raise GraphcError(f"weight {name}: expected bfloat16, found {t.dtype}")
            if t.layout != torch.strided or not t.is_contiguous():
                raise GraphcError(f"weight {name}: expected a dense contiguous tensor (kernels read it "
                                  f"as stored), found {'a ' + str(t.layout) if t.layout != torch.strided else 'strides ' + str(t.stride())}")
            if t.device.type != device.type or device.index not in (None, t.device.index):
                raise GraphcError(f"weight {name}: on {t.device}, the step runs on {device}")

    def row_major(self) -> "Weights":
        """These weights with every one in blocks copied back to [N, K] (the others shared, not
        copied): for plans whose cuBLAS or torch kernels read them row-major beside a step that
        reads them in blocks (tools, tests)."""
        if not self.blocked():
            return self
        return Weights({name: self.matrix(name) for name in self.tensors}, f"{self.origin}, row-major")

    def store_blocked(self, names, rows: int = weight_blocks.BLOCK) -> None:
        """Store these weights in blocks of ``rows`` x 64, each in its own memory (a few MB of
        temporaries)."""
        for name in sorted(names):
            if name in self.pinned_rows:
                raise GraphcError(f"weight {name}: a build sharing these weights reads it row-major, "
                                  f"so it cannot be stored in blocks now")
            if not self.is_blocked(name):
                self.tensors[name] = weight_blocks.to_blocks_(self.tensors[name], rows)

    def copy_in(self, name: str, value: torch.Tensor) -> None:
        """Overwrite a weight in place with ``value`` as the model has it ([N, K]), in the
        order it is stored."""
        t = self.tensors[name]
        if weight_blocks.is_blocked(t):
            value = weight_blocks.to_blocks(value, weight_blocks.block_rows(t))
        t.copy_(value)

    @classmethod
    def random(cls, shapes: Mapping[str, tuple[int, ...]], seed: int = 0,
               device: str | torch.device = "cpu") -> "Weights":
        layers = len({name.split(".", 1)[0] for name in shapes if _LAYER.match(name)})
        tensors = {name: _random_weight(name, shape, seed, torch.device(device), layers)
                   for name, shape in shapes.items()}
        return cls(tensors, f"random(seed={seed})")

    @classmethod
    def load(cls, path: str | Path, shapes: Mapping[str, tuple[int, ...]],
             device: str | torch.device = "cpu") -> "Weights":
        return cls(dict(read_weights(path, shapes, device)), str(path))

    def save(self, path: str | Path) -> None:
        """Write every weight to a safetensors file at ``path`` (replacing a file there, whatever
        it holds, but only once the whole file is written: graphc/files.py)."""
        from safetensors.torch import save_file

        # Files hold [N, K]: blocks are put back in rows on the host (no GPU copy of a weight).
        tensors = {k: weight_blocks.as_matrix(v.cpu()).contiguous() for k, v in self.tensors.items()}
        replace_file(path, lambda tmp: save_file(tensors, str(tmp)), "weights file")

    def check_values(self) -> None:
        """Refuse these weights if any value is NaN or Inf, as a weights file is refused when it
        loads: such a weight would only show up as NaN logits. Each tensor is tested where it is
        (one pass over its bits, a chunk at a time)."""
        for name, t in self.tensors.items():
            _refuse_non_finite(f"weights ({self.origin})", name, t)


# safetensors' dtype names -> torch's, for error messages.
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64",
                       "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_weights(path: str | Path, shapes: Mapping[str, tuple[int, ...]],
                 device: str | torch.device = "cpu", check_values: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a safetensors file, one tensor at a time on ``device``, after checking
    every name, dtype and shape against ``shapes`` from the file's header: a file with the
    wrong names or shapes is refused before any tensor is read, and a caller that copies each
    tensor into place (a reload) never holds more than one extra tensor (the 93-layer model's
    weights are 103 GB). A tensor holding NaN or Inf is refused when it is read: such a weight
    would only show up as NaN logits (``check_values=False``: not checked, for a second pass
    over a file already checked)."""
    with _checked_file(path, shapes, device) as f:
        for name in shapes:
            t = f.get_tensor(name).contiguous()
            if check_values:
                _refuse_non_finite(path, name, t)
            yield name, t


def check_finite_weights(path: str | Path, shapes: Mapping[str, tuple[int, ...]],
                         on: torch.device | None = None) -> None:
    """Read every weight of the file once on the host and refuse it if any value is NaN or Inf,
    keeping none of them. ``on`` (a GPU): the values are tested there, a chunk at a time, and
    on the host once that GPU has no room for a chunk (an H200 machine reloading 13 GB: 4.2 s
    in all testing on its GPU, 10-11 s testing on its host, 1.7-2.1 s without the test)."""
    for name, t in read_weights(path, shapes, "cpu", check_values=False):
        try:
            _refuse_non_finite(path, name, t, on)
        except torch.cuda.OutOfMemoryError:      # a reload must work on a full GPU
            on = None
            _refuse_non_finite(path, name, t)


# Elements tested at a time: the test's temporaries (96 MB at this size) stay inside the
# workspace a build reserves beside the weights, even for the 2.35 GB lm_head on a full GPU.
_FINITE_CHUNK = 1 << 25


def _refuse_non_finite(path, name: str, t: torch.Tensor, on: torch.device | None = None) -> None:
    # bf16 NaN and Inf are exactly the values whose 8 exponent bits are all ones; testing the
    # bits reads the tensor once, without a float copy of it. ``on``: each chunk is tested
    # there (a copy of one chunk, not of the tensor).
    bits = t.contiguous().view(-1).view(torch.int16)
    count, first_flat = 0, None
    for start in range(0, bits.numel(), _FINITE_CHUNK):
        chunk = bits[start:start + _FINITE_CHUNK]
        bad = ((chunk if on is None else chunk.to(on)) & 0x7F80) == 0x7F80
        found = int(bad.sum())
        if found and first_flat is None:
            first_flat = start + int(bad.nonzero()[0])
        count += found
    if count:
        first = tuple(int(i) for i in torch.unravel_index(torch.tensor(first_flat), t.shape))
        raise GraphcError(f"{path}: {name}: {count} value{'s' if count != 1 else ''} NaN or Inf "
                          f"(the first at index {list(first)}, {float(t[first])})")


def check_weights(path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a weights file that ``read_weights`` would refuse, reading only its header."""
    with _checked_file(path, shapes, "cpu"):
        pass


@contextlib.contextmanager
def _checked_file(path, shapes, device):
    """The open safetensors file, once its header names every weight of ``shapes`` with its
    shape as bfloat16 and nothing else."""
    from safetensors import SafetensorError, safe_open

    if not isinstance(path, (str, os.PathLike)):
        raise GraphcError(f"weights: expected the path of a .safetensors file, found "
                          f"{type(path).__name__} {path!r:.60}")
    if not os.fspath(path):
        raise GraphcError("weights: an empty path (give the .safetensors file)")
    path = Path(path)
    if path.is_dir():
        raise GraphcError(f"{path}: a folder, not a weights file (give the .safetensors file)")
    if not path.is_file():
        raise GraphcError(f"{path}: no such weights file")
    if not os.access(path, os.R_OK):    # safetensors reports this as "No such file or directory"
        raise GraphcError(f"{path}: this user cannot read the weights file (permission denied)")
    try:
        f = safe_open(str(path), framework="pt", device=str(device))
    except (SafetensorError, OSError) as e:
        raise GraphcError(f"{path}: not a readable safetensors file ({e})") from None
    with f:
        names = set(f.keys())
        missing = sorted(set(shapes) - names)
        extra = sorted(names - set(shapes))
        if missing or extra:
            problems = ([f"missing {_few(missing)}"] if missing else []) + \
                       ([f"not in the spec {_few(extra)}"] if extra else [])
            # Names that match but with other shapes say the file is another model's.
            found = {n: list(f.get_slice(n).get_shape()) for n in sorted(names & set(shapes))}
            other = [n for n, shape in found.items() if shape != list(shapes[n])]
            if other:
                problems.append(f"{len(other)} of the names in both have other shapes (e.g. {other[0]}: "
                                f"{found[other[0]]}, the spec needs {list(shapes[other[0]])}), so the file "
                                f"is probably for another model")
            raise GraphcError(f"{path}: weight names do not match the spec: {'; '.join(problems)} "
                              f"(graphc build SPEC --write-weight-names FILE lists them)")
        for name, shape in shapes.items():
            header = f.get_slice(name)
            dtype, found = header.get_dtype(), list(header.get_shape())
            if found != list(shape) or dtype != "BF16":
                raise GraphcError(f"{path}: {name}: expected bfloat16 {list(shape)}, "
                                  f"found {_SAFETENSORS_DTYPES.get(dtype, dtype)} {found}")
        yield f


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# A decoder layer's weights are named L<layer>.<...>; the projections that write a layer's
# output back into the residual stream (attention's o_proj and the MLP's down).
_LAYER = re.compile(r"L\d+\.")
_RESIDUAL_BRANCH_OUTPUTS = (".attn.o_proj.weight", ".mlp.down.weight")


def random_init_temporary_bytes(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The peak of temporaries while ``Weights.random`` creates these weights: one fp32 draw
    of the largest (``_random_weight`` works in place on it)."""
    return 4 * max(math.prod(shape) for shape in shapes.values())


def _random_weight(name: str, shape: tuple[int, ...], seed: int, device: torch.device, layers: int = 1):
    """Sized so activations stay O(1) through every layer and one bf16 rounding difference stays
    small at the logits (bench/perturbation.py measures it; bench/step_notes.md):

    * linear weights N(0, 1/K), except the residual-branch outputs (o_proj, down), which get a
      further 1/sqrt(2 x layers) as in GPT-2's initialisation, so each layer adds a small
      update instead of replacing the stream;
    * norm weights near 1;
    * AttnRes queries giving pseudo-logits of order 0.5: a softmax over the blocks that is
      smooth rather than nearly one-hot, so a one-ulp change in a key cannot swing the mix.

    With 8 layers this moves the logits ~2.5x less under a one-ulp flip of one op's outputs
    than plain N(0, 1/K) with sharper queries did (1.2-1.8e-2 -> 5-7e-3).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    # In place: the fp32 draw is the only temporary (4 bytes per element: 4.7 GB for a
    # 163840 x 7168 lm_head), the same values as the out-of-place expressions.
    values = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("norm", "key_norm"):
        values.mul_(0.1).add_(1.0)
    elif leaf == "query":
        values.mul_(0.45 / math.sqrt(shape[0]))
    elif name == "embed.weight":
        pass
    elif name.endswith(_RESIDUAL_BRANCH_OUTPUTS):
        values.div_(math.sqrt(shape[-1] * 2 * max(layers, 1)))
    else:                      # linear [N, K]
        values.div_(math.sqrt(shape[-1]))
    return values.to(torch.bfloat16)
