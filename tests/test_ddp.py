"""spmd.parallel.DistributedDataParallel: parity with torch DDP over Gloo, errors, hooks, state dicts, groups."""

from __future__ import annotations

import ddp_helpers
import pytest
import torch

from spmd.parallel import StrategyNotFoundError, get_strategy
from spmd.parallel.buckets import assign_buckets


@pytest.mark.parametrize("case", ["plain", "no_sync", "unused", "buckets", "no_grad_forward"])
def test_parity_with_torch_ddp(spmd_world, case):
    results = spmd_world(2, "gloo").run(ddp_helpers.parity, case, timeout=90)
    assert all(r["changed"] for r in results)
    if case == "buckets":
        assert all(r["buckets"] >= 3 for r in results), results  # several (after the rebuild: bias+weight pairs)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compression_hooks_match_torch_hooks(spmd_world, hook):
    spmd_world(2, "gloo").run(ddp_helpers.parity, hook, timeout=90)


def test_ranks_disagreeing_on_used_parameters_raise_instead_of_hanging(spmd_world):
    results = spmd_world(2, "gloo").run(ddp_helpers.mismatch, timeout=60)
    assert results[0]["result"] == "no error"  # rank 0 got every gradient
    message = results[1]["result"]
    assert message.startswith("SpmdError: ")
    assert "extra.weight" in message and "extra.bias" in message
    assert "find_unused_parameters=True" in message
    assert all(r["elapsed"] < 10 for r in results), results  # far below the 30 s collective timeout
    assert [r["check"] for r in results] == [2.0, 2.0]  # and the ranks are still in step


def test_custom_comm_hook_by_name(spmd_world):
    for r in spmd_world(2, "gloo").run(ddp_helpers.custom_hook, timeout=60):
        assert r["calls"] == r["buckets"] >= 2
        assert r["numel"] == r["total"]
        assert r["indices"] == list(range(r["buckets"]))  # launched in bucket order
        assert r["overlapped"]  # the first bucket went out before backward reached the first layer


def test_state_dict_has_no_wrapper_prefix(spmd_world):
    for r in spmd_world(2, "gloo").run(ddp_helpers.state_dict_round_trip, timeout=60):
        assert r["type"] == "DistributedDataParallel"
        assert not any(k.startswith("module.") for k in r["keys"])
        assert r["nested"] == ["0.fc1.weight", "0.fc1.bias"]


def test_ddp_over_a_subgroup(spmd_world):
    results = spmd_world(3, "gloo").run(ddp_helpers.against_local_reference, [0, 2], timeout=90)
    assert results[1] is None
    assert [r["group_rank"] for r in (results[0], results[2])] == [0, 1]


def test_ddp_on_a_third_party_backend(spmd_world):
    """The isend/irecv-only example plugin: every collective DDP uses comes from the generic algorithms."""
    pytest.importorskip("spmd_example_p2p")
    results = spmd_world(2, "p2p").run(ddp_helpers.against_local_reference, timeout=90)
    assert [r["backend"] for r in results] == ["p2p", "p2p"]


@pytest.mark.parametrize("case", ["plain", "unused", "active_ranks", "no_batches"])
def test_uneven_inputs_with_join_match_torch_ddp_join(spmd_world, case):
    """Ranks with 5 and 8 batches (or 0 and 3); BatchNorm buffers; unused parameters; both divisor modes."""
    results = spmd_world(2, "gloo").run(ddp_helpers.uneven, case, timeout=120)
    assert all(r["changed"] for r in results)
    assert results[0]["fc1"] == results[1]["fc1"]  # every rank ends with the same model


def test_join_can_stop_every_rank_when_one_runs_out(spmd_world):
    results = spmd_world(2, "gloo").run(ddp_helpers.uneven_throw, timeout=60)
    for r in results:
        assert "ran out of inputs" in r["result"] and "group rank(s) [0]" in r["result"], r
        assert r["elapsed"] < 20, r
    assert [r["steps"] for r in results] == [3, 3]  # rank 1 stopped at its 4th forward


def test_buckets_are_rebuilt_along_the_first_backwards_ready_order(spmd_world):
    results = spmd_world(2, "gloo").run(ddp_helpers.rebuild, timeout=90)
    first, later = results[0]["layouts"][0], results[0]["layouts"][1]
    layers = lambda layout: [name.split(".")[0] for names in layout for name in names]  # noqa: E731
    assert layers(first) == ["c", "b", "c", "a", "b", "a"]  # cut in registration order, launched reversed
    assert layers(later) == ["b", "b", "a", "a", "c", "c"]  # re-cut in the order gradients arrived
    assert all(r["layouts"][1:] == [later] * 5 for r in results)  # once, and the same on every rank


def test_strategy_registry():
    assert get_strategy("ddp").name == "ddp"
    with pytest.raises(StrategyNotFoundError, match="unknown strategy 'nope'; available strategies: .*ddp"):
        get_strategy("nope")


def test_buckets_follow_reverse_registration_order_and_split_dtypes():
    params = [torch.zeros(256) for _ in range(4)] + [torch.zeros(256, dtype=torch.float64)]
    buckets = assign_buckets(params, cap_bytes=2048, first_cap_bytes=1024)
    assert buckets == [[4], [3], [1, 2], [0]]  # the first-registered bucket is the small one
    assert assign_buckets(params, cap_bytes=1 << 20, first_cap_bytes=1 << 20) == [[4], [0, 1, 2, 3]]
