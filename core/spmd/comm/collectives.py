"""The module-level collectives, with torch.distributed's signatures.

Each call validates its arguments (errors name the problem and the fix),
makes the tensors contiguous (through reused staging buffers when they are
not), dispatches to the group's backend for the tensor's device, and either
waits (``async_op=False``) or returns the Work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spmd.comm.backend import Backend
from spmd.comm.buffers import BufferPool
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp, check_reduce_op
from spmd.comm.state import resolve_group
from spmd.comm.work import Work
from spmd.debug import desync
from spmd.debug.recorder import Entry, recorder

_pool = BufferPool()
_AVG = ReduceOp.AVG  # a module constant: reading an Enum member off its class costs ~100 ns


# -- validation ----------------------------------------------------------------------
def _check_tensor(tensor: object, what: str, op: str) -> torch.Tensor:
    if type(tensor) is torch.Tensor and tensor.layout is torch.strided:
        return tensor  # the common case, checked in one step
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{op}: {what} is a sparse tensor; convert it with .to_dense() first")
    return tensor


def _route(group: ProcessGroup | None, tensor: torch.Tensor, what: str, op: str, reduce_op: ReduceOp | None = None) -> tuple[ProcessGroup, Backend]:
    """Resolve the group, check ``tensor`` (and ``reduce_op`` on its dtype), and pick its device's backend.

    The shared prologue of the ops, in one frame: with Gloo threads sharing the
    cores, each Python call between two collectives measured 1-3 us of added
    latency here, so the common case of every check is tested inline.
    """
    g = resolve_group(group)
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        _check_tensor(tensor, what, op)  # raises for what is not a dense tensor
    if reduce_op is not None:
        check_reduce_op(reduce_op, tensor.dtype)
    backend = g.backends_by_device.get(tensor.device)
    return g, backend if backend is not None else g.backend_for(tensor)


def _check_output(output: torch.Tensor, input: torch.Tensor, what: str, op: str) -> None:
    """``output`` is a dense tensor of ``input``'s dtype on ``input``'s device."""
    if type(output) is not torch.Tensor or output.layout is not torch.strided:
        _check_tensor(output, what, op)
    _check_same(output, input, op)


def _check_same(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: output dtype {a.dtype} differs from input dtype {b.dtype}; use one dtype")
    if a.get_device() != b.get_device():  # cheaper than comparing torch.device objects
        raise ValueError(f"{op}: output is on {a.device} but input is on {b.device}; put both on one device")


def _root(group: ProcessGroup, rank: int | None, group_rank: int | None, what: str, op: str) -> int:
    """The group-local rank of a root given as a global rank or a group rank."""
    if group_rank is not None:
        if rank is not None and group.global_rank(group_rank) != rank:
            raise ValueError(f"{op}: {what}={rank} and group_{what}={group_rank} name different ranks")
        if not 0 <= group_rank < group.size:
            raise ValueError(f"{op}: group_{what}={group_rank} is out of range for group {group.name!r} of size {group.size}")
        return group_rank
    if rank is None:
        raise ValueError(f"{op}: pass {what}= (a global rank) or group_{what}= (a rank within the group)")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{op}: {what}={rank!r} is not a valid rank; ranks are 0..{group.size - 1}")
    return group.group_rank(rank)


# -- completion ----------------------------------------------------------------------
#: What ``_begin`` hands ``_complete``: the recorded entry, or the op, tensors and reduce op to record.
_Call = Entry | tuple[str, Sequence[torch.Tensor], ReduceOp | None]


def _begin(
    group: ProcessGroup,
    op: str,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp | None = None,
    root: int | None = None,
) -> _Call:
    """What must precede submitting an op: nothing, or with the desync check on, recording and checking it.

    Recording (sequence number, flight-recorder entry) otherwise waits for
    ``_complete``, which runs once the backend has the op: Python run between
    one collective's end and the next one's submission delays both ranks (the
    flight-recorder entry alone measured ~7 us there on the 2-core host), while
    run after submission it overlaps the transfer.
    """
    if desync.on:
        entry = recorder.start(group.name, group.next_seq(), op, tensors, reduce_op)
        desync.check(group, entry, root)
        return entry
    return (op, tensors, reduce_op)


def _complete(
    work: Work,
    group: ProcessGroup,
    op: str,
    call: _Call,
    async_op: bool,
    after: Callable[[], None] | None = None,
) -> Work | None:
    """Record the submitted op, attach timeout, group and entry to ``work``; wait for it unless ``async_op``.

    The hot path of every op: a few attribute stores, no closures. The
    description and the diagnosis of a failure are derived from the group and
    the entry only when an error needs them (``Work.description``, ``Work._explain``).
    """
    entry = call if isinstance(call, Entry) else recorder.start(group.name, group.next_seq(), *call)
    work.default_timeout = group.timeout_s
    work._entry = entry
    work._group = group
    if work._is_done:  # finished before it had an entry to finish (Work.completed(), a fast worker thread)
        entry.finish(work._error)
    if op != entry.op:  # point-to-point: "isend to rank 3 (tag 0)"
        work._describe = lambda: group.describe(op)
    if async_op:
        if after is not None:
            work = work.then(after)
            work._entry, work._group = entry, group
        recorder.watch(entry, work)
        return work
    work.wait()  # the synchronous path waits natively, with no callback hop
    if after is not None:
        after()
    return None


class _Contiguous:
    """A contiguous stand-in for a tensor: the tensor itself, or a pooled copy written back later."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool = True) -> None:
        self.original = tensor
        self._buffer: torch.Tensor | None = None
        if tensor.is_contiguous():
            self.tensor = tensor
        else:
            self._buffer = _pool.acquire(tensor.numel(), tensor.dtype, tensor.device)
            self.tensor = self._buffer[: tensor.numel()].view(tensor.shape)
            if copy_in:
                self.tensor.copy_(tensor)

    @property
    def staged(self) -> bool:
        return self._buffer is not None

    def write_back(self) -> None:
        if self._buffer is not None:
            self.original.copy_(self.tensor)

    def release(self) -> None:
        if self._buffer is not None:
            _pool.release(self._buffer)
            self._buffer = None


def _sequence(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    """One callable running the given steps in order; None when there is nothing to do."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


def _staging_steps(*staged: _Contiguous, write_back: tuple[_Contiguous, ...] = ()) -> list[Callable[[], None]]:
    """Write-back and release steps for the staged stand-ins only (none on the fast path)."""
    steps: list[Callable[[], None]] = [s.write_back for s in write_back if s.staged]
    steps += [s.release for s in staged if s.staged]
    return steps


def _average(tensor: torch.Tensor, size: int) -> Callable[[], None]:
    def divide() -> None:
        tensor.div_(size)

    return divide


def _native_op(backend: Backend, op: ReduceOp) -> ReduceOp:
    """AVG becomes SUM for backends that cannot average (the kernel divides afterwards)."""
    if op is _AVG and not backend.supports_avg:
        return ReduceOp.SUM
    return op


# -- reductions ----------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across every rank of ``group``, in place, so all ranks hold the result."""
    g, backend = _route(group, tensor, "tensor", "all_reduce", op)
    call = _begin(g, "all_reduce", (tensor,), op, None)
    if tensor.is_contiguous() and (op is not _AVG or backend.supports_avg):
        return _complete(backend.all_reduce(tensor, op), g, "all_reduce", call, async_op)  # nothing to stage
    native = _native_op(backend, op)
    staged = _Contiguous(tensor)
    work = backend.all_reduce(staged.tensor, native)
    steps = [_average(staged.tensor, g.size)] if native is not op else []
    steps += _staging_steps(staged, write_back=(staged,))
    return _complete(work, g, "all_reduce", call, async_op, _sequence(*steps))


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` of every rank into ``dst``'s; other ranks' tensors are unchanged."""
    g, backend = _route(group, tensor, "tensor", "reduce", op)
    root = _root(g, dst, group_dst, "dst", "reduce")
    call = _begin(g, "reduce", (tensor,), op, root)
    staged = _Contiguous(tensor)
    native = _native_op(backend, op)
    work = backend.reduce(staged.tensor, root, native)
    steps = [_average(staged.tensor, g.size)] if native is not op and g.rank == root else []
    steps += _staging_steps(staged, write_back=(staged,) if g.rank == root else ())
    return _complete(work, g, "reduce", call, async_op, _sequence(*steps))


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input`` (group size blocks along dim 0, or flat) and give rank r block r in ``output``."""
    g, backend = _route(group, input, "input", "reduce_scatter_tensor", op)
    _check_output(output, input, "output", "reduce_scatter_tensor")
    if input.numel() != output.numel() * g.size:
        raise ValueError(
            f"reduce_scatter_tensor: input has {input.numel()} elements but must have group size "
            f"({g.size}) x output ({output.numel()}) = {output.numel() * g.size}; size the input "
            f"as torch.empty(({g.size} * n, ...)) for an output of n rows"
        )
    call = _begin(g, "reduce_scatter_tensor", (input, output), op, None)
    native = _native_op(backend, op)
    if native is op and input.is_contiguous() and output.is_contiguous():
        return _complete(backend.reduce_scatter_tensor(output, input, op), g, "reduce_scatter_tensor", call, async_op)
    staged_in = _Contiguous(input)
    staged_out = _Contiguous(output, copy_in=False)
    work = backend.reduce_scatter_tensor(staged_out.tensor, staged_in.tensor, native)
    steps = [_average(staged_out.tensor, g.size)] if native is not op else []
    steps += _staging_steps(staged_out, staged_in, write_back=(staged_out,))
    return _complete(work, g, "reduce_scatter_tensor", call, async_op, _sequence(*steps))


def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """List form: rank r's ``output`` gets the reduction of every rank's ``input_list[r]``."""
    g = resolve_group(group)
    _check_tensor(output, "output", "reduce_scatter")
    _check_list(input_list, g, output, "input_list", "reduce_scatter")
    flat = _pool.acquire(output.numel() * g.size, output.dtype, output.device)
    packed = flat[: output.numel() * g.size]
    for block, item in zip(packed.chunk(g.size) if packed.numel() else [], input_list):
        block.view(item.shape).copy_(item)
    work = reduce_scatter_tensor(output, packed, op, group=g, async_op=True)
    assert work is not None
    return _finish_list(work.then(lambda: _pool.release(flat)), async_op)


# -- data movement -------------------------------------------------------------------
def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor``."""
    g, backend = _route(group, tensor, "tensor", "broadcast")
    root = _root(g, src, group_src, "src", "broadcast")
    call = _begin(g, "broadcast", (tensor,), None, root)
    if tensor.is_contiguous():
        return _complete(backend.broadcast(tensor, root), g, "broadcast", call, async_op)
    staged = _Contiguous(tensor, copy_in=g.rank == root)
    work = backend.broadcast(staged.tensor, root)
    return _complete(work, g, "broadcast", call, async_op, _sequence(*_staging_steps(staged, write_back=(staged,))))


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (rank r's in block r)."""
    g, backend = _route(group, input_tensor, "input_tensor", "all_gather_into_tensor")
    _check_output(output_tensor, input_tensor, "output_tensor", "all_gather_into_tensor")
    if output_tensor.numel() != input_tensor.numel() * g.size:
        raise ValueError(
            f"all_gather_into_tensor: output has {output_tensor.numel()} elements but must have "
            f"group size ({g.size}) x input ({input_tensor.numel()}) = {input_tensor.numel() * g.size}; "
            f"allocate it as torch.empty(({g.size} * n, ...)) or torch.empty(({g.size}, n, ...))"
        )
    call = _begin(g, "all_gather_into_tensor", (input_tensor, output_tensor), None, None)
    if input_tensor.is_contiguous() and output_tensor.is_contiguous():
        return _complete(backend.all_gather_into_tensor(output_tensor, input_tensor), g, "all_gather_into_tensor", call, async_op)
    staged_in = _Contiguous(input_tensor)
    staged_out = _Contiguous(output_tensor, copy_in=False)
    work = backend.all_gather_into_tensor(staged_out.tensor, staged_in.tensor)
    after = _sequence(*_staging_steps(staged_out, staged_in, write_back=(staged_out,)))
    return _complete(work, g, "all_gather_into_tensor", call, async_op, after)


def _check_list(items: Sequence[torch.Tensor], g: ProcessGroup, like: torch.Tensor, what: str, op: str) -> None:
    if len(items) != g.size:
        raise ValueError(f"{op}: {what} has {len(items)} tensors but the group has {g.size} ranks; pass one per rank")
    for i, item in enumerate(items):
        _check_tensor(item, f"{what}[{i}]", op)
        _check_same(item, like, op)
        if item.numel() != like.numel():
            raise ValueError(
                f"{op}: {what}[{i}] has shape {tuple(item.shape)} but the local tensor has "
                f"{tuple(like.shape)}; every entry must have the same number of elements"
            )


def _check_root_list(
    g: ProcessGroup, root: int, items: Sequence[torch.Tensor] | None, like: torch.Tensor, what: str, op: str, role: str
) -> None:
    """The root of gather/scatter passes one tensor per rank; every other rank passes none."""
    if g.rank == root:
        if items is None:
            raise ValueError(f"{op}: the {role} rank must pass {what}, one tensor per rank")
        _check_list(items, g, like, what, op)
    elif items:
        raise ValueError(f"{op}: only the {role} rank ({root} in the group) passes {what}")


def _unpack_blocks(items: Sequence[torch.Tensor], packed: torch.Tensor, blocks: int) -> None:
    """Copy equal blocks of a flat buffer back into the caller's list of tensors."""
    if packed.numel():
        for item, block in zip(items, packed.chunk(blocks)):
            item.copy_(block.view(item.shape))


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
) -> Work | None:
    """List form: ``tensor_list[r]`` receives rank r's ``tensor``."""
    g = resolve_group(group)
    _check_tensor(tensor, "tensor", "all_gather")
    _check_list(tensor_list, g, tensor, "tensor_list", "all_gather")
    flat = _pool.acquire(tensor.numel() * g.size, tensor.dtype, tensor.device)
    packed = flat[: tensor.numel() * g.size]
    work = all_gather_into_tensor(packed, tensor, group=g, async_op=True)
    assert work is not None

    def unpack() -> None:
        _unpack_blocks(tensor_list, packed, g.size)
        _pool.release(flat)

    return _finish_list(work.then(unpack), async_op)


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
) -> Work | None:
    """Rows of ``input`` go to each rank by ``input_split_sizes``; ``output`` collects by ``output_split_sizes``."""
    g, backend = _route(group, input, "input", "all_to_all_single")
    _check_output(output, input, "output", "all_to_all_single")
    in_rows = input.shape[0] if input.dim() else input.numel()
    out_rows = output.shape[0] if output.dim() else output.numel()
    in_sizes = _splits(input_split_sizes, in_rows, g, "input")
    out_sizes = _splits(output_split_sizes, out_rows, g, "output")
    if input.dim() > 1 and output.dim() > 1 and input.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"all_to_all_single: input rows have shape {tuple(input.shape[1:])} but output rows "
            f"{tuple(output.shape[1:])}; they must match"
        )
    call = _begin(g, "all_to_all_single", (input, output), None, None)
    if input.is_contiguous() and output.is_contiguous():
        return _complete(backend.all_to_all_single(output, input, out_sizes, in_sizes), g, "all_to_all_single", call, async_op)
    staged_in = _Contiguous(input)
    staged_out = _Contiguous(output, copy_in=False)
    work = backend.all_to_all_single(staged_out.tensor, staged_in.tensor, out_sizes, in_sizes)
    after = _sequence(*_staging_steps(staged_out, staged_in, write_back=(staged_out,)))
    return _complete(work, g, "all_to_all_single", call, async_op, after)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """List form: ``input_tensor_list[i]`` goes to rank i; ``output_tensor_list[j]`` comes from rank j.

    Entries may differ in size (uneven all-to-all).
    """
    g = resolve_group(group)
    for what, items in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if len(items) != g.size:
            raise ValueError(f"all_to_all: {what} has {len(items)} tensors but the group has {g.size} ranks")
        for i, item in enumerate(items):
            _check_tensor(item, f"{what}[{i}]", "all_to_all")
    dtype = input_tensor_list[0].dtype if input_tensor_list else torch.float32
    for t in [*output_tensor_list, *input_tensor_list]:
        if t.dtype != dtype:
            raise TypeError(f"all_to_all: mixed dtypes {t.dtype} and {dtype}; use one dtype")
    in_sizes = [t.numel() for t in input_tensor_list]
    out_sizes = [t.numel() for t in output_tensor_list]
    packed_in = torch.cat([t.reshape(-1) for t in input_tensor_list]) if input_tensor_list else torch.empty(0)
    flat_out = _pool.acquire(sum(out_sizes), dtype, input_tensor_list[0].device if input_tensor_list else "cpu")
    packed_out = flat_out[: sum(out_sizes)]
    work = all_to_all_single(packed_out, packed_in, out_sizes, in_sizes, group=g, async_op=True)
    assert work is not None

    def unpack() -> None:
        for item, block in zip(output_tensor_list, packed_out.split(out_sizes)):
            item.copy_(block.view(item.shape))
        _pool.release(flat_out)

    return _finish_list(work.then(unpack), async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """``gather_list[r]`` on ``dst`` receives rank r's ``tensor``; other ranks pass no list."""
    g = resolve_group(group)
    _check_tensor(tensor, "tensor", "gather")
    root = _root(g, 0 if dst is None and group_dst is None else dst, group_dst, "dst", "gather")
    is_root = g.rank == root
    _check_root_list(g, root, gather_list, tensor, "gather_list", "gather", "destination")
    backend = g.backend_for(tensor)
    call = _begin(g, "gather", (tensor,), None, root)
    staged = _Contiguous(tensor)
    flat = _pool.acquire(tensor.numel() * g.size, tensor.dtype, tensor.device) if is_root else None
    packed = flat[: tensor.numel() * g.size] if flat is not None else None
    work = backend.gather(packed, staged.tensor, root)

    def unpack() -> None:
        if packed is not None and gather_list is not None:
            _unpack_blocks(gather_list, packed, g.size)
        if flat is not None:
            _pool.release(flat)
        staged.release()

    return _complete(work, g, "gather", call, async_op, unpack)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Rank r's ``tensor`` receives ``scatter_list[r]`` of ``src``; other ranks pass no list."""
    g = resolve_group(group)
    _check_tensor(tensor, "tensor", "scatter")
    root = _root(g, 0 if src is None and group_src is None else src, group_src, "src", "scatter")
    is_root = g.rank == root
    _check_root_list(g, root, scatter_list, tensor, "scatter_list", "scatter", "source")
    packed = torch.cat([t.reshape(-1) for t in scatter_list]) if is_root and scatter_list is not None else None
    backend = g.backend_for(tensor)
    call = _begin(g, "scatter", (tensor,), None, root)
    staged = _Contiguous(tensor, copy_in=False)
    work = backend.scatter(staged.tensor, packed, root)
    return _complete(work, g, "scatter", call, async_op, _sequence(*_staging_steps(staged, write_back=(staged,))))


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids: object = None) -> Work | None:
    """Return once every rank of ``group`` has called barrier (or raise at the group timeout)."""
    g = resolve_group(group)
    device = "cpu" if g.backend_map is None or "cpu" in g.backend_map else next(iter(g.backend_map))
    backend = g.backend(device)
    call = _begin(g, "barrier", (), None, None)
    return _complete(backend.barrier(), g, "barrier", call, async_op)
