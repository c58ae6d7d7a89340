"""The Reducer: averages gradients across a group bucket by bucket, overlapping backward.

Each parameter gets a post-accumulate-grad hook. When a parameter's gradient
is ready its hook moves it into the parameter's slot of a flat bucket buffer
(and points ``param.grad`` at that slot, so the averaged result needs no copy
back); when a bucket's last gradient is in, the bucket's all-reduce starts at
once, asynchronously, in bucket order so every rank issues the same sequence.
A callback queued on the autograd engine waits for every bucket at the end of
backward, so ``loss.backward()`` returns with averaged gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Variable

from spmd.comm.collectives import all_reduce, broadcast
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.errors import SpmdError
from spmd.parallel.buckets import GradBucket, assign_buckets, assign_buckets_in_order
from spmd.parallel.comm_hooks import CommHook
from spmd.parallel.graph import reached_parameters

_DONE = Work.completed()


class Reducer:
    """Bucketed, overlapped gradient averaging for one list of parameters over one group."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: ProcessGroup,
        bucket_cap_bytes: int,
        first_bucket_bytes: int,
        find_unused_parameters: bool,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        #: What gradients are divided by before the sum; None means the group size. Set by
        #: ``join()`` when only the active ranks count.
        self.divisor: int | None = None
        self._cap, self._first_cap = bucket_cap_bytes, first_bucket_bytes
        n = len(self.params)
        self.buckets: list[GradBucket] = []
        self._layout(assign_buckets(self.params, bucket_cap_bytes, first_bucket_bytes))
        # Bucket rebuild (as torch, and like it only without find_unused_parameters): the first
        # reducing backward records the order gradients became ready; the next forward rebuilds
        # the buckets along group rank 0's order, once.
        self._order: list[int] | None = None if find_unused_parameters else []
        self._recorded: list[int] = []
        self._rebuild_due = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]
        # Per-iteration state.
        self._armed = False  # the coming backward reduces (set by the forward)
        self._started = False  # a hook of this backward has run
        self._pending: list[int] = []
        self._ready = bytearray(n)
        self._next = 0
        self._works: list[Work] = []
        self._unused: list[int] = []
        self._used_work: Work | None = None
        self._used_map: torch.Tensor | None = None

    def _layout(self, assignment: list[list[int]]) -> None:
        """Make the buckets for ``assignment`` (indices per bucket, in launch order); existing
        gradients move into their new slots."""
        n = len(self.params)
        self._bucket_of = [0] * n
        self._views: list[torch.Tensor] = [torch.empty(0)] * n
        self.buckets = []
        for b, indices in enumerate(assignment):
            bucket = GradBucket(b, [self.params[i] for i in indices], indices, [self.names[i] for i in indices], self.group)
            for i, view in zip(indices, bucket.views):
                self._bucket_of[i] = b
                self._views[i] = view
            self.buckets.append(bucket)
        if self.buckets:
            self.buckets[-1]._is_last = True
        self._bucket_sizes = [len(b.param_indices) for b in self.buckets]
        for i, param in enumerate(self.params):
            if param.grad is not None:  # keep an existing gradient, now inside its bucket
                self._views[i].copy_(param.grad)
                param.grad = self._views[i]

    def _rebuild(self) -> None:
        """Re-cut the buckets along the first iteration's gradient-ready order (group rank 0's)."""
        self._rebuild_due = False
        recorded = self._recorded
        seen = set(recorded)
        order = recorded + [i for bucket in self.buckets for i in bucket.param_indices if i not in seen]
        if self.group.size > 1:
            shared = torch.tensor(order, dtype=torch.int64)
            broadcast(shared, group=self.group, group_src=0)
            order = shared.tolist()
        assignment = assign_buckets_in_order(self.params, order, self._cap, self._first_cap)
        if assignment != [bucket.param_indices for bucket in self.buckets]:
            self._layout(assignment)

    def _hook_for(self, index: int) -> Any:
        ready = self._grad_ready

        def hook(param: torch.Tensor) -> None:
            ready(index, param)

        return hook

    # -- iteration -------------------------------------------------------------------
    def prepare(self, output: Any) -> None:
        """Arm the reduction for the backward of this forward's ``output``."""
        if self._rebuild_due:
            self._rebuild()
        self._reset()
        self._armed = True
        self._pending = list(self._bucket_sizes)
        if self.find_unused_parameters:
            reached = reached_parameters(output)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]

    def disarm(self) -> None:
        """The coming backward only accumulates locally (``no_sync`` or no grad)."""
        self._reset()

    def _reset(self) -> None:
        self._armed = self._started = False
        self._ready = bytearray(len(self.params))
        self._next = 0
        self._works = []
        self._unused = []
        self._used_work = self._used_map = None

    def _start(self) -> None:
        """The first hook of a reducing backward: queue the final wait, settle unused parameters."""
        self._started = True
        Variable._execution_engine.queue_callback(self._finalize)
        if self.find_unused_parameters:
            used = torch.ones(len(self.params), dtype=torch.int32)
            for i in self._unused:
                if self.params[i].grad is None:
                    used[i] = 0
            self._used_map = used
            self._used_work = all_reduce(used, ReduceOp.MAX, group=self.group, async_op=True)
            for i in self._unused:
                self._mark_ready(i, self.params[i], unused=True)

    # -- hooks -----------------------------------------------------------------------
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._armed:
            return
        if not self._started:
            self._start()
        self._mark_ready(index, param)

    def _mark_ready(self, index: int, param: torch.Tensor, unused: bool = False) -> None:
        if self._ready[index]:
            raise SpmdError(
                f"DistributedDataParallel: parameter {self.names[index]!r} got a gradient twice in one "
                "backward (reentrant checkpointing, a second backward through the same graph, or a "
                "parameter marked unused that still received a gradient); reduce each gradient once"
            )
        self._ready[index] = 1
        if self._order is not None and not unused:
            self._order.append(index)
        view = self._views[index]
        grad = param.grad
        divisor = self.divisor or self.group.size
        divide = self.comm_hook is None and self.group.size > 1 and divisor > 1
        if grad is view:
            if divide:
                view.div_(divisor)
        elif grad is not None:
            if divide:
                torch.div(grad, divisor, out=view)  # the average's division, fused into the copy
            else:
                view.copy_(grad)
            param.grad = view
        elif unused:
            view.zero_()  # no local contribution; param.grad stays None unless another rank has one
        b = self._bucket_of[index]
        self._pending[b] -= 1
        if not self._pending[b] and b == self._next:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start every ready bucket from the next one on, in bucket order (the same on every rank)."""
        pending, buckets = self._pending, self.buckets
        while self._next < len(buckets) and not pending[self._next]:
            self._works.append(self._launch(buckets[self._next]))
            self._next += 1

    def _launch(self, bucket: GradBucket) -> Work:
        if self.comm_hook is None:
            if self.group.size == 1:
                return _DONE
            work = all_reduce(bucket.buffer(), ReduceOp.SUM, group=self.group, async_op=True)
        else:
            work = self.comm_hook(self.comm_hook_state, bucket)
            if not isinstance(work, Work):
                raise TypeError(
                    f"communication hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} returned "
                    f"{type(work).__name__}; a hook must return the spmd.Work of its reduction"
                )
        assert work is not None
        return work

    # -- end of backward -------------------------------------------------------------
    def _finalize(self) -> None:
        """Runs once backward is done: wait for every bucket, then settle parameters no rank used."""
        try:
            if self._next < len(self.buckets):
                self._fail_missing()
            for work in self._works:
                work.wait()
            self._first_backward_done()
            if self._used_work is not None and self._used_map is not None:
                self._used_work.wait()
                for i in self._unused:
                    if self.params[i].grad is None and self._used_map[i]:
                        self.params[i].grad = self._views[i]  # another rank's gradient, averaged
        finally:
            self._reset()

    def _first_backward_done(self) -> None:
        """After the first reducing backward: keep its gradient-ready order for the rebuild."""
        if self._order is not None:
            self._recorded, self._order = self._order, None
            self._rebuild_due = True

    def _fail_missing(self) -> None:
        """Some parameter got no gradient: still reduce every bucket (peers must not hang), then raise."""
        missing = [i for i in range(len(self.params)) if not self._ready[i]]
        for i in missing:
            self._ready[i] = 1
            if self.params[i].grad is not self._views[i]:
                self._views[i].zero_()
            self._pending[self._bucket_of[i]] -= 1
        self._launch_ready()
        for work in self._works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001, S110 - the missing gradients are the error to report
                pass
        names = ", ".join(self.names[i] for i in missing)
        raise SpmdError(
            f"DistributedDataParallel: {len(missing)} parameter(s) received no gradient in this backward "
            f"on rank {self.group.rank} of group {self.group.name!r}: {names}. If the forward does not "
            "use every parameter (or uses different ones on different ranks), pass "
            "find_unused_parameters=True; otherwise make every output that depends on them part of "
            "the loss"
        )

    # -- uneven inputs -----------------------------------------------------------------
    def shadow_backward(self) -> None:
        """A joined rank's part in an active rank's backward: the same reductions, in the same
        order (used-parameter map, then every bucket through the comm hook if any), with zeros.
        The bucket rebuild happens here as on the active ranks (this rank adds no ready order)."""
        if self._rebuild_due:
            self._rebuild()
        works: list[Work] = []
        if self.find_unused_parameters:
            used = all_reduce(torch.zeros(len(self.params), dtype=torch.int32), ReduceOp.MAX, group=self.group, async_op=True)
            assert used is not None  # async_op=True always returns the Work
            works.append(used)
        for bucket in self.buckets:
            bucket.buffer().zero_()
            works.append(self._launch(bucket))
        for work in works:
            work.wait()
        if self._order is not None:
            self._order = []  # a rank that joined before any backward of its own: no order to offer
            self._first_backward_done()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
