"""spmd.tensor: placements, DTensor, redistribution and the sharding-rule contract.

Mirrors ``torch.distributed.tensor``: a torch script ports by changing its imports
(``torch.distributed.tensor`` -> ``spmd.tensor``; ``.parallel`` and ``.experimental``
too). torch's names spmd lacks raise ``spmd.errors.NotYetInSpmdError`` naming the
closest spmd way (docs/porting.md lists every name).
"""

from spmd._mirror import missing_names
from spmd.mesh import DeviceMesh, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dtensor import DTensor, distribute_tensor
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
    "distribute_tensor",
    "init_device_mesh",
    "linear_pointwise_rule",
    "pointwise_rule",
    "replicate_rule",
]

#: torch.distributed.tensor names spmd does not have yet -> the closest spmd way.
MISSING = {
    "distribute_module": "spmd.tensor.parallel.parallelize_module(module, mesh, plan) with ParallelStyles, "
    "or distribute_tensor on each parameter (register_parameter with the DTensor)",
    "zeros": "spmd.distribute_tensor(torch.zeros(size), mesh, placements) (or DTensor.from_local of a local shard)",
    "ones": "spmd.distribute_tensor(torch.ones(size), mesh, placements) (or DTensor.from_local of a local shard)",
    "empty": "spmd.distribute_tensor(torch.empty(size), mesh, placements) (or DTensor.from_local of a local shard)",
    "full": "spmd.distribute_tensor(torch.full(size, value), mesh, placements)",
    "rand": "spmd.distribute_tensor(torch.rand(size), mesh, placements) after torch.manual_seed with the same seed on "
    "every rank (rank 0's values are broadcast by default)",
    "randn": "spmd.distribute_tensor(torch.randn(size), mesh, placements) after torch.manual_seed with the same seed on "
    "every rank (rank 0's values are broadcast by default)",
}

__getattr__ = missing_names(__name__, MISSING)
