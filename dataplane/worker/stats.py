"""Per-call observability of :meth:`~dataplane.worker.DataPlaneWorkerMixin.fetch`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["FetchStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchStats:
    """What one :meth:`DataPlaneWorkerMixin.fetch` moved, on this rank.

    Attributes:
        policy: the policy that ran (``auto`` resolved).
        role: ``reader`` (independent), ``leader`` or ``sibling``.
        group_size: ranks in the replica group (1 without one).
        rows: rows of the shard.
        fields: fields fetched.
        store_bytes: tensor bytes this rank read from the store, in wire form (values + offsets;
            object columns are not counted, as in :class:`~dataplane.observability.ObservedClient`).
        broadcast_bytes: bytes this rank sent (leader) or received (sibling) through the group,
            descriptor included.
        read_s: seconds reading from the store.
        stage_s: seconds copying the wire form into the flat buffers (leader).
        wait_s: seconds a sibling waited for the leader's descriptor (the leader's read).
        broadcast_s: seconds of descriptor, agreement and buffer broadcasts.
        materialize_s: seconds turning the wire form into the returned TensorDict.
        total_s: seconds of the whole call.
        pad_width: width of the padded jagged fields (``layout="padded"``), else None.

    >>> s = FetchStats(policy="independent", role="reader", group_size=1, rows=2, fields=("x",))
    >>> FetchStats.from_dict(s.to_dict()) == s
    True
    """

    policy: Literal["independent", "leader_broadcast"]
    role: Literal["reader", "leader", "sibling"]
    group_size: int
    rows: int
    fields: tuple[str, ...]
    store_bytes: int = 0
    broadcast_bytes: int = 0
    read_s: float = 0.0
    stage_s: float = 0.0
    wait_s: float = 0.0
    broadcast_s: float = 0.0
    materialize_s: float = 0.0
    total_s: float = 0.0
    pad_width: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fields"] = list(self.fields)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FetchStats:
        return cls(**{**d, "fields": tuple(d["fields"])})
