"""DDP communication hooks: the builtin ones and the registry (``spmd_comm_hooks``) that names them.

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

Plugins name their hooks in the hook ``spmd_comm_hooks() -> {name: hook}``,
as the builtin plugin ``spmd.parallel.builtin`` does; code may also name one
at run time with ``register_hook``. ``ddp.register_comm_hook(state, "name")``
finds either::

    @spmd.parallel.comm_hooks.register_hook("topk")
    def topk_hook(state, bucket): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmd import hookspecs, plugins
from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.state import resolve_group
from spmd.comm.work import Work
from spmd.errors import NotProvidedError, PluginConflictError, PluginSpecError
from spmd.markers import hookimpl
from spmd.parallel.buckets import GradBucket
from spmd.registry import Overriding, Registry

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


def builtin_hooks() -> dict[str, CommHook]:
    """The builtin hooks by name, aliases included (what the builtin plugin's ``spmd_comm_hooks`` returns)."""
    return {
        "allreduce": allreduce_hook,
        "fp16_compress": fp16_compress_hook,
        "bf16_compress": bf16_compress_hook,
        "fp16": fp16_compress_hook,
        "bf16": bf16_compress_hook,
    }


class CommHookNotFoundError(NotProvidedError):
    """No loaded plugin names a communication hook of the requested name."""


_HINT = "A plugin names one in its spmd_comm_hooks() hook, or code with spmd.parallel.comm_hooks.register_hook(name, hook)"
COMM_HOOKS: Registry[str, CommHook] = Registry(
    hookspecs.spmd_comm_hooks, "communication hook", plural="hooks", keys=None, expected="a callable hook(state, bucket) -> spmd.Work",
    missing=CommHookNotFoundError, listed="registered", hint=_HINT)


class _NamedHook:
    """The plugin ``register_hook`` adds for one name: its ``spmd_comm_hooks`` returns that one hook."""

    def __init__(self, name: str, hook: CommHook, override: bool) -> None:
        self.name, self.hook, self.override = name, hook, override

    @hookimpl
    def spmd_comm_hooks(self) -> dict[str, object]:
        return {self.name: Overriding(self.hook) if self.override else self.hook}


def register_hook(name: str, hook: CommHook | None = None, *, override: bool = False) -> Any:
    """Name a communication hook (``register_hook("x", fn)`` or as a decorator ``@register_hook("x")``).

    It becomes the plugin ``comm-hook:<name>`` (kept across ``spmd.plugins.reset()``); a second hook
    under one name is an error unless ``override=True``, which also wins over a plugin's hook of that name.
    """

    def add(fn: CommHook) -> CommHook:
        if not callable(fn):
            raise PluginSpecError(f"communication hook {name!r} must be callable, got {type(fn).__name__}")
        previous = COMM_HOOKS.find(name)
        if previous is not None and previous.spec is not fn and not override:
            raise PluginConflictError(
                f"communication hook {name!r} is registered twice ({_describe(previous.spec)} from plugin "
                f"{previous.plugin!r}, and {_describe(fn)}); pick another name or pass override=True"
            )
        plugins.add(_NamedHook(name, fn, override), f"comm-hook:{name}")
        return fn

    return add(hook) if hook is not None else add


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def hook_names() -> list[str]:
    """Every registered hook name (plugins loaded first), sorted."""
    return COMM_HOOKS.keys()


def get_hook(name: str) -> CommHook:
    """The hook registered as ``name``, or an error listing the registered names."""
    return COMM_HOOKS.get(name).spec
