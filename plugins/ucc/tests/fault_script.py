"""One rank exits mid-job; the others must raise a named error, not hang. Prints RESULT json.

    RANK=r WORLD_SIZE=3 MASTER_ADDR=... MASTER_PORT=... python fault_script.py SCENARIO TIMEOUT
"""

import json
import os
import sys
import time

import torch

import spmd

scenario, timeout = sys.argv[1], float(sys.argv[2])
spmd.init("ucc", timeout=timeout)
rank, world = spmd.get_rank(), spmd.get_world_size()
spmd.all_reduce(torch.ones(4))  # #0: everyone connected and in step
spmd.all_reduce(torch.ones(1 << 18))  # and the ring's connections too
result = {"rank": rank}
if scenario == "finish_first":
    # Not a failure: the last rank finishes its part (a send) and exits while the others still
    # exchange messages among themselves; nothing may fail because it left.
    start = time.monotonic()
    try:
        if rank == world - 1:
            spmd.send(torch.full((4,), 2.0), dst=1)
            os._exit(0)
        if rank == 0:
            time.sleep(1.0)  # well after rank 2 left, within the failure grace
            spmd.send(torch.full((4,), 7.0), dst=1)
        if rank == 1:
            late = torch.zeros(4)
            work = spmd.irecv(late, src=0)
            early = torch.zeros(4)
            spmd.recv(early, src=world - 1)
            work.wait()
            assert early.tolist() == [2.0] * 4 and late.tolist() == [7.0] * 4, (early, late)
            result["saw_failure"] = spmd.comm.state.get_state().world.backend("cpu").failure is not None
        result["error"] = None
    except Exception as error:  # noqa: BLE001 - the error is the result
        result["error"] = type(error).__name__
        result["message"] = str(error)
    result["elapsed"] = time.monotonic() - start
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
if rank == world - 1:
    time.sleep(0.2)
    os._exit(3)  # dies without a word: no destroy, no socket shutdown by Python
start = time.monotonic()
try:
    if scenario == "all_reduce":
        spmd.all_reduce(torch.ones(4))
    elif scenario == "all_reduce_ring":
        spmd.all_reduce(torch.ones(1 << 20))
    elif scenario == "recv":
        spmd.recv(torch.empty(4), src=world - 1)
    elif scenario == "broadcast":  # a generic collective (isend/irecv) rooted at the dead rank
        spmd.broadcast(torch.empty(4), src=world - 1)
    elif scenario == "async":
        spmd.all_reduce(torch.ones(4), async_op=True).wait()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    result["error"] = None
except Exception as error:  # noqa: BLE001 - the error is the result
    result["error"] = type(error).__name__
    result["message"] = str(error)
result["elapsed"] = time.monotonic() - start
# A later op on the broken group fails at once, with the same diagnosis.
start = time.monotonic()
try:
    spmd.all_reduce(torch.ones(4))
    result["after"] = None
except Exception as error:  # noqa: BLE001
    result["after"] = type(error).__name__
result["after_elapsed"] = time.monotonic() - start
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)  # peers may be wedged: do not wait in teardown
