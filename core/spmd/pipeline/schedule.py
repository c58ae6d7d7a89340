"""The Schedule contract: a class with a ``name`` and a ``programs`` generator; the runtime does the rest."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from spmd.pipeline.actions import Action
from spmd.pipeline.stage import PipelineStage


class Schedule:
    """A pipeline schedule: subclass it, set ``name``, write ``programs``; register it through ``spmd_schedules``.

    ``programs(num_stages, stages_per_rank, n_microbatches)`` returns
    ``{rank: [Action, ...]}``; it is validated once per arguments, so a
    buggy program fails when the schedule is built, never as a hang.
    Instantiating the class gives the runtime of one rank, which executes
    that rank's program; a third party writes only the generator::

        class Reverse1F1B(spmd.pipeline.Schedule):
            name = "mine"

            @classmethod
            def programs(cls, num_stages, stages_per_rank, n_microbatches):
                compute = {...}                       # F and B order per rank
                return spmd.pipeline.with_communication(compute, num_stages)

    Runtime conventions (those of torch.distributed.pipelining): ``step(x)``
    on the rank of stage 0 splits ``x`` along dim 0 into ``n_microbatches``
    with ``torch.tensor_split``, ``step(target=y, losses=losses)`` on the
    rank of the last stage splits ``y`` the same way, computes
    ``loss_fn(output, target)`` per microbatch, fills ``losses`` with them
    (unscaled) and returns the outputs concatenated. Gradients are those of
    the mean over microbatches (``scale_grads=True``, for a mean-reducing
    loss; False for a summing one): spmd divides each microbatch's loss by
    M before its backward, where torch divides ``.grad`` afterwards, so
    gradients accumulated over several steps are not rescaled.
    """

    name: ClassVar[str] = ""
    #: How many stages per rank the schedule expects when not told (interleaved: 2).
    stages_per_rank: ClassVar[int] = 1
    #: True: wins over a same-named schedule of another plugin.
    overrides: ClassVar[bool] = False

    @classmethod
    def programs(cls, num_stages: int, stages_per_rank: int, n_microbatches: int) -> Mapping[int, Sequence[Action]]:
        """One program per rank; stage s lives on rank s % (num_stages // stages_per_rank)."""
        raise NotImplementedError(f"{cls.__qualname__} must define the classmethod programs()")

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        scale_grads: bool = True,
    ) -> None:
        from spmd.pipeline.runtime import Runtime

        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._runtime = Runtime(type(self), stages, n_microbatches, loss_fn, scale_grads)

    @property
    def program(self) -> tuple[Action, ...]:
        """This rank's validated program."""
        return self._runtime.program

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None, losses: list[torch.Tensor] | None = None) -> Any:
        """Run one pipeline step (forward and backward of every microbatch); the last stage returns the outputs."""
        return self._runtime.step(args, target, losses)
