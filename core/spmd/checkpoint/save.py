"""``save``: every rank writes its share of the chunks in parallel, rank 0 commits ``metadata.json`` last.

A save is two phases. ``prepare`` (in the caller's thread) flattens the state
dict, agrees on the plan with one exchange of small descriptions, and takes
the tensors this rank writes (for ``async_save``: copies into staging
buffers). ``execute`` writes this rank's safetensors file under a fresh data
directory, exchanges the outcome, and rank 0 commits by replacing
``metadata.json`` atomically, then hands the data of older saves to the
background remover (``cleanup``). Rank 0 holds the id's claim (``claim``)
from before the plan's exchange until after the commit, so a second saver
of the same id fails at once instead of deleting this one's data.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.checkpoint.claim import CheckpointInUseError, Claim, take
from spmd.checkpoint.cleanup import remove_later, run_later
from spmd.checkpoint.flatten import json_value, leaves
from spmd.checkpoint.leftovers import sweep_siblings
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
from spmd.checkpoint.pending import wait_pending
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
from spmd.checkpoint.schema import parse_metadata
from spmd.checkpoint.stateful import expand_stateful
from spmd.checkpoint.storage import Storage, checkpoint_location, open_storage
from spmd.errors import first_line

log = logging.getLogger("spmd.checkpoint")

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
    #: Rank 0's claim on the checkpoint id (held until the commit or the rollback) and the storage it took it on.
    claim: Claim | None = None
    storage: Storage | None = None

    def release(self) -> None:
        """Drop the claim (rank 0; a no-op elsewhere and after the first call)."""
        claim, self.claim = self.claim, None
        if claim is not None:
            claim.release()


@dataclass
class Refusal:
    """A rank's answer in the plan's exchange when it cannot take part: why, and whether another save holds the id."""

    text: str
    in_use: bool = False


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
    """Flatten, claim the id (rank 0), agree on the plan (one exchange), and take the data this rank writes.

    A rank whose state dict cannot be saved (a value that is not JSON, a dtype
    safetensors lacks), or a rank 0 that finds the id claimed by another
    save, says so in the exchange, so every rank raises instead of the
    others waiting for it.
    """
    mine: Any
    local_error: Exception | None = None
    job = SaveJob(str(checkpoint_id), "", WritePlan({}, {}))
    try:
        descs, local, values = _describe(state_dict, ranks.rank)
        data_dir = f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}"
        if ranks.rank == 0:
            job.storage = open_storage(job.checkpoint_id)
            job.claim = take(job.storage, job.checkpoint_id, data_dir)
        mine = (data_dir, descs)
    except CheckpointInUseError as error:
        local_error, mine = error, Refusal(str(error), in_use=True)
    except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
        local_error, mine = error, Refusal(f"rank {ranks.rank}: {type(error).__name__}: {error}")
    try:
        gathered = ranks.gather(mine)
    except BaseException:
        job.release()
        raise
    refused = [g for g in gathered if isinstance(g, Refusal)]
    if refused:
        job.release()
        if local_error is not None and ranks.size == 1:
            raise local_error
        if any(r.in_use for r in refused):
            raise CheckpointInUseError(next(r.text for r in refused if r.in_use)) from local_error
        text = "; ".join(r.text for r in refused)
        raise CheckpointError(f"save to {checkpoint_id!r} refused, nothing written: {text}") from local_error
    try:
        job.plan = plan_writes([d for _, d in gathered])
    except BaseException:
        job.release()
        raise
    job.data_dir, job.values = gathered[0][0], values
    try:
        for key, box in job.plan.chunks_of(ranks.rank):
            job.tensors.append((key, box, stage(key, box, local[key])))
    except Exception as error:  # noqa: BLE001 - reported to every rank by execute, then raised
        job.tensors.clear()
        job.failed = f"rank {ranks.rank} staging {key!r}: {type(error).__name__}: {error}"
    return job


def data_file(data_dir: str, rank: int) -> str:
    """This rank's safetensors file in the save's data directory."""
    return f"{data_dir}/rank-{rank:05d}.safetensors"


def execute(job: SaveJob, ranks: Ranks, storage: Storage | None = None) -> Metadata | None:
    """Write this rank's file, exchange outcomes, commit on rank 0; every rank raises if any rank failed.

    A commit that happened is reported as one on every rank: a rank whose
    exchange fails (a peer died) looks at ``metadata.json``, and if it names
    this save, the save is committed and returns normally.
    """
    try:
        return _execute(job, ranks, storage if storage is not None else job.storage)
    finally:
        job.release()


def _execute(job: SaveJob, ranks: Ranks, storage: Storage | None) -> Metadata | None:
    path = data_file(job.data_dir, ranks.rank)
    outcome: Any = job.failed
    if outcome is None:
        try:
            storage = storage if storage is not None else open_storage(job.checkpoint_id)
            named = [(chunk_name(key, box, job.plan.tensors[key].shape), data) for key, box, data in job.tensors]
            outcome = write_file(storage, path, named) if named else {}
        except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
            outcome = f"rank {ranks.rank} writing {path}: {type(error).__name__}: {error}"
    try:
        outcomes = ranks.gather(outcome)
    except Exception as error:
        _exchange_failed(job, ranks, storage, error)
        return None
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
            if job.claim is not None:
                job.claim.verify()  # another saver took the id over: committing would name data it may delete
            storage.write_atomic(METADATA_FILE, metadata.to_json())
        except Exception as error:  # noqa: BLE001 - reported to every rank, then raised
            metadata, commit_error = None, f"rank 0 committing {METADATA_FILE}: {type(error).__name__}: {error}"
            _discard(storage, job)
        else:  # committed: the new metadata names job.data_dir, so nothing after this may remove it
            _remove_superseded(storage, job.data_dir, job.claim.spared if job.claim is not None else ())
            job.release()
            checkpoint_id = job.checkpoint_id
            run_later(lambda: sweep_siblings(checkpoint_id))
    try:
        committed = ranks.gather(commit_error)
    except Exception as error:
        if metadata is not None:  # rank 0 committed; a peer that died since cannot undo that
            log.warning("save to %r committed; the ranks' last exchange failed after it: %s", job.checkpoint_id,
                        first_line(error))
            return metadata
        _exchange_failed(job, ranks, storage, error)
        return None
    failures += [c for c in committed if c]
    if failures:
        raise CheckpointError(
            f"save to {job.checkpoint_id!r} failed and was rolled back; the last complete checkpoint there, "
            f"if any, is unchanged. {'; '.join(failures)}"
        )
    return metadata


def is_committed(storage: Storage | None, job: SaveJob) -> bool:
    """Whether ``metadata.json`` at the job's checkpoint names the job's data directory (its commit happened)."""
    try:
        storage = storage if storage is not None else open_storage(job.checkpoint_id)
        return parse_metadata(storage.read(METADATA_FILE)).data_dir == job.data_dir
    except Exception:  # noqa: BLE001 - no readable metadata naming this save: not committed
        return False


def _exchange_failed(job: SaveJob, ranks: Ranks, storage: Storage | None, error: Exception) -> None:
    """The ranks could not exchange outcomes (a peer died or gave up): return if rank 0's commit is there, else raise."""
    if is_committed(storage, job):
        log.warning("save to %r: rank %d lost its peers (%s), but rank 0's commit is there: the save is complete",
                    job.checkpoint_id, ranks.rank, first_line(error))
        return
    if ranks.rank == 0:
        _discard(storage, job)
    raise CheckpointError(
        f"save to {job.checkpoint_id!r} failed on rank {ranks.rank}: the exchange between the ranks failed "
        f"({type(error).__name__}: {first_line(error)}) and {METADATA_FILE} does not name this save, so the last "
        "complete checkpoint there, if any, is unchanged; save again once every rank is up"
    ) from error


def _remove_superseded(storage: Storage, data_dir: str, spared: tuple[str, ...] = ()) -> None:
    """Hand the older saves' data directories (not ``spared``) to the background cleanup; a failure leaves them to the next save."""
    try:
        remove_later(storage, [n for n in storage.listdir() if is_data_dir(n) and n != data_dir and n not in spared])
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
    wait_pending()
    ranks = Ranks(process_group)
    job = prepare(expand_stateful(state_dict), checkpoint_location(checkpoint_id, storage_writer, "save"), ranks)
    execute(job, ranks)
