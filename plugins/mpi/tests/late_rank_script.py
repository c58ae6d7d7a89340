"""Under mpiexec -n 2, rank 1 is 10 s late to spmd.init (WHAT=init) or to its first use of a new group
(WHAT=group); spmd's timeout is 4 s. Each rank prints how long it took and what it raised (run by
test_mpi_startup.py): MPI's own calls have no timeout, so spmd's must end the wait and name rank 1."""

import os
import sys
import time

import torch

import spmd

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
what = sys.argv[1]
start = time.monotonic()
if what == "init" and rank == 1:
    time.sleep(10)
try:
    spmd.init("mpi", timeout=4)
    if what == "group":
        group = spmd.new_group([0, 1])
        if rank == 1:
            time.sleep(10)
        spmd.all_reduce(torch.ones(2), group=group)
    print(f"RESULT {rank} ok", flush=True)
except spmd.SpmdError as error:
    print(f"RESULT {rank} {time.monotonic() - start:.2f} {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    sys.stdout.flush()
    os._exit(3)  # (without MPI_Finalize: the late rank may still be inside MPI)
