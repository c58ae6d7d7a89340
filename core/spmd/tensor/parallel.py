"""Mirror of ``torch.distributed.tensor.parallel``: spmd's tensor parallelism (home: ``spmd.parallel.tp``)."""

from spmd._mirror import missing_names
from spmd.parallel import tp as _home
from spmd.parallel.tp import *  # noqa: F403 - a mirror re-exports its home's names, whatever they are

__all__ = list(_home.__all__)

#: torch.distributed.tensor.parallel names spmd does not have yet -> the closest spmd way.
MISSING = {
    "PrepareModuleInputOutput": "PrepareModuleInput(...) and PrepareModuleOutput(...) applied to the module one after "
    "the other (parallelize_module(m, mesh, PrepareModuleInput(...)); then again with PrepareModuleOutput(...))",
}

__getattr__ = missing_names(__name__, MISSING)
