"""spmd as torch.distributed's process group: torch's API, DDP and DistributedSampler on spmd backends."""

from __future__ import annotations

import pytest

from spmd.comm.registry import backends
from spmd.testing.interop import TorchInteropSuite


def _usable(name: str) -> bool:
    try:
        return backends().get(name).spec.unavailable_reason() is None
    except Exception:  # noqa: BLE001 - not installed
        return False


class TestGlooInterop(TorchInteropSuite):
    backend = "gloo"


@pytest.mark.skipif(not _usable("ucc"), reason="spmd-ucc is not usable here")
class TestUccInterop(TorchInteropSuite):
    backend = "ucc"
