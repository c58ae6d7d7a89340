"""What the torch-path mirror modules share: the ``__getattr__`` that answers a torch name spmd lacks.

The mirror modules (``spmd.device_mesh``, ``spmd.tensor.parallel``, ``spmd.fsdp``,
``spmd.pipelining``, ...) only re-export; each lists the torch names it does
not have yet, with the closest spmd way, and installs ``missing_names`` as its
module ``__getattr__`` so ``from spmd.X import name`` says so instead of
raising a bare ImportError (and ``hasattr`` answers False).
"""

from __future__ import annotations

import dis
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spmd.errors import NotYetInSpmdError


def missing_names(module: str, missing: Mapping[str, str], homes: Sequence[str] = ()) -> Callable[[str], Any]:
    """A module ``__getattr__``: names of ``missing`` raise ``NotYetInSpmdError`` with their hint.

    ``homes`` are spmd modules where a missing name may appear later (work in
    progress elsewhere): once one of them has it, it is returned instead, so
    the mirror picks it up without an edit (docs/porting.md then needs its row
    updated, which tests/test_porting.py reports).
    """

    def __getattr__(name: str) -> Any:
        hint = missing.get(name)
        if hint is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        for home in homes:
            found = getattr(importlib.import_module(home), name, None)
            if found is not None:
                return found
        torch_module = "torch.distributed" + module.removeprefix("spmd")
        message = f"{torch_module}.{name} is not yet in spmd; the closest spmd way is {hint}"
        if not _from_an_import_statement():
            raise AttributeError(message)  # (so hasattr() answers False, as torch's feature checks expect)
        raise NotYetInSpmdError(message)

    return __getattr__


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _from_an_import_statement() -> bool:
    """Whether the attribute lookup in progress is a ``from module import name`` (CPython: the caller's
    current instruction is IMPORT_FROM), rather than ``getattr``/``hasattr``/``module.name``.

    ``from m import x`` turns a module ``__getattr__``'s AttributeError into a
    bare "cannot import name" ImportError, dropping the message; so the import
    statement gets ``NotYetInSpmdError`` (an ImportError that keeps it), and
    everything else an AttributeError with the same message.
    """
    frame = sys._getframe(2)  # (0: this function, 1: the module __getattr__, 2: the code that asked)
    try:
        return frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM
    except (IndexError, AttributeError):  # another interpreter: keep the message, as an import error
        return True
