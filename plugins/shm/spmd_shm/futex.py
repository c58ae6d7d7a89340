"""Sleep on a 32-bit word of shared memory until another process changes it (Linux futex via ctypes).

Elsewhere (or where the syscall is refused) ``wait`` falls back to a short ``time.sleep``: correct,
only slower to wake.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the PRIVATE variants: the word is shared between processes
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238, "riscv64": 98}.get(platform.machine())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None or os.environ.get("SPMD_SHM_NO_FUTEX"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


def _load_syscall_holding_gil():  # type: ignore[no-untyped-def]
    """The same syscall, called without releasing the GIL: for wakes, which never block (releasing
    and retaking the GIL around them let another thread in on every wake)."""
    if _syscall is None:
        return None
    fn = ctypes.PyDLL(None).syscall
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()
_syscall_gil = _load_syscall_holding_gil()
#: Whether waits really sleep on the word (False: polling with short sleeps).
AVAILABLE = _syscall is not None


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep until the int32 at ``address`` differs from ``expected``, a wake, or ``timeout`` seconds."""
    if _syscall is None:
        time.sleep(min(timeout, 200e-6))
        return
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address``."""
    if _syscall_gil is not None:
        _syscall_gil(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


def address(word: ctypes.c_int32) -> int:
    """The address of a ctypes word in the mapping (what the futex syscall takes)."""
    return ctypes.addressof(word)
