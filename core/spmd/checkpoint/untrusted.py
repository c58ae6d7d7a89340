"""Primitives for reading a checkpoint directory as untrusted input: strict JSON and safe relative names.

A checkpoint may come from anywhere (a shared bucket, a download), so what
it holds is checked before it is believed: JSON objects may not repeat a key
or nest without bound, and a path it names may not leave its directory.
"""

from __future__ import annotations

import json
import re
from typing import Any

from spmd.checkpoint.errors import CheckpointError

#: The deepest nesting of lists and objects a checkpoint's JSON may have (spmd's own nests a few levels).
MAX_NESTING = 64
#: A path component a checkpoint may name: no separators, no leading dot (so no ``.``/``..``), no control bytes.
SAFE_NAME = re.compile(r"[A-Za-z0-9_@~+=,-][A-Za-z0-9_.@~+=,-]*")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a damaged field may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def strict_loads(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Parse JSON that may not repeat a key in one object nor nest deeper than ``MAX_NESTING``."""
    try:
        doc = json.loads(bytes(data), object_pairs_hook=_unique)
    except _DuplicateKey as duplicate:
        raise CheckpointError(
            f"{where}: the key {show(duplicate.key)} appears twice in one object (which one counts is ambiguous); "
            "the file is damaged or was not written by spmd"
        ) from None
    except RecursionError:
        raise CheckpointError(f"{where} nests lists or objects deeper than {MAX_NESTING} levels; it is damaged") from None
    except ValueError as error:  # UnicodeDecodeError included
        raise CheckpointError(f"{where} is not valid JSON ({error}); the checkpoint is damaged") from None
    check_nesting(doc, where)
    return doc


def check_nesting(doc: Any, where: str) -> None:
    """Refuse JSON data nested deeper than ``MAX_NESTING`` (later code walks it recursively)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_NESTING:
            raise CheckpointError(f"{where} nests lists or objects deeper than {MAX_NESTING} levels; it is damaged")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def check_relative(path: str, where: str = "checkpoint") -> list[str]:
    """The components of a ``/``-separated path inside a checkpoint; an error for ``..``, absolute or odd names."""
    parts = path.split("/") if isinstance(path, str) else []
    if not parts or not all(SAFE_NAME.fullmatch(part) for part in parts):
        raise CheckpointError(
            f"{where}: the path {show(path)} is not a plain name inside the checkpoint directory (no '..', no "
            "absolute paths, no leading dots or unusual characters); the checkpoint is damaged or hostile"
        )
    return parts


def check_range(where: str, size: int, offset: int, length: int) -> None:
    """Refuse a read of ``length`` bytes at ``offset`` that is not inside a ``size``-byte file (before allocating it)."""
    if offset < 0 or length < 0 or offset + length > size:
        raise CheckpointError(
            f"{where}: bytes {offset}-{offset + length} were asked for, outside the file's {size}; "
            "the checkpoint is damaged or truncated"
        )
