"""Leaves an orphan that exits at once (``sh -c 'sleep 0.1 &'``): the agent, its subreaper, must reap it.
Exits 0 once the orphan is gone from /proc, 1 if it is still there (a zombie) 10 s later."""

import os
import subprocess
import sys

from spmd.polling import poll

pid = int(subprocess.run(["sh", "-c", "sleep 0.1 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True).stdout)
poll(lambda: not os.path.exists(f"/proc/{pid}"), 10, 0.02)
if os.path.exists(f"/proc/{pid}"):
    with open(f"/proc/{pid}/stat") as f:
        print(f"orphan {pid} is still there: {f.read()}", file=sys.stderr)
    sys.exit(1)
