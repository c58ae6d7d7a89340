"""Checkpoints for examples/train.py: ``--save-every K --checkpoint-dir DIR`` and ``--resume``.

Every K steps the job saves model, optimizer, the step and each rank's data
RNG to ``DIR/step-NNNNNN`` with ``spmd.checkpoint.async_save`` (training goes
on while it writes); ``--resume`` loads the latest committed one and
continues from its step. The data RNG is a (world, n) tensor sharded by rank,
so a resume on the same world size draws the batches the uninterrupted run
would have drawn; a resume on another world size (a job restarted on the
nodes that are left) loads model, optimizer and step, and each rank keeps
its own freshly seeded data RNG.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

import torch

import spmd
import spmd.checkpoint as dcp

_pending: list[dcp.SaveFuture] = []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The three checkpoint flags."""
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every K steps (0: never)")
    parser.add_argument("--checkpoint-dir", default="checkpoints/train", help="where step-NNNNNN checkpoints go")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")


def latest(directory: str) -> str | None:
    """The committed checkpoint with the highest step in ``directory``, if any."""
    steps = [n for n in os.listdir(directory) if re.fullmatch(r"step-\d+", n)] if os.path.isdir(directory) else []
    done = [n for n in sorted(steps) if os.path.exists(os.path.join(directory, n, "metadata.json"))]
    return os.path.join(directory, done[-1]) if done else None


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, step: int) -> dict[str, Any]:
    mesh = spmd.init_device_mesh("cpu", (spmd.get_world_size(),))
    rng = spmd.DTensor.from_local(generator.get_state().unsqueeze(0), mesh, [spmd.Shard(0)])
    model_sd, optim_sd = dcp.get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step, "data_rng": rng}


def resume(args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> int:
    """Load the latest checkpoint when ``--resume`` is given; return the step to start from."""
    path = latest(args.checkpoint_dir) if args.resume else None
    if path is None:
        return 0
    state = _state(model, optimizer, generator, 0)
    with open(os.path.join(path, "metadata.json")) as f:
        saved_world = json.load(f)["tensors"]["data_rng"]["shape"][0]
    same_world = saved_world == spmd.get_world_size()
    if not same_world:  # one RNG state per rank of the saving job: no row is this rank's
        del state["data_rng"]
    dcp.load(state, checkpoint_id=path)
    dcp.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if same_world:
        generator.set_state(state["data_rng"].to_local()[0].contiguous())
    if spmd.get_rank() == 0:
        note = "" if same_world else f" (saved by {saved_world} ranks: each rank's data RNG starts afresh)"
        print(f"resumed from {path} at step {state['step']}{note}", flush=True)
    return int(state["step"])


def maybe_save(args: argparse.Namespace, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               generator: torch.Generator) -> None:
    """After step ``step`` (0-based): start an async save every ``--save-every`` steps and at the last step."""
    done = step + 1
    if not args.save_every or (done % args.save_every and done != args.steps):
        return
    path = os.path.join(args.checkpoint_dir, f"step-{done:06d}")
    _pending[:] = [dcp.async_save(_state(model, optimizer, generator, done), checkpoint_id=path)]


def finish() -> None:
    """Wait for the last async save (raises if it failed)."""
    for future in _pending:
        future.result()
