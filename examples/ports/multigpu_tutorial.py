# ruff: noqa: I001  (the ported import lines carry their torch original as a trailing comment)
"""The pattern of pytorch/examples' DDP tutorial series (multigpu.py), on CPU: mp.spawn, env:// by hand.

    python examples/ports/multigpu_tutorial.py --epochs 2

Ported from torch.distributed by changing the lines marked ``# port:`` only
(each names the torch line it replaces); examples/ports/README.md lists the five ports.
"""

import argparse
import json
import os

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from spmd import destroy_process_group, init_process_group  # port: from torch.distributed import destroy_process_group, init_process_group
from spmd.parallel import DistributedDataParallel as DDP  # port: from torch.nn.parallel import DistributedDataParallel as DDP


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ.setdefault("MASTER_PORT", "12355")
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id):
        self.gpu_id = gpu_id
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model, device_ids=None)  # the tutorial passes [gpu_id] on GPUs

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def train(self, max_epochs):
        losses = []
        for epoch in range(max_epochs):
            self.train_data.sampler.set_epoch(epoch)
            for source, targets in self.train_data:
                losses.append(self._run_batch(source, targets))
        return losses


def main(rank, world_size, total_epochs, batch_size):
    ddp_setup(rank, world_size)
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset))
    losses = Trainer(model, loader, optimizer, rank).train(total_epochs)
    weights = [round(w, 6) for w in model.weight.flatten().tolist()[:4]]
    print("RESULT " + json.dumps({"rank": rank, "losses": losses[-3:], "weights": weights}), flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    world_size = 2
    mp.spawn(main, args=(world_size, args.epochs, args.batch_size), nprocs=world_size)
