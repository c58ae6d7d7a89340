"""Writes its pid, then waits to be stopped (the test signals the agent)."""

import os
import sys
import time

with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
