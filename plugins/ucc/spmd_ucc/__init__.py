"""spmd-ucc: UCX (through ucxx) behind spmd's Backend contract, as the ``ucc`` backend.

This module never imports ``ucxx``: it loads UCX's libraries, which clash with
the UCX that the MPI wheels bundle under the same names, so it happens only in
the backend factory, the first time a group uses ``ucc`` (see ``probe``).
``spmd plugins`` lists this plugin and ``spmd doctor`` says what to install
even where ucxx is absent.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import spmd
from spmd_ucc import probe


def _available() -> str | None:
    """None where ucxx can be loaded into this process, else why not (``spmd doctor`` prints it)."""
    missing = probe.ucxx_missing()
    if missing is not None:
        return missing
    clashing = probe.mpi_loaded()
    if clashing is not None:
        return (
            f"{clashing} is loaded in this process and its UCX clashes with ucxx's; "
            "use one of the mpi and ucc backends per process"
        )
    return None


def _factory(ctx: spmd.BackendContext) -> spmd.Backend:
    from spmd_ucc.backend import UccBackend

    return UccBackend(ctx)


#: The collectives UccBackend implements natively (kept in step with the class by a test;
#: listed here so that loading the plugin does not import the backend module).
def _where_it_binds(binding: object) -> str:
    """UCX publishes the addresses of its devices (not this host's name), so it needs no binding from spmd."""
    devices = os.environ.get("UCX_NET_DEVICES")
    if devices:
        return f"UCX_NET_DEVICES={devices} (the user's choice)"
    return ("every device UCX finds (UCX_NET_DEVICES unset): its worker address lists each device's own address, "
            "never this host's name, and peers try them in turn; set UCX_NET_DEVICES to pin one")


@spmd.hookimpl
def spmd_backends() -> Iterable[spmd.BackendSpec]:
    return [
        spmd.BackendSpec(
            name="ucc",
            devices=("cpu",),
            factory=_factory,
            priority=5,  # below gloo (10): see README.md, "Priority"
            available=_available,
            backend_class="spmd_ucc.backend:UccBackend",
            description=probe.describe(),
            where_it_binds=_where_it_binds,
        )
    ]
