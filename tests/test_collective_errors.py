"""Bad input gets a clear error naming the problem and the fix; a missing rank becomes a timeout."""

import pytest
import torch

import helpers
import spmd

CASES = {
    "bad_dst": ("ValueError", "global rank 5 is not a member of group 'group"),
    "bad_group_src": ("ValueError", "group_src=-1 is out of range"),
    "wrong_output_size": ("ValueError", "output has 3 elements but must have group size (2) x input (2) = 4"),
    "wrong_rs_input": ("ValueError", "input has 5 elements but must have group size (2) x output (2) = 4"),
    "mixed_dtypes": ("TypeError", "output dtype torch.int32 differs from input dtype torch.float32"),
    "bitwise_on_float": ("TypeError", "bitwise reduction and cannot apply to a torch.float32 tensor"),
    "avg_on_int": ("TypeError", "ReduceOp.AVG needs a floating-point tensor"),
    "bad_splits": ("ValueError", "input_split_sizes [1, 1] must have 2 non-negative entries that sum to the input's 4 rows"),
    "send_to_self": ("ValueError", "a rank cannot isend to itself"),
    "list_length": ("ValueError", "tensor_list has 1 tensors but the group has 2 ranks"),
    "not_a_tensor": ("TypeError", "tensor must be a torch.Tensor, got list"),
    "unpicklable": ("AttributeError", "Can't pickle local object"),
}
#: Point-to-point ops pair by peer and tag, not by order: a failed send leaves its group usable.
KEEPS_GROUP = {"send_to_self"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_a_clear_error(spmd_world, case):
    kind, text = CASES[case]
    for message in spmd_world(2, "gloo").run(helpers.expect_error, case):
        assert message.startswith(kind), message
        assert text in message.splitlines()[0], message
        if case in KEEPS_GROUP:
            assert message.endswith("then the group still works"), message
        else:  # the ranks raised before entering the op: the next one is refused, naming the call that raised
            assert "then CollectiveError: group 'group" in message, message
            assert "raised on rank" in message and "fix the call, then create a new group" in message, message


def test_call_before_init_says_what_to_do():
    assert not spmd.is_initialized()
    with pytest.raises(spmd.NotInitializedError, match=r"call spmd.init\(\)"):
        spmd.all_reduce(torch.ones(1))


def test_unknown_backend_at_init():
    with pytest.raises(spmd.BackendNotFoundError, match="unknown backend 'nope'; installed backends: .*gloo"):
        spmd.init("nope", rank=0, world_size=1, store=torch.distributed.HashStore())
    assert not spmd.is_initialized()


def test_bad_rank_at_init():
    with pytest.raises(ValueError, match="rank 3 is out of range for world size 2"):
        spmd.init("gloo", rank=3, world_size=2, store=torch.distributed.HashStore())


def test_bad_backend_string():
    with pytest.raises(ValueError, match="bad backend string"):
        spmd.init("cpu:", rank=0, world_size=1, store=torch.distributed.HashStore())


def test_missing_device_backend_is_named():
    spmd.init({"cpu": "gloo"}, rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        with pytest.raises(spmd.BackendUnavailableError, match="no backend for 'meta' tensors"):
            spmd.all_reduce(torch.ones(1, device="meta"))
    finally:
        spmd.destroy_process_group()


def test_a_rank_that_never_arrives_is_a_timeout_error(spmd_world):
    results = spmd_world(2, "gloo").run(helpers.skip_a_collective, 1.5)
    elapsed, message = results[0].split("|", 1)
    assert 1.4 <= float(elapsed) < 3.5, elapsed
    assert "all_reduce on group 'group" in message and "ranks [0, 1]" in message
    assert "did not complete within 1.5 s" in message
    assert results[1] == "skipped"


def _assert_names_the_stuck_op(message, limit):
    assert "CollectiveTimeoutError" in message
    assert "all_reduce on group 'group" in message and "(seq 1, ranks [0, 1])" in message
    assert f"did not complete within {limit:.1f} s" in message
    assert "ranks that never reached seq 1: [1]" in message


def test_an_unwaited_async_op_fails_its_future_at_the_group_timeout(spmd_world):
    """Nobody waits: the watchdog ages the Work and fails its future and callbacks, naming who never came."""
    world = spmd_world(2, "gloo")
    try:
        rank0, rank1 = world.run(helpers.unwaited_async_op, 1.5, None)
    finally:
        world.kill()  # Gloo's half-done op stays behind: later tests get a fresh world
    elapsed, called, message = rank0.split("|", 2)
    assert 1.4 <= float(elapsed) <= 1.5 + 2.0, rank0
    assert 1.4 <= float(called) <= 1.5 + 2.0, rank0
    _assert_names_the_stuck_op(message, 1.5)
    assert rank1 == "skipped"


def test_a_per_op_timeout_shorter_than_the_groups_wins(spmd_world):
    """all_reduce(timeout=1) on a 60 s group: the async Work fails at 1 s, and so does the sync call."""
    world = spmd_world(2, "gloo")
    try:
        rank0, _ = world.run(helpers.unwaited_async_op, 60.0, 1.0)
    finally:
        world.kill()
    elapsed, _, message = rank0.split("|", 2)
    assert 0.9 <= float(elapsed) <= 1.0 + 2.0, rank0
    _assert_names_the_stuck_op(message, 1.0)
    world = spmd_world(2, "gloo")
    try:
        rank0, _ = world.run(helpers.sync_op_timeout, 60.0, 1.0)
    finally:
        world.kill()
    elapsed, message = rank0.split("|", 1)
    assert 0.9 <= float(elapsed) <= 1.0 + 2.0, rank0
    assert "did not complete within 1.0 s" in message and "ranks that never reached seq 1: [1]" in message


def _run_and_discard(spmd_world, backend, fn, *args, **kwargs):
    """Run ``fn`` on a 2-rank world of ``backend`` (skip if it cannot start here), then kill that world:
    these tests leave groups broken or ranks out of step, so later tests get a fresh one."""
    launcher, reason = _launcher(backend)
    if launcher is None:
        pytest.skip(reason)
    world = spmd_world(2, backend, launcher=launcher or None)
    try:
        return world.run(fn, *args, **kwargs)
    finally:
        world.kill()


def _launcher(backend):
    """How to start a world on ``backend`` here (a launcher, or () for none), or None and a reason to skip."""
    from spmd.comm.registry import backends

    if backend not in backends().names():
        return None, f"backend {backend!r} is not installed"
    reason = backends().get(backend).spec.unavailable_reason()
    if reason is not None:
        return None, reason
    if backend != "mpi":
        return (), ""
    from spmd_mpi import probe

    path, why = probe.find_mpiexec()
    return (tuple(probe.mpiexec_command("{n}", path)), "") if path else (None, why)


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_a_rank_missing_from_the_first_collective_is_a_named_timeout(spmd_world, backend):
    """The op, the group and the rank that never arrived, from the kernel; no C++ stack dump on stderr."""
    (message, stderr), skipped = _run_and_discard(spmd_world, backend, helpers.never_meet, 1.0)
    assert "all_reduce on group 'group" in message and "(seq 0, ranks [0, 1])" in message, message
    assert "did not complete within 1.0 s: ranks [1] never reached their first collective" in message, message
    assert "keys:" not in message and "/cpu/" not in message  # not a store key
    assert "Exception raised from" not in stderr and "Traceback" not in stderr, stderr
    assert tuple(skipped) == ("skipped", "")


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_a_timed_out_op_leaves_its_group_unusable_on_every_rank(spmd_world, backend):
    """After rank 0's all_reduce times out, its later ops on that group raise at once, naming the op
    that failed, and rank 0 says so through the store: the late rank 1 refuses its own calls on the
    group instead of pairing them with rank 0's abandoned op (MPI and UCC cannot cancel it)."""
    rank0, rank1 = _run_and_discard(spmd_world, backend, helpers.after_a_timeout, 1.5, timeout=120)
    assert rank0[0].startswith("CollectiveTimeoutError"), rank0
    for later in rank0[1:]:
        assert later.startswith("CollectiveError") and "cannot be used: all_reduce #1 failed on this rank" in later, rank0
    for outcome in rank1:
        assert outcome.startswith("CollectiveError") and "rank 0 gave up on it: all_reduce #1 failed" in outcome, rank1


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_a_rank_whose_call_raises_leaves_its_group_unusable_everywhere(spmd_world, backend):
    """Rank 0's all_gather fails its local size check while rank 1 is inside a valid one: rank 0 refuses
    the group at once, rank 1's all_gather ends in a named error within its timeout, and neither
    rank's later all_reduce pairs with the other's abandoned op (on MPI one did: 8 instead of 14)."""
    rank0, rank1 = _run_and_discard(spmd_world, backend, helpers.one_rank_raises, 2.0, timeout=120)
    assert rank0[0].startswith("ValueError") and "output has 3 elements" in rank0[0], rank0
    for later in rank0[1:]:
        assert later.startswith("CollectiveError") and "cannot be used: all_gather_into_tensor raised on rank 0" in later, rank0
    assert rank1[0].startswith(("CollectiveTimeoutError", "CollectiveError")), rank1
    assert float(rank1[0].split(" after ")[1].split(" s")[0]) <= 2.0 + 2.0, rank1
    for later in rank1[1:]:
        assert later.startswith("CollectiveError") and "cannot be used" in later, rank1
        assert "all_gather_into_tensor" in later, rank1


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_a_rank_inside_a_collective_stops_when_its_peer_gives_the_group_up(spmd_world, backend):
    """Rank 1 waits inside the backend (timeout 60 s) when rank 0's call raises: the kernel aborts
    rank 1's wait once rank 0's announcement arrives (Gloo, where nothing ends a wait on a c10d op:
    rank 0 closes the group's connections), and rank 1 raises the group's refusal, naming rank 0's
    reason, within seconds instead of at the timeout."""
    rank0, rank1 = _run_and_discard(spmd_world, backend, helpers.peer_gives_up_while_inside, 60.0, timeout=150)
    assert rank0.startswith("ValueError") and "output has 3 elements" in rank0, rank0
    assert rank1.startswith("CollectiveError") and "rank 0 gave up on it: all_gather_into_tensor raised on rank 0" in rank1, rank1
    assert float(rank1.split(" after ")[1].split(" s")[0]) < 20.0, rank1


def test_a_destroyed_group_is_refused_not_recreated(spmd_world):
    for message in spmd_world(2, "gloo").run(helpers.use_after_destroy):
        assert message.startswith("CollectiveError") and "it was destroyed (destroy_process_group)" in message, message


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_aliased_input_and_output_give_the_right_result(spmd_world, backend):
    """all_to_all_single(t, t), an output shifted over its input, torch's in-place all_gather and an
    in-place reduce_scatter: the kernel stages the input, so every backend computes the right values."""
    launcher, reason = _launcher(backend)
    if launcher is None:
        pytest.skip(reason)
    for result in spmd_world(2, backend, launcher=launcher or None).run(helpers.aliased_buffers, timeout=120):
        assert all(result.values()), result


def test_desync_mode_checks_all_to_all_splits_across_ranks(spmd_world):
    for message in spmd_world(2, "gloo").run(helpers.all_to_all_splits_disagree, timeout=120):
        assert message.startswith("CollectiveDesyncError"), message
        assert "rank 1 sends 2 rows to rank 0, which expects 1 from it" in message, message


@pytest.mark.parametrize("backend", ["mpi"])
def test_mismatched_element_counts_are_named_and_break_the_group_everywhere(spmd_world, backend):
    """4 elements against 1000 (desync mode off): both calls are named (by the always-on check, or by
    the timeout of a rank left waiting), and every rank's next op on the group is refused. (On Gloo, and
    the p2p example over Gloo's pairs, the kernel refuses it before the op: see the test above.)"""
    ranks = _run_and_discard(spmd_world, backend, helpers.mismatched_counts, 1.5, timeout=120)
    # named by the always-on mismatch check, or by the timeout of the rank still waiting for the rest
    named = [o for r in ranks for o in r if "all_reduce(float32; 4) SUM" in o and "all_reduce(float32; 1000) SUM" in o]
    assert named and all("ranks disagree on" in o for o in named), ranks
    for outcomes in ranks:
        assert outcomes[-1].startswith("CollectiveError") and "cannot be used" in outcomes[-1], ranks


#: The calls a mismatch error must name, for gather sizes and all_to_all_single row widths that differ.
SHAPE_SIGNATURES = {
    "gather": ("gather(float32; 4) root=0", "gather(float32; 6) root=0"),
    "rows": ("all_to_all_single(float32,float32; rows 2)", "all_to_all_single(float32,float32; rows 4)"),
}


@pytest.mark.parametrize("backend", ["gloo", "p2p"])
@pytest.mark.parametrize("kind", ["count", "dtype", "splits", "known", "gather", "rows"])
def test_gloo_buffers_of_different_sizes_are_named_not_a_signal(spmd_world, backend, kind):
    """Gloo aborts the process (SIGABRT in its C++ loop thread) if it pairs buffers of different byte
    sizes. The kernel compares each call shape new to a group across its ranks before Gloo sees it:
    ranks that both call a new shape get a CollectiveDesyncError naming both calls, and the group is
    refused afterwards, as after any mismatch; a rank repeating an agreed shape while its peer calls a
    new one is stopped, like its peer, by the always-on mismatch check (not the op's timeout), and Gloo
    never pairs the two."""
    world = spmd_world(2, backend)  # (the p2p example sends over Gloo's pairs, which abort the same way)
    try:
        results = world.run(helpers.size_mismatch_on_gloo, kind, 3.0, timeout=120)
    finally:
        world.kill()
    if kind == "known":
        assert any(r["first"].startswith("CollectiveError") for r in results), results
    for r in results:
        if kind == "known":
            # The rank checking its new shape is stopped by the always-on mismatch check and gives the
            # group up; the rank already inside Gloo is then stopped too (its wait aborted, or the group
            # found unusable by its own check: about 1 s), or on a host too loaded for that, by the op's
            # own timeout. Every error names the disagreement: the checking rank's as a CollectiveDesyncError
            # (the check gave the group up over this very call).
            assert "ranks disagree" in r["first"], r
            if "the ranks' calls disagree" in r["first"]:
                assert r["first"].startswith("CollectiveDesyncError") and r["took"] < 3.0, r
            elif "stopped waiting" in r["first"]:
                assert r["first"].startswith("CollectiveError") and r["took"] < 3.0, r
            elif r["first"].startswith("CollectiveError"):
                assert r["took"] < 3.0 + 2.0, r
            else:
                assert r["first"].startswith("CollectiveTimeoutError"), r
                assert r["took"] < 3.0 + 2.0 + 3.0, r  # the op's timeout, +2 s, and slack for a loaded host
            assert r["after"].startswith("CollectiveError") and "cannot be used" in r["after"], r
            continue
        assert r["first"].startswith("CollectiveDesyncError") and "ranks disagree on collective" in r["first"], r
        expected = {
            "count": ("all_reduce(float32; 4) SUM", "all_reduce(float32; 1000) SUM"),
            "dtype": ("all_reduce(float32; 4) SUM", "all_reduce(float64; 4) SUM"),
            "splits": ("splits 2,1/2,3", "splits 2,3/2,3", "rank 0 sends 1 rows to rank 1, which expects 2 from it"),
            **SHAPE_SIGNATURES,
        }[kind]
        assert all(call in r["first"] for call in expected), r
        assert r["after"].startswith("CollectiveError") and "cannot be used" in r["after"], r  # as after any mismatch


def test_gloo_takes_splits_that_change_on_one_rank_only(spmd_world):
    """The shape check must not refuse a legitimate program: rank 1 keeps a different number of its own
    rows each step while rank 0's splits stay the same (so only rank 1's call shape is new)."""
    results = spmd_world(2, "gloo").run(helpers.uneven_all_to_all_with_changing_local_rows, timeout=120)
    assert results[0] == [[0.0, 1.0, 100.0]] * 3, results
    assert results[1] == [[2.0] + [100.0 + 1 + i for i in range(step + 1)] for step in range(3)], results


def test_gloo_compares_an_all_to_all_shape_once_unless_splits_are_given(spmd_world):
    """Even splits follow from the tensors' shapes: the cross-rank shape check (a store round trip) runs for
    the first call of a shape only; split sizes the caller gives are compared at every call."""
    world = spmd_world(2, "gloo")
    assert world.run(helpers.cross_rank_checks_per_all_to_all, False) == [0, 0]
    assert world.run(helpers.cross_rank_checks_per_all_to_all, True) == [5, 5]


SILENT = [(b, k) for b in ("gloo", "mpi", "ucc", "p2p") for k in ("reduce_op", "dtype")] + [("ucc", "count")]
SILENT += [(b, "width") for b in ("mpi", "ucc")]  # float32 against float64 (Gloo and p2p: refused before the op)
SILENT += [(b, "splits") for b in ("mpi", "ucc")]  # (Gloo and p2p: refused before the op, as above)
SILENT += [(b, k) for b in ("mpi", "ucc") for k in ("gather", "rows")]  # (Gloo and p2p: as above)
SIGNATURES = {
    **SHAPE_SIGNATURES,
    "splits": ("all_to_all_single(float32,float32) splits 2,1/2,2", "all_to_all_single(float32,float32) splits 2,2/2,2",
               "all_to_all_single splits disagree: rank 0 sends 1 rows to rank 1, which expects 2 from it"),
    "reduce_op": ("all_reduce(float32; 4) SUM", "all_reduce(float32; 4) MAX"),
    "dtype": ("all_reduce(float32; 4) SUM", "all_reduce(int32; 4) SUM"),
    "count": ("all_reduce(float32; 4) SUM", "all_reduce(float32; 1000) SUM"),
    "width": ("all_reduce(float32; 4) SUM", "all_reduce(float64; 4) SUM"),
}


@pytest.mark.parametrize(("backend", "kind"), SILENT, ids=[f"{b}-{k}" for b, k in SILENT])
def test_a_mismatch_the_backend_completes_is_named_on_every_rank(spmd_world, backend, kind):
    """SUM against MAX, float32 against int32 (and on UCC 4 elements against 1000; on MPI and UCC float32
    against float64) complete, or fail on one rank only, in the backend. A call shape new to the group is
    compared across ranks before its result is handed back (the signatures were posted before the op), so
    the mismatched call itself raises, naming both calls, on every rank where the backend completed it,
    and every rank's next op on the group raises at once."""
    results = _run_and_discard(spmd_world, backend, helpers.silently_mismatched, kind, timeout=120)
    for r in results:
        assert not r["first"].startswith("value"), r  # never a result handed back
        error = r["later"][-1] if r["later"] else r["first"]
        assert error.startswith("CollectiveError") and "cannot be used" in error, r
        assert r["error_after"] is not None and r["error_after"] < 3.0, r
        if kind not in ("count", "width", "gather", "rows"):  # (UCX and MPI may fail one rank on buffers of different sizes: that error reaches the other)
            assert r["first"].startswith("CollectiveDesyncError"), r
            assert "ranks disagree on collective #1 of group" in r["first"] and "ranks disagree on collective #1 of group" in error, r
            for call in SIGNATURES[kind]:
                assert call in r["first"], r
                assert call.replace("all_to_all_single splits disagree: ", "splits disagree: ") in error, r


def test_only_this_worlds_announcements_make_a_group_unusable(spmd_world):
    """A store outlives a world (spmd run's agent store, a re-init): an old announcement under a reused
    group name is ignored, a fresh one is adopted by every rank's watchdog."""
    world = spmd_world(2, "gloo")
    try:
        results = world.run(helpers.stale_and_fresh_announcements, timeout=60)
    finally:
        world.kill()
    for r in results:
        assert r["old"] is None and r["old_sum"] == [2.0, 2.0], r
        assert r["new"] == "rank 1 gave up on it: now", r


def test_a_rank_whose_watchdog_starts_after_its_peer_gave_the_world_up_still_adopts_it():
    """Rank 0 gives the world up while rank 1 is between arriving at init and starting its watchdog:
    rank 1 adopts it (it took the announcement for an earlier world's, and paired its next op with nothing)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from spmd.testing.ports import free_port

    script = Path(__file__).parent / "fault_scripts" / "late_watchdog.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                "SPMD_WATCHDOG_INTERVAL": "0.2"})
    procs = [subprocess.Popen([sys.executable, str(script), "gloo"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    lines = [next((x for x in out.splitlines() if x.startswith("RESULT ")), None) for out, _ in outputs]
    assert all(lines), outputs
    assert json.loads(lines[1][len("RESULT "):])["unusable"] == "rank 0 gave up on it: rank 0 gave up on it for the test", outputs[1]


def test_roots_may_be_numpy_or_torch_integers_and_a_bad_one_names_the_groups_ranks():
    import numpy as np

    spmd.init("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        t = torch.ones(3)
        spmd.broadcast(t, src=np.int64(0))  # torch takes these (it was "not a valid rank")
        spmd.reduce(t, dst=torch.tensor(0))
        with pytest.raises(ValueError, match=r"src='0' is not a rank; pass an integer, one of group 'world''s ranks \[0\]"):
            spmd.broadcast(t, src="0")
    finally:
        spmd.destroy_process_group()
