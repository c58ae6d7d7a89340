"""NcclError: a failed NCCL call as spmd's CollectiveError, with the ncclResult_t kept for callers."""

from __future__ import annotations

from spmd.errors import CollectiveError


class NcclError(CollectiveError):
    """NCCL returned an error; ``code`` is the ncclResult_t."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
