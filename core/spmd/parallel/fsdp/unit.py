"""FSDPUnit: one ``fully_shard``-ed module's parameters, their flat shard, and the unit's collectives.

A unit owns the parameters of its module that no inner ``fully_shard``-ed
module owns. Their rows (``torch.chunk`` on dim 0) live in one flat shard
buffer per rank; each parameter is an ``nn.Parameter`` wrapping a DTensor
(``Shard(0)``, or ``(Replicate(), Shard(0))`` on a 2-D mesh) whose local
tensor is a view of that buffer, so the optimizer updates the buffer in
place and the all-gather reads it without a copy (without mixed precision).
A tensor-parallel parameter (a DTensor on other dimensions of the same mesh)
is sharded the same way, its local piece's rows chunked over this unit's
ranks: its DTensor lives on the concatenated mesh (``tp`` then ``dp``) with
the tensor-parallel placements followed by ``Shard(0)``, and during forward
the module sees the tensor-parallel DTensor again (2-D: TP inside, FSDP outside).
``fully_shard([a, b])`` makes one unit of several modules' parameters.
Whatever replaces the registered parameters (``module._apply`` as in
``to_empty``/``.to``, ``load_state_dict(assign=True)``, an assignment) is
adopted by ``adopt_parameters``: the values are copied into a new flat shard
and each parameter's local tensor becomes its view again, so the forward
never gathers from a buffer the optimizer no longer steps.
Unsharding is one ``all_gather_into_tensor`` of the whole unit and one copy
into the parameter-major unsharded buffer; the gradient reduction is one
``reduce_scatter_tensor`` (plus, with HSDP, one ``all_reduce`` over the
replicate dimension). On a backend whose reduce-scatter is an all-reduce of
an input copy (Gloo), it is that all-reduce, on the unit's scratch input
itself: the same bytes moved, a third of the memory in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd.comm import collectives
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.work import Work
from spmd.errors import SpmdError
from spmd.mesh import DeviceMesh, concatenate_meshes
from spmd.parallel.fsdp.layout import FlatLayout
from spmd.parallel.fsdp.policy import MixedPrecisionPolicy
from spmd.tensor.debug import counted_as
from spmd.tensor.dtensor import DTensor, FromLocal
from spmd.tensor.placements import Placement, Replicate, Shard
from spmd.tensor.spec import DTensorSpec, contiguous_stride, local_piece

SHARDED, GATHERING, UNSHARDED = "sharded", "gathering", "unsharded"


@dataclass
class PendingReduce:
    """A reduce-scatter in flight: the unit, its Work, and the buffers it writes and reads."""

    unit: FSDPUnit
    work: Work
    out: torch.Tensor | None  # None: ``inp`` is all-reduced in place, this rank's block is the result
    inp: torch.Tensor


class FSDPUnit:
    """The sharded parameters of one module (or one group of modules) and the collectives that unshard them and reduce their gradients."""

    def __init__(
        self,
        modules: list[nn.Module],
        named: list[tuple[str, nn.Parameter]],
        owners: dict[int, list[tuple[nn.Module, str]]],
        mesh: DeviceMesh,
        reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy,
        offload_to_cpu: bool = False,
    ) -> None:
        if mesh.ndim not in (1, 2):
            raise SpmdError(f"fully_shard: the mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got {mesh}")
        self.modules = modules
        self.module = modules[0]
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.mp_policy = mp_policy
        self.offload_to_cpu = offload_to_cpu
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.world = self.shard_group.size
        self.rank = self.shard_group.rank
        self.dp_size = mesh.size()
        self.placements: tuple[Placement, ...] = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        self.names = [name for name, _ in named]  # relative to the module of ``modules`` that holds it
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise SpmdError(f"fully_shard({type(self.module).__name__}): its parameters mix dtypes {sorted(map(str, dtypes))}; "
                            "give each dtype its own fully_shard-ed submodule")
        for name, p in named:
            if p.ndim == 0:
                raise SpmdError(f"fully_shard: parameter {name!r} is a scalar; dim 0 cannot be sharded (make it shape (1,))")
        #: Per parameter: the DTensorSpec it has inside the module's forward (tensor parallel), or None (plain).
        self._tp_specs = [self._inner_spec(name, p) for name, p in named]
        self._set_dtype(dtypes.pop() if dtypes else torch.float32)
        data = [p._local_tensor if isinstance(p, DTensor) else p for _, p in named]  # type: ignore[attr-defined]
        self.layout = FlatLayout([tuple(t.shape) for t in data], self.world)
        device = named[0][1].device if named else torch.device(mesh.device_type)
        self._check_offload(device)
        self.specs: list[DTensorSpec] = []
        for (_, p), inner in zip(named, self._tp_specs):
            shape = tuple(p.shape)
            if inner is None:
                self.specs.append(DTensorSpec(mesh, self.placements, shape, contiguous_stride(shape), self.dtype))
            else:  # the tensor-parallel placements, then this unit's: dp chunks the tp piece's rows
                outer = concatenate_meshes(inner.mesh, mesh)
                self.specs.append(DTensorSpec(outer, inner.placements + self.placements, shape, inner.stride, self.dtype))
        pieces = [whole.detach().narrow(0, self.layout.row_offset(i, self.rank), self.layout.slots[i].rows[self.rank])
                  for i, whole in enumerate(data)]
        #: This rank's piece of each parameter: a view of ``flat_shard``, and the local tensor of its DTensor.
        views = self._new_flat_shard(pieces, device)
        self.params: list[nn.Parameter] = []
        self.owners: list[list[tuple[nn.Module, str]]] = []
        for (_, p), local, spec in zip(named, views, self.specs):
            sharded = nn.Parameter(DTensor(local, spec), requires_grad=p.requires_grad)
            if sharded._local_tensor.data_ptr() != local.data_ptr() and local.numel():  # type: ignore[attr-defined]
                raise SpmdError("fully_shard: nn.Parameter copied the DTensor's local shard; the flat shard would go stale")
            self.params.append(sharded)
            self.owners.append(owners[id(p)])
            for owner, attr in owners[id(p)]:
                owner._parameters[attr] = sharded
        self.locals = [p._local_tensor for p in self.params]  # type: ignore[attr-defined]
        self.state = SHARDED
        self._gathered_version = -1  # the parameters' version counters (summed) when they were last gathered
        self._gather: tuple[Work, torch.Tensor, torch.Tensor] | None = None
        self._accumulated: torch.Tensor | None = None  # unsharded gradients kept while sync is off
        self._partial: torch.Tensor | None = None  # HSDP: reduce-scattered gradients kept while all-reduce is off
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None  # None: the data-parallel size (the mean)
        self.is_last_backward = True  # torch's flag; spmd finishes each backward's reductions anyway
        self.forward_prefetch: list[FSDPUnit] | None = None  # None: the next unit in forward order
        self.backward_prefetch: list[FSDPUnit] | None = None  # None: the previous unit in forward order
        self.root: Any = None  # the FSDPRoot that drives this unit, set on the root's first forward
        #: A group's modules still to finish their forward in this pass (the unit is set up for the rest of them).
        self.pending: set[nn.Module] = set()
        self.grad_params = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.dummy = torch.empty(0, device="cpu", requires_grad=True)  # gives the views' autograd node an input

    def _set_dtype(self, dtype: torch.dtype) -> None:
        """The parameters' dtype, and the compute and reduce dtypes the policy derives from it."""
        self.dtype = dtype
        self.compute_dtype = self.mp_policy.compute_dtype(dtype)
        self.reduce_dtype = self.mp_policy.gradient_dtype(dtype)
        self.inner_specs = [None if s is None else DTensorSpec(s.mesh, s.placements, s.shape, s.stride, self.compute_dtype)
                            for s in self._tp_specs]

    def _check_offload(self, device: torch.device) -> None:
        if self.offload_to_cpu and device.type not in ("cpu", "meta"):
            raise NotImplementedError(
                f"fully_shard(offload_policy=CPUOffloadPolicy()): the parameters are on {device}; spmd does not offload "
                "accelerator parameters to the CPU (keep them on the CPU, or drop the offload policy)")

    def _new_flat_shard(self, pieces: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """A new flat shard on ``device`` holding ``pieces`` (this rank's rows of each parameter), a new unsharded
        buffer there (freed); returns each parameter's local view of the shard."""
        flat = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        views = [self.layout.local_view(flat, i, self.rank) for i in range(len(pieces))]
        with torch.no_grad():
            for view, piece in zip(views, pieces):
                view.copy_(piece)
        self.flat_shard = flat
        self.full = torch.empty(self.layout.full_numel, dtype=self.compute_dtype, device=device)
        self.full_views = self.layout.full_views(self.full)
        self._free_full()
        return views

    # -- the parameters the modules hold ------------------------------------------------
    def adopt_parameters(self, strict: bool = True) -> None:
        """Make the flat shard the storage of the parameters registered on the modules now.

        ``module._apply`` (``to_empty``, ``.to``) gives each parameter a new local
        tensor, ``load_state_dict(assign=True)`` new Parameter objects: their
        values are copied into a new flat shard (on their device, in their
        dtype) and each parameter's local tensor becomes its view of it, so the
        all-gather reads what the optimizer steps. A no-op when nothing changed.
        Parameters left on different devices or dtypes (a group whose other
        module ``_apply`` has not reached yet) wait for the next call unless ``strict``.
        """
        found = [owners[0][0]._parameters.get(owners[0][1]) for owners in self.owners]
        if all(p is mine and p._local_tensor is local  # type: ignore[attr-defined]
               for p, mine, local in zip(found, self.params, self.locals)):
            return
        if self.state != SHARDED:
            self.reshard()
        pieces = [self._piece(i, p) for i, p in enumerate(found)]
        devices, dtypes = {t.device for t in pieces}, {t.dtype for t in pieces}
        if len(devices) > 1 or len(dtypes) > 1:
            if not strict:
                return
            raise SpmdError(f"fully_shard({type(self.module).__name__}): its parameters are on {sorted(map(str, devices))} in "
                            f"{sorted(map(str, dtypes))}; one unit's parameters must share one device and dtype")
        device = devices.pop()
        self._check_offload(device)
        self._set_dtype(dtypes.pop())
        views = self._new_flat_shard(pieces, device)
        for i, (p, local) in enumerate(zip(found, views)):
            assert p is not None
            old = self.specs[i]
            spec = self.specs[i] = DTensorSpec(old.mesh, old.placements, old.shape, old.stride, self.dtype)
            param: nn.Parameter
            if isinstance(p, DTensor):
                p._local_tensor = local  # type: ignore[attr-defined]
                p._spec = spec  # type: ignore[attr-defined]
                param = p
            else:  # a plain full tensor set on the module: sharded again, as fully_shard did
                param = nn.Parameter(DTensor(local, spec), requires_grad=p.requires_grad)
            self.params[i] = param
            self.locals[i] = param._local_tensor  # type: ignore[attr-defined]
            for owner, attr in self.owners[i]:
                owner._parameters[attr] = param
        self.grad_params = [i for i, p in enumerate(self.params) if p.requires_grad]

    def _piece(self, index: int, p: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows of the parameter now registered at ``index`` (its DTensor's local tensor, or cut from a full tensor)."""
        name, spec = self.names[index], self.specs[index]
        if p is None:
            raise SpmdError(f"fully_shard: parameter {name!r} was removed from its module; a unit's parameters cannot change")
        if isinstance(p, DTensor):
            got: DTensorSpec = p._spec  # type: ignore[attr-defined]
            if got.shape != spec.shape or got.placements != spec.placements or got.mesh != spec.mesh:
                raise SpmdError(f"fully_shard: parameter {name!r} became a DTensor of shape {got.shape} placed {got.placements} "
                                f"on {got.mesh}; it must keep shape {spec.shape} and placements {spec.placements} on {spec.mesh}")
            return p._local_tensor  # type: ignore[attr-defined]
        if tuple(p.shape) != spec.shape:
            raise SpmdError(f"fully_shard: parameter {name!r} was replaced by a tensor of shape {tuple(p.shape)}, not {spec.shape}")
        return local_piece(p.detach(), spec)

    def _inner_spec(self, name: str, p: nn.Parameter) -> DTensorSpec | None:
        """A tensor-parallel DTensor parameter's spec, checked; None for a plain one."""
        if not isinstance(p, DTensor):
            return None
        spec: DTensorSpec = p._spec  # type: ignore[attr-defined]
        shared = set(spec.mesh.mesh_dim_names or ()) & set(self.mesh.mesh_dim_names or ())
        if shared or not spec.mesh.mesh_dim_names or not self.mesh.mesh_dim_names:
            raise SpmdError(
                f"fully_shard: parameter {name!r} is already a DTensor on {spec.mesh}; fully_shard takes plain "
                "parameters, or tensor-parallel ones on other dimensions of the same named mesh "
                "(parallelize_module(m, mesh['tp'], ...) then fully_shard(m, mesh=mesh['dp'])); apply fully_shard once per module"
            )
        if not all(isinstance(q, (Shard, Replicate)) for q in spec.placements):
            raise SpmdError(f"fully_shard: parameter {name!r} has placements {spec.placements}; only Shard and Replicate can be sharded further")
        return spec

    # -- unshard / reshard -------------------------------------------------------------
    def _free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    def unshard(self) -> None:
        """Start the unit's all-gather (async); a no-op when it is unsharded or on its way."""
        if self.state != SHARDED:
            return
        self.adopt_parameters()  # parameters replaced since (outside _apply and load_state_dict): gather those
        if self.flat_shard.is_meta:
            raise SpmdError(f"fully_shard({type(self.module).__name__}): the parameters are on the meta device; call "
                            "model.to_empty(device=...) and initialise them (reset_parameters(), or load_state_dict) first")
        send = self.flat_shard if self.compute_dtype == self.dtype else self.flat_shard.to(self.compute_dtype)
        gathered = torch.empty(self.world * self.layout.shard_numel, dtype=self.compute_dtype, device=send.device)
        work = collectives.all_gather_into_tensor(gathered, send, group=self.shard_group, async_op=True)
        assert work is not None
        self._gather = (work, gathered, send)
        self.state = GATHERING

    def wait_unshard(self) -> None:
        """Finish the all-gather and fill the unsharded buffer (that the parameter views read)."""
        if self.state == SHARDED:
            self.unshard()
        if self.state != GATHERING:
            return
        assert self._gather is not None
        work, gathered, _send = self._gather
        self._gather = None
        work.wait()
        storage = self.full.untyped_storage()
        storage.resize_(self.layout.full_numel * self.full.element_size())
        # Autograd saved views of this buffer in an earlier forward: refilling it is not a modification they must see.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            self.layout.copy_out(gathered, self.full)
        self.state = UNSHARDED
        self._gathered_version = self._version()

    def drop_stale_unsharded(self) -> None:
        """Reshard if the shard changed since it was gathered (an optimizer step while ``reshard_after_backward``
        was False kept the unsharded parameters): the next forward gathers the new values, never the old ones."""
        if self.state == UNSHARDED and self._version() != self._gathered_version:
            self.reshard()

    def _version(self) -> int:
        """The sum of the parameters' version counters: in-place updates (optimizer steps) raise it. (The
        flat shard's own counter does not move: the updates reach it below the dispatcher's version bump.)"""
        return sum(p._version for p in self.params)

    def reshard(self) -> None:
        """Free the unsharded parameters (the sharded ones always stay)."""
        if self.state == GATHERING:
            self.wait_unshard()
        if self.state == UNSHARDED:
            self._free_full()
        self.state = SHARDED

    # -- gradients -----------------------------------------------------------------------
    def reduce_gradients(self, grads: tuple[torch.Tensor | None, ...]) -> PendingReduce | None:
        """Take the unit's unsharded gradients (one per parameter that requires grad; None: zero).

        With gradient sync off they are added to a local unsharded accumulator;
        otherwise (with anything accumulated) they start one async reduce-scatter,
        pre-divided by the data-parallel size (or ``gradient_divide_factor``) so the
        result is the average (or the sum over that factor).
        """
        full: list[torch.Tensor | None] = [None] * len(self.params)
        for index, grad in zip(self.grad_params, grads):
            full[index] = grad
        if not self.requires_gradient_sync or self._accumulated is not None:
            if self._accumulated is None:
                self._accumulated = torch.zeros(self.layout.full_numel, dtype=self.dtype, device=self.flat_shard.device)
            views = self.layout.full_views(self._accumulated)
            for view, grad in zip(views, full):
                if grad is not None:
                    view.add_(grad)
            if not self.requires_gradient_sync:
                return None
            full = list(views)
            self._accumulated = None
        inp = torch.empty(self.world * self.layout.shard_numel, dtype=self.reduce_dtype, device=self.flat_shard.device)
        self.layout.copy_in(full, inp)
        factor = self.gradient_divide_factor if self.gradient_divide_factor is not None else self.dp_size
        if factor != 1:
            inp.div_(factor)
        if self.shard_group.backend_for(inp, "reduce_scatter_tensor").reduce_scatter_copies_input:
            # The backend would all-reduce a copy of ``inp`` anyway: all-reduce the scratch buffer itself,
            # so only ``inp`` is in flight while the next unit's backward runs (not a copy and an output too).
            with counted_as("reduce_scatter"):
                work = collectives.all_reduce(inp, op=ReduceOp.SUM, group=self.shard_group, async_op=True)
            assert work is not None
            return PendingReduce(self, work, None, inp)
        out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=inp.device)
        work = collectives.reduce_scatter_tensor(out, inp, op=ReduceOp.SUM, group=self.shard_group, async_op=True)
        assert work is not None
        return PendingReduce(self, work, out, inp)

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for the reduce-scatter (and HSDP's all-reduce), then set or add the sharded ``.grad``s."""
        pending.work.wait()
        out = pending.out
        if out is None:  # all-reduced in place: keep this rank's block, let the whole buffer go
            out = pending.inp.view(self.world, self.layout.shard_numel)[self.rank].clone()
        if self.replicate_group is not None and self.replicate_group.size > 1:
            if self._partial is not None:  # reduce-scattered while all-reduce was off
                out.add_(self._partial)
                self._partial = None
            if not self.requires_all_reduce:
                self._partial = out
                return
            collectives.all_reduce(out, op=ReduceOp.SUM, group=self.replicate_group)
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
        for index in self.grad_params:
            param = self.params[index]
            local = self.layout.local_view(out, index, self.rank)
            if param.grad is None:
                param.grad = DTensor(local, self.specs[index])
            else:
                param.grad._local_tensor.add_(local)  # type: ignore[attr-defined]

    # -- the module's attributes during forward -------------------------------------------
    def install(self, views: list[torch.Tensor]) -> None:
        """Point the modules' parameter attributes at the unsharded views (shadowing the sharded parameters)."""
        for owners, view, inner in zip(self.owners, views, self.inner_specs):
            value = view if inner is None else FromLocal.apply(view, inner)  # the tensor-parallel DTensor it was
            for owner, attr in owners:
                owner.__dict__[attr] = value

    def uninstall(self) -> None:
        """The modules' parameter attributes are the sharded parameters again."""
        for owners in self.owners:
            for owner, attr in owners:
                owner.__dict__.pop(attr, None)

    def __repr__(self) -> str:
        n = sum(math.prod(s.shape) for s in self.layout.slots)
        names = "+".join(type(m).__name__ for m in self.modules)
        return f"FSDPUnit({names}, {len(self.params)} parameters, {n} elements, {self.state})"
