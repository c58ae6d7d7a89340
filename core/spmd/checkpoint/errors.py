"""The checkpoint's errors, below every module of the package (metadata, the untrusted-input checks, save, load)."""

from __future__ import annotations

from spmd.errors import SpmdError


class CheckpointError(SpmdError):
    """A checkpoint is missing, partial, damaged or unsafe, or does not match the state dict it is loaded into."""


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """A file a checkpoint names does not exist: a CheckpointError for its readers, and a FileNotFoundError
    (the Storage contract's "not there") for code that probes for a file, such as a save's claim."""
