"""A group's first call of a kind that differs on one rank (dtype, reduce op, root, splits): on a backend that
compares new call shapes before the op (Gloo, and the isend/irecv plugin over Gloo's pairs) a named error on every
rank before any rank gets a result; on every backend a job with a mismatched call never exits 0, because
destroy_process_group compares what the always-on check (every 0.2 s) had not reached."""

from __future__ import annotations

import first_call_helpers as h
import pytest
from test_collective_errors import _launcher, _run_and_discard


@pytest.mark.parametrize("backend", ["gloo", "p2p"])
def test_a_first_call_that_disagrees_is_named_on_every_rank(spmd_world, backend):
    for rank, r in enumerate(_run_and_discard(spmd_world, backend, h.first_calls_that_disagree, timeout=180)):
        for case in ("float64", "int32", "max", "root", "splits"):
            assert r[case].startswith("CollectiveDesyncError"), (backend, rank, case, r[case])
            assert r[case + "_next"].startswith("CollectiveError") and "cannot be used" in r[case + "_next"], (rank, case, r)
        assert "float32; 4) SUM" in r["float64"] and "float64; 4) SUM" in r["float64"], r["float64"]
        assert "MAX" in r["max"] and "root=1" in r["root"], r
        assert r["agreed"] == "no error: [2.0, 2.0, 2.0]", r


@pytest.mark.parametrize("backend", ["mpi", "ucc"])
def test_a_first_call_the_backend_completes_is_named_before_its_result_is_handed_back(spmd_world, backend):
    """MPI and UCC run a mismatched call (they survive a size mismatch): each rank posted its call before the op,
    and the result comes back only once every rank's agrees, so a disagreement raises on every rank where the
    backend completed the op; one the backend failed (buffers of different sizes) raises the backend's error."""
    for rank, r in enumerate(_run_and_discard(spmd_world, backend, h.first_calls_that_disagree, timeout=180)):
        for case in ("float64", "int32", "max", "root", "splits"):
            assert not r[case].startswith("no error"), (backend, rank, case, r[case])
            assert r[case].startswith(("CollectiveDesyncError", "CollectiveError")), (backend, rank, case, r[case])
            assert r[case + "_next"].startswith("CollectiveError") and "cannot be used" in r[case + "_next"], (rank, case, r)
        for case in ("int32", "max", "root"):  # (the same bytes on every rank: the backend completes them)
            assert r[case].startswith("CollectiveDesyncError"), (backend, rank, case, r[case])
        assert "float32; 4) SUM" in r["int32"] and "int32; 4) SUM" in r["int32"], r["int32"]
        assert "MAX" in r["max"] and "root=1" in r["root"], r
        assert r["agreed"] == "no error: [2.0, 2.0, 2.0]", r


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_an_async_first_call_that_disagrees_fails_its_work_on_every_rank(spmd_world, backend):
    """Rank 1 calls 2 s after rank 0; rank 0's async call returns at once on every backend. On MPI and UCC the
    comparison follows the op, inside its Work; on Gloo and the isend/irecv plugin (a size mismatch aborts their
    pairs) it precedes the op, in a thread that submits the op only once the ranks agreed."""
    rank0, rank1 = _run_and_discard(spmd_world, backend, h.async_first_call_that_disagrees, 2.0, timeout=120)
    for r in (rank0, rank1):
        assert r["wait"].startswith("CollectiveDesyncError") and "int32; 4) SUM" in r["wait"], r
    assert rank0["returned_after"] < 1.0, rank0  # (wide: a store round trip and the submission, on a loaded host)


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_ops_after_an_async_first_call_keep_their_order_and_results(spmd_world, backend):
    """While an async call's comparison waits for a late rank, the group's next calls (async, blocking, a barrier,
    a broadcast) queue behind it and reach the backend in call order: every result equals the one-process value."""
    results = _run_and_discard(spmd_world, backend, h.async_new_shapes_then_more, 2.0, timeout=120)
    for r in results:
        for case in ("summed", "gathered", "blocking", "broadcast"):
            got, expected = r[case]
            assert got == expected, (backend, case, r)
        assert r["later"] == "no error: [2.0, 2.0, 2.0, 2.0, 2.0]", r
    assert results[0]["returned_after"] < 1.0, results[0]  # (rank 0's: it called 2 s before rank 1)


@pytest.mark.parametrize(("backend", "kind"), [("gloo", "op"), ("ucc", "op"), ("ucc", "dtype"), ("mpi", "op"), ("mpi", "dtype")])
def test_a_job_whose_last_call_disagrees_never_exits_0(backend, kind):
    """The always-on check compares every 0.2 s; a mismatch in a job's last step was found after it had exited 0.
    destroy_process_group compares what is left (waiting a bounded time for the neighbours' last calls)."""
    outputs, codes = _run_script(backend, "last_call_mismatch.py", kind)
    assert codes == [1, 1], outputs
    for out, err in outputs:
        assert "clean exit" not in out
        # (the rank whose call was new to the group raises at it; its peer, for which the call was not new,
        # at its next call, naming the same disagreement)
        assert "CollectiveDesyncError" in err or "ranks disagree on collective #2" in err, err[-2000:]
        assert ("all_reduce(float32; 4) MAX" if kind == "op" else "all_reduce(int32; 4) SUM") in err, err[-2000:]


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "p2p"])
def test_a_receive_that_disagrees_with_its_send_never_exits_0(backend):
    """Rank 0 sends float32, rank 1 receives into int32 of the same byte size: the backend delivers the bytes with
    no error. The always-on check pairs each receive with its send (the k-th of a sender, receiver and tag), and at
    the latest destroy_process_group finds the difference, so the receiving rank exits 1 naming both calls."""
    outputs, codes = _run_script(backend, "last_call_mismatch.py", "p2p")
    assert codes[1] != 0, (codes, outputs)
    out, err = outputs[1]
    assert "clean exit" not in out
    assert "point-to-point message" in err and "float32 x 4" in err and "int32 x 4" in err, err[-2000:]


@pytest.mark.parametrize("backend", ["gloo", "ucc"])
def test_a_receive_that_disagrees_with_its_send_breaks_the_group_on_both_ranks(spmd_world, backend):
    """Found within a watchdog step or two of the receive: the receiver gives the group up naming both calls, and
    the sender learns it from the announcement, so each rank's next op raises the same named error."""
    for r in _run_and_discard(spmd_world, backend, h.p2p_mismatch_then_ops, timeout=120):
        assert r.startswith("CollectiveError") and "cannot be used" in r, r
        assert "rank 0 sent its send #1 to rank 1 (tag 0) as float32 x 4, rank 1 received it as int32 x 4" in r, r


def _run_script(backend: str, name: str, *args: str) -> tuple[list[tuple[str, str]], list[int]]:
    """Run ``fault_scripts/<name> BACKEND *args`` as the 2 ranks of a job (under mpiexec on mpi); every rank's
    (stdout, stderr) and exit code. Skips when the backend cannot start here."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from spmd.testing.ports import free_port

    launcher, reason = _launcher(backend)
    if launcher is None:
        pytest.skip(reason)
    script = [sys.executable, str(Path(__file__).parent / "fault_scripts" / name), backend, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if launcher:  # mpiexec starts both ranks; each writes its output to its own files (see the script)
        with tempfile.TemporaryDirectory() as folder:
            env["SPMD_FAULT_OUT"] = os.path.join(folder, "rank")
            done = subprocess.run([part.format(n=2) for part in launcher] + script, env=env, capture_output=True,
                                  text=True, timeout=180)
            outputs = [tuple(Path(f"{env['SPMD_FAULT_OUT']}.{r}.{kind}").read_text() for kind in ("out", "err"))
                       for r in (0, 1)]
        return outputs, [done.returncode] * 2  # (mpiexec's: non-zero when any rank's was)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"})
    procs = [subprocess.Popen(script, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    return outputs, [p.returncode for p in procs]
