"""DeviceMesh: an n-dimensional grid of ranks with named dimensions, and one group per dimension.

Mirrors ``torch.distributed.device_mesh``: ranks are laid out row-major (on a
("dp", "tp") mesh of shape (2, 2), rank = 2 * dp + tp), ``mesh["tp"]`` and
``mesh["dp", "tp"]`` are sub-meshes, and ``get_group(dim)`` is the group of the
ranks that differ from this one only along ``dim``. Each dimension's group is
created lazily, on first use, with ``new_group(use_local_synchronization=True)``:
only its members take part and no rank waits on any other to create it.
Unlike torch, ``backend=`` may choose a backend per dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from spmd.comm.group import ProcessGroup
from spmd.comm.init import get_rank, get_world_size, new_group
from spmd.errors import SpmdError

BackendChoice = str | Mapping[str, str] | None


class DeviceMesh:
    """A grid of global ranks (``mesh``: an int tensor) with optional dimension names.

    Build it with ``spmd.init_device_mesh``; the constructor takes the grid
    itself (any layout of distinct world ranks), as torch's does.
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence[Any],
        *,
        mesh_dim_names: Sequence[str] | None = None,
        backend: BackendChoice = None,
        _groups: dict[int, ProcessGroup] | None = None,
    ) -> None:
        ensure_world()
        self._build(device_type, mesh, mesh_dim_names, backend, _groups, get_rank(), get_world_size())

    @classmethod
    def for_planning(cls, mesh: torch.Tensor | Sequence[Any], rank: int, *, device_type: str = "cpu",
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """The grid and ``rank``'s place in it, without a world: what planning reads (local shapes, rules,
        redistribution plans), for tests and what-if questions. Asking it for a group is an error."""
        made = cls.__new__(cls)
        grid = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
        made._build(device_type, grid, mesh_dim_names, None, None, rank, grid.numel())
        made._planning_only = True
        return made

    #: Made by ``for_planning``: a shape without groups.
    _planning_only = False

    def _build(self, device_type: str, mesh: torch.Tensor | Sequence[Any], mesh_dim_names: Sequence[str] | None,
               backend: BackendChoice, _groups: dict[int, ProcessGroup] | None, rank: int, world: int) -> None:
        grid = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
        if grid.ndim == 0:
            grid = grid.reshape(1)
        self.device_type = device_type
        self.mesh = grid
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        _check_names(self.mesh_dim_names, grid.ndim)
        flat = grid.flatten().tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"DeviceMesh: the mesh {grid.tolist()} lists a rank twice; list each rank once")
        outside = [r for r in flat if not 0 <= r < world]
        if outside:
            raise ValueError(f"DeviceMesh: ranks {outside} are outside the world of {world} ranks (0..{world - 1})")
        self._rank = rank
        found = (grid == self._rank).nonzero()
        self._coordinate: tuple[int, ...] | None = tuple(found[0].tolist()) if len(found) else None
        self._backends = _backends_per_dim(backend, self.mesh_dim_names, grid.ndim)
        self._groups: dict[int, ProcessGroup] = dict(_groups or {})
        #: For a sub-mesh: the mesh it was sliced from and which of its dimensions it kept.
        self._parent_dims: tuple[DeviceMesh, list[int]] | None = None

    # -- shape ----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along one dimension."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's position in the grid, or None if it is not in the mesh."""
        return list(self._coordinate) if self._coordinate is not None else None

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (may be omitted on a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank: pass mesh_dim on a {self.ndim}-D mesh")
            mesh_dim = 0
        return self._require_coordinate("get_local_rank")[self._dim_index(mesh_dim)]

    # -- groups ---------------------------------------------------------------------
    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The group of this rank's neighbours along ``mesh_dim``, created on first use."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group: pass mesh_dim on a {self.ndim}-D mesh (or use get_all_groups)")
            mesh_dim = 0
        index = self._dim_index(mesh_dim)
        group = self._groups.get(index)
        if group is None and self._parent_dims is not None:
            parent, kept = self._parent_dims
            group = self._groups[index] = parent.get_group(kept[index])
        if group is None:
            if self._planning_only:
                raise SpmdError(f"DeviceMesh.for_planning({self.mesh.tolist()}) has no groups: it plans, it does not "
                                "communicate; build the mesh with spmd.init_device_mesh inside a world to run collectives")
            coordinate = list(self._require_coordinate("get_group"))
            coordinate[index] = slice(None)  # type: ignore[call-overload]
            ranks = self.mesh[tuple(coordinate)].tolist()
            label = self.mesh_dim_names[index] if self.mesh_dim_names else f"dim{index}"
            group = new_group(
                ranks,
                backend=self._backends[index],
                use_local_synchronization=True,
                group_desc=f"mesh.{label}",  # (new_group adds the ranks: mesh.dp[0,2])
                sort_ranks=False,
            )
            self._groups[index] = group
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(d) for d in range(self.ndim)]

    # -- sub-meshes -----------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over the named dimensions that contains this rank."""
        wanted = (names,) if isinstance(names, str) else tuple(names)
        indices = [self._dim_index(n) for n in wanted]
        if len(set(indices)) != len(indices):
            raise ValueError(f"DeviceMesh: dimension names {list(wanted)} repeat a dimension")
        coordinate = self._require_coordinate("slicing")
        index: list[Any] = [slice(None) if d in indices else c for d, c in enumerate(coordinate)]
        grid = self.mesh[tuple(index)]
        kept = sorted(indices)
        if indices != kept:
            grid = grid.permute([kept.index(i) for i in indices])
        groups = {new: self._groups[old] for new, old in enumerate(indices) if old in self._groups}
        sub = DeviceMesh.__new__(DeviceMesh)
        sub.device_type = self.device_type
        sub.mesh = grid
        sub.mesh_dim_names = tuple(wanted)
        sub._rank = self._rank
        found = (grid == self._rank).nonzero()
        sub._coordinate = tuple(found[0].tolist())
        sub._backends = [self._backends[i] for i in indices]
        sub._groups = groups
        sub._parent_dims = (self, indices)  # a sub-mesh's groups are its parent's: created there, once
        return sub

    def _root(self) -> DeviceMesh:
        """The mesh ``init_device_mesh`` made, that this one was sliced from (itself if not a slice)."""
        mesh = self
        while mesh._parent_dims is not None:
            mesh = mesh._parent_dims[0]
        return mesh

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(
                    f"DeviceMesh has no dimension {mesh_dim!r}; its dimensions are "
                    f"{list(self.mesh_dim_names or [])} (name them with mesh_dim_names=)"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dimension {mesh_dim} is out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def _require_coordinate(self, what: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise ValueError(
                f"DeviceMesh {what}: rank {self._rank} is not in this mesh {self.mesh.tolist()}; "
                "only the mesh's ranks may use it"
            )
        return self._coordinate

    # -- identity -------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, DeviceMesh)
            and self._rank == other._rank  # (always so in one process; planning meshes may stand for other ranks)
            and self.device_type == other.device_type
            and self.mesh_dim_names == other.mesh_dim_names
            and self.mesh.shape == other.mesh.shape
            and bool(torch.equal(self.mesh, other.mesh))
        )

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:  # meshes key DTensor's propagation cache: hash once
            cached = hash((self.device_type, self.mesh_dim_names, tuple(self.mesh.flatten().tolist()), self.shape))
            self.__dict__["_hash"] = cached
        return cached

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


def concatenate_meshes(outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The mesh over ``outer``'s dimensions then ``inner``'s, both slices of one named mesh.

    Placements on it apply left to right, so ``(*outer_placements, Shard(0))``
    chunks the piece ``outer`` already gave this rank: how FSDP shards a
    tensor-parallel parameter over the data-parallel dimension.
    """
    root = outer._root()
    names = (outer.mesh_dim_names or ()) + (inner.mesh_dim_names or ())
    if (
        inner._root() is not root
        or root.mesh_dim_names is None
        or len(names) != outer.ndim + inner.ndim
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"concatenate_meshes: {outer} and {inner} must be slices over distinct named dimensions of one "
            "init_device_mesh(..., mesh_dim_names=...) mesh, e.g. mesh['tp'] and mesh['dp']"
        )
    return root[names]


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    backend_override: Mapping[int | str, Any] | None = None,
    backend: BackendChoice = None,
) -> DeviceMesh:
    """A row-major mesh of every rank in the world with shape ``mesh_shape``.

    ``backend`` is one backend for every dimension (``"gloo"``), or one per
    dimension name (``{"dp": "gloo", "tp": "mpi"}``); unnamed dimensions use
    the world's backends. ``backend_override`` is torch's spelling of the same
    (keys: dimension index or name; values: a backend name or a
    ``(backend, options)`` pair), accepted so torch scripts port unchanged.
    Without a world yet, it first joins one with ``spmd.init_process_group()``
    (launcher environment: ``spmd run``, torchrun, ...), as torch's does.
    """
    ensure_world()
    shape = tuple(int(s) for s in mesh_shape)
    world = get_world_size()
    if not shape or any(s < 1 for s in shape) or math.prod(shape) != world:
        raise ValueError(
            f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape) if shape else 0} ranks but the "
            f"world has {world}; choose a shape whose product is {world}, e.g. ({world},)"
        )
    _check_names(tuple(mesh_dim_names) if mesh_dim_names is not None else None, len(shape))
    if backend_override:
        if backend is not None:
            raise ValueError("init_device_mesh: give backend= or torch's backend_override=, not both")
        backend = _from_backend_override(backend_override, mesh_dim_names, len(shape))
    grid = torch.arange(world, dtype=torch.int64).reshape(shape)
    return DeviceMesh(device_type, grid, mesh_dim_names=mesh_dim_names, backend=backend)


def ensure_world() -> None:
    """Join the job from the launcher's environment if no world exists yet (torch's meshes create the default group)."""
    from spmd.comm.state import is_initialized

    if not is_initialized():
        from spmd.world import init_process_group

        init_process_group()


#: The default 1-D mesh per device type, and the world group it was made in: every DTensor, module and
#: FSDP unit made without a mesh shares its groups (one backend connection set, not one per call); a new
#: world (after destroy_process_group and init) gets a new mesh.
_default_meshes: dict[str, tuple[ProcessGroup, DeviceMesh]] = {}


def default_mesh(device_type: str) -> DeviceMesh:
    """The 1-D mesh over the whole world for ``device_type``: what ``distribute_tensor``, ``fully_shard`` and
    the other mesh-taking calls use when given none (made once per world)."""
    from spmd.comm.state import resolve_group

    world = resolve_group(None)
    cached = _default_meshes.get(device_type)
    if cached is None or cached[0] is not world:
        with torch.device("cpu"):  # the mesh's rank grid, even inside ``with torch.device("meta")``
            cached = _default_meshes[device_type] = (world, init_device_mesh(device_type, (get_world_size(),)))
    return cached[1]


def _from_backend_override(
    override: Mapping[int | str, Any], names: Sequence[str] | None, ndim: int
) -> dict[str, str]:
    """torch's ``{dim: backend or (backend, options)}`` as spmd's ``{name: backend}``."""
    out: dict[str, str] = {}
    for key, value in override.items():
        if isinstance(key, int):
            if names is None or not 0 <= key < ndim:
                raise ValueError(
                    f"init_device_mesh: backend_override key {key} needs mesh_dim_names and a dimension index below {ndim}"
                )
            key = names[key]
        name = value[0] if isinstance(value, tuple) else value
        if name is not None:
            out[key] = name
    return out


def _check_names(names: tuple[str, ...] | None, ndim: int) -> None:
    if names is None:
        return
    if len(names) != ndim:
        raise ValueError(f"DeviceMesh: {len(names)} dimension names {list(names)} for a {ndim}-D mesh; give one name per dimension")
    if len(set(names)) != len(names):
        raise ValueError(f"DeviceMesh: dimension names {list(names)} repeat a name; names must be distinct")


def _backends_per_dim(backend: BackendChoice, names: tuple[str, ...] | None, ndim: int) -> list[Any]:
    if backend is None or isinstance(backend, str):
        return [backend] * ndim
    if names is None:
        raise ValueError("DeviceMesh: a per-dimension backend mapping needs mesh_dim_names")
    unknown = set(backend) - set(names)
    if unknown:
        raise ValueError(f"DeviceMesh: backend= names dimensions {sorted(unknown)} that the mesh lacks (it has {list(names)})")
    return [backend.get(n) for n in names]
