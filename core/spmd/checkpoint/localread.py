"""Opening a file inside a local checkpoint directory as untrusted input: no symbolic links, no blocking.

Each component below the root is opened relative to its parent
(``openat``) with ``O_NOFOLLOW``, the file itself with ``O_NONBLOCK`` too,
and ``fstat`` on the opened descriptor must say regular file: a link out of
the directory, a FIFO or a device is an error before a byte is read. The
root itself is the user's choice and may be a link.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

from spmd.checkpoint.metadata import CheckpointError, CheckpointFileMissing
from spmd.checkpoint.untrusted import check_range

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
_OPENAT = os.open in os.supports_dir_fd and bool(_NOFOLLOW)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refused(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where} is {what}; a checkpoint's files are read only as regular files inside its directory "
        "(no links, pipes or devices), so it is refused"
    )


def _missing(where: str) -> CheckpointError:
    return CheckpointFileMissing(f"{where} does not exist; the checkpoint is incomplete or damaged")


def _open_at(dir_fd: int, name: str, flags: int, where: str) -> int:
    try:
        return os.open(name, flags | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _missing(where) from None
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise CheckpointError(f"{where} cannot be opened: {error.strerror}") from None
        try:
            mode = os.lstat(name, dir_fd=dir_fd).st_mode
        except OSError:
            raise _refused(where, "not a regular file") from None
        raise _refused(where, _kind(mode)) from None


def _open_checked(root: str, parts: Sequence[str], where: str) -> int:
    """Without ``openat`` (Windows): every component is checked with ``lstat`` before the open."""
    path = root
    for part in parts:
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise _missing(where) from None
        if stat.S_ISLNK(mode):
            raise _refused(where, "a symbolic link")
    try:
        return os.open(path, os.O_RDONLY | _BINARY | _NONBLOCK)
    except OSError as error:
        raise CheckpointError(f"{where} cannot be opened: {error.strerror}") from None


def open_regular(root: str, parts: Sequence[str], where: str) -> tuple[int, int]:
    """A read-only descriptor of the regular file ``root/parts...`` and its size; never follows a link below ``root``."""
    if not _OPENAT:
        fd = _open_checked(root, parts, where)
    else:
        try:
            dir_fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        except FileNotFoundError:
            raise _missing(where) from None
        except OSError as error:
            raise CheckpointError(f"{where}: the checkpoint directory cannot be opened: {error.strerror}") from None
        try:
            for part in parts[:-1]:
                inner = _open_at(dir_fd, part, os.O_RDONLY | _DIRECTORY, where)
                os.close(dir_fd)
                dir_fd = inner
            fd = _open_at(dir_fd, parts[-1], os.O_RDONLY | _NONBLOCK, where)
        finally:
            os.close(dir_fd)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refused(where, _kind(info.st_mode))
    return fd, info.st_size


def pread_exact(fd: int, size: int, offset: int, out: memoryview, where: str) -> None:
    """Fill ``out`` from ``offset`` of the ``size``-byte file ``fd``; a range outside the file is an error, not a read."""
    length = out.nbytes
    check_range(where, size, offset, length)
    done = 0
    while done < length:
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{where} ends before byte {offset + length} (it shrank while read)")
        done += n
