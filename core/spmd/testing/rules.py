"""The sharding-rule conformance kit: check an op under every placement of its inputs on real ranks.

Call it on every rank of a job (inside a test world, for example)::

    from spmd.testing.rules import check_sharding
    check_sharding(torch.ops.mylib.gelu2.default, torch.randn(6, 5))

For a 1-D mesh of the whole world and, when the world has 4 or more ranks
and an even size, a 2-D mesh (2, world / 2), every combination of input
placements (Replicate, Shard on each dimension, Partial for floating-point
inputs, its summands made non-zero on every rank) is tried: the inputs are distributed, the op runs on DTensors, and
``full_tensor()`` of each output, and of each input's gradient, must equal the
op run on the full tensors in one process. Rank 0's inputs are used on every
rank (broadcast once per call, for the reference and every combination
alike). A failure raises AssertionError listing every failing combination.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.comm.collectives import broadcast
from spmd.comm.init import get_world_size
from spmd.mesh import DeviceMesh, init_device_mesh
from spmd.tensor.dtensor import DTensor, distribute_tensor
from spmd.tensor.placements import Partial, Placement, Replicate, Shard


def _choices(t: torch.Tensor) -> list[Placement]:
    options: list[Placement] = [Replicate()]
    options += [Shard(d) for d in range(t.ndim)]
    if t.is_floating_point():
        options.append(Partial())
    return options


def meshes_for(world: int) -> list[DeviceMesh]:
    """The meshes the kit tries on a world of ``world`` ranks."""
    meshes = [init_device_mesh("cpu", (world,), mesh_dim_names=("x",))]
    if world >= 4 and world % 2 == 0:
        meshes.append(init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b")))
    return meshes


def _outputs(result: Any) -> list[Any]:
    if isinstance(result, (tuple, list)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return [result] if isinstance(result, torch.Tensor) else []


def check_sharding(
    op: Callable[..., Any],
    *args: Any,
    grad: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    max_combinations: int | None = 64,
    seed: int = 0,
    **kwargs: Any,
) -> int:
    """Check ``op(*args, **kwargs)`` under every input placement; return the number of combinations run.

    Tensor positional arguments are distributed; everything else is passed as is.
    ``max_combinations`` caps the combinations per mesh (a seeded sample of
    them, the same on every rank); None tries them all. ``grad`` also compares
    the gradients of floating-point inputs.
    """
    args = _rank_zeros(args)
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    differentiable = [i for i in positions if args[i].is_floating_point()] if grad else []
    reference_inputs = [a.detach().clone().requires_grad_(i in differentiable) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    reference = _outputs(op(*reference_inputs, **kwargs))
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(r.shape, generator=generator, dtype=r.dtype) if r.is_floating_point() else None for r in reference]
    ref_grads: dict[int, torch.Tensor | None] = {}
    if differentiable:
        loss = sum((r * w).sum() for r, w in zip(reference, weights) if w is not None and r.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        ref_grads = {i: reference_inputs[i].grad for i in differentiable}
    failures: list[str] = []
    ran = 0
    for mesh in meshes_for(get_world_size()):
        per_tensor = [list(itertools.product(_choices(args[i]), repeat=mesh.ndim)) for i in positions]
        combos = list(itertools.product(*per_tensor))
        if max_combinations is not None and len(combos) > max_combinations:
            combos = random.Random(seed).sample(combos, max_combinations)
        for combo in combos:
            ran += 1
            try:
                problem = _check_one(op, args, kwargs, mesh, positions, combo, differentiable, reference, weights, ref_grads, atol, rtol)
            except Exception as error:  # noqa: BLE001 - reported with the combination
                problem = f"raised {type(error).__name__}: {error}"
            if problem:
                failures.append(f"mesh {tuple(mesh.shape)} placements {[list(c) for c in combo]}: {problem}")
    if failures:
        name = getattr(op, "__name__", str(op))
        raise AssertionError(f"{name}: {len(failures)} of {ran} placement combinations failed:\n" + "\n".join(failures[:20]))
    return ran


def _rank_zeros(args: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` with every tensor replaced by rank 0's (one broadcast each), so the reference and
    every combination start from the same data on every rank without a broadcast per combination."""
    tensors = [a.detach().clone(memory_format=torch.contiguous_format) if isinstance(a, torch.Tensor) else a for a in args]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            broadcast(t, 0)
    return tuple(tensors)


def _check_one(
    op: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    mesh: DeviceMesh,
    positions: list[int],
    combo: tuple,
    differentiable: list[int],
    reference: list[torch.Tensor],
    weights: list[Any],
    ref_grads: dict[int, torch.Tensor | None],
    atol: float,
    rtol: float,
) -> str | None:
    dist_args = list(args)
    for i, placements in zip(positions, combo):
        dt = distribute_tensor(args[i], mesh, list(placements), src_data_rank=None)  # (rank 0's data already)
        _split_summands(dt, i)
        if i in differentiable:
            dt.requires_grad_()
        dist_args[i] = dt
    results = _outputs(op(*dist_args, **kwargs))
    if len(results) != len(reference):
        return f"{len(results)} outputs, expected {len(reference)}"
    loss = None
    for k, (got, want, w) in enumerate(zip(results, reference, weights)):
        full = got.full_tensor() if isinstance(got, DTensor) else got
        if full.shape != want.shape or not torch.allclose(full.detach().to(want.dtype), want.detach(), atol=atol, rtol=rtol, equal_nan=True):
            return f"output {k} differs (max error {_error(full, want)})"
        if differentiable and w is not None and got.requires_grad:
            term = (got * distribute_tensor(w, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)).sum()
            loss = term if loss is None else loss + term
    if loss is not None:
        loss.backward()
        for i in differentiable:
            want_grad = ref_grads.get(i)
            got_grad = dist_args[i].grad
            if want_grad is None:
                continue
            if got_grad is None:
                return f"input {i} got no gradient"
            full = got_grad.full_tensor()
            if not torch.allclose(full, want_grad, atol=atol, rtol=rtol):
                return f"gradient of input {i} differs (max error {_error(full, want_grad)}; placements {list(got_grad.placements)})"
    return None


def _split_summands(dt: DTensor, seed: int) -> None:
    """Make every summand of a Partial input non-zero: add noise that sums to zero along each Partial mesh dimension.

    ``distribute_tensor`` gives a Partial tensor's value to one rank and zeros
    to the others, and f(v) + f(0) == f(v) for relu, floor, casts to int...: a
    rule that let a partial sum through such an op would pass. With summands
    like v + d and -d it cannot.
    """
    coordinate = dt.device_mesh.get_coordinate()
    local = dt._local_tensor
    if coordinate is None or not local.is_floating_point():
        return
    with torch.no_grad():
        for m, p in enumerate(dt.placements):
            if isinstance(p, Partial):
                generator = torch.Generator().manual_seed(1000 * seed + m)
                noise = torch.randn((dt.device_mesh.size(m), *local.shape), generator=generator).to(local.dtype)
                local.add_(noise[coordinate[m]] - noise.mean(0))


def _error(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    return f"{(got.detach().double() - want.detach().double()).abs().max().item():.3g}"
