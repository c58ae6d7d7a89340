"""spmd.pipeline: schedules against one process, the validator, the simulator, a third-party schedule, DDP."""

from __future__ import annotations

import pipeline_helpers as h
import pytest
import torch

import spmd
from spmd.pipeline import (
    Action,
    Kind,
    ScheduleError,
    get_schedule,
    schedule_names,
    simulate,
    validate,
    with_communication,
)

BUILTIN = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def _check(results: list[dict], num_stages: int, n_microbatches: int) -> None:
    grads, losses = h.reference(num_stages, n_microbatches)
    seen = set()
    for r in results:
        for s, gs in r["grads"].items():
            seen.add(s)
            for got, want in zip(gs, grads[s], strict=True):
                torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    assert seen == set(range(num_stages))
    last = results[(num_stages - 1) % len(results)]
    assert last["losses"] == pytest.approx(losses, rel=1e-5)
    assert last["out_shape"] == (h.BATCH, h.WIDTH)


def test_builtin_schedules_are_registered():
    assert set(BUILTIN) <= set(schedule_names())
    info = spmd.plugins.manager().infos["spmd.pipeline.builtin"]
    assert info.loaded


@pytest.mark.parametrize("world", [2, 4])
def test_every_builtin_schedule_matches_one_process(spmd_world, world):
    w = spmd_world(world, "gloo")
    for name in BUILTIN:
        v = get_schedule(name).stages_per_rank
        for m in (4, 8):
            _check(w.run(h.run_step, name, v, m, timeout=300), world * v, m)


def test_stages_built_with_input_args_run_and_match_one_process(spmd_world):
    """The upstream stage sends shape metadata whatever the receiver was given: input_args only checks it."""
    _check(spmd_world(2, "gloo").run(h.run_step, "1f1b", 1, 4, None, True, timeout=120), 2, 4)


def test_p2p_ops_carry_the_pipeline_context(spmd_world):
    results = spmd_world(2, "gloo").run(h.run_step, "1f1b", 1, 4, timeout=120)
    assert any("RECV_B of stage 0, microbatch" in c for c in results[0]["contexts"]), results[0]["contexts"]


def test_timeout_names_rank_action_stage_microbatch_and_peer(spmd_world):
    results = spmd_world(2, "gloo").run(h.timeout_names_the_action, timeout=120)
    assert results[0] == "idle"
    assert "rank 1 waits in RECV_F of stage 1, microbatch 0 (shape metadata), from rank 0" in results[1], results[1]
    assert "timed out" in results[1]


def test_third_party_schedule_runs_and_a_broken_one_never_reaches_the_runtime(spmd_world):
    results = spmd_world(2, "gloo").run(h.third_party, timeout=120)
    _check(results, 2, 4)
    for r in results:
        assert "test_drops_a_receive" in r["broken"] and "rank 1" in r["broken"], r["broken"]
        assert r["p2p_after_broken"] == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "test_splits_the_first_backward"])
def test_pipeline_over_pp_and_ddp_over_dp(spmd_world, name):
    results = spmd_world(4, "gloo").run(h.with_ddp, name, 4, timeout=180)
    grads, _ = h.reference(2, 4)
    for r in results:
        for got, want in zip(r["grads"], grads[r["stage"]], strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_pipeline_over_pp_and_fsdp_over_dp(spmd_world, name):
    """Each stage fully_shard-ed over "dp": one reduce-scatter per unit in the stage's last backward."""
    results = spmd_world(4, "gloo").run(h.with_fsdp, name, 4, timeout=180)
    grads, _ = h.reference(2, 4)
    for r in results:
        assert r["sharded"] == ["(Shard(dim=0),)"]
        for got, want in zip(r["grads"], grads[r["stage"]], strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_a_split_backward_schedule_with_fsdp_is_refused_by_name(spmd_world):
    for r in spmd_world(4, "gloo").run(h.with_fsdp, "zb_h1", 4, timeout=180):
        assert "'zb_h1' splits backward into B and W" in r["error"], r


# -- validator ----------------------------------------------------------------------------------


def _programs() -> dict[int, list[Action]]:
    return {r: list(p) for r, p in get_schedule("1f1b").programs(2, 1, 4).items()}


def test_every_builtin_program_validates():
    for name in BUILTIN:
        cls = get_schedule(name)
        v = cls.stages_per_rank
        for world in (1, 2, 4):
            for m in (4, 8):
                validate(cls.programs(world * v, v, m))


def test_validator_rejects_a_missing_receive():
    programs = _programs()
    programs[1].remove(Action(1, 2, Kind.RECV_F))
    with pytest.raises(ScheduleError, match=r"rank 1, step \d+: F1.2 .* needs RECV_F1.2"):
        validate(programs)


def test_validator_rejects_a_swap_into_a_deadlock():
    programs = _programs()
    p = programs[0]
    i, j = p.index(Action(0, 0, Kind.SEND_F)), p.index(Action(0, 0, Kind.RECV_B))
    p[i], p[j] = p[j], p[i]
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(programs)
    assert "rank 0, step" in str(info.value) and "RECV_B0.0" in str(info.value) and "rank 1" in str(info.value)


def test_validator_rejects_receives_in_another_order_than_the_sends():
    """Fine where messages match by tag; on a backend that matches them by order (NCCL), a silent microbatch swap."""
    compute = {0: [Action(0, m, Kind.F) for m in range(2)] + [Action(0, m, Kind.B) for m in range(2)],
               1: [Action(1, 1, Kind.F), Action(1, 0, Kind.F), Action(1, 1, Kind.B), Action(1, 0, Kind.B)]}
    with pytest.raises(ScheduleError, match=r"rank 0 sends SEND_F0.0 to rank 1 where rank 1 receives the message of SEND_F0.1"):
        validate(with_communication(compute, 2))


def test_validator_rejects_a_duplicated_microbatch():
    programs = _programs()
    p = programs[0]
    i = p.index(Action(0, 2, Kind.F))
    p[i] = Action(0, 1, Kind.F)
    with pytest.raises(ScheduleError, match=r"rank 0, step \d+: F0.1 .* duplicated"):
        validate(programs)


def test_validator_rejects_b_before_f_w_before_b_and_an_unreceived_send():
    programs = _programs()
    p = programs[1]
    p.insert(0, Action(1, 3, Kind.B))
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: B1.3 .* needs F1.3"):
        validate(programs)
    programs = _programs()
    programs[1].insert(0, Action(1, 0, Kind.W))
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: W1.0 .* needs B1.0"):
        validate(programs)
    programs = _programs()
    programs[0].append(Action(0, 9, Kind.SEND_F))
    with pytest.raises(ScheduleError, match="rank 0"):
        validate(programs)


def test_validator_rejects_a_stage_on_the_wrong_rank():
    programs = _programs()
    programs[0].insert(0, Action(1, 0, Kind.F))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(programs)


def test_action_kind_is_a_str_enum():
    a = Action(stage=2, microbatch=3, kind="RECV_F")
    assert a.kind == "RECV_F" and a.kind is Kind.RECV_F and str(a) == "RECV_F2.3"
    assert a.peer() == Action(1, 3, Kind.SEND_F)
    with pytest.raises(ValueError, match="unknown"):
        Action(0, 0, "X")


# -- simulator ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_simulated_bubble_of_gpipe_and_1f1b_matches_the_formula(p, m):
    for name in ("gpipe", "1f1b"):
        sim = simulate(get_schedule(name).programs(p, 1, m), {"F": 1, "B": 1})
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert sim.makespan == pytest.approx(2 * (m + p - 1))
    assert max(simulate(get_schedule("1f1b").programs(p, 1, m)).peak_activations.values()) <= p
    assert max(simulate(get_schedule("gpipe").programs(p, 1, m)).peak_activations.values()) == m


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    p, m = 4, 8
    one = simulate(get_schedule("1f1b").programs(p, 1, m), {"F": 1, "B": 2})
    inter = simulate(get_schedule("interleaved_1f1b").programs(2 * p, 2, m), {"F": 0.5, "B": 1})
    zb = simulate(get_schedule("zb_h1").programs(p, 1, m), {"F": 1, "B": 1, "W": 1})
    assert inter.bubble_fraction == pytest.approx((p - 1) / (2 * m + p - 1))
    assert zb.makespan < one.makespan
    assert max(zb.peak_activations.values()) <= p


def test_simulator_refuses_an_invalid_program():
    programs = _programs()
    programs[1].remove(Action(1, 0, Kind.RECV_F))
    with pytest.raises(ScheduleError):
        simulate(programs)


def test_cli_pipeline_show_prints_the_timeline(capsys, tmp_path):
    from spmd.cli import main

    assert main(["pipeline", "show", "gpipe", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "rank 3 |" in out and "bubble 27.3%" in out and "F7" in out


def test_train_example_pipeline_follows_one_process(tmp_path):
    """examples/train.py --pp 2 (embeddings, blocks and head in two stages, 1F1B, 2 microbatches) trains
    like one process on the same data, and its saved state dict (gathered from both stages) matches."""
    from train_runs import assert_same_state, losses, run_train

    single = losses(run_train(1, [], tmp_path / "one.pt"))
    piped = losses(run_train(2, ["--pp", "2", "--microbatches", "2"], tmp_path / "pp.pt"))
    assert len(single) == 5 and max(abs(a - b) for a, b in zip(single, piped)) < 2e-4, (single, piped)
    assert_same_state(tmp_path / "one.pt", tmp_path / "pp.pt")


def test_train_example_pipeline_inside_fsdp_follows_ddp(tmp_path):
    """--pp 2 --strategy fsdp on 4 ranks (two stages, each sharded over 2 replicas) follows DDP on 2 ranks."""
    from train_runs import assert_same_state, losses, run_train

    ddp = losses(run_train(2, [], tmp_path / "ddp.pt"))
    piped = losses(run_train(4, ["--pp", "2", "--microbatches", "2", "--strategy", "fsdp"], tmp_path / "pp.pt"))
    assert len(ddp) == 5 and max(abs(a - b) for a, b in zip(ddp, piped)) < 2e-4, (ddp, piped)
    assert_same_state(tmp_path / "ddp.pt", tmp_path / "pp.pt")


def test_a_schedule_whose_data_tags_would_reach_the_metadata_tags_is_refused() -> None:
    """Data tags are 2 x (stage x microbatches + microbatch) + direction, below META_TAG; past it a data
    message could be taken for a metadata one (of the same size: silently), so the runtime refuses."""
    from spmd.pipeline.actions import Action, Kind
    from spmd.pipeline.transfers import META_TAG, Transfer

    m = META_TAG // 4  # 2 x (stage 2 x m) = META_TAG: the first data tag that would collide
    assert Transfer(Action(1, m - 1, Kind.RECV_F), m, 4).tag < META_TAG  # stage 0 -> 1: fine
    with pytest.raises(ValueError, match="data tags must stay below"):
        Transfer(Action(3, 0, Kind.RECV_F), m, 4)  # stage 2 -> 3
