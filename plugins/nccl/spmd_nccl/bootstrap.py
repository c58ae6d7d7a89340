"""Making an ncclComm_t: rank 0's ncclUniqueId shared through the group's store, then waiting out
the non-blocking init, so that a rank that never arrives becomes a named timeout instead of a hang.
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta
from typing import Any

from spmd.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError
from spmd_nccl import library as nccl
from spmd_nccl.errors import NcclError

#: Store key (under the group's prefixed store) for rank 0's ncclUniqueId.
UNIQUE_ID_KEY = "nccl/unique_id"


def exchange_unique_id(lib: nccl.NcclLibrary, store: Any, rank: int, timeout: timedelta, group: str, key: str = UNIQUE_ID_KEY) -> nccl.ncclUniqueId:
    """Rank 0 makes the ncclUniqueId and publishes it in ``store``; the others read it.

    The value carries a one-byte tag: ``U`` + the 128-byte id, or ``E`` + rank 0's
    error, so a failure on rank 0 is reported on every rank instead of a timeout.
    """
    if rank == 0:
        try:
            uid = lib.unique_id()
        except nccl.NcclLibraryError as error:
            store.set(key, b"E" + str(error).encode())
            raise BackendUnavailableError(f"spmd-nccl: {error}") from error
        store.set(key, b"U" + bytes(uid))
        return uid
    try:
        store.wait([key], timeout)
    except RuntimeError as error:
        raise CollectiveTimeoutError(
            f"spmd-nccl: rank {rank} of group {group!r} waited {timeout.total_seconds():.1f} s for rank 0's NCCL "
            "unique id: rank 0 has not reached its first CUDA operation on this group (every rank of a group "
            f"must take part in its first CUDA op, which creates the NCCL communicator) [{error}]"
        ) from error
    data = bytes(store.get(key))
    if data[:1] == b"E":
        raise BackendUnavailableError(f"spmd-nccl: rank 0 of group {group!r} could not create the NCCL unique id: {data[1:].decode(errors='replace')}")
    if data[:1] != b"U" or len(data) != 1 + nccl.NCCL_UNIQUE_ID_BYTES:
        raise CollectiveError(f"spmd-nccl: the store key {key!r} of group {group!r} does not hold an NCCL unique id ({len(data)} bytes)")
    return nccl.ncclUniqueId.from_buffer_copy(data[1:])


def await_ready(lib: nccl.NcclLibrary, handle: ctypes.c_void_p, deadline: float, what: str) -> None:
    """Poll a new non-blocking communicator until it is ready; abort it at the deadline."""
    state = nccl.ncclResult_t()
    delay = 50e-6
    while True:
        result = lib.ncclCommGetAsyncError(handle, ctypes.byref(state))
        status = state.value if result == nccl.ncclSuccess else result
        if status == nccl.ncclSuccess:
            return
        if status != nccl.ncclInProgress:
            detail = lib.describe(status, handle)
            lib.ncclCommAbort(handle)
            raise NcclError(f"{what} failed: {detail}", status)
        if time.monotonic() >= deadline:
            lib.ncclCommAbort(handle)
            raise CollectiveTimeoutError(
                f"{what} did not finish in time: not every rank of the group reached its first CUDA operation "
                "(which creates the NCCL communicator); the half-made communicator was aborted"
            )
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)

