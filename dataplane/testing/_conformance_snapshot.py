"""The conformance suite's snapshot tests (:mod:`dataplane.snapshot`): a partition saved from this
backend and loaded back holds the same keys in the same listing order, the same tags (tag-only rows
too), the same fields per row and every value bit-exact; named partitions alone are saved and loaded;
a damaged snapshot or a load the store cannot hold changes nothing. Part of
:class:`~dataplane.testing.conformance.ClientConformance`."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from dataplane.client import DataPlaneClient
from dataplane.errors import CapacityExceeded, InvalidArgument, SchemaError, SnapshotError
from dataplane.snapshot import load_snapshot, save_snapshot
from dataplane.testing._conformance_base import ConformanceBase, _jagged, _rows_of
from dataplane.testing.strategies import ALL_DTYPES, bit_exact, random_tensor

__all__ = ["ConformanceSnapshot", "partition_state", "same_state"]

State = tuple[list[tuple[str, dict[str, Any]]], dict[str, frozenset[str]], dict[str, dict[str, Any]]]


def partition_state(client: DataPlaneClient, pid: str) -> State:
    """What ``pid`` holds, read row by row: its listing (keys in order, tags), each key's fields, and
    each row's value of each field (a tensor, or an object)."""
    listing = client.kv_list(pid).get(pid, {})
    keys = list(listing)
    info = client.kv_describe(keys, partition_id=pid) if keys else {}
    values: dict[str, dict[str, Any]] = {}
    for k in keys:
        names = sorted(info[k].fields)
        if names:
            got = client.kv_batch_get([k], select_fields=names, partition_id=pid)
            values[k] = {f: got[f][0] if isinstance(got[f], list) else _rows_of(got[f])[0] for f in names}
    return list(listing.items()), {k: info[k].fields for k in keys}, values


def same_state(a: State, b: State) -> None:
    """Assert two :func:`partition_state` results are equal, tensors bit-exact (dtype and shape too)."""
    assert a[0] == b[0], "listing (keys, order, tags) differs"
    assert a[1] == b[1], "fields per row differ"
    assert a[2].keys() == b[2].keys()
    for k, row in a[2].items():
        for f, v in row.items():
            w = b[2][k][f]
            if isinstance(v, torch.Tensor):
                assert isinstance(w, torch.Tensor) and bit_exact(v, w), (k, f)
            else:
                assert v == w and type(v) is type(w), (k, f)


def fill_every_kind(client: DataPlaneClient, pid: str, seed: int = 0) -> None:
    """Rows of every kind in ``pid``: tag-only rows, dense fields of every dtype (random bits, NaN
    payloads included), jagged fields (empty rows, 2-D rows), an object column, rows with different
    field sets, merged tags, a key cleared and put again (it lists last), non-ASCII keys."""
    client.kv_batch_put(["p1", "p2"], None, partition_id=pid, tags=[{"s": "pending"}, {"s": "pending", "i": 2}])
    keys = ["a", "ключ", "c", "🦆 d"]
    fields: dict[str, Any] = {
        f"d_{str(d).removeprefix('torch.')}": random_tensor((4, 3), d, seed + i) for i, d in enumerate(ALL_DTYPES)
    }
    fields["scalar"] = random_tensor((4,), torch.float32, seed + 99)
    fields["tok"] = _jagged([random_tensor((n,), torch.int64, seed + n) for n in (3, 0, 7, 1)])
    fields["lp2"] = _jagged([random_tensor((n, 2), torch.bfloat16, seed + n) for n in (2, 5, 0, 1)])
    fields["msg"] = ["héllo", {"role": "user", "content": [1, 2.5, None]}, [b"\x00raw", True], None]
    client.kv_batch_put(keys, fields, partition_id=pid, tags=[{"r": 1.0}, {}, {"r": -2}, {"u": "x"}])
    client.kv_batch_put(["a", "c"], {"adv": torch.tensor([0.5, -0.25])}, partition_id=pid, tags=[{"v": 3}, {}])
    client.kv_batch_put(["e"], {"only": _jagged([torch.arange(4)])}, partition_id=pid, tags=[{"e": True}])
    client.kv_clear(["a"], partition_id=pid)
    client.kv_batch_put(["a"], {"scalar": torch.tensor([7.0])}, partition_id=pid, tags=[{"back": 1}])
    client.kv_batch_put(["p2"], {}, partition_id=pid, tags=[{"s": "running"}])


class ConformanceSnapshot(ConformanceBase):
    """Snapshots saved from and loaded into this backend (see the module docstring)."""

    def test_snapshot_round_trip_keeps_order_tags_fields_and_bits(
        self, client: DataPlaneClient, pid: str, tmp_path: Path
    ) -> None:
        fill_every_kind(client, pid)
        want = partition_state(client, pid)
        assert [k for k, _ in want[0]] == ["p1", "p2", "ключ", "c", "🦆 d", "e", "a"]
        assert want[1]["p1"] == frozenset() and want[1]["a"] == {"scalar"}
        info = save_snapshot(client, tmp_path / "snap", [pid], metadata={"step": 5})
        assert info.partitions == {pid: 7} and info.metadata == {"step": 5}
        assert info.backend == client.capabilities.backend
        client.kv_clear(partition_id=pid)
        client.kv_batch_put(["stale", "c"], {"x": torch.zeros(2)}, partition_id=pid, tags=[{"old": 1}, {}])
        loaded = load_snapshot(client, tmp_path / "snap")
        assert loaded.partitions == {pid: 7} and loaded.metadata == {"step": 5}
        same_state(partition_state(client, pid), want)
        client.kv_batch_put(["a"], {"scalar": torch.tensor([1.0])}, partition_id=pid)  # the schema came back too
        with pytest.raises(SchemaError):
            client.kv_batch_put(["a"], {"scalar": torch.tensor([1], dtype=torch.int8)}, partition_id=pid)

    def test_snapshot_of_named_partitions_and_partial_loads(
        self, client: DataPlaneClient, pid: str, tmp_path: Path
    ) -> None:
        other, empty = f"{pid}-b", f"{pid}-empty"
        try:
            client.kv_batch_put(["a", "b"], {"x": torch.arange(2)}, partition_id=pid, tags=[{"i": 0}, {"i": 1}])
            client.kv_batch_put(["z"], {"y": torch.ones(1, 2)}, partition_id=other)
            info = save_snapshot(client, tmp_path / "snap", [other, pid, empty])
            assert list(info.partitions) == [other, pid, empty] and info.partitions[empty] == 0
            saved = {p: partition_state(client, p) for p in (pid, other)}
            client.kv_batch_put(["c"], {"x": torch.tensor([9])}, partition_id=pid)
            client.kv_batch_put(["z"], {"y": torch.zeros(1, 2)}, partition_id=other)
            client.kv_batch_put(["q"], None, partition_id=empty, tags=[{}])
            changed_other = partition_state(client, other)
            assert load_snapshot(client, tmp_path / "snap", [pid, empty]).partitions == {pid: 2, empty: 0}
            same_state(partition_state(client, pid), saved[pid])
            same_state(partition_state(client, other), changed_other)  # not named: untouched
            assert client.kv_list(empty).get(empty, {}) == {}  # saved empty: loaded empty
            with pytest.raises(InvalidArgument, match="not in the snapshot"):
                load_snapshot(client, tmp_path / "snap", ["nope"])
            # replace=False adds rows after the partition's own, and refuses keys both hold
            client.kv_clear(["a"], partition_id=pid)
            before = partition_state(client, pid)
            with pytest.raises(InvalidArgument, match="already holds"):
                load_snapshot(client, tmp_path / "snap", [pid], replace=False)
            same_state(partition_state(client, pid), before)
            client.kv_clear(partition_id=pid)
            client.kv_batch_put(["own"], {"x": torch.tensor([5])}, partition_id=pid)
            load_snapshot(client, tmp_path / "snap", [pid], replace=False)
            assert list(client.kv_list(pid)[pid]) == ["own", "a", "b"]
            got = client.kv_batch_get(["own", "a", "b"], select_fields="x", partition_id=pid)["x"]
            assert got.tolist() == [5, 0, 1]
        finally:
            client.kv_clear(partition_id=other)
            client.kv_clear(partition_id=empty)

    def test_snapshot_damaged_loads_nothing(self, client: DataPlaneClient, pid: str, tmp_path: Path) -> None:
        client.kv_batch_put(["a", "b"], {"x": torch.arange(6.0).view(2, 3)}, partition_id=pid, tags=[{"i": 0}, {}])
        info = save_snapshot(client, tmp_path / "snap", [pid])
        tensors = next(info.path.glob("*.pt"))
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(bytes(data))
        client.kv_batch_put(["a"], {"x": torch.ones(1, 3)}, partition_id=pid, tags=[{"new": 1}])
        before = partition_state(client, pid)
        with pytest.raises(SnapshotError, match=rf"{tensors.name}.*sha256"):
            load_snapshot(client, tmp_path / "snap")
        same_state(partition_state(client, pid), before)

    def test_snapshot_load_the_store_cannot_hold_is_undone(self, client: DataPlaneClient, tmp_path: Path) -> None:
        limited = self.make_limited_client(capacity_bytes=64 * 1024, capacity_rows=8)
        if limited is None:
            pytest.skip("this adapter cannot bound its capacity from a client option")
        pid = f"snap-{uuid.uuid4().hex[:8]}"
        try:
            keys = [f"k{i}" for i in range(6)]
            client.kv_batch_put(keys, {"x": torch.ones(6, 4096)}, partition_id=pid, tags=[{"i": i} for i in range(6)])
            save_snapshot(client, tmp_path / "big", [pid])  # 96 KiB: more than the limited store holds
        finally:
            client.kv_clear(partition_id=pid)
        with limited:
            limited.kv_batch_put(["o1", "o2"], {"x": torch.zeros(2, 1024)}, partition_id=pid, tags=[{"o": 1}, {}])
            limited.kv_batch_put(["t"], None, partition_id=pid, tags=[{"tag": "only"}])
            limited.kv_batch_put(["w"], {"y": torch.ones(1)}, partition_id="elsewhere")
            before = {p: partition_state(limited, p) for p in (pid, "elsewhere")}
            with pytest.raises(CapacityExceeded):
                load_snapshot(limited, tmp_path / "big")
            for p, state in before.items():
                same_state(partition_state(limited, p), state)
