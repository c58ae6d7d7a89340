"""What the torch-path mirror modules share: the ``__getattr__`` that answers a torch name spmd lacks.

The mirror modules (``spmd.device_mesh``, ``spmd.tensor.parallel``, ``spmd.fsdp``,
``spmd.pipelining``, ...) only re-export; each lists the torch names it does
not have yet, with the closest spmd way, and installs ``missing_names`` as its
module ``__getattr__`` so ``from spmd.X import name`` says so instead of
raising a bare ImportError.
"""

from __future__ import annotations

import importlib
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
        raise NotYetInSpmdError(f"{torch_module}.{name} is not yet in spmd; the closest spmd way is {hint}")

    return __getattr__
