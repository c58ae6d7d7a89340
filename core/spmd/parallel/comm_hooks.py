"""DDP communication hooks: the builtin ones and the registry that names them.

A hook is a callable ``hook(state, bucket) -> spmd.Work``. DDP calls it once
per bucket, as soon as the bucket's last gradient is ready, with the
``state`` given to ``DistributedDataParallel.register_comm_hook``. The hook
starts the reduction of ``bucket.buffer()`` (a flat gradient tensor) and
returns at once; when the returned Work completes, the buffer must hold the
*average* over the group. With a hook registered, DDP does not divide the
gradients itself.

``state`` may be a ``spmd.ProcessGroup`` (as in torch) or anything the hook
wants; the builtin hooks reduce over it when it is a group and over the DDP
module's own group (``bucket.process_group``) otherwise.

Third parties name their hooks with ``register_hook`` at import of their
plugin module, so ``ddp.register_comm_hook(state, "name")`` finds them::

    @spmd.parallel.comm_hooks.register_hook("topk")
    def topk_hook(state, bucket): ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.state import resolve_group
from spmd.comm.work import Work
from spmd.errors import PluginConflictError, SpmdError
from spmd.parallel.buckets import GradBucket

#: ``hook(state, bucket) -> Work``; on completion ``bucket.buffer()`` holds the group average.
CommHook = Callable[[Any, GradBucket], Work]


def _group(state: Any, bucket: GradBucket) -> ProcessGroup:
    if isinstance(state, ProcessGroup):
        return state
    return resolve_group(bucket.process_group)


def allreduce_hook(state: Any, bucket: GradBucket) -> Work:
    """Average the bucket: divide by the group size, then all-reduce SUM (what DDP does without a hook)."""
    group = _group(state, bucket)
    buffer = bucket.buffer()
    buffer.div_(group.size)
    work = all_reduce(buffer, ReduceOp.SUM, group=group, async_op=True)
    assert work is not None
    return work


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(state: Any, bucket: GradBucket) -> Work:
        group = _group(state, bucket)
        buffer = bucket.buffer()
        # Divide before the sum, as torch does: the low-precision sum then cannot overflow.
        compressed = buffer.to(dtype).div_(group.size)
        work = all_reduce(compressed, ReduceOp.SUM, group=group, async_op=True)
        assert work is not None

        def decompress() -> None:
            buffer.copy_(compressed)

        return work.then(decompress)

    return hook


fp16_compress_hook: CommHook = _compress_hook(torch.float16)
fp16_compress_hook.__doc__ = "Average in float16: compress the bucket, all-reduce, decompress into it."
fp16_compress_hook.__name__ = fp16_compress_hook.__qualname__ = "fp16_compress_hook"
bf16_compress_hook: CommHook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = "Average in bfloat16: compress the bucket, all-reduce, decompress into it."
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "bf16_compress_hook"


_HOOKS: dict[str, CommHook] = {
    "allreduce": allreduce_hook,
    "fp16_compress": fp16_compress_hook,
    "bf16_compress": bf16_compress_hook,
}
_ALIASES = {"fp16": "fp16_compress", "bf16": "bf16_compress"}
_lock = threading.Lock()


def register_hook(name: str, hook: CommHook | None = None, *, override: bool = False) -> Any:
    """Name a communication hook (``register_hook("x", fn)`` or as a decorator ``@register_hook("x")``).

    A second hook under one name is an error unless ``override=True``.
    """

    def add(fn: CommHook) -> CommHook:
        if not callable(fn):
            raise TypeError(f"communication hook {name!r} must be callable, got {type(fn).__name__}")
        with _lock:
            previous = _HOOKS.get(name)
            if previous is not None and previous is not fn and not override:
                raise PluginConflictError(
                    f"communication hook {name!r} is registered twice ({_describe(previous)} and "
                    f"{_describe(fn)}); pick another name or pass override=True"
                )
            _HOOKS[name] = fn
        return fn

    return add(hook) if hook is not None else add


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def hook_names() -> list[str]:
    """Every registered hook name (plugins loaded first), sorted."""
    from spmd.plugins import manager

    manager()  # importing plugin modules is what registers their hooks
    return sorted([*_HOOKS, *_ALIASES])


def get_hook(name: str) -> CommHook:
    """The hook registered as ``name``, or an error listing the registered names."""
    hook = _HOOKS.get(_ALIASES.get(name, name))
    if hook is None:
        names = hook_names()  # loads plugins, which may register it
        hook = _HOOKS.get(_ALIASES.get(name, name))
        if hook is None:
            raise SpmdError(
                f"unknown communication hook {name!r}; registered hooks: {', '.join(names)}. "
                "A plugin registers one with spmd.parallel.comm_hooks.register_hook(name, hook)"
            )
    return hook
