"""Mirror of torch's deprecated ``torch.distributed._tensor`` (pytorch/examples still import from it).

The same names as ``spmd.tensor``; ``spmd._tensor.device_mesh`` mirrors the old mesh path.
"""

from spmd._mirror import missing_names
from spmd.mesh import DeviceMesh, init_device_mesh
from spmd.tensor import (
    MISSING,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    ones,
    rand,
    randn,
    zeros,
)

__all__ = [
    "DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module", "distribute_tensor",
    "empty", "full", "init_device_mesh", "ones", "rand", "randn", "zeros",
]

__getattr__ = missing_names("spmd.tensor", MISSING)
