"""Run a transport's own torch kernels (reductions, copies) on one thread, whatever the program's count.

With torch's default thread count (a thread per core: a launcher that does not set
``OMP_NUM_THREADS``) and ranks sharing a host's cores, every reduction or copy above torch's
grain size (32768 elements) opens an OpenMP parallel region. Its threads meet at a spinning
barrier and spin on after it (libgomp's ``GOMP_SPINCOUNT``), holding the core the peer rank
needs to produce what this rank waits for: a 256 KiB spmd-ucc all_reduce took 6 ms instead of
0.08 ms on 2 shared cores. A transport's progress code runs inside ``one_torch_thread()``.

With OpenMP (torch's CPU wheels) the block sets only the calling thread's OpenMP count
(``omp_set_num_threads``, which torch reads per thread), so no other thread of the program is
touched. Where that function cannot be found, or is not the one torch uses, it falls back to
``torch.set_num_threads``: also per thread, but it changes torch's process-wide default too, which a
thread reads at its first parallel op. Under torch's native thread pool the count is
process-wide and fixed once work has started, so the block does nothing there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import TracebackType

import torch

#: How to set the calling thread's count (None: not decided yet; see ``_setter``).
_set: Callable[[int], object] | None = None
_openmp: bool | None = None


def _uses_openmp() -> bool:
    """Whether torch's intra-op parallelism is OpenMP (computed once)."""
    global _openmp
    if _openmp is None:
        _openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _openmp


def _setter(current: int) -> Callable[[int], object]:
    """The OpenMP runtime's own ``omp_set_num_threads`` if it is torch's (checked once, with the
    calling thread at ``current`` > 1 threads), else ``torch.set_num_threads``."""
    global _set
    if _set is None:
        try:
            omp: Callable[[int], object] | None = ctypes.CDLL(None).omp_set_num_threads
        except (AttributeError, OSError):
            omp = None
        if omp is not None:
            omp(1)
            if torch.get_num_threads() != 1:  # another OpenMP runtime came first: not torch's
                omp = None
            else:
                omp(current)
        _set = omp if omp is not None else torch.set_num_threads
    return _set


class one_torch_thread:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with one_torch_thread():`` torch ops in this thread run serially; the thread's count is restored after."""

    __slots__ = ("_previous",)

    def __enter__(self) -> None:
        previous = torch.get_num_threads()  # also settles this thread's count (torch reads it lazily)
        if previous > 1 and _uses_openmp():
            (_set or _setter(previous))(1)
        else:
            previous = 1
        self._previous = previous

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._previous > 1:
            (_set or torch.set_num_threads)(self._previous)
