"""FSDP's policies, with torch's fields: MixedPrecisionPolicy (dtypes) and OffloadPolicy / CPUOffloadPolicy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; master weights keep their dtype.

    ``param_dtype`` (e.g. ``torch.bfloat16``): each unit's parameters are cast
    to it before the all-gather (so the all-gather moves half the bytes) and the
    module computes with them. ``reduce_dtype``: the dtype of the gradient
    reduce-scatter (and of HSDP's all-reduce); None means ``param_dtype``.
    ``output_dtype``: floating-point forward outputs are cast to it (None: no
    cast). ``cast_forward_inputs``: with a ``param_dtype``, floating-point
    forward inputs are cast to it before the module's forward (for a
    ``fully_shard([a, b])`` group: before each module's forward). The sharded
    parameters, their gradients and the optimizer state stay in the parameters'
    own dtype (usually float32). The fields and their meaning are torch's.

        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype the module computes in for parameters stored in ``orig``."""
        return self.param_dtype or orig

    def gradient_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in for parameters stored in ``orig``."""
        return self.reduce_dtype or self.param_dtype or orig


@dataclass
class OffloadPolicy:
    """No offloading (``fully_shard``'s default): the sharded parameters stay where the module's parameters are."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Torch's CPU offload: sharded parameters, gradients and optimizer state on the CPU.

    spmd accepts it where the parameters already are on the CPU, where it
    changes nothing (they, their gradients and the optimizer state are on the
    CPU already). spmd does not move accelerator parameters to the CPU:
    ``fully_shard`` raises NotImplementedError for them instead of pretending
    to offload. ``pin_memory`` is torch's field (pinning needs an accelerator).
    """

    pin_memory: bool = True
