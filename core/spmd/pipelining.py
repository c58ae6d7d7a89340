"""Mirror of ``torch.distributed.pipelining``: torch's stage and schedule classes over spmd's runtime.

Thin adapters (home: ``spmd.pipeline``): each class takes torch's constructor
arguments and ``step(*args, target=None, losses=None, ...)`` and runs the
schedule of the same kind from spmd's registry (``gpipe``, ``1f1b``,
``interleaved_1f1b``, ``zb_h1``). What spmd's runtime does not do yet (several
inputs per stage, chunk specs, keyword inputs) raises ``NotYetInSpmdError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from spmd._mirror import missing_names
from spmd.errors import NotYetInSpmdError
from spmd.pipeline.registry import get_schedule
from spmd.pipeline.stage import PipelineStage as _Stage

__all__ = [
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
]


def _not_yet(what: str, hint: str) -> NotYetInSpmdError:
    return NotYetInSpmdError(f"torch.distributed.pipelining: {what} is not yet in spmd; the closest spmd way is {hint}")


def _one(value: Any, what: str) -> torch.Tensor | None:
    """A single tensor from torch's ``Tensor | tuple[Tensor, ...]`` (spmd stages take one input tensor)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 1:
            raise _not_yet(f"a stage with {len(value)} {what}", "one tensor per stage: pack several into one (torch.cat/stack)")
        return value[0]
    return value


class PipelineStage(_Stage):
    """torch's ``PipelineStage(submodule, stage_index, num_stages, device, input_args=None, ...)`` as spmd's stage.

    ``input_args`` (one tensor) is checked against what arrives; ``output_args``
    and the gradient examples are not needed (spmd learns the shapes in the
    first step); ``group`` defaults to the world.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_grads: Any = None,
        input_grads: Any = None,
        group: Any = None,
        dw_builder: Callable[[], Callable[..., None]] | None = None,
        get_mesh: Any = None,
    ) -> None:
        if dw_builder is not None:
            raise _not_yet("dw_builder=", "a schedule that splits backward itself: spmd.pipeline.get_schedule('zb_h1')")
        if get_mesh is not None:
            raise _not_yet("get_mesh=", "give the pipeline's group (mesh.get_group('pp')) as group=")
        _one(output_args, "outputs")
        super().__init__(submodule, stage_index, num_stages, device, group, input_args=_one(input_args, "inputs"))


class _TorchSchedule:
    """A torch schedule class: torch's arguments, run by the spmd schedule named ``spmd_name``."""

    spmd_name: ClassVar[str]

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        if args_chunk_spec is not None or kwargs_chunk_spec is not None or output_merge_spec is not None:
            raise _not_yet("args_chunk_spec/kwargs_chunk_spec/output_merge_spec", "the default: spmd splits the input "
                           "and target along dim 0 (torch.tensor_split) and concatenates the outputs along dim 0")
        self._stages = stages
        self._schedule = get_schedule(self.spmd_name)(stages, n_microbatches, loss_fn, scale_grads=scale_grads)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn

    def step(
        self,
        *args: torch.Tensor,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One pipeline step: forward and backward of every microbatch; the last stage's rank gets the outputs."""
        if kwargs or loss_kwargs:
            raise _not_yet("keyword inputs to step()", "one positional input tensor on the first stage's rank, "
                           "and target= on the last stage's rank")
        out = self._schedule.step(*args, target=target, losses=losses)
        return out if return_outputs else None


class ScheduleGPipe(_TorchSchedule):
    """All forwards, then all backwards (spmd's ``gpipe``)."""

    spmd_name = "gpipe"


class Schedule1F1B(_TorchSchedule):
    """One forward, one backward (spmd's ``1f1b``)."""

    spmd_name = "1f1b"


class ScheduleInterleaved1F1B(_TorchSchedule):
    """Several stages per rank, stage s on rank s % ranks (spmd's ``interleaved_1f1b``); takes a list of stages."""

    spmd_name = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(_TorchSchedule):
    """Zero-bubble with backward split into B and W: spmd's ``zb_h1``, one stage per rank only so far."""

    spmd_name = "zb_h1"

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int, *args: Any, **kwargs: Any) -> None:
        stage_list: list[PipelineStage] = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if len(stage_list) != 1:
            raise _not_yet(f"ScheduleInterleavedZeroBubble with {len(stage_list)} stages per rank",
                           "ScheduleInterleaved1F1B for several stages per rank, or one stage per rank here (ZB-H1)")
        super().__init__(stage_list, n_microbatches, *args, **kwargs)


_TRACER = (
    "cut the model by hand: spmd.pipeline.split_module(model, split_points) (or your own nn.Sequential pieces), "
    "then PipelineStage(piece, stage_index, num_stages, device) for this rank's piece"
)

#: torch.distributed.pipelining names spmd does not have yet -> the closest spmd way.
MISSING = {
    "Pipe": _TRACER,
    "pipe_split": _TRACER,
    "SplitPoint": _TRACER,
    "pipeline": _TRACER,
    "build_stage": "PipelineStage(piece, stage_index, num_stages, device) built from this rank's piece",
    "ScheduleLoopedBFS": "ScheduleInterleaved1F1B (several stages per rank), or a schedule plugin "
    "(subclass spmd.pipeline.Schedule, write programs(); docs/pipeline.md)",
    "ScheduleZBVZeroBubble": "ScheduleInterleavedZeroBubble with one stage per rank (spmd's zb_h1), or a schedule "
    "plugin for the V placement (docs/pipeline.md)",
    "ScheduleDualPipeV": "ScheduleInterleaved1F1B, or a schedule plugin (subclass spmd.pipeline.Schedule; docs/pipeline.md)",
}

__getattr__ = missing_names(__name__, MISSING)
