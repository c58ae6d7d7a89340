# mypy: disable-error-code="override, assignment"
# (c10d's stubs declare each method as overloads of its old and new argument forms; this class implements the forms c10d calls.)
"""SpmdProcessGroup: a torch.distributed ProcessGroup whose every c10d call runs on a spmd group.

torch accepts a Python subclass of ``torch.distributed.ProcessGroup`` as a
backend (``Backend.register_backend``): Python callers
(``torch.distributed.all_reduce`` ...) find these methods by attribute
lookup, and C++ callers (DDP's reducer, functional collectives,
``_broadcast_coalesced``) reach them through pybind11's trampoline. Each
method translates c10d's argument forms (lists of tensors, options objects,
group-local roots) into a spmd collective with ``async_op=True`` and returns
a ``TorchWork`` over the spmd Work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

import spmd.comm.collectives as coll
import spmd.comm.p2p as p2p
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work, WorkList
from spmd.interop.work import TorchWork

#: c10d's RedOpType -> spmd's ReduceOp, by name (the stubs omit the bitwise members).
_OPS: dict[Any, ReduceOp] = {getattr(tdist.ReduceOp.RedOpType, op.name): op for op in ReduceOp}


def spmd_op(op: Any) -> ReduceOp:
    """The spmd ReduceOp of a c10d ReduceOp, RedOpType or options object (PREMUL_SUM is refused)."""
    if isinstance(op, ReduceOp):
        return op
    op = getattr(op, "reduceOp", op)
    kind = getattr(op, "op", op)
    found = _OPS.get(kind)
    if found is None:
        raise ValueError(
            f"the spmd torch.distributed backend cannot reduce with {op!r}: it supports SUM, AVG, "
            "PRODUCT, MIN, MAX, BAND, BOR and BXOR (PREMUL_SUM is NCCL-only in torch too)"
        )
    return found


def _root(opts: Any) -> int:
    return int(getattr(opts, "rootRank", 0))


def _gather(works: Sequence[Work | None]) -> Work:
    live = [w for w in works if w is not None]
    return live[0] if len(live) == 1 else WorkList(live)


class SpmdProcessGroup(tdist.ProcessGroup):
    """torch.distributed's view of one spmd ProcessGroup (ranks in the same order)."""

    def __init__(self, group: ProcessGroup, end_world: Callable[[], None] | None = None) -> None:
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]
        self.spmd_group = group
        #: Set when torch.distributed.init_process_group("spmd") started ``group`` as spmd's world: ends it.
        self._end_world = end_world
        self._name = ""
        self._desc = ""

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types the group serves: torch reads it to pick where object and state-dict broadcasts run
        (its ``broadcast_from_rank0`` raised IndexError on an empty list)."""
        configured = self.spmd_group.backend_map
        if configured is not None:
            return [torch.device(device_type) for device_type in configured]
        return [torch.device("cpu"), *([torch.device("cuda")] if torch.cuda.is_available() else [])]

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        """"spmd", as registered with torch.distributed.Backend."""
        return "spmd"

    def __repr__(self) -> str:
        return f"SpmdProcessGroup({self.spmd_group!r})"

    def shutdown(self) -> None:
        """``torch.distributed.destroy_process_group``: a spmd world that torch started goes with it.

        The next ``init_process_group("spmd")`` then starts a new world with
        what it is given (it silently reused the old one: its ranks, store and
        timeout). A world ``spmd.init`` started stays until ``spmd.destroy_process_group``.
        """
        from spmd.comm import state

        if self._end_world is not None and state.is_initialized() and self.spmd_group is state.get_state().world:
            self._end_world()

    # torch names the group after creating it (_set_group_name), and C++ reads the name back
    # (functional collectives resolve groups by it): both go through these overrides.
    def setGroupName(self, name: str) -> None:  # noqa: N802 - c10d's name
        """Remember torch's name for this group."""
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802 - c10d's name
        """torch's name for this group."""
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - c10d's name
        """Remember torch's description of this group."""
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - c10d's name
        """torch's description of this group."""
        return self._desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """torch's name for this group (what functional collectives pass to C++)."""
        return self._name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        """torch's description of this group."""
        return self._desc

    # -- reductions ----------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> TorchWork:
        """``all_reduce`` of each tensor (c10d passes a list of one)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = spmd_op(opts) if opts is not None else ReduceOp.SUM
        g = self.spmd_group
        return TorchWork(_gather([coll.all_reduce(t, op, group=g, async_op=True) for t in tensors]), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """Several all_reduces as one Work."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> TorchWork:
        """``reduce`` into the group-local root ``opts.rootRank``."""
        g = self.spmd_group
        op, root = spmd_op(opts), _root(opts)
        return TorchWork(_gather([coll.reduce(t, None, op, group=g, async_op=True, group_dst=root) for t in tensors]), tensors)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> TorchWork:
        """List form: ``outputs[i]`` gets the reduction of every rank's ``input_lists[i][rank]``."""
        g = self.spmd_group
        op = spmd_op(opts) if opts is not None else ReduceOp.SUM
        works = [coll.reduce_scatter(o, list(i), op, group=g, async_op=True) for o, i in zip(outputs, input_lists)]
        return TorchWork(_gather(works), outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TorchWork:
        """Tensor form (``reduce_scatter_tensor``)."""
        op = spmd_op(opts) if opts is not None else ReduceOp.SUM
        return TorchWork(coll.reduce_scatter_tensor(output, input, op, group=self.spmd_group, async_op=True), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """Several tensor-form reduce-scatters as one Work."""
        op = spmd_op(opts) if opts is not None else ReduceOp.SUM
        g = self.spmd_group
        works = [coll.reduce_scatter_tensor(o, i, op, group=g, async_op=True) for o, i in zip(outputs, inputs)]
        return TorchWork(_gather(works), outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -------------------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None) -> TorchWork:
        """``broadcast`` from the group-local root ``opts.rootRank``."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = _root(opts) if opts is not None else 0
        g = self.spmd_group
        return TorchWork(_gather([coll.broadcast(t, None, group=g, async_op=True, group_src=root) for t in tensors]), tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """List form: ``output_lists[i][r]`` receives rank r's ``inputs[i]``."""
        g = self.spmd_group
        works = [coll.all_gather(list(o), i, group=g, async_op=True) for o, i in zip(output_lists, inputs)]
        return TorchWork(_gather(works), [t for o in output_lists for t in o])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """``all_gather_coalesced``: ``output_lists[r][i]`` receives rank r's ``inputs[i]``.

        The transpose of ``allgather``'s layout (there the outer list is the
        input's index): one all_gather per input, into column i of the lists.
        """
        g = self.spmd_group
        if len(output_lists) != g.size or any(len(row) != len(inputs) for row in output_lists):
            raise ValueError(
                f"all_gather_coalesced: output_tensor_lists must hold one list per rank ({g.size}), each with one "
                f"tensor per input ({len(inputs)}); got {[len(row) for row in output_lists]}"
            )
        works = [coll.all_gather([row[i] for row in output_lists], t, group=g, async_op=True) for i, t in enumerate(inputs)]
        return TorchWork(_gather(works), [t for row in output_lists for t in row])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TorchWork:
        """Tensor form (``all_gather_into_tensor``)."""
        return TorchWork(coll.all_gather_into_tensor(output, input, group=self.spmd_group, async_op=True), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """Several tensor-form all-gathers as one Work."""
        g = self.spmd_group
        works = [coll.all_gather_into_tensor(o, i, group=g, async_op=True) for o, i in zip(outputs, inputs)]
        return TorchWork(_gather(works), outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> TorchWork:
        """``gather`` to ``opts.rootRank``: only the root passes output lists."""
        g, root = self.spmd_group, _root(opts)
        outputs = list(output_lists[0]) if output_lists else None
        work = coll.gather(inputs[0], outputs if g.rank == root else None, None, group=g, async_op=True, group_dst=root)
        return TorchWork(work, outputs or [])

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> TorchWork:
        """``scatter`` from ``opts.rootRank``: only the root passes input lists."""
        g, root = self.spmd_group, _root(opts)
        inputs = list(input_lists[0]) if input_lists and g.rank == root else None
        work = coll.scatter(outputs[0], inputs, None, group=g, async_op=True, group_src=root)
        return TorchWork(work, outputs)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int], opts: Any = None
    ) -> TorchWork:
        """Tensor form (``all_to_all_single``); empty split lists mean even splits."""
        g = self.spmd_group
        work = coll.all_to_all_single(output, input, list(output_splits) or None, list(input_splits) or None, group=g, async_op=True)
        return TorchWork(work, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """List form (``all_to_all``)."""
        return TorchWork(coll.all_to_all(list(outputs), list(inputs), group=self.spmd_group, async_op=True), outputs)

    def barrier(self, opts: Any = None) -> TorchWork:
        """Every rank of the group has arrived (``opts.timeout`` when set, else the group's)."""
        timeout = getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None
        return TorchWork(coll.barrier(group=self.spmd_group, async_op=True, timeout=seconds), [])

    # -- point to point ------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> TorchWork:
        """Send ``tensors[0]`` to group-local rank ``dst``."""
        return TorchWork(p2p.isend(tensors[0], group=self.spmd_group, tag=tag, group_dst=dst), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> TorchWork:
        """Receive ``tensors[0]`` from group-local rank ``src``."""
        return TorchWork(p2p.irecv(tensors[0], group=self.spmd_group, tag=tag, group_src=src), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TorchWork:
        """Refused: spmd's backend contract has no receive from any source."""
        raise NotImplementedError(
            "torch.distributed.recv without src= is not supported on the spmd backend: spmd's "
            "backends receive from a named rank; pass src="
        )


#: c10d method names that SpmdProcessGroup answers (for tests and ``spmd doctor``).
ROUTED: tuple[str, ...] = tuple(
    name for name, value in vars(SpmdProcessGroup).items() if callable(value) and not name.startswith("__")
)
