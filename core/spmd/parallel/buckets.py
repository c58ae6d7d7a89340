"""Gradient buckets: which parameters share one flat buffer, and that buffer with a view per parameter."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.comm.group import ProcessGroup

#: torch DDP's size for the bucket of the first-registered parameters (ready last in backward):
#: small, so little communication is left after the last gradient is computed.
FIRST_BUCKET_BYTES = 1 << 20


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, in launch order (reverse registration order).

    Each bucket holds one dtype and device and closes once it reaches its cap
    (so it may pass the cap by one parameter). Like torch DDP, buckets are cut
    in registration order with ``first_cap_bytes`` for the first one, then
    reversed: gradients are produced roughly in reverse registration order.
    """
    done: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_per_key: dict[tuple[torch.dtype, torch.device], int] = {}
    for index, param in enumerate(params):
        key = (param.dtype, param.device)
        bucket = open_.setdefault(key, [])
        bucket.append(index)
        size[key] = size.get(key, 0) + param.numel() * param.element_size()
        limit = first_cap_bytes if closed_per_key.get(key, 0) == 0 else cap_bytes
        if size[key] >= limit:
            done.append(bucket)
            del open_[key]
            size[key] = 0
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
    done.extend(open_.values())
    done.sort(key=lambda bucket: bucket[0])
    done.reverse()
    return done


def assign_buckets_in_order(
    params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Parameter indices per bucket for a known gradient-ready ``order`` (launch order = that order).

    What torch DDP rebuilds its buckets with after the first iteration: buckets
    are cut along the order gradients actually became ready, one dtype and
    device each, the first launched one capped at ``first_cap_bytes`` so
    communication starts early.
    """
    done: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in order:
        param = params[index]
        key = (param.dtype, param.device)
        bucket = open_.setdefault(key, [])
        bucket.append(index)
        size[key] = size.get(key, 0) + param.numel() * param.element_size()
        if size[key] >= (first_cap_bytes if not done else cap_bytes):
            done.append(bucket)
            del open_[key]
            size[key] = 0
    done.extend(open_.values())
    position = {index: i for i, index in enumerate(order)}
    done.sort(key=lambda bucket: position[bucket[0]])
    return done


class GradBucket:
    """One flat gradient buffer shared by several parameters and reduced as one message.

    This is what a communication hook receives; the method names are torch's
    ``dist.GradBucket`` ones, so torch hooks port with few edits.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[torch.nn.Parameter],
        param_indices: Sequence[int],
        names: Sequence[str],
        process_group: ProcessGroup | None = None,
    ) -> None:
        self._index = index
        #: The group DDP reduces over (hooks use it when their state names no group).
        self.process_group = process_group
        self._params = list(params)
        self.param_indices = list(param_indices)
        self.names = list(names)
        first = self._params[0]
        total = sum(p.numel() for p in self._params)
        self._buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for param in self._params:
            self.views.append(self._buffer[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        self._is_last = False

    def index(self) -> int:
        """The bucket's position in launch order (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer: a hook reduces it in place (or writes the result into it)."""
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients live in this bucket, in buffer order."""
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into ``buffer()``."""
        return list(self.views)

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._is_last

    def __repr__(self) -> str:
        return f"<GradBucket {self._index}: {len(self._params)} params, {self._buffer.numel()} x {self._buffer.dtype}>"
