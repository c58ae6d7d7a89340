"""The DTensor dispatcher: rule lookup, a propagation cache, input redistribution, local compute, wrapping.

For each op call: build a key from the op, the mesh and each argument's
placements/shape/dtype (or value); on a cache miss run the op on meta tensors
for the global output shapes, ask the op's rule (once per mesh dimension), and
store the plan. Then redistribute the inputs the plan names, run the op on the
local shards and wrap the outputs. An op without a rule falls back to
gather, compute, reshard, with a warning naming the op once per process.

All of it is state of one object, ``dispatcher`` (a ``Dispatcher``, installed
as ``DTensor._dispatcher``): the plan caches, kept per generation of the
plugins (a rule registered at run time is used from the next call on), the ops
an active context takes over (``loss_parallel``), the fallback's warnings, and
whether plain tensors count as replicated (``implicit_replication``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spmd import plugins
from spmd.mesh import DeviceMesh
from spmd.tensor import registry
from spmd.tensor.dtensor import DTensor
from spmd.tensor.errors import (
    DetachedViewError,
    InPlaceViewError,
    MixedTensorError,
    ShardingRuleError,
)
from spmd.tensor.placements import Partial, Placement, Replicate
from spmd.tensor.redistribute import redistribute_local, shares_memory
from spmd.tensor.rule import Decompose, LocalInfo, OpCall, Rule, Sharding, TensorArg, TensorMeta
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

_NO_META = object()


@dataclass
class Plan:
    """What to do for one call signature: input targets, output specs, local argument rewrite."""

    targets: tuple[tuple[Placement, ...], ...]  # per DTensor input
    out_specs: tuple[DTensorSpec, ...]  # per tensor output
    rewrite: Callable[[tuple, dict, LocalInfo], tuple[tuple, dict]] | None
    info: LocalInfo | None
    mutated: tuple[int, ...]  # DTensor-input indices the op writes to
    returns_self: bool  # an in-place op: return the mutated DTensor itself
    fallback: bool = False
    #: The op returns a view of an input (its write-through is lost if that input had to be redistributed).
    view: bool = False
    #: Nothing to do but the local op and the wrap: the inputs already sit where the rule wants them.
    direct: bool = False


def _replicate_plain_tensors(flat: list[Any]) -> list[Any]:
    """``flat`` with each plain tensor of one or more dimensions wrapped as a replicated DTensor on the DTensors' mesh."""
    mesh = next(x._spec.mesh for x in flat if isinstance(x, DTensor))
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim != 0:
            shape = tuple(x.shape)
            x = DTensor(x, DTensorSpec(mesh, replicate, shape, tuple(x.stride()), x.dtype))
        out.append(x)
    return out


# -- flattening (one level of lists is all aten schemas use) ------------------------------------------


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], list[Any]]:
    flat: list[Any] = []
    layout: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            layout.append(len(a))
            flat.extend(a)
        else:
            layout.append(None)
            flat.append(a)
    for name, a in kwargs.items():
        if isinstance(a, (list, tuple)):
            layout.append((name, len(a)))
            flat.extend(a)
        else:
            layout.append((name, None))
            flat.append(a)
    return flat, layout


def _unflatten(flat: list[Any], layout: list[Any]) -> tuple[tuple, dict]:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    i = 0
    for entry in layout:
        if isinstance(entry, tuple):
            name, n = entry
            if n is None:
                kwargs[name] = flat[i]
                i += 1
            else:
                kwargs[name] = list(flat[i : i + n])
                i += n
        elif entry is None:
            args.append(flat[i])
            i += 1
        else:
            args.append(list(flat[i : i + entry]))
            i += entry
    return tuple(args), kwargs


# -- dispatch -----------------------------------------------------------------------------------------

#: What ``__torch_dispatch__`` hands on: an aten op overload.
Op = torch._ops.OpOverload
#: An op taken over by a context: called with the op's own arguments instead of its rule.
Override = Callable[..., object]


def _direct_key(func: Op, args: tuple) -> tuple | None:
    """The direct path's key for positional ``args`` (DTensors and non-tensors), else None (a tensor or a list)."""
    key: list[Any] = [func]
    for a in args:
        if type(a) is DTensor:
            spec = a._spec
            key.append(spec.key)
            key.append(id(spec.mesh))  # (a plan holds its mesh: the id cannot pass to another mesh)
        elif isinstance(a, (torch.Tensor, list, tuple)):
            return None
        else:
            key.append(a)
            key.append(type(a))  # 2 and 2.0 hash alike; their results' dtypes do not
    return tuple(key)


class Dispatcher:
    """The owner of DTensor's dispatch state: plan caches, context overrides, fallback warnings, implicit replication.

    One per process (``dispatcher``, reachable as ``DTensor._dispatcher``); a
    test may make its own to ``plan`` from empty caches.
    """

    def __init__(self) -> None:
        #: Plans by full call signature (op, argument layout, specs, non-tensor values, mesh).
        self._cache: dict[tuple, Plan] = {}
        #: Plans that need no redistribution, rewrite or mutation, keyed on positional arguments alone (the fast path).
        self._direct: dict[tuple, Plan] = {}
        #: The plugin generation (``spmd.plugins.generation``) the caches were filled under: a new one empties them.
        self._generation: object = None
        #: Ops the fallback warned about (once per process each).
        self.warned: set[str] = set()
        #: Open ``implicit_replication()`` contexts: while above 0, a plain tensor beside DTensors is taken as
        #: replicated on their mesh instead of raising MixedTensorError. Read only where a plain tensor is
        #: found, so the common path (DTensors and scalars) never pays for it.
        self.implicit_depth = 0
        #: Ops taken over by an active context (``loss_parallel``), checked before the rules.
        self.overrides: dict[Op, Override] = {}
        #: The ops being dispatched, innermost last (``CommDebugMode`` names the op a collective served).
        self.current_op: list[Op] = []

    # -- contexts ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def implicit_replication(self) -> Iterator[None]:
        """Within it, a plain ``torch.Tensor`` beside DTensors counts as replicated on their mesh (torch's semantics).

        As ``torch.distributed.tensor.experimental.implicit_replication``: code that
        mixes a DTensor with a tensor every rank holds whole (a mask, a bias built
        by hand) runs without converting it. Each rank's tensor is taken as is, so
        it must be the same on every rank. Not thread-local, as torch's is not.
        """
        self.implicit_depth += 1
        try:
            yield
        finally:
            self.implicit_depth -= 1

    @contextlib.contextmanager
    def overriding(self, ops: Mapping[Op, Override]) -> Iterator[None]:
        """Within it, each op of ``ops`` runs its function instead of its rule (``loss_parallel``); nests, restores on exit."""
        previous = {op: self.overrides.get(op) for op in ops}
        self.overrides.update(ops)
        try:
            yield
        finally:
            for op, fn in previous.items():
                if fn is None:
                    self.overrides.pop(op, None)
                else:
                    self.overrides[op] = fn

    # -- dispatch ---------------------------------------------------------------------------------------

    def dispatch(self, func: Op, args: tuple, kwargs: dict) -> object:
        """Run ``func`` on DTensor arguments (the body of ``DTensor.__torch_dispatch__``).

        Most calls in a training step (positional DTensors and scalars, shards
        already where the rule wants them) take the direct path: one key, one
        lookup, the local op, the wrap.
        """
        if self.overrides:
            override = self.overrides.get(func)
            if override is not None:
                return override(*args, **kwargs)
        key = _direct_key(func, args) if not kwargs and self._generation is plugins.generation else None
        if key is not None:
            try:
                plan = self._direct.get(key)  # hashes the key once
            except TypeError:  # an unhashable argument: the general path
                return self.dispatch_by_rule(func, args, kwargs)
            if plan is not None:
                return _wrap(func(*[a._local_tensor if type(a) is DTensor else a for a in args]), plan.out_specs)
            out, plan = self._dispatch_planned(func, args, kwargs, None)
            if plan is not None and plan.direct:
                self._direct[key] = plan
            return out
        return self.dispatch_by_rule(func, args, kwargs)

    def dispatch_by_rule(self, func: Op, args: tuple, kwargs: dict, rule: Rule | Decompose | None = None) -> object:
        """``dispatch`` without the context overrides: ``rule``, else the op's registered rule (or the fallback).

        A ``Decompose`` that handles only some layouts passes the rest on here with a plain rule.
        """
        return self._dispatch_planned(func, args, kwargs, rule)[0]

    def plan(self, func: Op, args: tuple, kwargs: dict | None = None) -> Plan | None:
        """The plan ``func`` on these arguments gets (cached as a call would cache it), without running it.

        None for an op whose rule is a ``Decompose`` or that has no meta kernel.
        What planning reads of the mesh is its shape and this rank's place in it,
        so a ``DeviceMesh.for_planning`` mesh serves (tests, what-if questions).
        """
        rule = registry.lookup(func)
        return None if isinstance(rule, Decompose) else self._planned(func, args, kwargs or {}, rule)[0]

    def _dispatch_planned(self, func: Op, args: tuple, kwargs: dict, rule: Rule | Decompose | None) -> tuple[object, Plan | None]:
        """``dispatch_by_rule``, also returning the plan it used (None: a decomposition or no meta kernel)."""
        if rule is None:
            rule = registry.lookup(func)
        if isinstance(rule, Decompose):
            return rule.fn(*args, **kwargs), None
        plan, flat, layout, positions, mesh = self._planned(func, args, kwargs, rule)
        if plan is None:  # no meta kernel: compute on the full tensors
            return _run_unplanned(self, func, flat, layout, positions, mesh), None
        return _execute(self, func, plan, flat, layout, positions), plan

    def _planned(self, func: Op, args: tuple, kwargs: dict, rule: Rule | None
                 ) -> tuple[Plan | None, list[Any], list[Any], list[int], DeviceMesh]:
        """The call's plan (from the cache, else propagated and cached; None: no meta kernel) and its flattened
        arguments (with plain tensors wrapped as replicated under ``implicit_replication``)."""
        if self._generation is not plugins.generation:  # plugins (re)loaded or registered: rules may have changed
            self._cache.clear()
            self._direct.clear()
            self._generation = plugins.generation
        flat, layout = _flatten(args, kwargs)
        key: list[Any] = [func, tuple(layout)]
        positions: list[int] = []
        mesh: DeviceMesh | None = None
        for i, x in enumerate(flat):
            if isinstance(x, DTensor):
                positions.append(i)
                spec = x._spec
                if mesh is None:
                    mesh = spec.mesh
                elif spec.mesh is not mesh and spec.mesh != mesh:
                    raise ValueError(f"{func}: DTensor arguments live on different meshes ({mesh} and {spec.mesh}); redistribute onto one mesh first")
                key.append(spec.key)
            elif isinstance(x, torch.Tensor):
                if x.ndim != 0:
                    if self.implicit_depth:  # the switch: only consulted when a plain tensor turns up
                        return self._planned(func, *_unflatten(_replicate_plain_tensors(flat), layout), rule)
                    raise MixedTensorError(
                        f"{func}: got a plain torch.Tensor of shape {tuple(x.shape)} beside DTensors; convert it with "
                        "spmd.distribute_tensor(t, mesh, [Replicate()]) or DTensor.from_local first, or run the code "
                        "under spmd.tensor.experimental.implicit_replication() (only 0-dim tensors are taken as "
                        "replicated otherwise)"
                    )
                key.append((x.dtype, x.device.type))
            else:
                key.append(x)
                key.append(type(x))
        assert mesh is not None
        key.append(mesh)
        cache_key = tuple(key)
        try:
            plan = self._cache.get(cache_key)
            cacheable = True
        except TypeError:  # an unhashable argument: propagate without caching
            plan, cacheable = None, False
        if plan is None:
            plan = _propagate(self, func, rule, flat, layout, positions, mesh)
            if cacheable and plan is not None:
                self._cache[cache_key] = plan
        return plan, flat, layout, positions, mesh

    def warn_fallback(self, func: Op) -> None:
        """Warn (once per op and process) that ``func`` has no rule and runs gathered."""
        name = str(func)
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(
                f"spmd DTensor: no sharding rule for {name}; falling back to gather, compute on the full tensors, "
                "reshard (correct but slow). A plugin can provide a rule through the spmd_sharding_rules hook",
                stacklevel=5,
            )


def _execute(dispatcher: Dispatcher, func: Op, plan: Plan, flat: list[Any], layout: list[Any], positions: list[int]) -> Any:
    local = list(flat)
    for index in plan.mutated:
        _refuse_detached_write(func, flat[positions[index]])
    dispatcher.current_op.append(func)
    try:
        for target, pos in zip(plan.targets, positions):
            dt = flat[pos]
            if dt._spec.placements == target:
                local[pos] = dt._local_tensor
            else:
                local[pos] = redistribute_local(dt._local_tensor, dt._spec, target)
                if plan.view and local[pos].numel() and not shares_memory(local[pos], dt._local_tensor):
                    # the view will alias this copy, not the input: remember it, so a write through it fails
                    # (on the storage: locals made inside dispatch carry no view links, every view shares it)
                    local[pos].untyped_storage()._spmd_detached = (func, dt._spec.placements, target)
    finally:
        dispatcher.current_op.pop()
    args, kwargs = _unflatten(local, layout)
    if plan.rewrite is not None:
        assert plan.info is not None  # (set with every rewrite)
        args, kwargs = plan.rewrite(args, kwargs, plan.info)
    original = [flat[p]._spec for p in positions] if plan.fallback else []
    out = func(*args, **kwargs)
    for index in plan.mutated:
        pos = positions[index]
        dt = flat[pos]
        if dt._spec.placements != plan.targets[index]:  # the rule moved the mutated input: it holds the new shard
            dt._local_tensor = local[pos]
            dt._spec = dt._spec.with_placements(plan.targets[index])
    if plan.fallback:
        return _reshard_fallback(plan, out, flat, positions, original)
    if plan.returns_self:
        return flat[positions[plan.mutated[0]]]
    return _wrap(out, plan.out_specs)


def _refuse_detached_write(func: Any, dt: DTensor) -> None:
    """Raise if ``dt`` is a view of a copy that a view op's redistribution made (see ``_execute``)."""
    detached = getattr(dt._local_tensor.untyped_storage(), "_spmd_detached", None)
    if detached is None:
        return
    view_op, source, target = detached
    raise DetachedViewError(
        f"{func}: writes in place into a DTensor view made by {view_op} of a redistributed copy (its input had "
        f"placements {list(source)}, the op needed {list(target)}), so the write would not reach the tensor the view "
        f"was taken from. Write into .clone() of the view, or redistribute the base to {list(target)} before "
        "taking the view"
    )


def _wrap(out: Any, specs: tuple[DTensorSpec, ...]) -> Any:
    if isinstance(out, torch.Tensor):
        return DTensor(out, specs[0])
    if isinstance(out, (tuple, list)):
        it = iter(specs)
        wrapped = [DTensor(o, next(it)) if isinstance(o, torch.Tensor) else o for o in out]
        return type(out)(wrapped) if isinstance(out, tuple) else wrapped
    return out


# -- propagation --------------------------------------------------------------------------------------


def _meta_outputs(func: Any, flat: list[Any], layout: list[Any]) -> Any:
    meta = []
    for x in flat:
        if isinstance(x, DTensor):
            s = x._spec
            meta.append(torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta"))
        elif isinstance(x, torch.Tensor):
            meta.append(x.to("meta"))
        else:
            meta.append(x)
    args, kwargs = _unflatten(meta, layout)
    try:
        return func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent shape
        return _NO_META


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _mutated_inputs(func: Any, flat: list[Any], layout: list[Any], positions: list[int]) -> tuple[tuple[int, ...], bool]:
    """DTensor-input indices the op writes to, and whether it returns its first (mutated) argument."""
    schema = func._schema
    if not schema.is_mutable:
        return (), False
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    flat_index = 0
    mutated = []
    names = [a.name for a in schema.arguments]
    for slot, entry in enumerate(layout):
        name = entry[0] if isinstance(entry, tuple) else names[slot]
        count = (entry[1] if isinstance(entry, tuple) else entry) or 1
        if name in written:
            for k in range(flat_index, flat_index + count):
                if k in positions:
                    mutated.append(positions.index(k))
        flat_index += count
    returns_self = bool(mutated) and len(schema.returns) == 1 and schema.returns[0].alias_info is not None
    return tuple(mutated), returns_self


def _propagate(dispatcher: Dispatcher, func: Op, rule: Rule | None, flat: list[Any], layout: list[Any], positions: list[int], mesh: DeviceMesh) -> Plan | None:
    meta_out = _meta_outputs(func, flat, layout)
    if meta_out is _NO_META:
        return None
    leaves = _tensor_leaves(meta_out)
    outputs = tuple(TensorMeta(tuple(t.shape), t.dtype) for t in leaves)
    mutated, returns_self = _mutated_inputs(func, flat, layout, positions)
    specs = [flat[p]._spec for p in positions]
    if returns_self and leaves and (tuple(leaves[0].shape), tuple(leaves[0].stride())) != (specs[mutated[0]].shape, specs[mutated[0]].stride):
        raise InPlaceViewError(
            f"{func}: changes the shape or strides of a DTensor in place ({list(specs[mutated[0]].shape)} -> "
            f"{list(leaves[0].shape)}), which a DTensor's wrapper cannot follow; use the out-of-place op "
            f"(x = x.{func._schema.name.split('::')[-1].rstrip('_')}(...))"
        )
    if rule is None:
        dispatcher.warn_fallback(func)
        replicated: tuple[tuple[Placement, ...], ...] = tuple(tuple(Replicate() for _ in range(mesh.ndim)) for _ in positions)
        out_specs = tuple(
            DTensorSpec(mesh, replicated[0] if replicated else (Replicate(),) * mesh.ndim, tuple(t.shape), tuple(t.stride()), t.dtype)
            for t in leaves
        )
        return Plan(replicated, out_specs, None, None, mutated, returns_self, fallback=True, view=_is_view(func))
    per_dim: list[Sharding] = []
    for mesh_dim in range(mesh.ndim):
        inputs = tuple(TensorArg(s.shape, s.dtype, s.placements[mesh_dim], s.placements) for s in specs)
        rule_flat = list(flat)
        for p, arg in zip(positions, inputs):
            rule_flat[p] = arg
        args, kwargs = _unflatten(rule_flat, layout)
        call = OpCall(func, args, kwargs, inputs, outputs, mesh_dim, mesh.size(mesh_dim))
        sharding = rule(call)
        if len(sharding.inputs) != len(inputs) or len(sharding.outputs) != len(outputs):
            raise ShardingRuleError(
                f"the sharding rule for {func} (plugin {registry.owner(func)!r}) returned {len(sharding.inputs)} input "
                f"and {len(sharding.outputs)} output placements; the call has {len(inputs)} DTensor inputs and "
                f"{len(outputs)} tensor outputs"
            )
        per_dim.append(sharding)
    targets: tuple[tuple[Placement, ...], ...] = tuple(
        tuple(per_dim[d].inputs[i] for d in range(mesh.ndim)) for i in range(len(positions))
    )
    out_placements = [tuple(per_dim[d].outputs[k] for d in range(mesh.ndim)) for k in range(len(outputs))]
    out_specs = tuple(DTensorSpec(mesh, pl, tuple(t.shape), tuple(t.stride()), t.dtype) for pl, t in zip(out_placements, leaves))
    rewrite = next((s.rewrite for s in per_dim if s.rewrite is not None), None)
    info = None
    if rewrite is not None:
        info = LocalInfo(
            tuple(local_shape_and_offset(s.shape, mesh, s.placements)[0] for s in out_specs),
            tuple(local_shape_and_offset(spec.shape, mesh, t)[0] for spec, t in zip(specs, targets)),
        )
    direct = rewrite is None and not mutated and all(spec.placements == t for spec, t in zip(specs, targets))
    return Plan(targets, out_specs, rewrite, info, mutated, returns_self, direct=direct, view=_is_view(func))


def _is_view(func: Any) -> bool:
    """Whether ``func`` returns an alias of an input (a view op), not a new tensor."""
    schema = func._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


# -- the fallback: gather, compute, reshard ------------------------------------------------------------


def _reshard_fallback(plan: Plan, out: Any, flat: list[Any], positions: list[int], original: list[DTensorSpec]) -> Any:
    """Give fallback outputs (computed replicated) the first input's placements when the shapes allow."""
    first = original[0] if original else None
    for index in plan.mutated:  # an in-place op: the mutated DTensor goes back to its placements
        dt = flat[positions[index]]
        placements = original[index].placements
        if not any(isinstance(p, Partial) for p in placements):
            dt._local_tensor = redistribute_local(dt._local_tensor, dt._spec, placements)
            dt._spec = dt._spec.with_placements(placements)
    if plan.returns_self:
        return flat[positions[plan.mutated[0]]]
    wrapped = _wrap(out, plan.out_specs)
    if first is None or any(isinstance(p, Partial) for p in first.placements):
        return wrapped
    results = wrapped if isinstance(wrapped, (tuple, list)) else [wrapped]
    resharded = []
    for r in results:
        if isinstance(r, DTensor) and r._spec.shape == first.shape:
            local = redistribute_local(r._local_tensor, r._spec, first.placements)
            r = DTensor(local, r._spec.with_placements(first.placements))
        resharded.append(r)
    if isinstance(wrapped, tuple):
        return tuple(resharded)
    return resharded if isinstance(wrapped, list) else resharded[0]


def _run_unplanned(dispatcher: Dispatcher, func: Op, flat: list[Any], layout: list[Any], positions: list[int], mesh: DeviceMesh) -> Any:
    """An op whose output shape cannot be known ahead (no meta kernel): compute replicated, no cache."""
    dispatcher.warn_fallback(func)
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    local = list(flat)
    for pos in positions:
        dt = flat[pos]
        local[pos] = redistribute_local(dt._local_tensor, dt._spec, replicate)
    args, kwargs = _unflatten(local, layout)
    out = func(*args, **kwargs)
    leaves = _tensor_leaves(out)
    specs = tuple(DTensorSpec(mesh, replicate, tuple(t.shape), tuple(t.stride()), t.dtype) for t in leaves)
    return _wrap(out, specs)


#: The process's dispatcher: every DTensor op goes through it.
dispatcher = Dispatcher()
DTensor._dispatcher = dispatcher
#: ``spmd.tensor.experimental.implicit_replication``: the process dispatcher's context.
implicit_replication = dispatcher.implicit_replication
