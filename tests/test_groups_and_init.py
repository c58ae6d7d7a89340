"""init from every source, groups, async overlap."""

import os
import subprocess
import sys
import textwrap

import group_helpers
import pytest
import torch

import spmd
from spmd.testing.ports import free_port

SCRIPT = textwrap.dedent(
    """
    import sys, torch, spmd
    spmd.init("gloo", init_method=sys.argv[1] if len(sys.argv) > 1 else None, timeout=30)
    t = torch.tensor([float(spmd.get_rank() + 1)])
    spmd.all_reduce(t)
    print(f"rank={spmd.get_rank()} world={spmd.get_world_size()} sum={t.item():.0f}")
    spmd.destroy_process_group()
    """
)


def _launch(tmp_path, env_for_rank, args=()):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    procs = [
        subprocess.Popen([sys.executable, str(script), *args], env={**os.environ, **env_for_rank(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    return sorted(p.communicate(timeout=60)[0].strip() for p in procs)


def test_env_init_reads_torchrun_variables(tmp_path):
    port = free_port()
    out = _launch(tmp_path, lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert out == ["rank=0 world=2 sum=3", "rank=1 world=2 sum=3"]


def test_tcp_init_method(tmp_path):
    port = free_port()
    script = tmp_path / "tcp.py"
    script.write_text(SCRIPT.replace('init_method=sys.argv[1] if len(sys.argv) > 1 else None', 'init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2'))
    procs = [subprocess.Popen([sys.executable, str(script), f"tcp://127.0.0.1:{port}", str(r)], stdout=subprocess.PIPE, text=True) for r in range(2)]
    assert sorted(p.communicate(timeout=60)[0].strip() for p in procs) == ["rank=0 world=2 sum=3", "rank=1 world=2 sum=3"]


def test_file_init_method(tmp_path):
    script = tmp_path / "file.py"
    script.write_text(SCRIPT.replace('init_method=sys.argv[1] if len(sys.argv) > 1 else None', 'init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2'))
    url = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(script), url, str(r)], stdout=subprocess.PIPE, text=True) for r in range(2)]
    assert sorted(p.communicate(timeout=60)[0].strip() for p in procs) == ["rank=0 world=2 sum=3", "rank=1 world=2 sum=3"]


def test_plain_python_is_a_world_of_one():
    spmd.init("gloo")
    try:
        assert (spmd.get_rank(), spmd.get_world_size()) == (0, 1)
        t = torch.ones(3)
        spmd.all_reduce(t, op=spmd.ReduceOp.AVG)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert spmd.get_backend() == "gloo"
    finally:
        spmd.destroy_process_group()
    assert not spmd.is_initialized()


def test_init_twice_is_an_error():
    spmd.init("gloo")
    try:
        try:
            spmd.init("gloo")
        except spmd.SpmdError as error:
            assert "already initialised" in str(error)
        else:
            raise AssertionError("second init did not fail")
    finally:
        spmd.destroy_process_group()


def test_new_group_and_split_group_ranks(spmd_world):
    results = spmd_world(4, "gloo").run(group_helpers.subgroup_ranks)
    assert [r[0] for r in results] == [-1, 0, 1, -1]
    assert [r[1] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[2] for r in results] == [0, 0, 2, 2]


def test_groups_get_one_name_on_all_their_ranks(spmd_world):
    """A group_desc reused by overlapping groups, or split_group's colours, once named a group differently
    on different ranks (or two groups alike): their ranks never met and waited out the timeout."""
    results = spmd_world(4, "gloo").run(group_helpers.groups_named_alike)
    assert results[0]["first"] == results[1]["first"] and results[0]["first"][1] == 1 + 2
    assert results[1]["second"] == results[2]["second"] and results[1]["second"][1] == 2 + 3
    assert results[0]["first"][0] != results[1]["second"][0]
    assert results[1]["half"] == results[2]["half"] and results[1]["half"][1] == 2 + 3
    assert results[3]["half"][1] == 4 and results[3]["half"][0] != results[1]["half"][0]
    assert results[0]["last"] == results[3]["last"] and results[0]["last"][1] == 1 + 4


def test_local_groups_of_other_ranks_never_share_a_name(spmd_world):
    """Two groups made apart with one group_desc had one name, so one store prefix: their ranks' keys mixed."""
    results = spmd_world(4, "gloo").run(group_helpers.local_groups_with_one_desc)
    assert [value for _, value in results] == [3.0, 3.0, 7.0, 7.0]
    assert results[0][0] == results[1][0] != results[2][0] == results[3][0]


def test_many_async_ops_in_flight(spmd_world):
    for values in spmd_world(2, "gloo").run(group_helpers.async_overlap):
        assert values == [1.0 + 2 * k for k in range(5)]


def test_split_group_torch_form(spmd_world):
    results = spmd_world(4, "gloo").run(group_helpers.split_group_torch_form)
    assert results[1] == (None, None)
    assert results[0] == results[2] == ([0, 2], 1.0 + 3.0)
    assert results[3] == ([3], 4.0)


def test_split_group_argument_errors():
    spmd.init("gloo")
    try:
        with pytest.raises(ValueError, match="either split_ranks .* or color="):
            spmd.split_group()
        with pytest.raises(ValueError, match="not both"):
            spmd.split_group(split_ranks=[[0]], color=0)
        with pytest.raises(ValueError, match="must not overlap"):
            spmd.split_group(split_ranks=[[0], [0]])
        with pytest.raises(ValueError, match="out of range"):
            spmd.split_group(split_ranks=[[0, 1]])
        with pytest.raises(ValueError, match="name a rank twice"):
            spmd.new_group([0, 0])
    finally:
        spmd.destroy_process_group()


def test_new_group_order_and_local_synchronization(spmd_world):
    results = spmd_world(3, "gloo").run(group_helpers.unsorted_and_local_groups)
    assert [r[0] for r in results] == [1, 2, 0]  # group ranks follow [2, 0, 1]
    assert [r[1] for r in results] == [2.0, 2.0, 2.0]  # broadcast from group rank 0 = world rank 2
    assert results[0][2] == results[2][2] == [4.0, 4.0] and results[1][2] == []


def test_barrier_timeout_argument(spmd_world):
    world = spmd_world(2, "gloo")
    try:
        rank0, rank1 = world.run(group_helpers.barrier_with_timeout, 0.5)
    finally:
        world.kill()  # a timed-out wait leaves Gloo state behind: later tests get a fresh world
    elapsed, message = rank0.split("|", 1)
    assert float(elapsed) < 5.0, "barrier(timeout=0.5) waited for the group timeout instead"
    assert "barrier" in message and rank1 == "stayed away"


def test_module_api_matches_torch_signatures():
    """Every torch.distributed function spmd offers takes torch's parameters, in torch's order."""
    import inspect
    import warnings

    import torch.distributed as tdist

    extra = {"init_process_group": {"trace_dir"}, "get_backend": {"device"}}  # spmd's additions
    private = {"init_process_group": {"_ranks"}}  # torch-internal parameters
    names = [n for n in spmd.__all__ if callable(getattr(tdist, n, None)) and inspect.isfunction(getattr(spmd, n))]
    assert {"all_reduce", "split_group", "new_group", "barrier", "all_gather_single"} <= set(names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            ours = [p for p in inspect.signature(getattr(spmd, name)).parameters if p not in extra.get(name, set())]
            theirs = [p for p in inspect.signature(getattr(tdist, name)).parameters if p not in private.get(name, set())]
            assert ours[: len(theirs)] == theirs, f"spmd.{name}{ours} vs torch.distributed.{name}{theirs}"


def test_object_collectives_travel_on_the_groups_device(monkeypatch):
    """CPU when the group has a CPU backend; else the current device of its device type, as torch does for NCCL."""
    from types import SimpleNamespace

    from spmd.comm.objects import transport_device

    assert transport_device(SimpleNamespace(backend_map=None)) == torch.device("cpu")
    assert transport_device(SimpleNamespace(backend_map={"cpu": "gloo", "cuda": "nccl"})) == torch.device("cpu")
    assert transport_device(SimpleNamespace(backend_map={"cpu": "gloo"}), "meta") == torch.device("meta")
    # No GPU here: stand in for torch.cuda's current_device() to check which device is chosen.
    monkeypatch.setattr(torch, "get_device_module", lambda kind: SimpleNamespace(current_device=lambda: 3))
    assert transport_device(SimpleNamespace(backend_map={"cuda": "nccl"})) == torch.device("cuda", 3)


def test_subgroups_object_p2p_and_monitored_barrier(spmd_world):
    results = spmd_world(4, "gloo").run(group_helpers.subgroups_objects_monitored)
    assert [r["sub_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["sub_sum"] for r in results] == [3.0, 3.0, 7.0, 7.0]
    assert [r["listed"] for r in results] == [[0, 3], [1], None, [0, 3]]
    assert all(r["count"] == 2 for r in results)
    assert results[3]["sender"] == 0 and results[3]["received"] == [{"step": 7}, "adam"]


def test_monitored_barrier_names_the_rank_that_never_arrived(spmd_world):
    world = spmd_world(2, "gloo")
    try:
        rank0, rank1 = world.run(group_helpers.monitored_barrier_names_the_missing_rank, 0.5)
    finally:
        world.kill()  # the failed barrier closed a Gloo connection: later tests get a fresh world
    assert "monitored_barrier on group 'world': rank 1 did not reach it within 0.5 s" in rank0
    assert rank1 == "stayed away"


def test_environment_queries(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert spmd.get_node_local_rank(fallback_rank=3) == 3
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set"):
        spmd.get_node_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert spmd.get_node_local_rank() == 1
    assert spmd.is_available() and spmd.is_backend_available("gloo") and not spmd.is_backend_available("no-such")
