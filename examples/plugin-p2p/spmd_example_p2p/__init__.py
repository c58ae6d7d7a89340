"""An isend/irecv-only spmd backend, written only against the names DESIGN.md fixes.

It moves bytes with the point-to-point half of torch's Gloo transport and
declares no collective, so spmd's generic algorithms serve all of them: the
kernel's own tests run the conformance suite against it for exactly that
reason. It is also the template for a third-party backend: one BackendSpec,
one Backend subclass with two methods, one entry point.
"""

from __future__ import annotations

import concurrent.futures

import torch

import spmd


class P2PBackend(spmd.Backend):
    """Point-to-point only: every collective comes from spmd's generic algorithms."""

    aborts_on_size_mismatch = True  # Gloo's pairs abort the process on a message of the wrong size

    def __init__(self, ctx: spmd.BackendContext) -> None:
        super().__init__(ctx)
        import torch.distributed as tdist  # heavy imports belong in the factory, not at import

        self._pg = tdist.ProcessGroupGloo(ctx.store, ctx.rank, ctx.size, ctx.timeout)
        # Gloo's send/recv handles have no future; threads wait on them to complete spmd Works.
        self._waiters = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix=f"p2p-{ctx.group_name}")

    def _work(self, native, tensor) -> spmd.Work:  # type: ignore[no-untyped-def]
        def wait(keep_alive=tensor) -> None:  # type: ignore[no-untyped-def]
            native.wait()  # keep_alive holds the buffer until the transfer is done

        return spmd.Work.from_future(self._waiters.submit(wait))

    def isend(self, tensor, dst: int, tag: int = 0) -> spmd.Work:  # type: ignore[no-untyped-def]
        data = tensor.reshape(-1).view(dtype=torch.uint8)
        return self._work(self._pg.send([data], dst, tag), data)

    def irecv(self, tensor, src: int, tag: int = 0) -> spmd.Work:  # type: ignore[no-untyped-def]
        data = tensor.reshape(-1).view(dtype=torch.uint8)
        return self._work(self._pg.recv([data], src, tag), data)

    def close(self) -> None:
        super().close()
        self._waiters.shutdown(wait=True, cancel_futures=True)  # no thread may outlive the group
        self._pg = None  # release Gloo here, in the caller's thread, not at interpreter exit


@spmd.hookimpl
def spmd_backends():  # type: ignore[no-untyped-def]
    return [
        spmd.BackendSpec(
            name="p2p",
            devices=("cpu",),
            factory=P2PBackend,
            priority=-10,  # never chosen by spmd.init() when a native backend is installed
            description="example third-party backend: isend/irecv only, generic collectives",
        )
    ]
