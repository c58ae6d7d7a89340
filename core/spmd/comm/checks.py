"""Argument checks shared by the collectives and point-to-point ops: errors that name the problem and the fix.

``route`` is the prologue of every op (group, tensor, reduce op, backend in
one frame); the others check outputs, roots and per-rank lists.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from spmd.comm import state
from spmd.comm.backend import Backend
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp, check_reduce_op, checked_dtypes
from spmd.comm.state import resolve_group
from spmd.comm.work import Timeout


def check_tensor(tensor: object, what: str, op: str) -> torch.Tensor:
    if type(tensor) is torch.Tensor and tensor.layout is torch.strided:
        return tensor  # the common case, checked in one step
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{op}: {what} is a sparse tensor; convert it with .to_dense() first")
    return tensor


def route(group: ProcessGroup | None, tensor: torch.Tensor, what: str, op: str, reduce_op: ReduceOp | None = None, timeout: Timeout = None) -> tuple[ProcessGroup, Backend]:
    """Resolve the group, check ``tensor`` (and ``reduce_op`` on its dtype), and pick its device's backend.

    The shared prologue of the ops, in one frame: with Gloo threads sharing the
    cores, each Python call between two collectives measured 1-3 us of added
    latency here, so the common case of every check is tested inline.
    """
    world = state._state
    g = world.world if group is None and world is not None else resolve_group(group)
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        check_tensor(tensor, what, op)  # raises for what is not a dense tensor
    if reduce_op is not None:
        checked = checked_dtypes.get(reduce_op)
        if checked is None or tensor.dtype not in checked:
            check_reduce_op(reduce_op, tensor.dtype)
    backend = g.backends_by_device.get(tensor.device)
    return g, backend if backend is not None else g.backend_for(tensor, op, timeout)


def check_output(output: torch.Tensor, input: torch.Tensor, what: str, op: str) -> None:
    """``output`` is a dense tensor of ``input``'s dtype on ``input``'s device."""
    if type(output) is not torch.Tensor or output.layout is not torch.strided:
        check_tensor(output, what, op)
    if output.dtype is not input.dtype or output.get_device() != input.get_device():  # (dtypes are singletons)
        check_same(output, input, op)


def check_same(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: output dtype {a.dtype} differs from input dtype {b.dtype}; use one dtype")
    if a.get_device() != b.get_device():  # cheaper than comparing torch.device objects
        raise ValueError(f"{op}: output is on {a.device} but input is on {b.device}; put both on one device")


def resolve_root(group: ProcessGroup, rank: int | None, group_rank: int | None, what: str, op: str) -> int:
    """The group-local rank of a root given as a global rank or a group rank."""
    if group_rank is not None:
        if rank is not None and group.global_rank(group_rank) != rank:
            raise ValueError(f"{op}: {what}={rank} and group_{what}={group_rank} name different ranks")
        if not 0 <= group_rank < group.size:
            raise ValueError(f"{op}: group_{what}={group_rank} is out of range for group {group.name!r} of size {group.size}")
        return group_rank
    if rank is None:
        raise ValueError(f"{op}: pass {what}= (a global rank) or group_{what}= (a rank within the group)")
    if type(rank) is not int:
        try:
            rank = operator.index(rank)  # numpy and torch integers, as torch accepts them
        except TypeError:
            raise ValueError(f"{op}: {what}={rank!r} is not a rank; pass an integer, one of group {group.name!r}'s ranks {list(group.ranks)}") from None
    return group.group_rank(rank)


def check_list(items: Sequence[torch.Tensor], g: ProcessGroup, like: torch.Tensor, what: str, op: str) -> None:
    if len(items) != g.size:
        raise ValueError(f"{op}: {what} has {len(items)} tensors but the group has {g.size} ranks; pass one per rank")
    for i, item in enumerate(items):
        check_tensor(item, f"{what}[{i}]", op)
        check_same(item, like, op)
        if item.numel() != like.numel():
            raise ValueError(
                f"{op}: {what}[{i}] has shape {tuple(item.shape)} but the local tensor has "
                f"{tuple(like.shape)}; every entry must have the same number of elements"
            )


def blocks_error(op: str, whole: tuple[str, torch.Tensor], block: tuple[str, torch.Tensor], size: int, fix: str) -> ValueError:
    """The error for a tensor that must hold one ``block`` per rank of a group of ``size`` but does not."""
    (whole_name, w), (block_name, b) = whole, block
    return ValueError(
        f"{op}: {whole_name} has {w.numel()} elements but must have group size ({size}) x {block_name} "
        f"({b.numel()}) = {b.numel() * size}; {fix}"
    )


def check_root_list(
    g: ProcessGroup, root: int, items: Sequence[torch.Tensor] | None, like: torch.Tensor, what: str, op: str, role: str
) -> None:
    """The root of gather/scatter passes one tensor per rank; every other rank passes none."""
    if g.rank == root:
        if items is None:
            raise ValueError(f"{op}: the {role} rank must pass {what}, one tensor per rank")
        check_list(items, g, like, what, op)
    elif items:
        raise ValueError(f"{op}: only the {role} rank ({root} in the group) passes {what}")


def give_up(group: ProcessGroup | None, op: str, error: Exception) -> None:
    """A collective that raised on this rank (a bad argument, a backend that refused it) leaves its group unusable.

    Its peers may already be inside the op: were this rank to carry on, its
    next op would pair with their pending one and return a wrong value (on MPI
    an all_reduce met a peer's all_gather). The group is refused here at once
    and on the other ranks at their next op (see ``ProcessGroup.mark_unusable``).
    Errors that already did so (timeouts, mismatches) keep their own reason.
    """
    try:
        g = resolve_group(group)
    except Exception:  # noqa: BLE001 - no group (not initialised, not a member): nothing to give up on
        return
    if g.size < 2 or g.unusable is not None:
        return
    first = str(error).split("\n", 1)[0]
    g.mark_unusable(
        f"{op} raised on rank {g.rank} ({type(error).__name__}: {first}) while the other ranks may be inside it, "
        "so its ranks are out of step; fix the call, then create a new group or restart the job"
    )
