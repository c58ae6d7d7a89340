"""spmd as torch.distributed's process group, and torch.distributed's world under spmd.

``spmd.init`` registers a torch.distributed backend called ``"spmd"`` and
initialises torch's default group with it (unless ``torch_interop=False``,
``SPMD_TORCH_INTEROP=0``, or torch.distributed was initialised first, in which
case spmd reuses torch's rank, world size and store). Every c10d call on that
group (``torch.distributed.all_reduce``, torch's DDP, functional collectives,
``DistributedSampler``'s rank and world size) then runs on spmd's group and
so on whichever spmd backend it uses: Gloo, MPI, UCC or a third party's.
"""

from spmd.interop.bridge import (
    BACKEND_NAME,
    attach,
    detach,
    interop_requested,
    register,
    started_by_torch,
    torch_world,
)
from spmd.interop.process_group import SpmdProcessGroup
from spmd.interop.work import TorchWork

__all__ = [
    "BACKEND_NAME",
    "SpmdProcessGroup",
    "TorchWork",
    "attach",
    "detach",
    "interop_requested",
    "register",
    "started_by_torch",
    "torch_world",
]
