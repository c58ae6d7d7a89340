"""spmd.checkpoint on 1, 2 and 4 real ranks: save on 4, load resharded on 2 and as plain tensors on 1;
optimizer state and non-tensor values; a failing storage; async equals sync; the files; storage plugins."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import checkpoint_helpers as h
import pytest
import torch

import spmd.checkpoint as dcp
from spmd.checkpoint import cleanup
from spmd.checkpoint.metadata import METADATA_FILE

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture(scope="module")
def saved_on_four(tmp_path_factory, spmd_world_pool):
    path = str(tmp_path_factory.mktemp("ckpt") / "four")
    spmd_world_pool.get(4, "gloo").run(h.save_on_four, path, timeout=120)
    return path


def test_save_on_four_load_on_two_with_other_placements(spmd_world, saved_on_four):
    for rank, r in enumerate(spmd_world(2, "gloo").run(h.load_on_two, saved_on_four, timeout=120)):
        assert r.pop("w_local") == (10, 3), rank
        assert all(r.values()), (rank, r)


def test_save_on_four_load_on_one_rank_as_plain_tensors(spmd_world, saved_on_four):
    (r,) = spmd_world(1, "gloo").run(h.load_plain, saved_on_four, timeout=120)
    assert all(r.values()), r


def test_load_in_one_process_without_init(saved_on_four):
    r = h.load_plain(saved_on_four)
    assert all(r.values()), r


def test_every_file_is_safetensors_or_json_and_opens(saved_on_four):
    from safetensors import safe_open

    files = _files(saved_on_four)
    assert METADATA_FILE in files
    for name in files:
        assert name.endswith((".safetensors", ".json")), name
        full = os.path.join(saved_on_four, name)
        if name.endswith(".json"):
            with open(full) as f:
                json.load(f)
        else:
            with safe_open(full, "pt") as f:
                for key in f.keys():
                    f.get_tensor(key)


def test_replicated_values_are_written_once_by_spread_writers(saved_on_four):
    with open(os.path.join(saved_on_four, METADATA_FILE)) as f:
        meta = json.load(f)
    tensors = meta["tensors"]
    assert len(tensors["model.rep"]["chunks"]) == 1  # replicated on 4 ranks, stored once
    assert len(tensors["model.w"]["chunks"]) == 4  # one shard per rank (the last one short)
    assert len(tensors["model.bf"]["chunks"]) == 2  # Replicate x Shard(1): two distinct shards
    writers = {tensors[f"plain.{i}"]["chunks"][0]["file"] for i in range(4)}
    assert len(writers) >= 2, writers  # equal replicated tensors spread over several writers
    per_file: dict[str, int] = {}
    for entry in tensors.values():
        for c in entry["chunks"]:
            per_file[c["file"]] = per_file.get(c["file"], 0) + c["end"] - c["begin"]
    largest = max(c["end"] - c["begin"] for e in tensors.values() for c in e["chunks"])  # the RNG state
    assert len(per_file) == 4 and max(per_file.values()) - min(per_file.values()) <= largest, per_file
    assert meta["values"]["step"] == 17 and meta["values"]["loader.position"] == 1234


def test_optimizer_state_round_trips_from_tp_to_ddp(spmd_world, tmp_path):
    path = str(tmp_path / "tp")
    saved = spmd_world(2, "gloo").run(h.save_tp_training, path, timeout=120)[0]
    for r in spmd_world(4, "gloo").run(h.resume_ddp, path, timeout=120):
        assert r["keys"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "scale"]  # no "module."
        assert r["step"] == 3 and r["betas"] == (0.8, 0.9)
        assert set(r["values"]) == set(saved)
        for key, value in saved.items():
            if isinstance(value, list) and key != "optim.param_groups":
                assert torch.allclose(torch.tensor(r["values"][key]), torch.tensor(value)), key
            else:
                assert r["values"][key] == value, key


def test_failing_storage_leaves_the_previous_checkpoint(spmd_world, tmp_path):
    path = str(tmp_path / "atomic")
    results = spmd_world(2, "gloo").run(h.save_then_fail, path, f"failing://{path}", timeout=120)
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        committed = f.read()
    for r in results:
        assert "No space left on device (simulated)" in r["error"] and "rank 1" in r["error"], r["error"]
        assert "previous" in r["error"] or "unchanged" in r["error"]
        assert r["x"] == list(range(8)) and r["step"] == 1
    data_dirs = [n for n in os.listdir(path) if n.startswith("data-")]
    assert len(data_dirs) == 1 and json.loads(committed)["data_dir"] == data_dirs[0]  # the failed save's data is gone


def test_partial_checkpoint_fails_clearly(tmp_path):
    dcp.save({"x": torch.ones(3)}, checkpoint_id=str(tmp_path / "p"))
    os.unlink(tmp_path / "p" / METADATA_FILE)  # as a save killed before its commit leaves it
    with pytest.raises(dcp.CheckpointError, match="partial"):
        dcp.load({"x": torch.zeros(3)}, checkpoint_id=str(tmp_path / "p"))
    with pytest.raises(dcp.CheckpointError, match="no checkpoint"):
        dcp.load({"x": torch.zeros(3)}, checkpoint_id=str(tmp_path / "nothing"))


def test_async_save_equals_sync_save(spmd_world, tmp_path):
    a, b = str(tmp_path / "async"), str(tmp_path / "sync")
    results = spmd_world(2, "gloo").run(h.async_vs_sync, a, b, timeout=120)
    assert results[0]["second"]  # rank 0 gets the committed metadata
    assert all(r["second_done"] for r in results)  # the sync save waited for it
    r = h.load_two_and_compare(a, b)
    assert r["equal"] and r["w_ok"], r


def test_third_party_storage_scheme_from_a_plugin(spmd_world, tmp_path):
    path = str(tmp_path / "flat")
    for r in spmd_world(2, "gloo").run(h.third_party_roundtrip, path, timeout=120):
        assert r == {"equal": True, "n": 3, "bytes_read": 5 * 6 * 4}  # a rank's rows, not the whole tensor
    names = os.listdir(path)
    assert METADATA_FILE in names and any("~rank-00000.safetensors" in n for n in names), names


def test_fsspec_memory_url_and_unknown_scheme(tmp_path):
    pytest.importorskip("fsspec")
    state = {"x": torch.arange(6.0).reshape(2, 3), "v": [1, "a"]}
    dcp.save(state, checkpoint_id="memory://spmd-test/ckpt")
    out = {"x": torch.zeros(2, 3), "v": None}
    dcp.load(out, checkpoint_id="memory://spmd-test/ckpt")
    assert torch.equal(out["x"], state["x"]) and out["v"] == [1, "a"]
    with pytest.raises(Exception, match="nosuchscheme"):
        dcp.save(state, checkpoint_id="nosuchscheme://x")


def test_not_json_value_is_a_named_error(tmp_path):
    with pytest.raises(dcp.CheckpointError, match=r"state_dict\['obj'\].*no pickles"):
        dcp.save({"obj": object()}, checkpoint_id=str(tmp_path / "x"))


def test_cli_inspect_consolidate_import_torch(saved_on_four, tmp_path, capsys):
    from safetensors.torch import load_file

    from spmd.cli import main

    assert main(["checkpoint", "inspect", saved_on_four]) == 0
    table = capsys.readouterr().out
    assert "model.w" in table and "10x6" in table and "S(0)" in table and "S(0),S(1)" in table
    assert "loader.position" in table and "1234" in table
    out = str(tmp_path / "full.safetensors")
    assert main(["checkpoint", "consolidate", saved_on_four, out]) == 0
    full = load_file(out)
    assert torch.equal(full["model.m"], h.full_values()["m"]) and torch.equal(full["plain.3"], h.full_values()["plain3"])
    pt = tmp_path / "old.pt"
    torch.save({"w": torch.arange(6.0), "step": 4}, pt)
    assert main(["checkpoint", "import-torch", str(pt), str(tmp_path / "imported")]) == 0
    assert "unpickling" in capsys.readouterr().err
    state = {"w": torch.zeros(6), "step": 0}
    dcp.load(state, checkpoint_id=str(tmp_path / "imported"))
    assert torch.equal(state["w"], torch.arange(6.0)) and state["step"] == 4
    assert main(["checkpoint", "inspect", str(tmp_path / "none")]) == 2


def _train(tmp_path, *extra: str) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "4", "--corpus-chars", "20000",
            "--log-every", "1", *extra]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), *args],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


def test_train_example_saves_every_k_steps_and_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _train(tmp_path, "--steps", "8", "--save-every", "3", "--checkpoint-dir", ckpt, "--out", str(tmp_path / "straight.pt"))
    assert sorted(os.listdir(ckpt)) == ["step-000003", "step-000006", "step-000008"]  # every 3 steps and the last
    os.unlink(os.path.join(ckpt, "step-000008", METADATA_FILE))  # as if the job died before committing step 8
    out = _train(tmp_path, "--steps", "8", "--save-every", "3", "--checkpoint-dir", ckpt, "--resume",
                 "--out", str(tmp_path / "resumed.pt"))
    assert f"resumed from {ckpt}/step-000006 at step 6" in out[0]
    assert re.search(r"done: steps 6-7 \(resumed\) in [\d.]+ s, [\d,]+ tok/s; loss \d+\.\d+ -> \d+\.\d+", out[0]), out[0]
    resumed, straight = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)  # model, optimizer and data order restored
    again = _train(tmp_path, "--steps", "8", "--save-every", "3", "--checkpoint-dir", ckpt, "--resume",
                   "--out", str(tmp_path / "again.pt"))
    assert "done: the run was already complete (8 steps, resumed at step 8); nothing to train" in again[0], again[0]
    assert "nan" not in again[0].split("done:")[1].split("validation")[0]


def test_full_state_dict_gathers_and_loads_into_shards(spmd_world):
    for r in spmd_world(2, "gloo").run(h.full_and_sharded_state_dicts, timeout=120):
        assert r == {"plain": True, "sharded": True, "model_equal": True, "optim_equal": True}


def test_a_rank_that_cannot_save_fails_every_rank_and_async_failures_reach_the_future(spmd_world, tmp_path):
    world = spmd_world(2, "gloo")
    for message in world.run(h.one_rank_refuses, str(tmp_path / "r"), timeout=60):
        assert "refused, nothing written" in message and "rank 0" in message and "no pickles" in message
    assert not os.path.exists(tmp_path / "r" / METADATA_FILE)
    for message in world.run(h.async_save_failure, str(tmp_path / "a"), timeout=60):
        assert "No space left on device (simulated)" in message
    for message in world.run(h.a_rank_that_cannot_stage, str(tmp_path / "s"), timeout=60):
        assert "rank 1 staging" in message and "MemoryError" in message, message


def test_an_async_save_failure_nobody_asked_about_is_raised_by_the_next_save(spmd_world, tmp_path):
    for message in spmd_world(2, "gloo").run(h.unasked_async_failure, str(tmp_path / "a"), str(tmp_path / "b"), timeout=60):
        assert "previous async_save" in message and "No space left on device (simulated)" in message, message


def test_partial_targets_get_the_value_for_every_reduce_op(spmd_world, tmp_path):
    for r in spmd_world(2, "gloo").run(h.partial_targets, str(tmp_path / "p"), timeout=60):
        assert r == {op: (True, True) for op in ("sum", "avg", "max", "min")}, r


def test_a_cleanup_failure_after_the_commit_keeps_the_new_save(tmp_path, monkeypatch):
    from spmd.checkpoint.filesystem import FileStorage

    path = str(tmp_path / "c")
    dcp.save({"x": torch.zeros(3)}, checkpoint_id=path)

    def listing_fails(self, path: str = "") -> list[str]:
        raise OSError("listing failed (simulated)")

    monkeypatch.setattr(FileStorage, "listdir", listing_fails)
    dcp.save({"x": torch.arange(3.0)}, checkpoint_id=path)  # committed before the listing: not an error
    monkeypatch.undo()
    loaded = {"x": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=path)
    assert torch.equal(loaded["x"], torch.arange(3.0))


def test_only_data_directories_are_cleaned_up(tmp_path):
    path = tmp_path / "c"
    (path / "data-splits").mkdir(parents=True)
    (path / "data-splits" / "train.txt").write_text("mine")
    for step in range(2):
        dcp.save({"x": torch.full((3,), float(step))}, checkpoint_id=str(path))
    cleanup.wait()
    assert (path / "data-splits" / "train.txt").read_text() == "mine"
    assert len([n for n in os.listdir(path) if n.startswith("data-")]) == 2  # data-splits and the last save's


def test_set_state_dict_refuses_a_value_of_another_shape():
    net = torch.nn.Linear(3, 2)
    for bad in ({"weight": torch.ones(1, 3), "bias": torch.ones(2)}, {"weight": torch.ones(2, 3), "bias": torch.tensor(7.0)}):
        with pytest.raises(dcp.CheckpointError, match=r"model_state_dict\['(weight|bias)'\] has shape"):
            dcp.set_model_state_dict(net, bad)


def _storage_plugin(overrides: bool) -> object:
    from spmd.checkpoint.filesystem import FileStorage
    from spmd.markers import hookimpl

    class Plugin:
        @hookimpl
        def spmd_storages(self) -> list[dcp.StorageSpec]:
            return [dcp.StorageSpec(("dup",), FileStorage, overrides=overrides)]

    return Plugin()


def test_two_plugins_with_one_scheme_conflict_unless_one_overrides():
    from spmd import PluginConflictError
    from spmd.checkpoint import storage
    from spmd.plugins import manager

    pm = manager()
    pm.register(_storage_plugin(False), name="dup-a")
    pm.register(_storage_plugin(False), name="dup-b")
    try:
        storage.reset()
        with pytest.raises(PluginConflictError, match="two plugins: 'dup-[ab]' and 'dup-[ab]'"):
            storage.storages()
        pm.unregister(name="dup-b")
        pm.register(_storage_plugin(True), name="dup-c")
        storage.reset()
        assert storage.storages()["dup"].plugin == "dup-c"
        assert storage.storages()["file"].plugin == "spmd.checkpoint.filesystem"
    finally:
        for name in ("dup-a", "dup-b", "dup-c"):
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
        storage.reset()


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint(spmd_world, tmp_path):
    path = str(tmp_path / "killed")
    with pytest.raises(AssertionError):  # the world reports the dead rank (and rank 0's failed exchange)
        spmd_world(2, "gloo").run(h.save_then_die, path, f"dying://{path}", timeout=90)
    # rank 0's exchange with the dead rank fails: it rolls the save back (its data directory and its claim go)
    committed = json.loads(pathlib.Path(path, METADATA_FILE).read_text())["data_dir"]
    assert sorted(os.listdir(path)) == [committed, METADATA_FILE]
    state = {"x": torch.zeros(8), "y": torch.zeros(8), "step": 0}
    dcp.load(state, checkpoint_id=path)
    assert state["step"] == 1 and torch.equal(state["x"], torch.arange(8.0))
    dcp.save(state, checkpoint_id=path)  # the id is free again: no claim was left behind
    cleanup.wait()
    assert len([n for n in os.listdir(path) if n.startswith("data-")]) == 1


def _children_with_rank(parent: int, rank: int) -> list[int]:
    """Pids of ``parent``'s child processes whose environment says ``RANK=rank`` (the agent's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            found.append(int(entry))
    return found


def _spmd_run_train(tmp_path, ckpt: str, out: str, *extra: str, resume: bool = False) -> subprocess.Popen:
    """examples/train.py under ``spmd run`` on 2 ranks, 60 steps, a checkpoint every 4."""
    args = ["--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "4", "--corpus-chars", "20000",
            "--log-every", "1", "--steps", "60", "--save-every", "4", "--checkpoint-dir", ckpt, "--out", out]
    args += ["--resume"] if resume else []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "spmd", "run", "--nproc-per-node", "2", *extra,
                             str(ROOT / "examples" / "train.py"), *args],
                            env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _step_losses(stdout: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step\s+(\d+)\s+loss (\S+)", stdout, re.M)}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the agent's workers through /proc (Linux)")
def test_a_rank_killed_mid_run_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    straight = _spmd_run_train(tmp_path, str(tmp_path / "a"), str(tmp_path / "straight.pt"))
    ckpt = tmp_path / "b"
    job = _spmd_run_train(tmp_path, str(ckpt), str(tmp_path / "resumed.pt"), "--max-restarts", "1", resume=True)
    deadline = time.monotonic() + 240
    while not (ckpt / "step-000004" / METADATA_FILE).exists():  # the first checkpoint is committed: kill rank 1
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.01)
    victims = _children_with_rank(job.pid, 1)
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    assert "killed by signal SIGKILL; restarting the group (1/1)" in err
    resumed_at = re.search(rf"resumed from {ckpt}/step-(\d+) at step (\d+)", out)
    assert resumed_at is not None, out
    start = int(resumed_at[2])
    assert 4 <= start < 60, "the kill came after the run's end: the test did not test a resume"
    straight_out, straight_err = straight.communicate(timeout=300)
    assert straight.returncode == 0, straight_err
    expected = _step_losses(straight_out)
    after = _step_losses(out[resumed_at.end():])
    assert sorted(after) == list(range(start, 60)) and all(after[s] == expected[s] for s in after)
    resumed, uninterrupted = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_set_model_state_dict_into_a_meta_fully_shard_model(spmd_world):
    for row in spmd_world(2, "gloo").run(h.set_model_state_dict_into_meta_fully_shard, timeout=120):
        for how in ("broadcast_from_rank0", "full_state_dict"):
            assert row[how] == {"meta": False, "same_values": True, "forward": True}, (how, row)
