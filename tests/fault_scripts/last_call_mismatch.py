"""A job with one mismatched collective, then a matching one, then the end: destroy_process_group must find the
mismatch and raise, so the job exits non-zero (run by test_first_call_agreement.py).

    python last_call_mismatch.py BACKEND KIND    # KIND: op (SUM against MAX, both agreed before), dtype (a first
                                                 # call of a new shape: float32 against int32, the same bytes) or
                                                 # p2p (rank 0 sends float32, rank 1 receives int32: the same bytes)
"""

import os
import sys

import torch

import spmd

if "SPMD_FAULT_OUT" in os.environ:  # under mpiexec: each rank's output into files of its own
    rank_of_job = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    for fd, kind in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{os.environ['SPMD_FAULT_OUT']}.{rank_of_job}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)

backend, kind = sys.argv[1], sys.argv[2]
spmd.init(backend)
rank = spmd.get_rank()
t = torch.ones(4)
spmd.all_reduce(t)
spmd.all_reduce(t, op=spmd.ReduceOp.MAX)  # both shapes agreed once
if kind == "op":
    x = torch.arange(4.0) * (rank + 1)
    spmd.all_reduce(x, op=spmd.ReduceOp.SUM if rank == 0 else spmd.ReduceOp.MAX)
elif kind == "dtype":
    x = torch.ones(4, dtype=torch.int32 if rank else torch.float32)
    spmd.all_reduce(x)
else:
    x = torch.ones(4) if rank == 0 else torch.zeros(4, dtype=torch.int32)
    spmd.send(x, dst=1) if rank == 0 else spmd.recv(x, src=0)
spmd.all_reduce(torch.ones(4))  # a matching call after it
print(rank, "result", x.tolist(), flush=True)
spmd.destroy_process_group()
print(rank, "clean exit", flush=True)
