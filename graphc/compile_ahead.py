"""Compiling a build's CuTe DSL kernel variants ahead of its warm-up, in parallel processes.

A first build on a machine needs dozens of kernel variants (a decode GEMM per linear shape and
batch size, an AttnRes kernel per configuration, an attention kernel per batch size), each a
few seconds of Python tracing, MLIR passes and ptxas, all on one core. The warm-up would compile
them one after the other; instead ``graphc.build`` first asks every scheduled implementation
which variants its launches load (``Implementation.variants``), and the ones found in neither
compile cache (kernels/compile_cache.py) are compiled by worker processes into the disk cache
while the build loads its weights. The warm-up then loads them from disk. Nothing depends on
this step: a variant a worker could not compile is simply compiled by the warm-up in process,
which reports the real error.

The workers are fresh interpreters (``python -m graphc.compile_ahead``) with the parent's
environment and import path, so they generate the same cache keys. They are not
``multiprocessing`` children: those would re-import a user's script that calls
``graphc.build`` at top level without a ``__main__`` guard. Each reads one variant per line on
stdin and answers one line on stdout.

``GRAPHC_COMPILE_JOBS`` sets how many workers run (default: the CPU count, at most 8; 1 or 0
compiles in the warm-up as before). With the disk cache switched off
(``GRAPHC_KERNEL_CACHE=0``) there is nowhere to hand the objects back, so nothing runs ahead.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable, Iterator, Mapping

from .errors import GraphcError
from .kernels import weight_blocks

Variant = tuple[str, tuple]            # (kernel module, compile-cache key)

JOBS_ENV = "GRAPHC_COMPILE_JOBS"
MAX_DEFAULT_JOBS = 8                   # each worker holds the DSL and MLIR: ~0.5-1 GB of memory


def schedule_variants(schedules: Mapping, sms: int, blocked: Iterable[str] | None = None,
                      block_rows: int = weight_blocks.BLOCK) -> list[Variant]:
    """Every kernel variant the warm-up of these schedules (batch size -> Schedule) loads, each
    once, in the warm-up's order (largest batch first). ``sms``: the GPU's SM count, which the
    decode GEMM's partition depends on; ``blocked``: the weights stored in blocks of
    ``block_rows`` x 64 (default: those a build of these schedules that creates its weights
    stores so, ``plan.blocked_weights``), whose readers load a kernel compiled for that order."""
    from .plan import blocked_weights

    blocked = set(blocked_weights(schedules, sms, block_rows) if blocked is None else blocked)
    found: dict[Variant, None] = {}
    for batch in sorted(schedules, reverse=True):
        for k in schedules[batch].kernels:
            impl = k.op.implementations[k.impl]
            if impl.variants is not None:
                names = [name for name, _ in k.op.weight_shapes().values()]
                in_blocks = bool(names) and all(name in blocked for name in names)
                found.update(dict.fromkeys(impl.variants(k.op, batch, sms, block_rows if in_blocks else 0)))
    return list(found)


def kernel_cache(module: str):
    """The CompileCache of a kernel module (each has a ``compile_cache()``)."""
    return importlib.import_module(module).compile_cache()


def not_on_disk(variants: Iterable[Variant]) -> list[Variant]:
    """The variants whose compiled objects the disk cache does not hold."""
    return [(module, key) for module, key in variants if not kernel_cache(module).path(key).is_file()]


def uncached(variants: Iterable[Variant]) -> list[Variant]:
    """The variants found neither in this process's compile caches nor on disk."""
    return [(module, key) for module, key in not_on_disk(variants) if key not in kernel_cache(module)]


def default_jobs() -> int:
    text = os.environ.get(JOBS_ENV)
    if text:
        try:
            return max(int(text), 0)
        except ValueError:
            raise GraphcError(f"{JOBS_ENV}={text!r}: expected a number of processes, e.g. 4") from None
    return min(os.cpu_count() or 1, MAX_DEFAULT_JOBS)


@contextlib.contextmanager
def compiling_ahead(variants: Iterable[Variant], jobs: int | None = None,
                    progress: Callable[[str], None] = lambda s: None) -> Iterator[None]:
    """``compile_ahead`` in the background while the body runs (a build loads its weights
    meanwhile, which from a file takes longer than the compiles); waits for it on exit. If the
    body raises, the workers stop after the variant each is compiling. If compiling ahead
    fails (no worker could start, say), ``progress`` hears why and the warm-up compiles
    everything as it would without it."""
    jobs = default_jobs() if jobs is None else jobs     # a bad setting fails before the body runs
    stop = threading.Event()

    def run() -> None:
        try:
            compile_ahead(variants, jobs, progress, stop)
        except Exception as e:          # an optimisation only: never fail the build for it
            progress(f"compiling ahead failed ({type(e).__name__}: {e}); the warm-up compiles in process")

    thread = threading.Thread(target=run, name="graphc-compile-ahead", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join()


def compile_ahead(variants: Iterable[Variant], jobs: int | None = None,
                  progress: Callable[[str], None] = lambda s: None,
                  stop: threading.Event | None = None) -> list[Variant]:
    """Compile the uncached ``variants`` into the disk cache with up to ``jobs`` worker
    processes (None: ``default_jobs()``). Returns the variants now on disk. Does nothing with
    fewer than two to compile or fewer than two jobs: the warm-up compiles those in process.
    Once ``stop`` is set, no worker starts another variant."""
    from graphc.kernels.compile_cache import disk_cache_enabled

    jobs = default_jobs() if jobs is None else jobs
    todo = uncached(variants) if disk_cache_enabled() else []
    jobs = min(jobs, len(todo))
    if jobs < 2 or (stop is not None and stop.is_set()):
        return []
    t0 = time.perf_counter()
    progress(f"compiling {len(todo)} kernel variants in {jobs} processes "
             f"(cached on disk; {JOBS_ENV} sets how many)")
    pending: queue.Queue = queue.Queue()
    for variant in todo:
        pending.put(variant)
    done: list[Variant] = []
    lock = threading.Lock()

    def report(variant: Variant, answer: str) -> None:
        with lock:
            if answer.startswith("ok "):
                done.append(variant)
                kernel = variant[0].rsplit(".", 1)[-1]
                progress(f"[{len(done):3d}/{len(todo)}] {answer[3:].strip():>5s} s  {kernel} {variant[1]}")
            else:
                progress(f"could not compile {variant[0]} {variant[1]} ahead ({answer.strip()}); "
                         "the warm-up compiles it in process")

    workers: list[_Worker] = []
    try:
        for _ in range(jobs):
            workers.append(_Worker())
    except BaseException:
        for w in workers:               # no orphan left waiting on its stdin
            w.stop()
        raise
    threads = [threading.Thread(target=w.serve, args=(pending, report, stop or threading.Event()), daemon=True)
               for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    progress(f"compiled {len(done)} of {len(todo)} variants ahead in {time.perf_counter() - t0:.1f} s")
    return done


def compile_variants(variants: Iterable[Variant], jobs: int | None = None,
                     progress: Callable[[str], None] = lambda s: None) -> list[Variant]:
    """Every uncached variant into the disk cache: by worker processes where there are two or
    more to compile, then in this process whatever they left (one variant, ``jobs`` <= 1, or a
    worker's failure, whose real error then surfaces here). Returns those compiled."""
    from graphc.kernels.compile_cache import reporting_compiles

    todo = uncached(variants)
    compile_ahead(todo, jobs, progress)
    with reporting_compiles(progress):
        for module, key in uncached(todo):
            kernel_cache(module).get(key)
    return todo


class _Worker:
    """One ``python -m graphc.compile_ahead`` process, fed one variant at a time."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)   # import what we imported
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "graphc.compile_ahead"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def serve(self, pending: queue.Queue, report: Callable[[Variant, str], None], stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    variant = pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    self.proc.stdin.write(repr(variant) + "\n")
                    self.proc.stdin.flush()
                    answer = self.proc.stdout.readline()
                except OSError:
                    answer = ""
                if not answer:          # the worker died: say why and leave the rest to others
                    report(variant, f"worker exited: {self._log_tail()}")
                    return
                report(variant, answer)
        finally:
            self.stop()

    def _log_tail(self) -> str:
        self.proc.wait()
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        return f"exit status {self.proc.returncode}" + (f", {lines[-1]}" if lines else "")

    def stop(self) -> None:
        """Close its stdin (it exits after its current variant) and wait for it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()
        self.log.close()


def _serve() -> None:
    """The worker's side: compile each variant read from stdin into the disk cache and answer
    ``ok <seconds>`` or ``error <message>`` on the original stdout."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                       # whatever the compiler prints goes to the log, not the answers
    sys.stdout = sys.stderr
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        module, key = ast.literal_eval(line)
        t0 = time.perf_counter()
        try:
            cache = kernel_cache(module)
            cache.get(key)
            if not cache.path(key).is_file():
                raise RuntimeError(f"compiled, but not written: {cache.last_disk_error or cache.path(key)}")
            answers.write(f"ok {time.perf_counter() - t0:.1f}\n")
        except Exception as e:          # reported to the parent, which compiles it again in process
            answers.write(f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n")


if __name__ == "__main__":
    _serve()
