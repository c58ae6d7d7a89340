"""DTensor: a torch.Tensor subclass that holds this rank's shard, its mesh and its placements.

Every aten op on a DTensor goes through ``__torch_dispatch__`` to the
dispatcher that ``spmd.tensor.dispatch`` installs as ``DTensor._dispatcher``
(this module does not import it: the dispatcher is built on DTensor), which looks up the op's sharding rule, redistributes
the inputs the rule asks for, runs the op on the local shards and wraps the
results. Autograd sees DTensors, so backward ops are dispatched the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch

from spmd.mesh import DeviceMesh, default_mesh
from spmd.tensor import comm
from spmd.tensor.placements import Partial, Placement, Replicate, Shard
from spmd.tensor.redistribute import redistribute_local, shares_memory
from spmd.tensor.spec import (
    DTensorSpec,
    global_stride,
    local_shape_and_offset,
    normalize_placements,
)


class Dispatches(Protocol):
    """What DTensor needs of its dispatcher (``spmd.tensor.dispatch.Dispatcher``): run one aten op."""

    def dispatch(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object: ...

_CONJUGATE = torch._C.DispatchKey.Conjugate
_NEGATIVE = torch._C.DispatchKey.Negative
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


class DTensor(torch.Tensor):
    """A distributed tensor: global shape and dtype, local data, mesh and placements."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    #: Runs every aten op on DTensors (``spmd.tensor.dispatch.dispatcher``, which sets it when imported).
    _dispatcher: ClassVar[Dispatches]
    __slots__ = ("_local_tensor", "_spec")

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        # The math bits are the local tensor's, so the wrapper and its shard read the same values: torch's
        # Conjugate and Negative fallbacks see them on the wrapper and resolve them before an op that needs it
        if local_tensor.is_conj():
            torch._C._set_conj(r, True)
        if local_tensor.is_neg():
            torch._C._set_neg(r, True)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: torch._ops.OpOverload, types: object, args: tuple = (), kwargs: dict | None = None) -> object:  # type: ignore[override]
        # torch excludes the Conjugate and Negative keys while a subclass dispatches, so a local kernel that
        # builds a conjugate view inside (linalg_pinv's mH) would read it unresolved: silently wrong values.
        # The local compute runs with both keys back, as the same op on plain tensors does.
        if not _is_excluded(_CONJUGATE):
            return cls._dispatcher.dispatch(func, args, kwargs or {})
        negative = _is_excluded(_NEGATIVE)
        _set_excluded(_CONJUGATE, False)
        _set_excluded(_NEGATIVE, False)
        try:
            return cls._dispatcher.dispatch(func, args, kwargs or {})
        finally:
            _set_excluded(_CONJUGATE, True)
            _set_excluded(_NEGATIVE, negative)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple[DTensorSpec, bool]]:
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple[DTensorSpec, bool], outer_size: torch.Size,
                             outer_stride: tuple[int, ...]) -> DTensor:
        spec, requires_grad = meta
        return DTensor(inner["_local_tensor"], spec, requires_grad=requires_grad)

    # -- public API ------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """Wrap each rank's ``local_tensor`` as its shard (gradients pass through).

        Without ``shape`` the global shape assumes even shards (local size times
        the mesh size on each sharded dimension); pass ``shape=`` for uneven ones.
        With Partial, each rank's tensor is one summand. ``run_check`` checks
        that the ranks' local shapes agree with the global shape.
        """
        mesh = device_mesh if device_mesh is not None else default_mesh(local_tensor.device.type)
        normalized = normalize_placements(placements if placements is not None else [Replicate()] * mesh.ndim, mesh, local_tensor.ndim)
        if shape is None:
            global_shape = list(local_tensor.shape)
            for mesh_dim, p in enumerate(normalized):
                if isinstance(p, Shard):
                    global_shape[p.dim] *= mesh.size(mesh_dim)
            shape = global_shape
        shape_t = tuple(int(s) for s in shape)
        stride_t = tuple(stride) if stride is not None else global_stride(local_tensor, shape_t)
        spec = DTensorSpec(mesh, normalized, shape_t, stride_t, local_tensor.dtype)
        expected = local_shape_and_offset(shape_t, mesh, normalized)[0]
        if tuple(local_tensor.shape) != expected:
            raise ValueError(
                f"DTensor.from_local: this rank's tensor has shape {tuple(local_tensor.shape)} but placements "
                f"{list(normalized)} of global shape {shape_t} give it {expected}; pass shape= for uneven shards"
            )
        if run_check:
            _check_shapes_across_ranks(local_tensor, spec)
        return FromLocal.apply(local_tensor, spec)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable)."""
        if not torch.is_grad_enabled():
            return self._local_tensor
        return _ToLocal.apply(self, tuple(grad_placements) if grad_placements is not None else None)

    def redistribute(
        self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *, async_op: bool = False
    ) -> DTensor:
        """This tensor with ``placements`` (every Shard/Replicate/Partial transition; differentiable)."""
        if device_mesh is not None and device_mesh != self._spec.mesh:
            raise ValueError(
                f"redistribute: moving between meshes ({self._spec.mesh} -> {device_mesh}) is not supported; "
                "use full_tensor() and distribute_tensor() on the new mesh"
            )
        if placements is None:
            raise ValueError("redistribute: pass placements=, e.g. [Replicate()]")
        target = normalize_placements(placements, self._spec.mesh, self.ndim)
        return Redistribute.apply(self, target)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable)."""
        replicated = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)


class Redistribute(torch.autograd.Function):
    """Differentiable redistribution: the backward moves the gradient back to the source placements.

    A Partial source gets a Replicate gradient (the whole gradient of a sum is
    the gradient of each summand), so gradients are never divided by N.
    """

    @staticmethod
    def forward(ctx: Any, input: DTensor, placements: tuple[Placement, ...]) -> DTensor:  # noqa: A002
        spec = input._spec
        ctx.src = spec
        local = redistribute_local(input._local_tensor, spec, placements)
        if placements != spec.placements and shares_memory(local, input._local_tensor):
            # Replicate -> Shard narrows, Replicate -> Partial keeps rank 0's tensor: an in-place op on the
            # result would write into the source, which would then differ across the ranks it is replicated on
            local = local.clone()
        return DTensor(local, spec.with_placements(placements), requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        src: DTensorSpec = ctx.src
        target = tuple(Replicate() if isinstance(p, Partial) else p for p in src.placements)
        if not isinstance(grad, DTensor):
            return grad, None
        return Redistribute.apply(grad, target), None


class FromLocal(torch.autograd.Function):
    """A local tensor as the DTensor ``spec`` describes, no checks; backward hands the gradient back in ``spec``'s placements."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
        ctx.spec = spec
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        spec: DTensorSpec = ctx.spec
        if isinstance(grad, DTensor):
            target = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
            return redistribute_local(grad._local_tensor, grad._spec, target), None
        return grad, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor, grad_placements: tuple[Placement, ...] | None) -> torch.Tensor:
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        return DTensor(grad, spec.with_placements(placements)), None


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Split ``tensor`` over the mesh by ``placements``, taking the data of mesh rank ``src_data_rank``.

    ``src_data_rank`` counts the mesh's own ranks in row-major order (0 is the
    mesh's first rank, whatever its world rank). ``src_data_rank=0`` broadcasts
    that rank's tensor first (as torch does), so
    ranks whose tensors differ still agree; None uses each rank's own tensor.
    The result is a leaf that requires grad if ``tensor`` did.
    """
    mesh = device_mesh if device_mesh is not None else default_mesh(tensor.device.type)
    normalized = normalize_placements(placements if placements is not None else [Replicate()] * mesh.ndim, mesh, tensor.ndim)
    data = tensor.detach()
    if src_data_rank is not None:
        data = data.clone(memory_format=torch.contiguous_format)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        if not 0 <= src_data_rank < mesh.size():
            raise ValueError(
                f"distribute_tensor: src_data_rank {src_data_rank} is not a rank of the mesh {mesh.mesh.tolist()} "
                f"(it counts the mesh's own ranks, 0..{mesh.size() - 1}, as torch's does)"
            )
        src_coordinate = torch.unravel_index(torch.tensor(src_data_rank), mesh.shape)
        for mesh_dim in range(mesh.ndim):  # one broadcast per mesh dimension reaches every rank
            data = comm.broadcast(data, mesh.get_group(mesh_dim), int(src_coordinate[mesh_dim]))
    shape = tuple(data.shape)
    spec = DTensorSpec(mesh, tuple(Replicate() for _ in normalized), shape, global_stride(data, shape), data.dtype)
    local = redistribute_local(data, spec, normalized)
    if src_data_rank is None or local.numel() != data.numel():
        local = local.clone(memory_format=torch.contiguous_format)  # own storage: the full tensor is freed
    return DTensor(local, spec.with_placements(normalized), requires_grad=tensor.requires_grad)


def _check_shapes_across_ranks(local: torch.Tensor, spec: DTensorSpec) -> None:
    from spmd.comm.objects import all_gather_object

    for mesh_dim in range(spec.mesh.ndim):
        group = spec.mesh.get_group(mesh_dim)
        seen: list[Any] = [None] * group.size
        all_gather_object(seen, (tuple(local.shape), str(local.dtype), spec.shape), group=group)
        dtypes = {s[1] for s in seen}
        if len(dtypes) > 1:
            raise ValueError(f"DTensor.from_local: ranks along mesh dimension {mesh_dim} hold different dtypes {seen}")
        if len({s[2] for s in seen}) > 1:
            raise ValueError(
                f"DTensor.from_local: ranks along mesh dimension {mesh_dim} make different global shapes of their "
                f"local shards (local, dtype, global: {seen}): the shards are uneven; pass shape= (the global shape) "
                "on every rank"
            )
