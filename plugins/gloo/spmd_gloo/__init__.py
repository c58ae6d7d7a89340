"""spmd-gloo: the default CPU backend, torch's ProcessGroupGloo behind spmd's contract."""

from __future__ import annotations

from collections.abc import Iterable

import spmd


def _available() -> str | None:
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_gloo_available():
        return "this torch build has no Gloo (torch.distributed.is_gloo_available() is False)"
    return None


def _factory(ctx: spmd.BackendContext) -> spmd.Backend:
    from spmd_gloo.backend import GlooBackend

    return GlooBackend(ctx)


def _where_it_binds(binding: object) -> str:
    from spmd_gloo.backend import device_choice

    return device_choice({}, binding)[1]  # type: ignore[arg-type]


@spmd.hookimpl
def spmd_backends() -> Iterable[spmd.BackendSpec]:
    return [
        spmd.BackendSpec(
            name="gloo",
            devices=("cpu",),
            factory=_factory,
            priority=10,
            available=_available,
            backend_class="spmd_gloo.backend:GlooBackend",
            description="Gloo over TCP (torch's ProcessGroupGloo); the default CPU backend",
            where_it_binds=_where_it_binds,
        )
    ]


@spmd.hookimpl
def spmd_bench_peers():  # type: ignore[no-untyped-def]
    """The raw peer for ``spmd bench --vs-raw``: torch's ProcessGroupGloo on the same buffers' shapes."""
    from spmd_gloo.bench_peer import raw_gloo_ops

    return {"gloo": raw_gloo_ops}
