"""Starts helpers the way real jobs do, writes their pids, then ends as argv[2] says.

A child in the worker's process group (``sleep``), a child that has a child of its own (a
DataLoader-like grandchild), a double-forked orphan (``sh -c 'sleep &'``: its parent exits at once)
and a child in a session of its own (out of the worker's process group). ``argv[2]``: ``wait``
(until stopped), ``exit0`` or ``exit3`` (with the helpers still running). The helpers write to
/dev/null: a helper holding the worker's stdout would keep the agent's reader waiting for its end.
"""

import json
import os
import subprocess
import sys
import time

from spmd.polling import poll

folder, how = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
child = subprocess.Popen(["sleep", "300"], **quiet)
grandchild_file = os.path.join(folder, f".grandchild{rank}")
parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                           "p = subprocess.Popen(['sleep', '300'])\n"
                           "open(sys.argv[1] + '.tmp', 'w').write(str(p.pid))\n"
                           "__import__('os').replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
                           "time.sleep(300)", grandchild_file], **quiet)
orphan = int(subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True).stdout)
session = subprocess.Popen(["sleep", "300"], start_new_session=True, **quiet)
poll(lambda: os.path.exists(grandchild_file), 60, 0.01)
with open(grandchild_file) as f:
    grandchild = int(f.read())
pids = {"worker": os.getpid(), "child": child.pid, "parent": parent.pid, "grandchild": grandchild, "orphan": orphan, "session": session.pid}
with open(os.path.join(folder, f".pids{rank}"), "w") as f:
    json.dump(pids, f)
os.replace(os.path.join(folder, f".pids{rank}"), os.path.join(folder, f"pids{rank}.json"))
if how == "exit0":
    sys.exit(0)
if how == "exit3":
    sys.exit(3)
time.sleep(120)
