"""spmd-nccl on real GPUs: the shared conformance suite on CUDA tensors, then what only NCCL has
(unsupported reductions, its own gather and barrier, stream semantics, graphs, splits, timeouts).

Skipped as a whole where no CUDA device is visible; world sizes that need more
GPUs than are visible are left out (the conformance class) or skipped with the
count. Each rank of a World runs on GPU ``local rank % device_count`` (NCCL needs
one GPU per rank of a communicator).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("spmd_nccl", reason="spmd-nccl is not installed (pip install -e plugins/nccl)")

from spmd.testing.conformance import BackendConformance  # noqa: E402
from spmd_nccl import gpu_checks  # noqa: E402
from spmd_nccl.backend import cuda_unavailable_reason  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device is visible: {cuda_unavailable_reason()}", allow_module_level=True)

BACKEND = "cpu:gloo,cuda:nccl"  # object collectives and spmd.barrier stay on Gloo
GPUS = torch.cuda.device_count()


class TestNcclConformance(BackendConformance):
    """The suite every backend passes, on this rank's GPU."""

    backend = BACKEND
    device = "cuda"
    world_sizes = tuple(n for n in (1, 2, 4) if n <= GPUS)
    run_timeout = 300.0


def _world(spmd_world, n: int):  # type: ignore[no-untyped-def]
    if n > GPUS:
        pytest.skip(f"needs {n} GPUs (one per rank), {GPUS} visible")
    return spmd_world(n, BACKEND)


@pytest.mark.parametrize("ws", (1, 2))
def test_what_only_nccl_has(spmd_world, ws: int) -> None:  # type: ignore[no-untyped-def]
    per_rank = _world(spmd_world, ws).run(gpu_checks.run_nccl_checks, timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("ws", (1, 2))
def test_wait_orders_the_stream_without_blocking_the_cpu(spmd_world, ws: int) -> None:  # type: ignore[no-untyped-def]
    _world(spmd_world, ws).run(gpu_checks.check_stream_semantics)


@pytest.mark.parametrize("ws", (1, 2))
def test_all_reduce_in_a_cuda_graph(spmd_world, ws: int) -> None:  # type: ignore[no-untyped-def]
    _world(spmd_world, ws).run(gpu_checks.check_cuda_graph)


@pytest.mark.parametrize("ws", (1, 2))
def test_full_sub_groups_split_and_partial_ones_bootstrap(spmd_world, ws: int) -> None:  # type: ignore[no-untyped-def]
    origins = _world(spmd_world, ws).run(gpu_checks.check_split_origin)
    assert all(o["all ranks"] == "ncclCommSplit" for o in origins)
    if ws > 1:
        assert origins[0]["evens"] == "ncclCommInitRankConfig"


def test_a_timeout_aborts_the_communicator(spmd_world) -> None:  # type: ignore[no-untyped-def]
    results = _world(spmd_world, 2).run(gpu_checks.check_timeout_aborts, timeout=120)
    assert results[0] == "timed out and aborted"


def test_paths_the_kernel_stages_stay_on_the_device(spmd_world) -> None:  # type: ignore[no-untyped-def]
    """List forms, spmd.gather and non-contiguous tensors stage through the kernel's pool on the tensor's device.

    Fails (it used to xfail) if the pool hands NCCL host memory again.
    """
    failures = _world(spmd_world, 1).run(gpu_checks.check_kernel_staging)[0]
    assert not failures, "; ".join(failures)
