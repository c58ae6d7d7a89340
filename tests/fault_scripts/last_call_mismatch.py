"""A job with one mismatched collective, then a matching one, then the end: destroy_process_group must find the
mismatch and raise, so the job exits non-zero (run by test_first_call_agreement.py).

    python last_call_mismatch.py BACKEND KIND    # KIND: op (SUM against MAX, both agreed before) or dtype (a first
                                                 # call of a new shape: float32 against int32, the same bytes)
"""

import sys

import torch

import spmd

backend, kind = sys.argv[1], sys.argv[2]
spmd.init(backend)
rank = spmd.get_rank()
t = torch.ones(4)
spmd.all_reduce(t)
spmd.all_reduce(t, op=spmd.ReduceOp.MAX)  # both shapes agreed once
if kind == "op":
    x = torch.arange(4.0) * (rank + 1)
    spmd.all_reduce(x, op=spmd.ReduceOp.SUM if rank == 0 else spmd.ReduceOp.MAX)
else:
    x = torch.ones(4, dtype=torch.int32 if rank else torch.float32)
    spmd.all_reduce(x)
spmd.all_reduce(torch.ones(4))  # a matching call after it
print(rank, "result", x.tolist(), flush=True)
spmd.destroy_process_group()
print(rank, "clean exit", flush=True)
