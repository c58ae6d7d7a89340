"""The one runtime that executes any valid program: compute, batched non-blocking transfers, metadata once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.comm.agreement import verify_agreement
from spmd.comm.collectives import all_reduce
from spmd.comm.p2p import start_checked
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.pipeline import microbatch
from spmd.pipeline.actions import Action, Kind
from spmd.pipeline.stage import PipelineStage
from spmd.pipeline.transfers import Batch, Transfer, batches, decode, encode, meta_buffer
from spmd.pipeline.validate import validated_programs


class Runtime:
    """One rank's executor of a schedule's program over its stages."""

    def __init__(
        self,
        cls: type,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        scale_grads: bool,
    ) -> None:
        stage_list = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stage_list:
            raise ValueError("pipeline schedule: give at least one PipelineStage")
        first = stage_list[0]
        self.group = first.group
        self.num_stages = first.num_stages
        self.world = self.group.size
        problem = None
        if any(s.group is not self.group or s.num_stages != self.num_stages for s in stage_list):
            problem = "pipeline schedule: every stage of one rank must have the same group and num_stages"
        elif self.num_stages != len(stage_list) * self.world:
            problem = f"pipeline schedule: {len(stage_list)} stage(s) on this rank x {self.world} ranks != {self.num_stages} stages"
        # one schedule for the whole pipeline: a rank with another schedule, microbatch count or a set-up error of
        # its own would leave its peers waiting in a send or receive until the timeout
        verify_agreement(
            [("schedule", getattr(cls, "name", cls.__name__)), ("stages", self.num_stages), ("stages per rank", len(stage_list)),
             ("microbatches", n_microbatches), ("scale_grads", scale_grads), ("set-up error", problem)],
            self.group, "pipeline schedule", "set up different pipelines", "Build the same schedule on every rank",
        )
        if problem is not None:
            raise ValueError(problem)
        self.stages = {s.stage_index: s for s in stage_list}
        self.m = n_microbatches
        self.loss_fn = loss_fn
        self.scale = 1.0 / n_microbatches if scale_grads else 1.0
        self.program = validated_programs(cls, self.num_stages, len(stage_list), n_microbatches)[self.group.rank]
        self.split_w = {(a.stage, a.microbatch) for a in self.program if a.kind == Kind.W}
        last = self.num_stages - 1
        if last in self.stages and loss_fn is None:
            raise ValueError("pipeline schedule: the rank of the last stage needs loss_fn=")
        self.sync_points = self._data_parallel_sync_points()
        self.sync_at = {i: s for s, i in self.sync_points.items()}
        self.last_backward = self._sharded_last_backwards(cls)
        self.sent_meta: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        # learnt from the upstream stage's metadata message in the first step, always: that stage sends one
        # per microbatch whatever this one knows (a stage's input_args only checks what arrives)
        self.recv_meta: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        self.plan = self._compile()

    def _compile(self) -> list[tuple[int, Callable[[Runtime, Any], None], Any]]:
        """The program as (program index, method, argument) steps, worked out once: ``step`` only runs them.

        Runs of transfers become one step each (with their peers, tags and
        labels computed here), FSDP's gradient-sync switch and DDP's reduction
        their own steps; the index is what an error names.
        """
        runs = batches(self.program, self.m, self.world)
        plan: list[tuple[int, Callable[[Runtime, Any], None], Any]] = []
        i = 0
        while i < len(self.program):
            if i in runs:
                batch, i_next = runs[i]
                plan.append((i, Runtime._post, batch))
                i = i_next
                continue
            a = self.program[i]
            if a.kind == Kind.F:
                plan.append((i, Runtime._forward, a))
            elif a.kind == Kind.B:
                if a.stage in self.last_backward:  # FSDP: reduce once, in the stage's last backward
                    plan.append((i, Runtime._gradient_sync, (a.stage, i == self.last_backward[a.stage])))
                plan.append((i, Runtime._backward, a))
            else:
                plan.append((i, Runtime._weight, a))
            if i in self.sync_at:
                plan.append((i, Runtime._reduce_grads, self.stages[self.sync_at[i]]))
            i += 1
        return plan

    def _data_parallel_sync_points(self) -> dict[int, int]:
        """For each stage whose module is data parallel (has ``no_sync``), the program index after which to reduce.

        DDP arms its reduction in forward for the next backward, which in a
        pipeline is some other microbatch's; so every forward runs under
        ``no_sync()`` and the runtime averages the stage's gradients over
        DDP's group once, after the stage's last backward (B, or W when split),
        as one flat all-reduce. DDP's communication hooks are not applied.
        """
        points: dict[int, int] = {}
        for s, stage in self.stages.items():
            if not hasattr(stage.submod, "no_sync"):
                continue
            # the last action that adds to the stage's weight gradients: a W, or a B (one that is not split
            # into B and W may come after another microbatch's W)
            points[s] = max(i for i, a in enumerate(self.program) if a.stage == s and a.kind in (Kind.B, Kind.W))
        return points

    def _sharded_last_backwards(self, cls: type) -> dict[int, int]:
        """For each stage whose module is ``fully_shard``-ed, the program index of its last backward.

        FSDP reduces in its own backward hooks: every microbatch's backward but
        the stage's last runs with gradient sync off (unsharded gradients
        accumulate locally) and the last one reduce-scatters them all, once.
        A schedule that splits backward into B and W cannot be used: FSDP's
        gradient hooks fire with the weight gradients, which W computes for
        parameters FSDP swaps in during forward.
        """
        points: dict[int, int] = {}
        for s, stage in self.stages.items():
            if not hasattr(stage.submod, "set_requires_gradient_sync"):
                continue
            if any(a.stage == s and a.kind == Kind.W for a in self.program):
                raise ValueError(
                    f"pipeline schedule {getattr(cls, 'name', cls.__name__)!r} splits backward into B and W, which a "
                    "fully_shard-ed stage cannot run; use gpipe, 1f1b or interleaved_1f1b with FSDP (or DDP with this one)"
                )
            points[s] = max(i for i, a in enumerate(self.program) if a.stage == s and a.kind == Kind.B)
        return points

    def _gradient_sync(self, arg: tuple[int, bool]) -> None:
        """FSDP: turn the stage's gradient reduction on for its last backward only."""
        stage, last = arg
        self.stages[stage].submod.set_requires_gradient_sync(last)  # type: ignore[operator]

    def _reduce_grads(self, stage: PipelineStage) -> None:
        module = stage.submod
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, op=ReduceOp.AVG, group=module.process_group)  # type: ignore[arg-type]
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- transfers --------------------------------------------------------------------------------
    def _post(self, batch: Batch) -> None:
        """Start every transfer of a run of consecutive SEND/RECV actions (receives are waited for when used),
        then prefetch the program's next receive."""
        g = self.group
        for t in batch.sends:
            if t.kind is Kind.SEND_F:
                out = self.outputs[t.key].detach()
                meta = (out.shape, out.dtype)
                known = self.sent_meta.get(t.key)
                if known is None:
                    self.sent_meta[t.key] = meta
                    self.sends.append(start_checked("send", encode(out), g, t.peer, t.meta_tag, t.label))
                elif known != meta:
                    raise ValueError(
                        f"pipeline: stage {t.key[0]}, microbatch {t.key[1]} now outputs {tuple(out.shape)} {out.dtype}, "
                        f"the first step sent {tuple(known[0])} {known[1]}; keep the batch shape or build a new schedule"
                    )
                self.sends.append(start_checked("send", out, g, t.peer, t.tag, t.label))
            else:
                self.sends.append(start_checked("send", self.input_grads.pop(t.key), g, t.peer, t.tag, t.label))
        metas: list[tuple[Transfer, torch.Tensor, Work]] = []
        for t in batch.recvs:
            if t.kind is Kind.RECV_F and t.key not in self.recv_meta:
                buf = meta_buffer()
                metas.append((t, buf, start_checked("recv", buf, g, t.peer, t.meta_tag, t.meta_label)))
        for t, buf, work in metas:
            work.wait()
            meta = self.recv_meta[t.key] = decode(buf)
            s, mb = t.key
            expected = self.stages[s].input_meta
            if expected is not None and (tuple(expected[0]), expected[1]) != (tuple(meta[0]), meta[1]):
                raise ValueError(
                    f"pipeline: stage {s} was built with input_args of {tuple(expected[0])} {expected[1]}, but stage "
                    f"{s - 1} sends microbatch {mb} as {tuple(meta[0])} {meta[1]}; fix input_args or the batch"
                )
        for t in batch.recvs:
            if t.pending not in self.pending:
                self._post_recv(t)
        self._prefetch(batch.prefetch)

    def _post_recv(self, t: Transfer) -> None:
        """Start one receive into a fresh buffer; ``_received`` waits for it."""
        if t.kind is Kind.RECV_F:
            shape, dtype = self.recv_meta[t.key]
            buf = torch.empty(shape, dtype=dtype, device=self.stages[t.key[0]].device)
        else:
            buf = torch.empty_like(self.outputs[t.key])
        self.pending[t.pending] = (start_checked("recv", buf, self.group, t.peer, t.tag, t.label), buf)

    def _prefetch(self, t: Transfer | None) -> None:
        """Post ``t``, the program's next receive after a run of transfers, early if its buffer's shape is known by now.

        The peer's matching send can then complete while this rank computes
        (a Gloo send waits for the receiver to post), instead of only once this
        rank reaches that receive. One receive ahead keeps 1F1B's bound on live
        activations (at most one buffer more).
        """
        if t is None:
            return
        known = t.key in self.recv_meta if t.kind is Kind.RECV_F else t.key in self.outputs
        if known and t.pending not in self.pending:
            self._post_recv(t)

    def _received(self, kind: Kind, stage: int, mb: int) -> torch.Tensor | None:
        item = self.pending.pop((kind, stage, mb), None)
        if item is None:
            return None
        work, buf = item
        work.wait()
        return buf

    # -- compute ----------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        stage = self.stages[s]
        if s == 0:
            x = self.inputs_mb[mb]
        else:
            received = self._received(Kind.RECV_F, s, mb)
            x = (received if received is not None else self.outputs[(s - 1, mb)].detach())
            if x.is_floating_point():
                x.requires_grad_(True)
        if s in self.sync_points:
            with stage.submod.no_sync():  # type: ignore[operator]
                out = stage.submod(x)
        else:
            out = stage.submod(x)
        if stage.is_last:
            assert self.loss_fn is not None
            self.final_outputs[mb] = out.detach()
            loss = self.loss_fn(out, self.targets_mb[mb])
            self.losses[mb] = loss.detach()
            out = loss  # (scaled in _backward, through the gradient it starts from)
        self.inputs[(s, mb)] = x
        self.outputs[(s, mb)] = out

    def _backward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        key = (s, mb)
        out = self.outputs[key]
        grad: torch.Tensor | None = None
        if s != self.num_stages - 1:
            grad = self._received(Kind.RECV_B, s, mb)
            if grad is None:
                grad = self.input_grads.pop((s + 1, mb))
        elif self.scale != 1.0 and out.numel() == 1:
            # the gradient of loss * scale, without that product's node in every microbatch's graph: the
            # same values as its backward (ones times the scale, one mul kernel); a loss that is not a
            # scalar keeps grad None, so backward raises torch's own error for it as before
            grad = torch.ones_like(out).mul_(self.scale)
        x = self.inputs[key]
        wants_input = s > 0 and x.requires_grad
        if key in self.split_w:
            if wants_input:
                (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
                self.input_grads[key] = gx
            self.weight_work[key] = (out, grad)
        else:
            torch.autograd.backward(out, grad)
            if wants_input:
                assert x.grad is not None
                self.input_grads[key] = x.grad
        del self.outputs[key]
        if key not in self.split_w:
            del self.inputs[key]

    def _weight(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        out, grad = self.weight_work.pop(key)
        params = [p for p in self.stages[a.stage].submod.parameters() if p.requires_grad]
        if params:
            torch.autograd.backward(out, grad, inputs=params)
        del self.inputs[key]

    # -- one step ---------------------------------------------------------------------------------
    def step(self, args: Sequence[torch.Tensor], target: torch.Tensor | None, losses: list[torch.Tensor] | None) -> Any:
        """Run this rank's program once; return the merged outputs on the last stage's rank, else None."""
        has_first, has_last = 0 in self.stages, self.num_stages - 1 in self.stages
        if has_first:
            if len(args) != 1:
                raise TypeError(f"pipeline step: the rank of stage 0 takes one input tensor, got {len(args)}")
            self.inputs_mb = microbatch.split(args[0], self.m, "the input")
        elif args:
            raise TypeError("pipeline step: only the rank of stage 0 takes an input")
        if has_last:
            if target is None:
                raise TypeError("pipeline step: the rank of the last stage needs target=")
            self.targets_mb = microbatch.split(target, self.m, "the target")
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.weight_work: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pending: dict[tuple[Kind, int, int], tuple[Work, torch.Tensor]] = {}
        self.sends: list[Work] = []
        self.final_outputs: dict[int, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        program, i = self.program, 0
        try:
            for i, run, arg in self.plan:  # noqa: B007  (i: where an error happened, for the handler below)
                run(self, arg)
            i = len(program)
            for work in self.sends:
                work.wait()
        except Exception as error:
            if self.group.unusable is None:  # this rank's own failure: its peers would wait for it to the timeout
                where = f"{program[i]}" if i < len(program) else "the final sends"
                self.group.mark_unusable(f"group rank {self.group.rank} raised in pipeline step at {where}: "
                                         f"{type(error).__name__}: {error}")
            raise
        finally:
            self.sends = []
            self.inputs_mb = []
            self.targets_mb = []
        if not has_last:
            return None
        if losses is not None:
            losses.clear()
            losses.extend(self.losses[mb] for mb in range(self.m))
        return microbatch.merge([self.final_outputs[mb] for mb in range(self.m)])
