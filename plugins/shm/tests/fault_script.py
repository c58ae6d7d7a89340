"""One rank dies or stalls mid-job; the others must raise a named error in time. Prints RESULT json.

    RANK=r WORLD_SIZE=3 MASTER_ADDR=... MASTER_PORT=... python fault_script.py SCENARIO TIMEOUT
"""

import json
import os
import signal
import sys
import time

import torch

import spmd

scenario, timeout = sys.argv[1], float(sys.argv[2])
spmd.init("shm", timeout=timeout)
rank, world = spmd.get_rank(), spmd.get_world_size()
victim = world - 1
spmd.all_reduce(torch.ones(4))  # everyone attached (the segment is unlinked by now) and in step
result = {"rank": rank, "pid": os.getpid()}
big = torch.ones(16 << 20)  # 64 MiB: 16 rounds through the 4 MiB slots, so the victim dies inside the op
if rank == victim:
    if scenario == "kill_mid_all_reduce":
        spmd.all_reduce(big, async_op=True)  # writes its first two chunks, then waits for the others
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "kill_before_recv":
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "stall":
        time.sleep(timeout + 6)  # alive, but never reaches the collective
        os._exit(0)
if scenario == "kill_mid_all_reduce":
    time.sleep(0.3)  # enter after the victim started the op, before it died: it dies mid-op
start = time.monotonic()
try:
    if scenario in ("kill_mid_all_reduce", "stall"):
        spmd.all_reduce(big)
    elif scenario == "kill_before_recv":
        spmd.recv(torch.empty(4), src=victim)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    result["error"] = None
except Exception as error:  # noqa: BLE001 - the error is the result
    result["error"] = type(error).__name__
    result["spmd_error"] = isinstance(error, spmd.errors.SpmdError)
    result["message"] = str(error)
result["elapsed"] = time.monotonic() - start
# A later op on the broken group fails at once.
start = time.monotonic()
try:
    spmd.all_reduce(torch.ones(4))
    result["after"] = None
except Exception as error:  # noqa: BLE001
    result["after"] = type(error).__name__
result["after_elapsed"] = time.monotonic() - start
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)  # the group is broken: do not wait in teardown
