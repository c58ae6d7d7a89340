"""PipelineStage: one piece of the model on one rank, and ``split_module`` to cut a model into pieces."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from spmd.comm.group import ProcessGroup
from spmd.comm.state import resolve_group


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: a submodule, where it runs, and the group of the pipeline.

    Stage s must live on group rank s % group size (the schedules' contract);
    a rank may hold several stages (interleaved schedules) by making several
    PipelineStage objects and passing the list to the schedule. The shapes
    of received activations are learnt by one metadata message per
    microbatch in the first step (``input_args``, an example microbatch input
    of this stage, is checked against them: a clear error instead of a
    wrong-shaped stage); later steps must keep the batch shape.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        group: ProcessGroup | None = None,
        *,
        input_args: torch.Tensor | None = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} is outside 0..{num_stages - 1}")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = resolve_group(group)
        world = self.group.size
        if num_stages % world:
            raise ValueError(f"PipelineStage: {num_stages} stages do not spread evenly over the group's {world} ranks")
        if stage_index % world != self.group.rank:
            raise ValueError(
                f"PipelineStage: stage {stage_index} lives on group rank {stage_index % world} (stage s on rank "
                f"s % {world}), but this is group rank {self.group.rank}"
            )
        self.input_meta: tuple[torch.Size, torch.dtype] | None = (
            (input_args.shape, input_args.dtype) if input_args is not None else None
        )

    @property
    def is_first(self) -> bool:
        """True for stage 0 (it takes the batch)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, group={self.group.name!r})"


def split_module(module: nn.Module, split_points: Sequence[int] | None = None, *, num_stages: int | None = None) -> list[nn.Sequential]:
    """Cut an ``nn.Sequential`` (or a module whose ``layers`` is a list of modules) into stages.

    ``split_points`` are the indices where a new stage begins (``[2, 4]``
    gives layers [0:2], [2:4], [4:]); or give ``num_stages`` to cut into
    pieces as even as possible. The pieces share the original layers (no
    copy); build each rank's stage from its piece and drop the rest.

    >>> stages = split_module(nn.Sequential(*layers), num_stages=4)
    """
    layers = list(module) if isinstance(module, nn.Sequential) else list(getattr(module, "layers", []))
    if not layers:
        raise TypeError(f"split_module: {type(module).__name__} is not an nn.Sequential and has no `layers` list")
    if split_points is None:
        if num_stages is None or not 1 <= num_stages <= len(layers):
            raise ValueError(f"split_module: give split_points or num_stages in 1..{len(layers)}")
        base, extra = divmod(len(layers), num_stages)
        bounds, at = [], 0
        for i in range(num_stages - 1):
            at += base + (1 if i < extra else 0)
            bounds.append(at)
        split_points = bounds
    points = [0, *split_points, len(layers)]
    if any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"split_module: split points {list(split_points)} must increase strictly inside 1..{len(layers) - 1}")
    return [nn.Sequential(*layers[a:b]) for a, b in zip(points, points[1:], strict=False)]
