"""MixedPrecisionPolicy: the dtypes FSDP gathers parameters in and reduces gradients in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; master weights keep their dtype.

    ``param_dtype`` (e.g. ``torch.bfloat16``): each unit's parameters are cast
    to it before the all-gather (so the all-gather moves half the bytes) and the
    module computes with them; floating-point forward inputs are cast to it too.
    ``reduce_dtype``: the dtype of the gradient reduce-scatter (and of HSDP's
    all-reduce); None means ``param_dtype``. The sharded parameters, their
    gradients and the optimizer state stay in the parameters' own dtype
    (usually float32). None everywhere: no casts at all.

        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype the module computes in for parameters stored in ``orig``."""
        return self.param_dtype or orig

    def gradient_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in for parameters stored in ``orig``."""
        return self.reduce_dtype or self.param_dtype or orig
