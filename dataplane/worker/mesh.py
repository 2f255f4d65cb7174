"""Replica groups and write-back leaders from a named ``DeviceMesh``.

Ranks that differ only in non-data-parallel dims (tensor, context, pipeline parallel, ...) train on
the same rows: they form one replica group, and its leader is the rank at coordinate 0 of every
such dim. For a mesh ``("dp", "cp", "tp")`` the replica group of a rank is its ``cp x tp`` sub-mesh.

Leadership never depends on whether a broadcast is worth it: a worker that returns no replica group
on a TP-only mesh (to skip the broadcast) would otherwise make every TP sibling a writer of the same
keys, which some stores reject (Mooncake's duplicate-writer -601) and all of them pay for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from dataplane.errors import InvalidArgument

__all__ = ["DeviceMeshReplicaMixin", "is_leader_from_mesh", "replica_dims", "replica_group_from_mesh"]


def replica_dims(mesh: Any, dp_dims: Sequence[str] = ("dp",)) -> list[str]:
    """Names of the mesh dims that are not data parallel (checked against the mesh's names)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise InvalidArgument(
            "the DeviceMesh needs named dims, e.g. init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    unknown = [d for d in dp_dims if d not in names]
    if unknown:
        raise InvalidArgument(f"dp_dims {unknown} are not dims of the mesh {list(names)}; name its data-parallel dims")
    return [d for d in names if d not in dp_dims]


def replica_group_from_mesh(mesh: Any, dp_dims: Sequence[str] = ("dp",)) -> Any | None:
    """The process group of this rank's replica siblings, or None when every replica dim has size 1.

    One non-trivial replica dim reuses the mesh's own group. Several are flattened with
    ``dist.new_subgroups_by_enumeration``, a collective every rank of the default group must call
    (once: cache the result, as :class:`DeviceMeshReplicaMixin` does).

    Example (on every rank of 8)::

        mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        group = replica_group_from_mesh(mesh)  # the 4 ranks of this rank's cp x tp sub-mesh
    """
    dims = replica_dims(mesh, dp_dims)
    names = list(mesh.mesh_dim_names)
    sizes = {d: int(mesh.size(names.index(d))) for d in names}
    wide = [d for d in dims if sizes[d] > 1]
    if not wide:
        return None
    if len(wide) == 1:
        return mesh.get_group(wide[0])
    ranks = mesh.mesh.permute(*[names.index(d) for d in (*[d for d in names if d not in dims], *dims)])
    rows = ranks.reshape(-1, math.prod(sizes[d] for d in dims)).tolist()
    group, _ = dist.new_subgroups_by_enumeration(rows)  # type: ignore[no-untyped-call]
    return group


def is_leader_from_mesh(mesh: Any, dp_dims: Sequence[str] = ("dp",)) -> bool:
    """True on the rank at coordinate 0 of every replica dim: the one writer of its group's keys."""
    return all(int(mesh.get_local_rank(d)) == 0 for d in replica_dims(mesh, dp_dims))


class DeviceMeshReplicaMixin:
    """Hooks of :class:`~dataplane.worker.DataPlaneWorkerMixin` read from ``self.device_mesh``.

    Put it before the data-plane mixin; set ``data_plane_dp_dims`` for meshes whose data-parallel
    dims have other names (``("dp_replicate", "dp_shard")`` for HSDP).

    Example::

        class Worker(DeviceMeshReplicaMixin, DataPlaneWorkerMixin):
            def __init__(self):
                self.device_mesh = init_device_mesh("cuda", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    """

    device_mesh: Any
    data_plane_dp_dims: tuple[str, ...] = ("dp",)

    def replica_group(self) -> Any | None:
        key = (id(self.device_mesh), self.data_plane_dp_dims)
        cached = getattr(self, "_dp_mesh_group", None)
        if cached is None or cached[0] != key:
            cached = (key, replica_group_from_mesh(self.device_mesh, self.data_plane_dp_dims))
            self._dp_mesh_group = cached
        return cached[1]

    def is_writeback_leader(self) -> bool:
        return is_leader_from_mesh(self.device_mesh, self.data_plane_dp_dims)
