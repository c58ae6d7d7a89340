"""The exceptions spmd raises: each names the problem, its cause and the way out."""

from __future__ import annotations


class SpmdError(RuntimeError):
    """Base class of every error spmd raises on purpose."""


class NotInitializedError(SpmdError):
    """A collective or query ran before ``spmd.init`` (or after ``destroy_process_group``)."""


class NotProvidedError(SpmdError, LookupError):
    """No loaded plugin provides the name asked for (a backend, strategy, schedule, storage scheme, ...)."""


class BackendNotFoundError(NotProvidedError):
    """The backend name asked for is not provided by any installed, loadable plugin."""


class BackendUnavailableError(SpmdError):
    """The backend's plugin is installed but its native dependency cannot be used here."""


class PluginConflictError(SpmdError):
    """Two plugins provide the same name and neither declares that it overrides the other."""


class PluginSpecError(SpmdError, TypeError):
    """A plugin's hook returned something that is not what the hook's specification asks for."""


class CollectiveTimeoutError(SpmdError, TimeoutError):
    """A collective or point-to-point operation did not complete within its timeout."""


class CollectiveError(SpmdError):
    """A backend reported a failure while running an operation."""


class CollectiveDesyncError(SpmdError):
    """Ranks of a group called different collectives (or shapes/dtypes) at one sequence number."""


class RendezvousUnreachableError(SpmdError, ConnectionError):
    """The rendezvous service of ``spmd run`` (an etcd cluster, the agents' store) cannot be reached or refused a request."""


class WaitTimeoutError(SpmdError, TimeoutError):
    """A condition ``spmd.polling.wait_until`` polled for did not hold within its timeout."""


class SettingError(SpmdError, ValueError):
    """An ``SPMD_*`` environment variable holds a value its setting does not accept (``spmd.settings``)."""


class RendezvousAuthError(SpmdError, PermissionError):
    """The rendezvous service refused this agent's credentials (a wrong password, an unknown user, a missing permission)."""


class NotYetInSpmdError(SpmdError, ImportError):
    """A torch.distributed name that spmd's mirror module does not provide yet; the message names the closest spmd way.

    An ImportError, so ``from spmd.tensor.experimental import register_sharding``
    fails at the import line with this message rather than a bare ImportError.
    """


class MissingDependencyError(SpmdError, ImportError):
    """An optional part of spmd needs a package that is not installed; the message names the pip extra."""


class WorkerTimeoutError(SpmdError, TimeoutError):
    """A job's workers were not placed, started or finished within the time they were given (e.g. on a full Ray cluster)."""


class WorkerFailedError(SpmdError):
    """A worker of a job raised or died: ``rank`` names it, the message says what it raised and what was tried."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # picklable with its rank (Ray ships errors between processes)
        return type(self), (str(self), self.rank)


def first_line(error: BaseException) -> str:
    """An error's first line (C++ errors from torch carry a stack dump after it), or its type's name."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def timeout_error(description: str, limit: float | None, detail: str = "") -> CollectiveTimeoutError:
    """The error for an operation that outlived its timeout (kernel- or backend-detected)."""
    within = f"within {limit:.1f} s" if limit is not None else "in time"
    suffix = f" ({detail})" if detail else ""
    return CollectiveTimeoutError(
        f"{description} did not complete {within}{suffix}. A peer rank may have skipped this "
        "call, died, or be stuck elsewhere; check that every rank of the group reaches the "
        "same collectives in the same order, or raise the timeout (timeout= on the op, "
        "new_group(timeout=...), spmd.init(timeout=...))"
    )
