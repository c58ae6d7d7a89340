"""The first-call comparison in one process (a HashStore stands in for the job's store; the peer is a thread):
a disagreement that another check named first still ends the waiting call as a CollectiveDesyncError."""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from spmd.comm.group import ProcessGroup
from spmd.comm.health import desync
from spmd.debug.recorder import recorder
from spmd.debug.signatures import disagreed_seq, disagreement
from spmd.errors import CollectiveDesyncError, CollectiveError


def _group(name: str) -> ProcessGroup:
    return ProcessGroup(name, [0, 1], 0, tdist.HashStore(), timedelta(seconds=5), None)


def _entry(group: ProcessGroup, dtype: torch.dtype):
    return recorder.start(group.name, group.next_seq(), "all_reduce", [torch.ones(4, dtype=dtype)], None, None, None)


def test_a_disagreement_reason_names_its_call_also_after_another_rank_announced_it():
    reason = disagreement(7, "g", ": rank 0 called x, rank 1 called y")
    assert disagreed_seq(reason) == 7 and disagreed_seq(f"rank 1 gave up on it: {reason}") == 7
    assert disagreed_seq("all_reduce #7 was never called by every rank") is None


@pytest.mark.parametrize("given_up_for", ["this call", "an earlier call", "a failed op"])
def test_a_wait_ended_by_another_check_is_a_desync_error_only_for_this_calls_disagreement(given_up_for):
    group = _group(f"units-{given_up_for.replace(' ', '-')}")
    entry = _entry(group, torch.float32)
    reasons = {
        "this call": disagreement(entry.seq, group.name, ": rank 0 called all_reduce(float32; 4), rank 1 called all_reduce(int32; 4)"),
        "an earlier call": disagreement(entry.seq - 1, group.name, ": ..."),
        "a failed op": "all_reduce raised on rank 1 (ValueError: bad)",
    }
    # The peer never posts its call; while this rank waits, the always-on check gives the group up.
    threading.Timer(0.3, group.mark_unusable, (reasons[given_up_for],), {"announce": False}).start()
    with pytest.raises((CollectiveDesyncError, CollectiveError)) as raised:
        desync.check(group, entry, timeout_s=5.0)
    if given_up_for == "this call":
        assert raised.type is CollectiveDesyncError and "int32; 4" in str(raised.value), raised.value
    else:
        assert raised.type is CollectiveError and "cannot be used" in str(raised.value), raised.value


def test_both_calls_posted_compare_to_a_desync_error_naming_each_ranks_call():
    group = _group("units-compared")
    entry = _entry(group, torch.float32)
    peer = ProcessGroup(group.name, [0, 1], 1, group.root_store, timedelta(seconds=5), None)
    peer.uid = group.uid
    peer_entry = _entry(peer, torch.int32)
    desync.post(peer, peer_entry)
    with pytest.raises(CollectiveDesyncError, match="int32"):
        desync.check(group, entry, timeout_s=5.0)
