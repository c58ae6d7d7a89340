"""Mirror of ``torch.distributed.fsdp``: FSDP2's ``fully_shard`` API (home: ``spmd.parallel.fsdp``).

torch's FSDP1 wrapper (``FullyShardedDataParallel`` and its configuration
classes) is not mirrored: spmd has only the per-module ``fully_shard``.
"""

from spmd._mirror import missing_names
from spmd.parallel.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
)

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard"]

_FSDP1 = (
    "spmd's FSDP2 API: fully_shard(block) for each block, then fully_shard(model) "
    "(spmd.fsdp.fully_shard; torch's migration guide from FSDP1 to FSDP2 applies as is)"
)
_STATE_DICT = (
    "spmd.checkpoint.state_dict.get_state_dict/set_state_dict with "
    "StateDictOptions(full_state_dict=..., cpu_offload=...) instead of FSDP1's state_dict_type"
)

#: torch.distributed.fsdp names spmd does not have yet -> the closest spmd way.
MISSING = {
    "FullyShardedDataParallel": _FSDP1,
    "BackwardPrefetch": _FSDP1 + "; fully_shard prefetches the next unit's all-gather in forward and backward itself",
    "CPUOffload": _FSDP1 + "; CPU offloading is not yet in spmd",
    "MixedPrecision": "spmd.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) passed as fully_shard(mp_policy=...)",
    "ShardingStrategy": "fully_shard(mesh=...): a 1-D mesh is FULL_SHARD, a 2-D (replicate, shard) mesh is HYBRID_SHARD; "
    "reshard_after_forward=False is SHARD_GRAD_OP",
    "StateDictType": _STATE_DICT,
    "StateDictConfig": _STATE_DICT,
    "StateDictSettings": _STATE_DICT,
    "FullStateDictConfig": _STATE_DICT,
    "ShardedStateDictConfig": _STATE_DICT,
    "LocalStateDictConfig": _STATE_DICT,
    "OptimStateDictConfig": _STATE_DICT,
    "FullOptimStateDictConfig": _STATE_DICT,
    "ShardedOptimStateDictConfig": _STATE_DICT,
    "LocalOptimStateDictConfig": _STATE_DICT,
    "OptimStateKeyType": _STATE_DICT + " (optimizer state is keyed by parameter names)",
    "DataParallelMeshDims": "apply tensor parallelism first, then fully_shard(module, mesh=mesh['dp']): spmd shards the TP "
    "DTensors again over the data-parallel mesh dimension",
    "register_fsdp_forward_method": "call the module's forward (fully_shard hooks forward only); route other methods through forward",
    "share_comm_ctx": "no counterpart yet (a CUDA-stream sharing optimisation for several FSDP roots); leave the call out",
}

__getattr__ = missing_names(__name__, MISSING)
