"""spmd: backend-agnostic distributed training for PyTorch, where every piece is a plugin.

The public face mirrors ``torch.distributed``, so ``import spmd as dist``
needs few other edits::

    import spmd, torch
    spmd.init("gloo")                       # or spmd.init() under `spmd run`
    t = torch.ones(4) * spmd.get_rank()
    spmd.all_reduce(t, op=spmd.ReduceOp.SUM)
"""

from spmd import (  # noqa: E402 - after the names above: strategies, schedules and checkpoints need them
    checkpoint,
    parallel,
    pipeline,
)
from spmd.comm.backend import Backend, BackendContext, BackendSpec
from spmd.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from spmd.comm.group import ProcessGroup
from spmd.comm.init import (
    get_backend,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    is_available,
    is_backend_available,
    new_group,
    split_group,
)
from spmd.comm.monitored import monitored_barrier
from spmd.comm.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from spmd.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.state import GroupMember, is_initialized
from spmd.comm.subgroups import new_subgroups, new_subgroups_by_enumeration
from spmd.comm.work import Work
from spmd.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
    NotInitializedError,
    NotProvidedError,
    PluginConflictError,
    PluginSpecError,
    SpmdError,
)
from spmd.interop import register as _register_torch_backend
from spmd.markers import hookimpl, hookspec
from spmd.mesh import DeviceMesh, init_device_mesh
from spmd.registry import Overriding
from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from spmd.world import destroy_process_group, init, init_process_group

__version__ = "0.1.0"

#: torch.distributed's old name for ReduceOp (``dist.reduce_op.SUM``), kept so old scripts port unchanged.
reduce_op = ReduceOp

# torch.distributed.init_process_group("spmd") works once spmd is imported (a few dict entries, no I/O).
_register_torch_backend()

__all__ = [
    "Backend",
    "BackendContext",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DTensor",
    "DeviceMesh",
    "GroupMember",
    "NotInitializedError",
    "NotProvidedError",
    "Overriding",
    "P2POp",
    "Partial",
    "Placement",
    "PluginConflictError",
    "PluginSpecError",
    "ProcessGroup",
    "ReduceOp",
    "Replicate",
    "Shard",
    "SpmdError",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "checkpoint",
    "destroy_process_group",
    "distribute_tensor",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "hookimpl",
    "hookspec",
    "init",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "parallel",
    "pipeline",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "split_group",
]
