"""Writes its pid, then waits to be stopped (the test signals the agent); notes which signal reached it."""

import os
import signal
import sys
import time

folder, rank = sys.argv[1], os.environ["RANK"]


def note(signum, frame):
    with open(os.path.join(folder, f"got{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(0)


for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(signum, note)
# written aside and renamed, so the test that waits for the file never reads it empty
with open(os.path.join(folder, f".pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(folder, f".pid{rank}"), os.path.join(folder, f"pid{rank}"))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
