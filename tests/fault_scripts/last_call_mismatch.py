"""A job whose last collective disagrees (SUM on rank 0, MAX on rank 1; both shapes agreed before), then ends:
destroy_process_group must find it and raise, so the job exits non-zero (run by test_first_call_agreement.py)."""

import sys

import torch

import spmd

spmd.init(sys.argv[1] if len(sys.argv) > 1 else "gloo")
t = torch.ones(4)
spmd.all_reduce(t)
spmd.all_reduce(t, op=spmd.ReduceOp.MAX)          # both calls agreed once
x = torch.arange(4.0) * (spmd.get_rank() + 1)
spmd.all_reduce(x, op=spmd.ReduceOp.SUM if spmd.get_rank() == 0 else spmd.ReduceOp.MAX)
print(spmd.get_rank(), "result", x.tolist(), flush=True)
spmd.destroy_process_group()
print(spmd.get_rank(), "clean exit", flush=True)
