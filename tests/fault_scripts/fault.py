"""One rank misbehaves; every surviving rank must raise a named error in time. Prints RESULT json."""

import json
import os
import sys
import time
from datetime import timedelta

import torch

behind = float(os.environ.get("FAULT_CLOCK_BEHIND_S", "0"))
if behind and os.environ.get("RANK") == "2":  # this rank's host clock runs behind the others'
    _host_time = time.time
    time.time = lambda: _host_time() - behind

import spmd  # noqa: E402 - after the clock is set back

scenario, backend, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
# Start-up (imports, the store, the backend's connections) is not what the test times: on a loaded
# machine it alone can outlast a short timeout. Connect under a generous one, then shorten the
# world's timeout for the ops under test (the kernel's waits and the watchdog read it per op).
spmd.init(backend, timeout=max(60.0, timeout))
rank = spmd.get_rank()
t = torch.ones(4)
spmd.all_reduce(t)  # #0: everyone connected and in step
world = spmd.comm.state.get_state().world
world.timeout, world.timeout_s = timedelta(seconds=timeout), timeout
result = {"rank": rank}
start = time.monotonic()
try:
    if scenario == "skip" and rank == 2:
        time.sleep(timeout + 3)  # skips collective #1: busy elsewhere, then leaves
        result["skipped"] = True
    elif scenario == "exit" and rank == 2:
        os._exit(3)
    elif scenario == "raise_and_exit" and rank == 2:
        try:
            spmd.all_gather_into_tensor(torch.empty(3), t)  # a wrong output size: raises here, gives the group up
        finally:
            os._exit(1)  # as an uncaught error would end the process
    elif scenario == "rank0_leaves" and rank == 0:
        os._exit(0)  # the rank that hosts the store outside `spmd run`; exit 0: the agent keeps the rest
    elif scenario == "mismatch_op" and rank == 2:
        spmd.all_gather_into_tensor(torch.empty(4 * spmd.get_world_size()), t)
    elif scenario == "mismatch_shape" and rank == 2:
        spmd.all_reduce(torch.ones(5))
    else:
        spmd.all_reduce(t)
    result["error"] = None
except Exception as error:  # noqa: BLE001 - the error is the result
    result["error"] = type(error).__name__
    result["message"] = str(error)
result["elapsed"] = time.monotonic() - start
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)  # peers may be wedged: do not wait in teardown
