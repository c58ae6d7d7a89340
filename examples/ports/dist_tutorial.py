"""The pattern of the "Writing Distributed Applications with PyTorch" tutorial: Process per rank, env:// by hand.

    python examples/ports/dist_tutorial.py

Point-to-point (blocking and isend/irecv), all_reduce on a new_group with the
old ``dist.reduce_op`` name, a ring all-reduce made of send/recv, and the
tutorial's synchronous SGD with ``average_gradients``. Ported from
torch.distributed by changing the line marked ``# port:`` only.
"""

import json
import os
from random import Random

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import spmd as dist  # port: import torch.distributed as dist


def run_p2p(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    req = dist.isend(tensor=tensor * 2, dst=1) if rank == 0 else dist.irecv(tensor=tensor, src=0)
    req.wait()
    return tensor.item()


def run_allreduce(rank, size):
    group = dist.new_group([0, 1])
    tensor = torch.ones(1) * (rank + 1)
    dist.all_reduce(tensor, op=dist.reduce_op.SUM, group=group)
    return tensor.item()


def ring_allreduce(send, recv):
    rank, size = dist.get_rank(), dist.get_world_size()
    send_buff, recv_buff, accum = send.clone(), torch.zeros(send.size()), send.clone()
    left, right = ((rank - 1) + size) % size, (rank + 1) % size
    for i in range(size - 1):
        if i % 2 == 0:
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


class Partition:
    def __init__(self, data, index):
        self.data, self.index = data, index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        return self.data[self.index[index]]


class DataPartitioner:
    def __init__(self, data, sizes, seed=1234):
        self.data, self.partitions = data, []
        rng = Random()
        rng.seed(seed)
        indexes = list(range(len(data)))
        rng.shuffle(indexes)
        for frac in sizes:
            part_len = int(frac * len(data))
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run_sgd(rank, size):
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, generator=g), int(torch.randint(0, 4, (1,), generator=g))) for _ in range(128)]
    partition = DataPartitioner(data, [1.0 / size] * size).use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition, batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    epoch_loss = 0.0
    for _ in range(2):
        for data_, target in train_set:
            optimizer.zero_grad()
            loss = F.nll_loss(F.log_softmax(model(data_), dim=1), target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
    return round(epoch_loss, 5)


def run(rank, size):
    ring = torch.zeros(1)
    ring_allreduce(torch.ones(1) * (rank + 1), ring)
    result = {"rank": rank, "p2p": run_p2p(rank, size), "allreduce": run_allreduce(rank, size), "ring": ring.item(), "sgd": run_sgd(rank, size)}
    print("RESULT " + json.dumps(result), flush=True)


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    raise SystemExit(max(p.exitcode for p in processes))
