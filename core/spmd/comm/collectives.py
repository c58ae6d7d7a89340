"""The module-level collectives, with torch.distributed's signatures.

Each call validates its arguments (errors name the problem and the fix:
checks.py), makes the tensors contiguous (through reused staging buffers
when they are not: staging.py), dispatches to the group's backend for the
tensor's device, and records the op and either waits (``async_op=False``)
or returns the Work (lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.comm.checks import (
    blocks_error,
    check_list,
    check_output,
    check_root_list,
    check_tensor,
    give_up,
    resolve_root,
    route,
)
from spmd.comm.group import ProcessGroup
from spmd.comm.lifecycle import begin, begin_sized, complete
from spmd.comm.reduce_op import ReduceOp, divide
from spmd.comm.staging import (
    AVG,
    PREDIVIDED,
    Contiguous,
    average,
    native_op,
    overlaps,
    pool,
    predivided,
    sequence,
    staging_steps,
    unpack_blocks,
)
from spmd.comm.state import resolve_group
from spmd.comm.work import Timeout, Work


# -- reductions ----------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False, *, timeout: Timeout = None) -> Work | None:
    """Reduce ``tensor`` across every rank of ``group``, in place, so all ranks hold the result."""
    try:
        g, backend = route(group, tensor, "tensor", "all_reduce", op, timeout)
        call, backend = begin_sized(g, "all_reduce", (tensor,), op, None, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        if tensor.is_contiguous() and (op is not AVG or backend.supports_avg and tensor.dtype not in PREDIVIDED):
            return complete(backend.all_reduce(tensor, op), g, "all_reduce", call, async_op, None, timeout, tensor)  # nothing to stage
        native = native_op(backend, op, tensor.dtype)
        before = predivided(op, native, tensor.dtype)
        staged = Contiguous(tensor)
        if before:
            divide(staged.tensor, g.size)  # (the tensor is overwritten with the result anyway)
        work = backend.all_reduce(staged.tensor, native)
        steps = [average(staged.tensor, g.size)] if native is not op and not before else []
        steps += staging_steps(staged, write_back=(staged,))
        return complete(work, g, "all_reduce", call, async_op, sequence(*steps), timeout=timeout, result=tensor)
    except Exception as error:
        give_up(group, "all_reduce", error)
        raise


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Reduce ``tensor`` of every rank into ``dst``'s; other ranks' tensors are unchanged."""
    try:
        g, backend = route(group, tensor, "tensor", "reduce", op, timeout)
        root = resolve_root(g, dst, group_dst, "dst", "reduce")
        call, backend = begin_sized(g, "reduce", (tensor,), op, root, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        native = native_op(backend, op, tensor.dtype)
        before = predivided(op, native, tensor.dtype)
        staged = Contiguous(tensor, force=before and g.rank != root)  # (only the root's tensor is overwritten)
        if before:
            divide(staged.tensor, g.size)
        work = backend.reduce(staged.tensor, root, native)
        steps = [average(staged.tensor, g.size)] if native is not op and not before and g.rank == root else []
        steps += staging_steps(staged, write_back=(staged,) if g.rank == root else ())
        return complete(work, g, "reduce", call, async_op, sequence(*steps), timeout=timeout, result=tensor)
    except Exception as error:
        give_up(group, "reduce", error)
        raise


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Reduce ``input`` (group size blocks along dim 0, or flat) and give rank r block r in ``output``."""
    try:
        g, backend = route(group, input, "input", "reduce_scatter_tensor", op, timeout)
        check_output(output, input, "output", "reduce_scatter_tensor")
        if input.numel() != output.numel() * g.size:
            raise blocks_error("reduce_scatter_tensor", ("input", input), ("output", output), g.size,
                               f"size the input as torch.empty(({g.size} * n, ...)) for an output of n rows")
        call, backend = begin_sized(g, "reduce_scatter_tensor", (input, output), op, None, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        native = native_op(backend, op, input.dtype)
        aliased = overlaps(input, output)
        if native is op and input.is_contiguous() and output.is_contiguous() and not aliased:
            return complete(backend.reduce_scatter_tensor(output, input, op), g, "reduce_scatter_tensor", call, async_op, None, timeout, output)
        before = predivided(op, native, input.dtype)
        staged_in = Contiguous(input, force=aliased or before)  # (the input stays as the caller gave it)
        if before:
            divide(staged_in.tensor, g.size)
        staged_out = Contiguous(output, copy_in=False)
        work = backend.reduce_scatter_tensor(staged_out.tensor, staged_in.tensor, native)
        steps = [average(staged_out.tensor, g.size)] if native is not op and not before else []
        steps += staging_steps(staged_out, staged_in, write_back=(staged_out,))
        return complete(work, g, "reduce_scatter_tensor", call, async_op, sequence(*steps), timeout=timeout, result=output)
    except Exception as error:
        give_up(group, "reduce_scatter_tensor", error)
        raise


def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """List form: rank r's ``output`` gets the reduction of every rank's ``input_list[r]``."""
    try:
        g = resolve_group(group)
        check_tensor(output, "output", "reduce_scatter")
        check_list(input_list, g, output, "input_list", "reduce_scatter")
        flat = pool.acquire(output.numel() * g.size, output.dtype, output.device)
        packed = flat[: output.numel() * g.size]
        for block, item in zip(packed.chunk(g.size) if packed.numel() else [], input_list):
            block.view(item.shape).copy_(item)
        work = reduce_scatter_tensor(output, packed, op, group=g, async_op=True, timeout=timeout)
        assert work is not None
        return _finish_list(work.then(lambda: pool.release(flat)), async_op)
    except Exception as error:
        give_up(group, "reduce_scatter", error)
        raise


# -- data movement -------------------------------------------------------------------
def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor``."""
    try:
        g, backend = route(group, tensor, "tensor", "broadcast", None, timeout)
        root = resolve_root(g, src, group_src, "src", "broadcast")
        call, backend = begin_sized(g, "broadcast", (tensor,), None, root, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        if tensor.is_contiguous():
            return complete(backend.broadcast(tensor, root), g, "broadcast", call, async_op, None, timeout, tensor)
        staged = Contiguous(tensor, copy_in=g.rank == root)
        work = backend.broadcast(staged.tensor, root)
        return complete(work, g, "broadcast", call, async_op, sequence(*staging_steps(staged, write_back=(staged,))), timeout=timeout, result=tensor)
    except Exception as error:
        give_up(group, "broadcast", error)
        raise


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (rank r's in block r)."""
    try:
        g, backend = route(group, input_tensor, "input_tensor", "all_gather_into_tensor", None, timeout)
        check_output(output_tensor, input_tensor, "output_tensor", "all_gather_into_tensor")
        if output_tensor.numel() != input_tensor.numel() * g.size:
            raise blocks_error("all_gather_into_tensor", ("output", output_tensor), ("input", input_tensor), g.size,
                               f"allocate it as torch.empty(({g.size} * n, ...)) or torch.empty(({g.size}, n, ...))")
        call, backend = begin_sized(g, "all_gather_into_tensor", (input_tensor, output_tensor), None, None, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        aliased = overlaps(input_tensor, output_tensor)  # torch's in-place form: input = output[own block]
        if input_tensor.is_contiguous() and output_tensor.is_contiguous() and not aliased:
            return complete(backend.all_gather_into_tensor(output_tensor, input_tensor), g, "all_gather_into_tensor", call, async_op, None, timeout, output_tensor)
        staged_in = Contiguous(input_tensor, force=aliased)
        staged_out = Contiguous(output_tensor, copy_in=False)
        work = backend.all_gather_into_tensor(staged_out.tensor, staged_in.tensor)
        after = sequence(*staging_steps(staged_out, staged_in, write_back=(staged_out,)))
        return complete(work, g, "all_gather_into_tensor", call, async_op, after, timeout=timeout, result=output_tensor)
    except Exception as error:
        give_up(group, "all_gather_into_tensor", error)
        raise


def _finish_list(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """List form: ``tensor_list[r]`` receives rank r's ``tensor``."""
    try:
        g = resolve_group(group)
        check_tensor(tensor, "tensor", "all_gather")
        check_list(tensor_list, g, tensor, "tensor_list", "all_gather")
        flat = pool.acquire(tensor.numel() * g.size, tensor.dtype, tensor.device)
        packed = flat[: tensor.numel() * g.size]
        work = all_gather_into_tensor(packed, tensor, group=g, async_op=True, timeout=timeout)
        assert work is not None

        def unpack() -> None:
            unpack_blocks(tensor_list, packed, g.size)
            pool.release(flat)

        return _finish_list(work.then(unpack), async_op)
    except Exception as error:
        give_up(group, "all_gather", error)
        raise


def _splits(sizes: Sequence[int] | None, rows: int, g: ProcessGroup, what: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if rows % g.size:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, not divisible by the group size "
                f"{g.size}; pass {what}_split_sizes for uneven splits"
            )
        return [rows // g.size] * g.size
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(
            f"all_to_all_single: {what}_split_sizes {sizes} must have {g.size} non-negative "
            f"entries that sum to the {what}'s {rows} rows (dim 0)"
        )
    return sizes


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Rows of ``input`` go to each rank by ``input_split_sizes``; ``output`` collects by ``output_split_sizes``."""
    try:
        g, backend = route(group, input, "input", "all_to_all_single", None, timeout)
        check_output(output, input, "output", "all_to_all_single")
        in_rows = input.shape[0] if input.dim() else input.numel()
        out_rows = output.shape[0] if output.dim() else output.numel()
        in_sizes = _splits(input_split_sizes, in_rows, g, "input")
        out_sizes = _splits(output_split_sizes, out_rows, g, "output")
        if input.dim() > 1 and output.dim() > 1 and input.shape[1:] != output.shape[1:]:
            raise ValueError(
                f"all_to_all_single: input rows have shape {tuple(input.shape[1:])} but output rows "
                f"{tuple(output.shape[1:])}; they must match"
            )
        given = bool(input_split_sizes) or bool(output_split_sizes)
        call, backend = begin_sized(g, "all_to_all_single", (input, output), None, None, (in_sizes, out_sizes), backend, timeout, async_op, given)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        aliased = overlaps(input, output)  # all_to_all_single(t, t), or an output shifted over its input
        if input.is_contiguous() and output.is_contiguous() and not aliased:
            return complete(backend.all_to_all_single(output, input, out_sizes, in_sizes), g, "all_to_all_single", call, async_op, None, timeout, output)
        staged_in = Contiguous(input, force=aliased)
        staged_out = Contiguous(output, copy_in=False)
        work = backend.all_to_all_single(staged_out.tensor, staged_in.tensor, out_sizes, in_sizes)
        after = sequence(*staging_steps(staged_out, staged_in, write_back=(staged_out,)))
        return complete(work, g, "all_to_all_single", call, async_op, after, timeout=timeout, result=output)
    except Exception as error:
        give_up(group, "all_to_all_single", error)
        raise


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """List form: ``input_tensor_list[i]`` goes to rank i; ``output_tensor_list[j]`` comes from rank j.

    Entries may differ in size (uneven all-to-all).
    """
    try:
        g = resolve_group(group)
        for what, items in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
            if len(items) != g.size:
                raise ValueError(f"all_to_all: {what} has {len(items)} tensors but the group has {g.size} ranks")
            for i, item in enumerate(items):
                check_tensor(item, f"{what}[{i}]", "all_to_all")
        dtype = input_tensor_list[0].dtype if input_tensor_list else torch.float32
        for t in [*output_tensor_list, *input_tensor_list]:
            if t.dtype != dtype:
                raise TypeError(f"all_to_all: mixed dtypes {t.dtype} and {dtype}; use one dtype")
        in_sizes = [t.numel() for t in input_tensor_list]
        out_sizes = [t.numel() for t in output_tensor_list]
        packed_in = torch.cat([t.reshape(-1) for t in input_tensor_list]) if input_tensor_list else torch.empty(0)
        flat_out = pool.acquire(sum(out_sizes), dtype, input_tensor_list[0].device if input_tensor_list else "cpu")
        packed_out = flat_out[: sum(out_sizes)]
        work = all_to_all_single(packed_out, packed_in, out_sizes, in_sizes, group=g, async_op=True, timeout=timeout)
        assert work is not None

        def unpack() -> None:
            for item, block in zip(output_tensor_list, packed_out.split(out_sizes)):
                item.copy_(block.view(item.shape))
            pool.release(flat_out)

        return _finish_list(work.then(unpack), async_op)
    except Exception as error:
        give_up(group, "all_to_all", error)
        raise


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """``gather_list[r]`` on ``dst`` receives rank r's ``tensor``; other ranks pass no list."""
    try:
        g = resolve_group(group)
        check_tensor(tensor, "tensor", "gather")
        root = resolve_root(g, 0 if dst is None and group_dst is None else dst, group_dst, "dst", "gather")
        is_root = g.rank == root
        check_root_list(g, root, gather_list, tensor, "gather_list", "gather", "destination")
        backend = g.backend_for(tensor, "gather", timeout)
        call, backend = begin_sized(g, "gather", (tensor,), None, root, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        staged = Contiguous(tensor)
        flat = pool.acquire(tensor.numel() * g.size, tensor.dtype, tensor.device) if is_root else None
        packed = flat[: tensor.numel() * g.size] if flat is not None else None
        work = backend.gather(packed, staged.tensor, root)

        def unpack() -> None:
            if packed is not None and gather_list is not None:
                unpack_blocks(gather_list, packed, g.size)
            if flat is not None:
                pool.release(flat)
            staged.release()

        return complete(work, g, "gather", call, async_op, unpack, timeout=timeout)
    except Exception as error:
        give_up(group, "gather", error)
        raise


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    timeout: Timeout = None,
) -> Work | None:
    """Rank r's ``tensor`` receives ``scatter_list[r]`` of ``src``; other ranks pass no list."""
    try:
        g = resolve_group(group)
        check_tensor(tensor, "tensor", "scatter")
        root = resolve_root(g, 0 if src is None and group_src is None else src, group_src, "src", "scatter")
        is_root = g.rank == root
        check_root_list(g, root, scatter_list, tensor, "scatter_list", "scatter", "source")
        packed = torch.cat([t.reshape(-1) for t in scatter_list]) if is_root and scatter_list is not None else None
        backend = g.backend_for(tensor, "scatter", timeout)
        call, backend = begin_sized(g, "scatter", (tensor,), None, root, None, backend, timeout, async_op)
        if isinstance(call, Work):  # refused before submission (see lifecycle.begin)
            return call
        staged = Contiguous(tensor, copy_in=False)
        work = backend.scatter(staged.tensor, packed, root)
        return complete(work, g, "scatter", call, async_op, sequence(*staging_steps(staged, write_back=(staged,))), timeout=timeout, result=tensor)
    except Exception as error:
        give_up(group, "scatter", error)
        raise


def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: object = None,
    timeout: Timeout = None,
) -> Work | None:
    """Return once every rank of ``group`` has called barrier; raise after ``timeout`` (the group's by default)."""
    try:
        g = resolve_group(group)
        device = "cpu" if g.backend_map is None or "cpu" in g.backend_map else next(iter(g.backend_map))
        backend = g.backends_by_device.get(torch.device(device)) or g.backend(device, "barrier", timeout)  # (a deferral.Gate queues it)
        call = begin(g, "barrier", (), None, None)
        return complete(backend.barrier(), g, "barrier", call, async_op, timeout=timeout)
    except Exception as error:
        give_up(group, "barrier", error)
        raise


#: torch 2.13's names for the tensor forms (it deprecates all_gather_into_tensor and reduce_scatter_tensor).
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor
