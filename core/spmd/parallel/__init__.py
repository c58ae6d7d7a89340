"""Parallelism strategies: the strategy registry, the builtin DistributedDataParallel and fully_shard (FSDP).

    import spmd
    from spmd.parallel import DistributedDataParallel as DDP

    spmd.init()
    model = DDP(model)                        # or spmd.parallel.get_strategy("ddp").apply(model)
    fully_shard(block); fully_shard(model)    # or spmd.parallel.get_strategy("fsdp").apply(model)
"""

from spmd.parallel import tp as _tp
from spmd.parallel.buckets import GradBucket
from spmd.parallel.comm_hooks import (
    CommHook,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    get_hook,
    hook_names,
    register_hook,
)
from spmd.parallel.ddp import DistributedDataParallel
from spmd.parallel.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    get_full_state_dict,
    is_fully_sharded,
    load_full_state_dict,
)
from spmd.parallel.grad_norm import clip_grad_norm_
from spmd.parallel.registry import StrategyNotFoundError, StrategySpec, get_strategy, strategy_names
from spmd.parallel.tp import *  # noqa: F403 - tensor parallelism's names, listed once (spmd.tensor.parallel.__all__)

__all__ = [
    *_tp.__all__,
    "clip_grad_norm_",
    "CommHook",
    "CPUOffloadPolicy",
    "DistributedDataParallel",
    "FSDPModule",
    "GradBucket",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "StrategyNotFoundError",
    "StrategySpec",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "fully_shard",
    "get_full_state_dict",
    "get_hook",
    "get_strategy",
    "hook_names",
    "is_fully_sharded",
    "load_full_state_dict",
    "register_hook",
    "strategy_names",
    "UnshardHandle",
]
