"""Rank 1 kills itself with SIGKILL on the first attempt; later attempts finish."""

import os
import signal

import torch

import spmd

spmd.init("gloo")
t = torch.ones(1)
spmd.all_reduce(t)
if os.environ["SPMD_RESTART_COUNT"] == "0" and spmd.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
spmd.all_reduce(t)
print(f"FINISHED rank={spmd.get_rank()} restart={os.environ['SPMD_RESTART_COUNT']}", flush=True)
spmd.destroy_process_group()
