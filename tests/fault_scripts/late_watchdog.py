"""Rank 0 gives the world up before rank 1's watchdog has started; rank 1 must still adopt it. Prints RESULT json.

Rank 1's watchdog is held back (its start waits until the store shows rank 0's announcement), as a rank
slow between arriving at init and starting its watchdog would be.
"""

import json
import os
import sys

import spmd
from spmd.comm.health import watchdog
from spmd.polling import poll

real_start = watchdog.start


def late_start(store, *args, **kwargs):  # type: ignore[no-untyped-def]
    poll(lambda: int(store.add(watchdog.UNUSABLE_COUNT, 0)) >= 1, 30, 0.01)
    return real_start(store, *args, **kwargs)


if os.environ["RANK"] == "1":
    watchdog.start = late_start
spmd.init(sys.argv[1], timeout=60)
world = spmd.comm.state.get_state().world
store = spmd.comm.state.get_state().store
if spmd.get_rank() == 0:
    world.mark_unusable("rank 0 gave up on it for the test")
    store.wait(["late_watchdog/done"])  # rank 0 hosts the store: stay until rank 1 has looked
    result = {"rank": 0}
else:
    poll(lambda: world.unusable is not None, 10, 0.05)
    store.set("late_watchdog/done", "1")
    result = {"rank": 1, "unusable": world.unusable}
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
