"""One thread for a process's model passes on CPU.

torch's CPU kernels run on OpenMP (libgomp in the Linux wheels), which keeps a team of
worker threads for every thread that has run a parallel region. Once the teams together
hold more threads than the machine has CPUs, libgomp cuts its idle threads' spin-wait to
about 100 spins, so between two parallel regions they sleep, and every region (each op of
a pass) pays for waking them. A process that loads the model on one thread and runs its
passes on another (an event loop handing passes to a worker) holds two teams. Measured
here (2 cores, the bundled model in float32, 32 sequences of one token after 100 each):
76-79 ms a pass with one team, 109-117 ms once a second thread had run torch (CPU time
over wall time 1.4 instead of 2.0); the passes of a running engine took 1.4-2.0x as long as
the same passes replayed on the loading thread (the longer, the more it had drafted).

So every pass of a process runs on one thread (`cpu_worker`), and a thread that has
loaded or packed a model frees its team (`release_openmp_threads`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
from typing import Callable, TypeVar

import torch  # noqa: F401 (loads the OpenMP runtime that `_openmp_runtime` looks for)

T = TypeVar("T")

_lock = threading.Lock()
_worker: concurrent.futures.ThreadPoolExecutor | None = None
_on_worker = threading.local()
_runtime: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: none found
# OpenMP 5.0's omp_pause_soft (libgomp frees the calling thread's team for either kind).
_OMP_PAUSE_SOFT = 1


def cpu_worker() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one thread for model passes: the verifier engine's and those of
    proposers running in the same process. Passes on 2 cores cannot usefully overlap,
    and one thread keeps one OpenMP team."""
    global _worker
    with _lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="splitspec-model",
                initializer=lambda: setattr(_on_worker, "yes", True))
        return _worker


def on_cpu_worker() -> bool:
    """Whether the calling thread is `cpu_worker`'s."""
    return getattr(_on_worker, "yes", False)


def run_on_cpu_worker(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on `cpu_worker`, waiting for it (directly when already there)."""
    if on_cpu_worker():
        return fn(*args)
    return cpu_worker().submit(fn, *args).result()


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's), found in /proc/self/maps so
    that it is the same library torch calls, whatever its file is named."""
    global _runtime
    if _runtime is False:
        _runtime = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "/lib" in line and ".so" in line}
        except OSError:
            return None
        for name in ("libgomp", "libiomp5", "libomp"):
            for path in sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(name)):
                try:
                    lib = ctypes.CDLL(path)
                    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                    _runtime = lib
                    return lib
                except (OSError, AttributeError):
                    continue
    return _runtime


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP team, if it has one (it comes back should this
    thread run a parallel region again). Cheap without a team: the engine calls it on its
    event loop's thread every step. False when no OpenMP runtime with
    `omp_pause_resource_all` is loaded, or the thread is inside a parallel region."""
    if on_cpu_worker():
        return False
    lib = _openmp_runtime()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
