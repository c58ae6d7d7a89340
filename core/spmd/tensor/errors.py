"""Errors of the DTensor dispatcher: each names the op and what to do instead of computing a wrong result."""

from __future__ import annotations

from spmd.errors import SpmdError


class ShardingRuleError(SpmdError):
    """A sharding rule returned something the dispatcher cannot use."""


class MixedTensorError(SpmdError):
    """A plain tensor was passed beside DTensors (a RuntimeError, as every SpmdError: Python turns a TypeError from
    ``a + b`` into "unsupported operand" and lose the message)."""


class DetachedViewError(SpmdError):
    """An in-place write into a view that was taken of a redistributed copy: the write would not reach the tensor
    the view was taken from, so the result would be silently wrong."""


class InPlaceViewError(SpmdError):
    """An in-place op that changes a DTensor's shape or strides and cannot keep aliasing its memory: refused."""
