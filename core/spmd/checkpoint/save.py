"""``save``: every rank writes its share of the chunks in parallel, rank 0 commits ``metadata.json`` last.

A save is two phases. ``prepare`` (in the caller's thread) flattens the state
dict, agrees on the plan with one exchange of small descriptions, and takes
the tensors this rank writes (for ``async_save``: copies into staging
buffers). ``execute`` writes this rank's safetensors file under a fresh data
directory, exchanges the outcome, and rank 0 commits by replacing
``metadata.json`` atomically, then hands the data of older saves to the
background remover (``cleanup``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.checkpoint.cleanup import remove_later
from spmd.checkpoint.flatten import json_value, leaves
from spmd.checkpoint.metadata import (
    DATA_PREFIX,
    METADATA_FILE,
    CheckpointError,
    Chunk,
    Metadata,
    TensorEntry,
    dtype_name,
    is_data_dir,
)
from spmd.checkpoint.planner import (
    Box,
    TensorDesc,
    WritePlan,
    chunk_name,
    local_box,
    placements_label,
    plan_writes,
)
from spmd.checkpoint.ranks import Ranks
from spmd.checkpoint.safetensors_io import write_file
from spmd.checkpoint.stateful import expand_stateful
from spmd.checkpoint.storage import Storage, checkpoint_location, open_storage

#: ``stage(key, box, local) -> cpu tensor``: how the data to write is taken (sync: as is; async: a staging copy).
Stage = Callable[[str, Box, torch.Tensor], torch.Tensor]


@dataclass
class SaveJob:
    """One rank's part of one save: what to write where, and (on rank 0) what to commit."""

    checkpoint_id: str
    data_dir: str
    plan: WritePlan
    tensors: list[tuple[str, Box, torch.Tensor]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    #: Why this rank could not stage its data (out of memory copying to CPU...): its outcome in ``execute``,
    #: so every rank fails the save at once instead of waiting for this one.
    failed: str | None = None


def _local_data(tensor: torch.Tensor) -> torch.Tensor:
    from spmd.tensor.dtensor import DTensor

    if isinstance(tensor, DTensor):
        if any(p.is_partial() for p in tensor.placements):  # pending sums are reduced before saving
            from spmd.tensor.placements import Replicate

            target = [Replicate() if p.is_partial() else p for p in tensor.placements]
            tensor = tensor.redistribute(tensor.device_mesh, target)
        return tensor._local_tensor.detach()  # type: ignore[attr-defined]
    return tensor.detach()


def as_is(key: str, box: Box, local: torch.Tensor) -> torch.Tensor:
    """The sync save's stage: the tensor itself when on CPU (written straight from its memory)."""
    return local if local.device.type == "cpu" else local.to("cpu")


def _describe(state_dict: Mapping[str, Any], rank: int) -> tuple[list[TensorDesc], dict[str, torch.Tensor], dict[str, Any]]:
    descs: list[TensorDesc] = []
    local: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for leaf in leaves(state_dict):
        if isinstance(leaf.value, torch.Tensor):
            local[leaf.key] = _local_data(leaf.value)
            dtype = dtype_name(leaf.value.dtype)
            descs.append(TensorDesc(leaf.key, tuple(leaf.value.shape), dtype, leaf.value.element_size(),
                                    placements_label(leaf.value), local_box(leaf.value)))
        elif rank == 0:
            values[leaf.key] = json_value(leaf.key, leaf.value)
    return descs, local, values


def prepare(state_dict: Mapping[str, Any], checkpoint_id: str, ranks: Ranks, stage: Stage = as_is) -> SaveJob:
    """Flatten, agree on the plan (one exchange), and take the data this rank writes.

    A rank whose state dict cannot be saved (a value that is not JSON, a dtype
    safetensors lacks) says so in the exchange, so every rank raises instead
    of the others waiting for it.
    """
    mine: Any
    local_error: Exception | None = None
    try:
        descs, local, values = _describe(state_dict, ranks.rank)
        mine = (f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}", descs)
    except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
        local_error, mine = error, f"rank {ranks.rank}: {type(error).__name__}: {error}"
    gathered = ranks.gather(mine)
    refused = [g for g in gathered if isinstance(g, str)]
    if refused:
        if local_error is not None and ranks.size == 1:
            raise local_error
        raise CheckpointError(f"save to {checkpoint_id!r} refused, nothing written: {'; '.join(refused)}") from local_error
    plan = plan_writes([d for _, d in gathered])
    job = SaveJob(str(checkpoint_id), gathered[0][0], plan, values=values)
    try:
        for key, box in plan.chunks_of(ranks.rank):
            job.tensors.append((key, box, stage(key, box, local[key])))
    except Exception as error:  # noqa: BLE001 - reported to every rank by execute, then raised
        job.tensors.clear()
        job.failed = f"rank {ranks.rank} staging {key!r}: {type(error).__name__}: {error}"
    return job


def data_file(data_dir: str, rank: int) -> str:
    """This rank's safetensors file in the save's data directory."""
    return f"{data_dir}/rank-{rank:05d}.safetensors"


def execute(job: SaveJob, ranks: Ranks, storage: Storage | None = None) -> Metadata | None:
    """Write this rank's file, exchange outcomes, commit on rank 0; every rank raises if any rank failed."""
    path = data_file(job.data_dir, ranks.rank)
    outcome: Any = job.failed
    if outcome is None:
        try:
            storage = storage if storage is not None else open_storage(job.checkpoint_id)
            named = [(chunk_name(key, box, job.plan.tensors[key].shape), data) for key, box, data in job.tensors]
            outcome = write_file(storage, path, named) if named else {}
        except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
            outcome = f"rank {ranks.rank} writing {path}: {type(error).__name__}: {error}"
    outcomes = ranks.gather(outcome)
    failures = [o for o in outcomes if isinstance(o, str)]
    metadata = None
    commit_error = None
    if failures:
        if ranks.rank == 0:
            _discard(storage, job)
    elif ranks.rank == 0:
        assert storage is not None
        try:
            metadata = _metadata(job, outcomes)
            storage.write_atomic(METADATA_FILE, metadata.to_json())
        except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
            commit_error = f"rank 0 committing {METADATA_FILE}: {type(error).__name__}: {error}"
            _discard(storage, job)
        else:  # committed: the new metadata names job.data_dir, so nothing after this may remove it
            _remove_superseded(storage, job.data_dir)
    committed = ranks.gather(commit_error)
    failures += [c for c in committed if c]
    if failures:
        raise CheckpointError(
            f"save to {job.checkpoint_id!r} failed and was rolled back; the last complete checkpoint there, "
            f"if any, is unchanged. {'; '.join(failures)}"
        )
    return metadata


def _remove_superseded(storage: Storage, data_dir: str) -> None:
    """Hand the older saves' data directories to the background cleanup; a failure leaves them to the next save."""
    try:
        remove_later(storage, [n for n in storage.listdir() if is_data_dir(n) and n != data_dir])
    except Exception:  # noqa: BLE001 - the save is committed; garbage that stays goes at the next commit
        pass


def _discard(storage: Storage | None, job: SaveJob) -> None:
    """Remove a failed save's data directory (what other ranks wrote into it too)."""
    try:
        (storage if storage is not None else open_storage(job.checkpoint_id)).remove(job.data_dir)
    except Exception:  # noqa: BLE001 - the save's own error is the one to report; leftovers go at the next save
        pass


def _metadata(job: SaveJob, outcomes: list[dict[str, tuple[int, int]]]) -> Metadata:
    tensors = {key: TensorEntry(d.shape, d.dtype, d.placements) for key, d in sorted(job.plan.tensors.items())}
    for (key, box), rank in sorted(job.plan.writers.items()):
        name = chunk_name(key, box, job.plan.tensors[key].shape)
        begin, end = outcomes[rank][name]
        tensors[key].chunks.append(Chunk(box[0], box[1], data_file(job.data_dir, rank), name, begin, end))
    return Metadata(job.data_dir, tensors, job.values, world_size=len(outcomes))


def save(
    state_dict: Mapping[str, Any],
    checkpoint_id: str | os.PathLike | None = None,
    *,
    storage_writer: Any = None,
    process_group: Any = None,
) -> None:
    """Save ``state_dict`` (DTensors, plain tensors, JSON values) to ``checkpoint_id``, every rank in parallel.

    A top-level value that is ``Stateful`` (a module, an optimizer, any object
    with ``state_dict``/``load_state_dict``) is saved as its ``state_dict()``,
    as torch's DCP does. ``storage_writer=FileSystemWriter(path)`` is torch's
    spelling of ``checkpoint_id=path``.

    Every rank of ``process_group`` (the world by default; this process alone
    before ``spmd.init``) must call it. A replicated value is written once;
    the writers spread over the ranks that hold it. The save becomes visible
    in one step when rank 0 replaces ``metadata.json``; a save that fails on
    any rank raises on every rank and leaves the previous checkpoint intact.

        spmd.checkpoint.save({"model": model.state_dict(), "step": 100}, checkpoint_id="ckpt/step-100")
    """
    from spmd.checkpoint.async_save import wait_pending

    wait_pending()
    ranks = Ranks(process_group)
    job = prepare(expand_stateful(state_dict), checkpoint_location(checkpoint_id, storage_writer, "save"), ranks)
    execute(job, ranks)
