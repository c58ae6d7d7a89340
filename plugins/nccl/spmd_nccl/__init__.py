"""spmd-nccl: NCCL for CUDA tensors, through ctypes over the nvidia-nccl-cu12 wheel's libnccl.so.2.

Importing this module loads nothing: the library is found and loaded the first
time ``spmd doctor`` or ``spmd.init`` asks whether the backend is usable, and
the communicator is created on a group's first CUDA tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import spmd

#: Where a missing library or plugin comes from.
INSTALL = "pip install -e plugins/nccl (or: pip install 'spmd[nccl]'), which brings nvidia-nccl-cu12"


def library_summary() -> str:
    """``NCCL 2.x.y loaded from /path (how it was found)``, or why no library loads."""
    from spmd_nccl import library

    try:
        lib = library.load()
    except library.NcclLibraryError as error:
        return f"no NCCL library: {error}"
    return f"NCCL {lib.version_string} loaded from {lib.path} (via {lib.source})"


def _available() -> str | None:
    """None when NCCL loads and a CUDA device is visible; else the reason (with what to install)."""
    from spmd_nccl import library

    try:
        lib = library.load()
    except library.NcclLibraryError as error:
        return f"{error}. Install: {INSTALL}"
    where = f"NCCL {lib.version_string} loaded from {lib.path} (via {lib.source})"
    from spmd_nccl.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        return f"{where}, but no CUDA device is visible: {reason}"
    return None


def _factory(ctx: spmd.BackendContext) -> spmd.Backend:
    from spmd_nccl.backend import NcclBackend

    return NcclBackend(ctx)


@spmd.hookimpl
def spmd_backends() -> Iterable[spmd.BackendSpec]:
    return [
        spmd.BackendSpec(
            name="nccl",
            devices=("cuda",),
            factory=_factory,
            priority=50,
            available=_available,
            backend_class="spmd_nccl.backend:NcclBackend",
            description="NVIDIA NCCL through ctypes (no build step): " + library_summary(),
        )
    ]
