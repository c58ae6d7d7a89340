"""CUDA-side helpers the backend needs besides NCCL: is a device visible, which device is current,
and the thread-local stream-capture mode that lets background threads query events during a capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device is visible to torch, else why not (and what to install)."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch"
        return "torch.cuda.is_available() is False (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them; check nvidia-smi)"
    return None


# -- background threads and CUDA graphs ---------------------------------------------------
_CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal
_thread_state = threading.local()


@functools.cache
def _capture_mode_exchange() -> Callable[..., int] | None:
    """``cudaThreadExchangeStreamCaptureMode`` of the CUDA runtime torch already loaded, if found."""
    for soname in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        try:
            fn = runtime.cudaThreadExchangeStreamCaptureMode
        except AttributeError:
            continue
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        return fn
    return None


def allow_queries_during_other_threads_captures() -> None:
    """Give this (background) thread the thread-local capture interaction mode, once.

    A thread in the default (global) mode that queries an event while another
    thread captures a CUDA graph invalidates that capture; torch's NCCL watchdog
    switches its thread the same way. Without a loaded CUDA runtime it does nothing.
    """
    if getattr(_thread_state, "capture_mode_set", False):
        return
    _thread_state.capture_mode_set = True
    exchange = _capture_mode_exchange()
    if exchange is not None:
        mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
        exchange(ctypes.byref(mode))


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for the block (a no-op when it already is)."""
    if torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def in_background_thread() -> bool:
    """True when called from a thread other than the main one."""
    return threading.current_thread() is not threading.main_thread()
