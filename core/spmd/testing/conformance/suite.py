"""The pytest face of the conformance suite: one test per (world size, op, group shape)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import spmd
from spmd.comm.group import ProcessGroup
from spmd.comm.state import NON_GROUP_MEMBER
from spmd.testing.conformance.checks import CHECKS, Recorder
from spmd.testing.world import World

#: world: every rank; subset: all but rank 0; split: split_group by parity, in reverse rank order.
GROUP_SHAPES = ("world", "subset", "split")


@dataclass(frozen=True)
class SuiteParam:
    world_size: int
    op: str
    shape: str

    @property
    def id(self) -> str:
        return f"w{self.world_size}-{self.op}-{self.shape}"


def suite_params(world_sizes: tuple[int, ...]) -> list[SuiteParam]:
    """Every (world size, op, group shape); sub-group shapes only where they differ from the world."""
    return [
        SuiteParam(ws, op, shape)
        for ws in world_sizes
        for shape in GROUP_SHAPES
        if shape == "world" or ws > 1
        for op in CHECKS
    ]


def _make_group(shape: str) -> ProcessGroup | object:
    n, r = spmd.get_world_size(), spmd.get_rank()
    if shape == "world":
        return spmd.comm.state.get_state().world
    if shape == "subset":
        return spmd.new_group(list(range(1, n)))
    if shape == "split":
        return spmd.split_group(color=r % 2, key=-r)
    raise ValueError(f"unknown group shape {shape!r}; choose from {GROUP_SHAPES}")


def device_under_test(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: the CPU, or accelerator ``local rank % count`` (made current)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    index = int(os.environ.get("LOCAL_RANK", spmd.get_rank())) % module.device_count()
    module.set_device(index)
    return torch.device(device_type, index)


def run_cases(op: str, shape: str, device_type: str = "cpu") -> list[str]:
    """On one rank: build the group, run every case of ``op`` on ``device_type`` tensors, return the failures."""
    group = _make_group(shape)
    if group is NON_GROUP_MEMBER:
        return []
    assert isinstance(group, ProcessGroup)
    device = device_under_test(device_type)
    recorder = Recorder(device, group.backend(device_type).supports_reduction)
    try:
        CHECKS[op](group, recorder)
    finally:
        if device.type != "cpu":
            getattr(torch, device.type).synchronize()
            if group is not spmd.comm.state.get_state().world:
                spmd.destroy_process_group(group)  # frees its device communicator (and device memory)
    if recorder.count == 0 and not (op == "p2p" and group.size == 1):
        return [f"{op}: no cases ran"]
    return recorder.failures


class BackendConformance:
    """Subclass in a backend plugin's tests to run the whole suite against it::

        class TestGlooConformance(BackendConformance):
            backend = "gloo"

    A device backend names its device type and the backend string ``spmd.init``
    takes (a CPU backend beside it carries object collectives and barriers)::

        class TestNcclConformance(BackendConformance):
            backend = "cpu:gloo,cuda:nccl"
            device = "cuda"
    """

    spmd_conformance = True
    backend: str = ""
    #: The device type of the tensors the cases use (each rank takes device ``local rank % count``).
    device: str = "cpu"
    world_sizes: tuple[int, ...] = (1, 2, 3, 4)
    #: Seconds one (world size, op, group shape) run may take on all ranks.
    run_timeout: float = 240.0

    def test_conformance(self, spmd_world: Callable[[int, str], World], conformance_case: SuiteParam) -> None:
        world = spmd_world(conformance_case.world_size, self.backend)
        per_rank = world.run(run_cases, conformance_case.op, conformance_case.shape, self.device, timeout=self.run_timeout)
        failures = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
        assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])


def failures_across_hosts(hosts: Any, backend: str | None, env: dict[str, str] | None = None) -> list[str]:
    """Every op of the suite on 4 ranks spread over 2 test-bed nodes (``spmd.testing.hosts``; ranks alternate), plus
    split groups: one line per failing case (empty when the backend passes). ``backend`` None: the kernel's own choice."""
    world = World(4, backend, host=hosts.attach_here(), rank_prefix=lambda rank: hosts.nodes[rank % 2].command([]), env=env)
    try:
        return [f"{op}/{shape} rank {rank}: {failure}"
                for op, shape in [*((op, "world") for op in CHECKS), ("all_reduce", "split"), ("p2p", "split")]
                for rank, per_rank in enumerate(world.run(run_cases, op, shape, "cpu", timeout=120)) for failure in per_rank]
    finally:
        world.close()
