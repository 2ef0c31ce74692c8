"""A compile cache for CuTe DSL kernels: in process, then on disk, then compile.

Compiling one AttnRes variant takes a fraction of a second to a few seconds (Python tracing,
MLIR passes, NVVM, ptxas); a decode step needs dozens of variants, and every new process would
pay for all of them again. Two levels:

* **in process**: a dict from the static configuration to the compiled callable;
* **on disk**: CuTe DSL 4.8's ahead-of-time export. ``compiled.export_to_c(dir, name)`` writes
  an ELF object holding the host launch shim and the cubin, and
  ``cute.runtime.load_module(path)[name]`` loads it back as the same kind of callable, with no
  tracing and no GPU compilation. The file name is a hash of everything that decides the
  generated code: the source text of the kernel module (and of this file), the static
  parameters, the target architecture and the cutlass-dsl version. Editing the kernel therefore
  never loads a stale binary; it only leaves an orphan file behind.

Why not CuTe DSL's own file cache (``CUTE_DSL_CACHE_DIR``)? It is keyed by a hash of the traced
MLIR module, so every process still pays for tracing the kernel before it can look the cache
up, and it is switched off whenever PTX is kept (``--keep-ptx``), which our compile-only tests
need. The exported object skips both.

Writes are atomic (temporary file, then ``os.replace``), so processes that compile the same
variant at once never see a half-written object. Any failure to read or write the disk cache
falls back to compiling in process: the disk cache is an optimisation, never a requirement.
A failed write is still said (to whoever listens through ``reporting_compiles``) and kept in
``last_disk_error``, so that ``graphc compile``, whose whole job is the disk, can name it.
Set ``GRAPHC_KERNEL_CACHE=0`` to switch the disk level off, ``GRAPHC_CACHE_DIR`` to move it
(default ``~/.cache/graphc/kernels``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator

DISK_ENV = "GRAPHC_KERNEL_CACHE"
DIR_ENV = "GRAPHC_CACHE_DIR"
_THIS_SOURCE = Path(__file__).read_text()


def default_cache_dir() -> Path:
    root = os.environ.get(DIR_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "graphc" / "kernels"


def disk_cache_enabled() -> bool:
    return os.environ.get(DISK_ENV, "1").lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def _toolchain_fingerprint() -> str:
    """cutlass-dsl version and the architecture CuTe DSL compiles for."""
    import cutlass

    version = getattr(cutlass, "__version__", "unknown")
    arch = os.environ.get("CUTE_DSL_ARCH", "")
    if not arch:
        try:
            from cutlass.base_dsl import BaseDSL

            arch = str(BaseDSL._get_dsl().get_arch_enum())
        except Exception:  # pragma: no cover - depends on the installed DSL
            arch = "default"
    # The exported object links against the DSL's CUDA runtime shim (cu12 or cu13 build).
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        libs = ",".join(f"{Path(p).parent.parent.name}/{Path(p).name}" for p in CuTeDSL._get_dsl().get_shared_libs())
    except Exception:  # pragma: no cover - depends on the installed DSL
        libs = "unknown"
    return f"cutlass-dsl={version};arch={arch};libs={libs}"


# Who hears about compiles (not cache hits): a first build on a new machine compiles dozens of
# variants, seconds each, and should say so while it does (``reporting_compiles``).
_listeners: list[Callable[[str], None]] = []


@contextlib.contextmanager
def reporting_compiles(progress: Callable[[str], None]) -> Iterator[None]:
    """Within it, every kernel variant that has to be compiled (found in neither cache) is
    announced through ``progress`` before and after, with its compile time."""
    _listeners.append(progress)
    try:
        yield
    finally:
        _listeners.remove(progress)


def _announce(message: str) -> None:
    for listener in list(_listeners):
        listener(message)


class CompileCache:
    """Static configuration -> compiled CuTe DSL callable.

    ``build(*key)`` compiles one variant and returns the object ``cute.compile`` returned.
    ``source`` is the module (or its source text) whose code decides what ``build`` generates,
    or a tuple of them: the kernel's module and the helper modules it generates code from,
    so that an edit to a helper does not leave stale objects on disk.
    """

    def __init__(self, name: str, build: Callable[..., Any], source: Any, *, cache_dir: Path | str | None = None):
        self.name = name
        self._build = build
        sources = source if isinstance(source, tuple) else (source,)
        text = "".join(s if isinstance(s, str) else inspect.getsource(s) for s in sources)
        self._source_hash = hashlib.sha256((text + _THIS_SOURCE).encode()).hexdigest()
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._memory: dict[Hashable, Any] = {}
        self._executors: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.stats = {"memory_hits": 0, "disk_hits": 0, "compiles": 0, "disk_errors": 0}
        self.last_disk_error: str | None = None    # "<path>: <exception>" of the latest failure

    # -- keys and paths -------------------------------------------------------------------------
    @property
    def cache_dir(self) -> Path:
        return self._cache_dir if self._cache_dir is not None else default_cache_dir()

    def digest(self, key: tuple) -> str:
        text = f"{self.name}|{self._source_hash}|{_toolchain_fingerprint()}|{key!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, key: tuple) -> Path:
        return self.cache_dir / f"{self.name}-{self.digest(key)}.o"

    def _symbol(self, key: tuple) -> str:
        # The exported C symbols are prefixed with this; it must be a C identifier.
        return f"{self.name}_{self.digest(key)}"

    # -- lookup -----------------------------------------------------------------------------------
    def __contains__(self, key: tuple) -> bool:
        return key in self._memory

    def get(self, key: tuple) -> Any:
        fn = self._memory.get(key)
        if fn is not None:
            self.stats["memory_hits"] += 1
            return fn
        with self._lock:
            fn = self._memory.get(key)
            if fn is None:
                fn = self._load_or_build(key)
                self._memory[key] = fn
            return fn

    def on_device(self, key: tuple, device: int) -> Any:
        """The compiled kernel of ``key`` bound to GPU ``device``, to call with the kernel's
        arguments. Called directly, a compiled CuTe DSL function binds itself to the GPU of its
        first call and launches that GPU's kernel handles on any other (the DSL asks for one
        ``fn.to(device)`` per device); a step on cuda:1 after one on cuda:0 would fail. The
        module loads onto the device at the first call for that device, which the warm-up
        makes, outside any capture."""
        exe = self._executors.get((key, device))
        if exe is None:
            fn = self.get(key)
            with self._lock:
                exe = self._executors.get((key, device))
                if exe is None:
                    exe = self._executors[key, device] = fn.to(device) if hasattr(fn, "to") else fn
        return exe

    def clear_memory(self) -> None:
        """Forget the in-memory functions and executors (the disk cache stays). The next call
        of each kernel loads it again: warm up before capturing after this."""
        self._memory.clear()
        self._executors.clear()

    def _load_or_build(self, key: tuple) -> Any:
        use_disk = disk_cache_enabled()
        if use_disk:
            fn = self._load(key)
            if fn is not None:
                self.stats["disk_hits"] += 1
                return fn
        what = f"{self.name} {key}"
        _announce(f"compiling {what} (cached on disk afterwards)" if use_disk else f"compiling {what}")
        t0 = time.perf_counter()
        fn = self._build(*key)
        self.stats["compiles"] += 1
        _announce(f"compiled {self.name} in {time.perf_counter() - t0:.1f} s")
        if use_disk:
            self._store(key, fn)
        return fn

    def _load(self, key: tuple) -> Any | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(path))
            return module[self._symbol(key)]
        except Exception as e:          # unreadable or foreign object: compile it again
            self._disk_error(path, e)
            return None

    def _store(self, key: tuple, fn: Any) -> None:
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                fn.export_to_c(tmp, "kernel", function_prefix=self._symbol(key))
                staged = Path(tmp) / "kernel.o"
                os.replace(staged, path)
        except Exception as e:          # the kernel stays compiled in this process either way
            self._disk_error(path, e)
            _announce(f"could not write to the kernel cache: {self.last_disk_error} (the next process "
                      "that needs this kernel compiles it again)")

    def _disk_error(self, path: Path, error: Exception) -> None:
        self.stats["disk_errors"] += 1
        self.last_disk_error = f"{path}: {type(error).__name__}: {error}"
