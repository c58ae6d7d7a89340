"""DistributedDataParallel: replicate a module on every rank of a group and average its gradients."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from spmd.comm.state import resolve_group
from spmd.errors import SpmdError
from spmd.parallel.buckets import FIRST_BUCKET_BYTES
from spmd.parallel.comm_hooks import CommHook, get_hook
from spmd.parallel.join import Join
from spmd.parallel.reducer import Reducer
from spmd.parallel.state_dict import add_wrapped_prefix, strip_prefix
from spmd.parallel.sync import broadcast_coalesced, verify_shapes

DEFAULT_BUCKET_CAP_MB = 25.0


class DistributedDataParallel(nn.Module):
    """Data parallelism with torch DDP's behaviour, over any spmd backend and any group.

    At construction every rank gets group rank 0's parameters and buffers.
    Each forward broadcasts buffers from rank 0 (``broadcast_buffers=True``);
    each backward averages the gradients across the group, bucket by bucket
    while backward still runs, so ``loss.backward()`` returns with averaged
    gradients. Each ``param.grad`` is a view into its bucket's flat buffer
    (torch's ``gradient_as_bucket_view=True``, always on here: no copy back).

    Takes torch's parameters in torch's order (``DDP(model, [rank])`` ports
    unchanged). Differences from ``torch.nn.parallel.DistributedDataParallel``:
    ``process_group`` may be a spmd group or a torch group of backend
    ``"spmd"``; ``state_dict()`` has no ``module.``
    prefix and ``load_state_dict`` accepts keys with or without it; a
    parameter that got no gradient is an error at the end of that backward
    (naming it), not at the next forward; ``register_comm_hook`` also takes a
    registered hook's name. As in torch, the buckets are rebuilt once, after the
    first iteration, along the order gradients became ready (group rank 0's), unless
    ``find_unused_parameters`` is set.
    Uneven inputs: ``with ddp.join(): ...`` (see ``join``).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Any = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        # torch's parameters, in torch's order, so ``DDP(model, [rank])`` ports unchanged. device_ids,
        # output_device and dim place a single-device module (one device per process here);
        # check_reduction is deprecated in torch too; static_graph and batched_grad_copy are
        # optimisations this reducer does not need for correct results; gradient_as_bucket_view
        # is always on. Those that change what DDP computes are refused, by name.
        del device_ids, output_device, dim, check_reduction, gradient_as_bucket_view, static_graph, batched_grad_copy
        refused = {
            "delay_all_reduce_named_params": delay_all_reduce_named_params,
            "param_to_hook_all_reduce": param_to_hook_all_reduce,
            "mixed_precision": mixed_precision,
            "device_mesh": device_mesh,
            "bucket_cap_mb_list": bucket_cap_mb_list,
        }
        given = [name for name, value in refused.items() if value is not None]
        given += ["skip_all_reduce_unused_params"] if skip_all_reduce_unused_params else []
        if given:
            raise SpmdError(
                f"spmd's DistributedDataParallel does not implement {', '.join(given)}; for mixed precision use "
                "register_comm_hook(None, 'bf16') or spmd.parallel.fully_shard(mp_policy=...), for a mesh pass "
                "process_group=mesh.get_group(dim)"
            )
        if forward_sync_buffers is not None:
            broadcast_buffers = forward_sync_buffers
        broadcast_buffers = True if broadcast_buffers is None else broadcast_buffers
        self.module = module
        self.process_group = resolve_group(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        #: False inside ``no_sync()``: the backward of a forward run then only accumulates locally.
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise SpmdError("DistributedDataParallel: the module has no parameter that requires a gradient")
        group = self.process_group
        if init_sync:
            verify_shapes(named, group)
            broadcast_coalesced([p.detach() for _, p in named] + [b for b in module.buffers()], group)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        cap_bytes = max(int(cap * (1 << 20)), 1)
        first = min(FIRST_BUCKET_BYTES, cap_bytes) if bucket_cap_mb is None else cap_bytes
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], group, cap_bytes, first, find_unused_parameters)
        self.register_load_state_dict_pre_hook(add_wrapped_prefix)
        self._join: Join | None = None  # set inside join()

    # -- training --------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; its backward will average gradients unless in ``no_sync()``."""
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        src = self._join.before_forward(sync) if self._join is not None else 0
        if self.broadcast_buffers and self.process_group.size > 1:
            buffers = [b for b in self.module.buffers()]
            if buffers:
                broadcast_coalesced(buffers, self.process_group, src=src)
        output = self.module(*inputs, **kwargs)
        if sync:
            self.reducer.prepare(output)
        elif torch.is_grad_enabled():  # no_sync: this forward's backward accumulates locally
            self.reducer.disarm()
        # (a forward under no_grad has no backward: the pending one, if any, still reduces, as in torch)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside only accumulate gradients locally (for gradient accumulation)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @contextmanager
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Iterator[None]:
        """Train on uneven inputs: wrap the loop, and ranks whose data ends first keep step.

        As torch's ``with ddp.join():``. A rank that leaves the loop early answers
        the others' collectives with zeros until every rank is done; then every
        rank holds the parameters and buffers of the highest-ranked of the last
        ranks to finish. Gradients are divided by the group size
        (``divide_by_initial_world_size=True``) or by the number of ranks still
        training. With ``throw_on_early_termination=True`` every rank raises as
        soon as one runs out instead. Costs one small all-reduce per forward.
        With ``find_unused_parameters``, a joined rank uses no parameter; torch's
        reports its last iteration's usage, so a parameter no active rank used
        gets a zero gradient there, and None here.
        """
        if not enable or self.process_group.size == 1:
            yield
            return
        if self._join is not None:
            raise SpmdError("DistributedDataParallel.join() is already active on this model; do not nest it")
        join = Join(self.process_group, self.reducer, self.module, self.broadcast_buffers,
                    divide_by_initial_world_size, throw_on_early_termination)
        self._join = join
        try:
            yield
            self._join = None
            join.shadow_until_all_joined()
        finally:
            self._join = None
            self.reducer.divisor = None

    def register_comm_hook(self, state: Any, hook: CommHook | str) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> spmd.Work`` (or the hook registered under that name)."""
        if self.reducer.comm_hook is not None:
            raise SpmdError("DistributedDataParallel: a communication hook is already registered; register one only")
        resolved = get_hook(hook) if isinstance(hook, str) else hook
        if not callable(resolved):
            raise TypeError(f"communication hook must be callable or a registered name, got {type(hook).__name__}")
        self.reducer.comm_hook_state = state
        self.reducer.comm_hook = resolved

    # -- state -----------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict: keys have no ``module.`` prefix."""
        if args:  # torch's deprecated positional form (destination, prefix, keep_vars)
            return self.module.state_dict(*args)
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module; keys may carry a ``module.`` prefix or not."""
        return self.module.load_state_dict(strip_prefix(state_dict), strict=strict, assign=assign)
