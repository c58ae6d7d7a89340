"""spmd.tensor: placements, DTensor, redistribution and the sharding-rule contract.

Mirrors ``torch.distributed.tensor``: a torch script ports by changing its imports
(``torch.distributed.tensor`` -> ``spmd.tensor``; ``.parallel`` and ``.experimental``
too). torch's names spmd lacks raise ``spmd.errors.NotYetInSpmdError`` naming the
closest spmd way (docs/porting.md lists every name).
"""

from spmd._mirror import missing_names
from spmd.mesh import DeviceMesh, init_device_mesh
from spmd.tensor.creation import empty, full, ones, rand, randn, zeros
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dispatch import dispatcher as _dispatcher  # noqa: F401 - installs DTensor._dispatcher
from spmd.tensor.dtensor import DTensor, distribute_tensor
from spmd.tensor.module import distribute_module
from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.rule import (
    Decompose,
    LocalInfo,
    OpCall,
    Rule,
    Sharding,
    TensorArg,
    TensorMeta,
    linear_pointwise_rule,
    pointwise_rule,
    replicate_rule,
)

__all__ = [
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "Decompose",
    "LocalInfo",
    "OpCall",
    "Partial",
    "Placement",
    "Replicate",
    "Rule",
    "Shard",
    "Sharding",
    "TensorArg",
    "TensorMeta",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "ones",
    "rand",
    "randn",
    "zeros",
    "init_device_mesh",
    "linear_pointwise_rule",
    "pointwise_rule",
    "replicate_rule",
]

#: torch.distributed.tensor names spmd does not have yet -> the closest spmd way.
MISSING: dict[str, str] = {}

__getattr__ = missing_names(__name__, MISSING)
