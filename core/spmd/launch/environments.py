"""Builtin plugin: detect how this process was launched (torchrun/spmd run, mpiexec, srun, Kubeflow).

Each environment reads rank, world size and the rendezvous master from the
variables its launcher sets; ``spmd.init()`` without arguments asks them in
priority order and uses the first that detects its launcher.
"""

from __future__ import annotations

import os
import re
import socket
import zlib
from collections.abc import Iterable

from spmd import hookspecs
from spmd.errors import SpmdError
from spmd.markers import hookimpl
from spmd.registry import Registry
from spmd.specs import ClusterEnvironment, LaunchInfo

DEFAULT_MASTER_PORT = 29500


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def _master(default_addr: str) -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR") or default_addr
    port = int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    return addr, port


class TorchrunEnvironment:
    """torchrun and ``spmd run``: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT."""

    name = "torchrun"
    priority = 100

    def detect(self) -> bool:
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ

    def launch_info(self) -> LaunchInfo:
        addr, port = _master("127.0.0.1")
        return LaunchInfo(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=_env_int("LOCAL_RANK") or 0,
            master_addr=addr,
            master_port=port,
        )


def job_port(job_key: str) -> int:
    """A store port every process of one job derives alike, so that two jobs on a node differ.

    In 15000-29999: below Linux's ephemeral range, where outgoing connections take ports.
    """
    return 15000 + zlib.crc32(job_key.encode()) % 15000


class MpiEnvironment:
    """mpiexec of Open MPI (OMPI_COMM_WORLD_*), MPICH/Hydra and Intel MPI (PMI_*), or PMIx.

    MPI does not name a rendezvous master: MASTER_ADDR/MASTER_PORT if set.
    Otherwise the master is localhost (one node; multi-node jobs set
    MASTER_ADDR) and the port is derived from the job, so that concurrent
    mpiexec jobs on one node do not collide: from the PMIx namespace where the
    launcher sets one (Open MPI, and the same on every node), else from the
    parent process, the launcher's per-node proxy (Hydra), which all ranks of a
    one-node job share. A multi-node MPICH job without MASTER_PORT uses 29500.
    """

    name = "mpi"
    priority = 50

    def detect(self) -> bool:
        return _env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") is not None

    def launch_info(self) -> LaunchInfo:
        rank = _env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
        size = _env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        local = _env_int("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        if rank is None or size is None:
            raise RuntimeError("mpiexec set a rank but no world size (OMPI_COMM_WORLD_SIZE/PMI_SIZE)")
        addr, port = _master("127.0.0.1")
        if not os.environ.get("MASTER_PORT"):
            namespace = os.environ.get("PMIX_NAMESPACE") or os.environ.get("OMPI_MCA_ess_base_jobid")
            if namespace:
                port = job_port(namespace)
            elif not os.environ.get("MASTER_ADDR"):
                port = job_port(f"{socket.gethostname()}/{os.getppid()}")
        return LaunchInfo(rank, size, local or 0, addr, port)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[03-05,7],gpu1`` -> ``node03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


class SlurmEnvironment:
    """srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; master is the job's first node."""

    name = "slurm"
    priority = 40

    def detect(self) -> bool:
        return "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ

    def launch_info(self) -> LaunchInfo:
        host = first_slurm_host(os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1")
        addr = os.environ.get("MASTER_ADDR") or host
        # Every task of the job derives the same port from the job id unless MASTER_PORT is set.
        port = int(os.environ.get("MASTER_PORT") or job_port(f"slurm/{os.environ.get('SLURM_JOB_ID', '0')}"))
        return LaunchInfo(
            rank=int(os.environ["SLURM_PROCID"]),
            world_size=int(os.environ["SLURM_NTASKS"]),
            local_rank=_env_int("SLURM_LOCALID") or 0,
            master_addr=addr,
            master_port=port,
        )


class KubernetesPyTorchJobEnvironment:
    """Kubeflow's PyTorchJob without an elastic launcher: one process per pod.

    The operator sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (the pod's
    index) inside a pod (KUBERNETES_SERVICE_HOST). With ``spmd run`` inside the
    pod, the launcher's own variables take precedence (higher priority).
    """

    name = "kubernetes-pytorchjob"
    priority = 110  # more specific than the plain torchrun variables it shares

    def detect(self) -> bool:
        return (
            "KUBERNETES_SERVICE_HOST" in os.environ
            and "MASTER_ADDR" in os.environ
            and "RANK" in os.environ
            and "WORLD_SIZE" in os.environ
            and "LOCAL_RANK" not in os.environ  # LOCAL_RANK means a launcher ran inside the pod
        )

    def launch_info(self) -> LaunchInfo:
        addr, port = _master("127.0.0.1")
        return LaunchInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, addr, port)


class KubeflowTrainerEnvironment:
    """Kubeflow Trainer's torch runtime, one process per node: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT.

    The trainer sets torchrun's ``PET_*`` defaults in each node's pod; under
    ``spmd run`` or torchrun the launcher reads them and its workers' own
    variables win (higher priority). This is for ``python train.py`` alone in
    the pod, which is a job of one process per node (PET_NPROC_PER_NODE 1).
    """

    name = "kubeflow-trainer"
    priority = 45

    def detect(self) -> bool:
        return "PET_NNODES" in os.environ and "PET_NODE_RANK" in os.environ

    def launch_info(self) -> LaunchInfo:
        nproc, nnodes = os.environ.get("PET_NPROC_PER_NODE") or "1", os.environ["PET_NNODES"]
        if nproc != "1" or not nnodes.isdigit():
            raise SpmdError(
                f"Kubeflow Trainer asks for PET_NNODES={nnodes} PET_NPROC_PER_NODE={nproc}, but this process was "
                "started alone, without a launcher: run `spmd run train.py` in the pod (it reads the PET_* "
                "variables as torchrun does), or set the trainer's numProcPerNode to 1 and a fixed node count")
        addr = os.environ.get("PET_MASTER_ADDR") or "127.0.0.1"
        port = int(os.environ.get("PET_MASTER_PORT") or DEFAULT_MASTER_PORT)
        return LaunchInfo(int(os.environ["PET_NODE_RANK"]), int(nnodes), 0, addr, port)


@hookimpl
def spmd_cluster_environments() -> Iterable[object]:
    return [TorchrunEnvironment(), KubernetesPyTorchJobEnvironment(), MpiEnvironment(), SlurmEnvironment(),
            KubeflowTrainerEnvironment()]


def _is_environment(env: object) -> bool:
    return isinstance(getattr(env, "name", None), str) and isinstance(getattr(env, "priority", None), int) and all(
        callable(getattr(env, method, None)) for method in ("detect", "launch_info"))


ENVIRONMENTS: Registry[str, ClusterEnvironment] = Registry(
    hookspecs.spmd_cluster_environments, "cluster environment", accepts=_is_environment,
    expected="a ClusterEnvironment (str name, int priority, detect(), launch_info())")


def detect_launch() -> tuple[str, LaunchInfo] | None:
    """Ask every cluster environment plugin, highest priority first; None if none detects."""
    for env in sorted((e.spec for e in ENVIRONMENTS.entries().values()), key=lambda e: -e.priority):
        if env.detect():
            return env.name, env.launch_info()
    return None
