"""Run a transport's own torch kernels (reductions, copies) on one thread, whatever the program's count.

With torch's default thread count (a thread per core: a launcher that does not set
``OMP_NUM_THREADS``) and ranks sharing a host's cores, every reduction or copy above torch's
grain size (32768 elements) opens an OpenMP parallel region. Its threads meet at a spinning
barrier and spin on after it (libgomp's ``GOMP_SPINCOUNT``), holding the core the peer rank
needs to produce what this rank waits for: a 256 KiB spmd-ucc all_reduce took 6 ms instead of
77 us on 2 shared cores. A transport's progress code runs inside ``one_torch_thread()``.

With OpenMP (torch's CPU wheels) the count is the calling thread's, so the program's other
threads keep theirs; torch's process-wide default for threads that have not run a parallel op
yet reads 1 only inside the block. Under torch's native thread pool the count is process-wide
and fixed once work has started, so this does nothing there.
"""

from __future__ import annotations

from types import TracebackType

import torch

_openmp: bool | None = None


def _uses_openmp() -> bool:
    """Whether torch's intra-op parallelism is OpenMP (computed once)."""
    global _openmp
    if _openmp is None:
        _openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    return _openmp


class one_torch_thread:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with one_torch_thread():`` torch ops in this thread run serially; the thread's count is restored after."""

    __slots__ = ("_previous",)

    def __enter__(self) -> None:
        previous = torch.get_num_threads()
        if previous > 1 and _uses_openmp():
            torch.set_num_threads(1)
        else:
            previous = 1
        self._previous = previous

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._previous > 1:
            torch.set_num_threads(self._previous)
