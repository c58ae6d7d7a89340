"""What a killed save left behind: the data directories of checkpoint ids that no commit ever named.

A save killed before its commit leaves ``ID/data-<hex>/`` and no
``ID/metadata.json``. Another save of the same id removes it at its commit (it
holds the id's claim, so no other writer's data is there). A job that moved on
to the next id (``ckpt/step-12`` after a kill in ``ckpt/step-8``) never saves
that id again, so each commit also looks at the committed checkpoint's
siblings, in the background: a sibling whose only entries are data directories
of rank files (and a claim, temporary files) has no commit; if no live save
claims it, its data directories are removed. Nothing else is ever touched.
"""

from __future__ import annotations

import os
import re

from spmd.checkpoint.claim import CLAIM_FILE, claim_ttl, read_holder
from spmd.checkpoint.metadata import METADATA_FILE, is_data_dir
from spmd.checkpoint.storage import Storage, open_storage, scheme_of

#: The files a save writes into its data directory.
RANK_FILE = re.compile(r"rank-\d{5}\.safetensors")
#: The temporary files of a commit or a claim that a kill cut short.
TEMPORARY = re.compile(rf"({re.escape(METADATA_FILE)}|{re.escape(CLAIM_FILE)})\.[0-9a-f]{{32}}\.tmp")


def parent_of(url: str) -> tuple[str, str] | None:
    """The URL of the directory that holds checkpoint ``url`` and the checkpoint's name in it; None at a root."""
    if scheme_of(url) == "file":
        path = os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
        parent, name = os.path.split(path)
        return (parent, name) if name else None
    head, _, rest = url.partition("://")
    rest = rest.rstrip("/")
    if "/" not in rest.lstrip("/"):
        return None  # a bucket or the file system's root: no siblings to look at
    parent, name = rest.rsplit("/", 1)
    return f"{head}://{parent}", name


def abandoned_data(parent: Storage, name: str) -> list[str]:
    """The data directories of ``parent``'s entry ``name`` if it is a checkpoint id that was never committed."""
    entries = parent.listdir(name)
    if not entries or METADATA_FILE in entries:
        return []
    data = [e for e in entries if is_data_dir(e)]
    if not data or any(not is_data_dir(e) and e != CLAIM_FILE and not TEMPORARY.fullmatch(e) for e in entries):
        return []
    for directory in data:
        if not all(RANK_FILE.fullmatch(f) for f in parent.listdir(f"{name}/{directory}")):
            return []
    return data


def remove_if_abandoned(parent: Storage, name: str, ttl: float) -> list[str]:
    """Remove the data of entry ``name`` if it was never committed and no live save claims it; the names removed."""
    data = abandoned_data(parent, name)
    if not data:
        return []
    holder = read_holder(parent, f"{name}/{CLAIM_FILE}")
    if holder is not None and holder.stale(ttl) is None:
        return []  # a live save is writing it
    if parent.exists(f"{name}/{METADATA_FILE}"):
        return []  # committed since it was listed (the claim is dropped only after the commit)
    for directory in data:
        parent.remove(f"{name}/{directory}")
    again = read_holder(parent, f"{name}/{CLAIM_FILE}")
    if holder is not None and again is not None and again.token == holder.token:
        parent.remove(f"{name}/{CLAIM_FILE}")
    return [f"{name}/{d}" for d in data]


def sweep_siblings(url: str) -> list[str]:
    """Remove the never-committed data of the checkpoint ids beside ``url``; the paths removed (run it in the background)."""
    where = parent_of(url)
    if where is None:
        return []
    parent_url, own = where
    parent = open_storage(parent_url)
    ttl = claim_ttl()
    removed = []
    for name in parent.listdir():
        if name == own:
            continue
        try:
            removed += remove_if_abandoned(parent, name, ttl)
        except Exception:  # noqa: BLE001 - an entry that cannot be read (permissions, a file) is not ours to judge
            continue
    return removed
