"""All-reduce steps until the job is cut; a restarted attempt does a few steps and reports.

argv[1]: a folder. On the first attempt, with two nodes each rank writes ``ready-<GROUP_RANK>`` there
(its agent's pid); every rank keeps stepping (at most 60 s) until the round is cut; a restarted
attempt checks its sum and exits 0.
"""

import os
import sys
import time
from pathlib import Path

import torch

import spmd

folder = Path(sys.argv[1])
spmd.init("gloo")
world, restart = spmd.get_world_size(), int(os.environ["SPMD_RESTART_COUNT"])
if restart == 0:  # (a first round of one node is restarted for the other when it arrives: no restart used)
    if world == 2:
        (folder / f"ready-{os.environ['GROUP_RANK']}").write_text(str(os.getppid()))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        t = torch.ones(1)
        spmd.all_reduce(t)
        time.sleep(0.05)
    sys.exit(3)  # nobody cut the job: the test failed to
t = torch.full((1,), float(spmd.get_rank() + 1))
spmd.all_reduce(t)
print(f"DONE world={world} restart={restart} sum={t.item()} store={os.environ['SPMD_AGENT_STORE']}", flush=True)
spmd.destroy_process_group()
