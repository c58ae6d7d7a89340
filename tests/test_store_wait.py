"""missing_keys: a wait for store keys that names the missing ones and prints nothing when it runs out."""

import threading
import time

import torch.distributed as tdist

from spmd.comm.store_wait import missing_keys


def test_returns_once_keys_arrive_late_and_names_those_that_never_do(capfd):
    store = tdist.HashStore()
    store.set("a", "1")
    threading.Timer(0.3, store.set, ("b", "1")).start()
    start = time.monotonic()
    assert missing_keys(store, ["a", "b"], 5.0) == []
    assert 0.3 <= time.monotonic() - start < 0.3 + 0.2  # ends soon after the last key (pause <= a tenth of the wait)
    start = time.monotonic()
    assert missing_keys(store, ["a", "never", "b", "nor"], 0.4) == [1, 3]
    assert 0.4 <= time.monotonic() - start < 1.0
    assert capfd.readouterr().err == ""
