"""The `spmd run` agent with stand-in workers, the other nodes simulated over an in-process store:
how it reads a round's outcome (failures elsewhere, restarts, joins, a lost store, a stop request)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from launch_helpers import wait_for


class FakeGroup:
    """Stands in for WorkerGroup: its workers 'exit' as ``result`` says; ``stop`` only records the signal."""

    made: list[FakeGroup] = []
    first_result: tuple = (True, None)  # what a new group's poll says: (all exited 0, failure)

    def __init__(self, config, membership, restart, run_dir, log_root=None):
        self.membership, self.restart = membership, restart
        self.result = FakeGroup.first_result
        self.stopped: list[int] = []
        self.on_stop = lambda: None
        self.polls = 0  # how often the agent's monitor loop looked at the workers
        FakeGroup.made.append(self)

    def start(self):
        pass

    def poll(self):
        self.polls += 1
        return self.result

    def drain(self, timeout=10.0):
        pass

    def workers_left(self):
        return False

    def stop(self, signum=signal.SIGTERM):
        self.stopped.append(signum)
        self.on_stop()


def _config(**changes):
    from dataclasses import replace

    from spmd.launch.args import RunConfig

    base = RunConfig(nproc_per_node=1, min_nodes=2, max_nodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:1", rdzv_id="unit", standalone=False,
                     max_restarts=0, monitor_interval=0.01, redirects={0: 0}, tee={0: 0}, log_dir=None, module=False, no_python=False,
                     script="x.py", script_args=(), rdzv_timeout=30.0, last_call=0.0, stop_grace=1.0)
    return replace(base, **changes)


def _agent(monkeypatch, tmp_path, store, hosting: bool, endpoint: str = "127.0.0.1:1", wrap=None, **changes):
    """An Agent whose rendezvous runs over ``store`` (its prefixed view passed through ``wrap`` if given)
    and whose workers are FakeGroups."""
    import tempfile

    from spmd.launch import agent as agent_module
    from spmd.launch.rendezvous import Rendezvous

    config = _config(rdzv_endpoint=endpoint, **changes)

    def rendezvous(self):
        self._store, self._endpoint = store, endpoint
        rdzv = Rendezvous(store, config.rdzv_id, config.min_nodes, config.max_nodes, config.rdzv_timeout, config.last_call, poll=0.01)
        if wrap is not None:
            rdzv.store = wrap(rdzv.store)
        return rdzv, hosting, "127.0.0.1"

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(agent_module.Agent, "_rendezvous", rendezvous)
    monkeypatch.setattr(agent_module, "WorkerGroup", FakeGroup)
    FakeGroup.made, FakeGroup.first_result = [], (True, None)
    return agent_module.Agent(config)


def _other_node(store, script, config=None):
    """Node 1 of a two-node job, run by ``script(rdzv)`` in a thread over the same store; returns (thread, errors)."""
    from spmd.launch.rendezvous import Rendezvous

    config = config or _config()
    rdzv = Rendezvous(store, config.rdzv_id, config.min_nodes, config.max_nodes, config.rdzv_timeout, config.last_call, poll=0.01)
    errors: list[BaseException] = []

    def body():
        try:
            script(rdzv)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, errors


def _run_beside(agent, thread, errors, capture) -> tuple[int, str]:
    """Run ``agent`` while the other node's thread plays its part; (exit code, the agent's stderr)."""
    code = agent.run()
    thread.join(30)
    assert not errors, errors
    return code, capture.readouterr().err


def _node1_failure():
    from spmd.launch.workers import Failure

    return Failure(rank=1, local_rank=0, node_rank=1, host="node1", returncode=3, detail="Traceback (most recent call last):\nOSError: disk full")


def _membership(num_nodes: int, round_: int = 0):
    from spmd.launch.rendezvous import Membership

    return Membership(round=round_, node_rank=0, num_nodes=num_nodes, nprocs=(1,) * num_nodes, hosts=("127.0.0.1",) * num_nodes,
                      master_addr="127.0.0.1", master_port=1)


def test_monitor_sees_a_failed_round_even_when_its_own_workers_all_exited_0(monkeypatch, tmp_path):
    """The round's ``failed`` key is looked at before local success is trusted (it said "done")."""
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Rendezvous

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=True)
    rdzv = Rendezvous(store, "unit", 2, 2, 30, 0)
    rdzv.set(0, "failed", _node1_failure().to_json())
    agent.group = FakeGroup(agent.config, None, 0, tmp_path)
    outcome, failure = agent._monitor(rdzv, _membership(num_nodes=2))
    assert (outcome, failure) == ("failed", _node1_failure())


@pytest.mark.parametrize("hosting", [True, False])
def test_a_node_whose_workers_succeeded_reports_a_later_failure_elsewhere(monkeypatch, tmp_path, capsys, hosting):
    """Node 0's workers all exit 0; then a rank on node 1 fails for good. Node 0's agent exits with that rank's
    code and the summary (it exited 0: the job read as a success)."""
    import torch.distributed as tdist

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=hosting)

    def node1(rdzv):
        rdzv.join(1, 1, "node1")
        wait_for(lambda: int(rdzv.store.add(rdzv.key(0, "done"), 0)) == 1)  # node 0's workers are done
        rdzv.store.compare_set(rdzv.key(0, "failed"), "", _node1_failure().to_json())
        rdzv.store.set("shutdown", "job failed: rank 1 exited with code 3")  # no restarts left: node 1's agent exits

    thread, errors = _other_node(store, node1)
    code, err = _run_beside(agent, thread, errors, capsys)
    assert code == 3, err
    assert "job failed; restarts used 0/0" in err and "rank 1 (local rank 0) on node 1 (node1) exited with code 3" in err
    assert "OSError: disk full" in err  # node 1's last words: node 0's terminal did not show them


class _StopArrivingBetweenLooks:
    """A store on which node 1's failure and its stop request land just after this agent looked for a failure
    and before it looks for a stop (the interleaving CI once hit)."""

    def __init__(self, store, failure_json: str):
        self._store, self._failure_json, self._sprung = store, failure_json, False

    def check(self, keys):
        found = self._store.check(keys)
        if keys == ["r0/failed"] and not found and not self._sprung and int(self._store.add("r0/done", 0)) >= 1:
            self._sprung = True
            self._store.compare_set("r0/failed", "", self._failure_json)
            self._store.set("shutdown", "job failed: rank 1 exited with code 3")
        return found

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("hosting", [True, False])
def test_a_failure_and_stop_that_land_between_two_looks_are_reported_as_the_failure(monkeypatch, tmp_path, capsys, hosting):
    """The agent saw no failure, then the stop node 1 sent after setting it: it reports node 1's failure and
    exits with its code (it said "job stopped" and exited 1)."""
    import torch.distributed as tdist

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=hosting, stop_grace=0.0,
                   wrap=lambda view: _StopArrivingBetweenLooks(view, _node1_failure().to_json()))
    thread, errors = _other_node(store, lambda rdzv: rdzv.join(1, 1, "node1"))
    code, err = _run_beside(agent, thread, errors, capsys)
    assert code == 3, err
    assert "rank 1 (local rank 0) on node 1 (node1) exited with code 3" in err and "job stopped" not in err


def test_the_agent_hosting_the_store_waits_for_the_others_to_read_a_final_failure(monkeypatch, tmp_path, capsys):
    """A worker of the hosting node fails for good: its agent keeps the store up until node 1's agent has read
    the failure and stopped its workers (it exited at once, and node 1 then reported a lost store, exit 1)."""
    import torch.distributed as tdist

    from spmd.launch.workers import Failure

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=True)
    FakeGroup.first_result = (False, Failure(rank=0, local_rank=0, node_rank=0, host="node0", returncode=3, detail=""))
    seen: list[float] = []

    def node1(rdzv):
        rdzv.join(1, 1, "node1")
        wait_for(lambda: rdzv.store.check([rdzv.key(0, "failed")]))
        time.sleep(0.5)  # stopping its own workers
        seen.append(time.monotonic())
        rdzv.store.add(rdzv.key(0, "left"), 1)

    thread, errors = _other_node(store, node1)
    code = agent.run()
    returned = time.monotonic()
    thread.join(30)
    assert not errors, errors
    assert code == 3, capsys.readouterr().err
    assert seen and returned >= seen[0]


def test_a_node_whose_workers_succeeded_takes_part_in_the_restart(monkeypatch, tmp_path, capsys):
    """With a restart left, node 0 (workers done) rejoins when node 1 fails, so the restart can form; the job
    then succeeds in round 1 (node 0 exited 0 at once, and node 1 waited for it until the rendezvous timed out)."""
    import torch.distributed as tdist

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=False, max_restarts=1)

    def node1(rdzv):
        rdzv.join(1, 1, "node1")
        wait_for(lambda: int(rdzv.store.add(rdzv.key(0, "done"), 0)) == 1)
        rdzv.store.compare_set(rdzv.key(0, "failed"), "", _node1_failure().to_json())
        rdzv.advance_from(0)
        assert rdzv.join(1, 1, "node1").round == 1
        rdzv.store.add(rdzv.key(1, "done"), 1)  # node 1's workers succeed this time
        wait_for(lambda: int(rdzv.store.add(rdzv.key(1, "done"), 0)) == 2)

    thread, errors = _other_node(store, node1)
    code, err = _run_beside(agent, thread, errors, capsys)
    assert code == 0, err
    assert [g.restart for g in FakeGroup.made] == [0, 1] and [g.membership.round for g in FakeGroup.made] == [0, 1]
    assert "rank 1 (local rank 0) on node 1 (node1) exited with code 3; restarting the group (1/1)" in err


def test_a_node_whose_workers_succeeded_follows_the_job_into_a_new_round_and_ignores_late_joins(monkeypatch, tmp_path):
    """Once a node's workers finished, the running agents no longer restart the job for a newcomer; an agent whose
    workers finished and whose round was moved on anyway (the two crossed) goes with it instead of waiting alone."""
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Rendezvous

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=False, max_nodes=3)
    rdzv = Rendezvous(store, "unit", 2, 3, 30, 0)
    agent.group = FakeGroup(agent.config, None, 0, tmp_path)
    agent.group.result = (False, None)  # still running
    rdzv.set(0, "join", "node2")
    rdzv.store.add(rdzv.key(0, "done"), 1)  # node 1's workers finished
    threading.Timer(0.5, lambda: rdzv.store.set("shutdown", "test over")).start()
    assert agent._monitor(rdzv, _membership(num_nodes=2)) == ("shutdown", None)  # not "join"

    rdzv.advance_from(0)  # the other agent had taken the join before node 1 finished
    assert agent._await_job(rdzv, _membership(num_nodes=2), hosting=False) == ("join", None)


def _hosted_store():
    """A TCPStore server in this process (a list holding it: clear the list to take the store down) and a client."""
    from datetime import timedelta

    import torch.distributed as tdist

    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    client = tdist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    return [server], client, f"127.0.0.1:{server.port}"


def _client(endpoint: str):
    from datetime import timedelta

    import torch.distributed as tdist

    host, _, port = endpoint.rpartition(":")
    return tdist.TCPStore(host, int(port), None, False, timedelta(seconds=30))


def test_losing_the_store_stops_the_workers_gracefully_and_says_so(monkeypatch, tmp_path, capfd):
    """The agent hosting the store dies while this one watches its workers: one line saying what happened, the
    workers stopped with SIGTERM and the grace period, exit code 1 (a traceback escaped, the workers got PDEATHSIG)."""
    holder, client, endpoint = _hosted_store()
    agent = _agent(monkeypatch, tmp_path, client, hosting=False, endpoint=endpoint, node_rank=1)

    def node0(rdzv):
        rdzv.join(1, 0, "node0")
        wait_for(lambda: FakeGroup.made and FakeGroup.made[-1].polls > 0)  # the agent watches its workers
        holder.clear()  # node 0's agent dies, and its store with it

    FakeGroup.first_result = (False, None)  # the workers run on
    thread, errors = _other_node(_client(endpoint), node0)
    code, err = _run_beside(agent, thread, errors, capfd)
    assert code == 1, err
    assert f"spmd run: lost the rendezvous store at {endpoint}" in err and "the agent hosting it exited or died" in err
    assert "Traceback" not in err
    assert FakeGroup.made[0].stopped == [signal.SIGTERM]


def test_a_stop_request_is_reported_when_its_sender_takes_the_store_down_meanwhile(monkeypatch, tmp_path, capfd):
    """Node 0 got SIGTERM: it publishes the reason, stops its workers and exits with its store while this agent's
    workers get their grace period; the reason was read after that, from a store already gone."""
    holder, client, endpoint = _hosted_store()
    agent = _agent(monkeypatch, tmp_path, client, hosting=False, endpoint=endpoint, node_rank=1)

    def node0(rdzv):
        rdzv.join(1, 0, "node0")
        wait_for(lambda: bool(FakeGroup.made))
        FakeGroup.made[0].on_stop = holder.clear  # node 0 exits during this node's grace period
        rdzv.store.set("shutdown", "agent on node0 received SIGTERM")

    FakeGroup.first_result = (False, None)  # the workers run on
    thread, errors = _other_node(_client(endpoint), node0)
    code, err = _run_beside(agent, thread, errors, capfd)
    assert code == 1, err
    assert "spmd run: job stopped: agent on node0 received SIGTERM" in err and "Traceback" not in err


def test_a_full_round_is_not_restarted_for_a_join_request(monkeypatch, tmp_path):
    """A round that has --nnodes' maximum of nodes ignores a join request (a surplus agent's ask restarted it)."""
    import torch.distributed as tdist

    from spmd.launch.rendezvous import Rendezvous

    store = tdist.HashStore()
    agent = _agent(monkeypatch, tmp_path, store, hosting=True, min_nodes=1, max_nodes=2)
    rdzv = Rendezvous(store, "unit", 1, 2, 30, 0)
    agent.group = FakeGroup(agent.config, None, 0, tmp_path)
    agent.group.result = (False, None)
    rdzv.set(0, "join", "node2")
    threading.Timer(0.5, lambda: rdzv.store.set("shutdown", "test over")).start()
    assert agent._monitor(rdzv, _membership(num_nodes=2)) == ("shutdown", None)  # full: not "join"
    rdzv.store.delete_key("shutdown")
    assert agent._monitor(rdzv, _membership(num_nodes=1)) == ("join", None)  # room for one more
