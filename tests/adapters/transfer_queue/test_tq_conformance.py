"""The shipped conformance suite, unchanged, on ``tq://`` with SimpleStorage and with MooncakeStore.

The session's local Ray (``ray_cluster``, ``tests/conftest.py``) and one TransferQueue deployment per
backend (one class each): the fixture's client owns it, and every client the suite makes attaches to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.codec.wire import encode_fields
from dataplane.errors import BackendUnavailable, KeyNotFound
from dataplane.testing import ClientConformance, make_state_machine

pytestmark = [pytest.mark.tq]


async def _hand_on(ops: Any, retrieve: Any, partition_id: str, index: int, row: list[list[int]]) -> str:
    """Put ``row`` under a new key that takes the released row ``index`` (new keys take released
    indexes first-in first-out), with ``retrieve`` (the ops' own, unpatched); returns the key."""
    for batch in range(16):
        names = [f"new{batch}-{i}" for i in range(256)]
        got = (await retrieve(partition_id, names, create=True)).global_indexes
        if index in got:
            key = names[got.index(index)]
            await ops.put(partition_id, [key], encode_fields({"x": torch.tensor(row)}, 1), None, 30.0)
            return key
    raise AssertionError(f"no new key took index {index}: the race was not made")


class _TQConformance(ClientConformance):
    url = ""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def deployment(cls, ray_cluster: None) -> Iterator[DataPlaneClient]:
        owner = dataplane.connect(cls.url)
        yield owner
        owner.close()

    def make_client(self, **options: Any) -> DataPlaneClient:
        return dataplane.connect("tq://", **options)

    def test_state_machine(self, client: DataPlaneClient) -> None:
        run_state_machine_as_test(
            make_state_machine(lambda: client),
            settings=settings(max_examples=12, stateful_step_count=8, suppress_health_check=list(HealthCheck)),
        )

    def test_round_trips(self, client: DataPlaneClient) -> None:
        """Controller requests per call: put 3, get by meta 1, by keys 2. A write-back of the fields the rows
        hold, which changes no marker: 2 on SimpleStorage; on Mooncake 3, since it also reads the versions
        it replaces (sent while it writes)."""
        store: Any = getattr(client, "store")  # noqa: B009 - StoreClient's store
        pid = "round-trips"
        try:
            keys = [f"k{i}" for i in range(16)]
            fields = {"ids": torch.arange(16).view(16, 1).expand(16, 8), "lp": torch.zeros(16, 8)}
            before = store.round_trips
            meta = client.kv_batch_put(keys, fields, partition_id=pid)
            assert store.round_trips - before == 3
            before = store.round_trips
            client.kv_batch_get(meta, select_fields=["ids", "lp"])
            assert store.round_trips - before == 1
            before = store.round_trips
            client.kv_batch_get(keys, partition_id=pid, select_fields=["ids"])
            assert store.round_trips - before == 2
            before = store.round_trips
            client.kv_batch_put(
                keys, {"lp": torch.ones(16, 8), "ids": torch.zeros(16, 8, dtype=torch.int64)}, partition_id=pid
            )
            assert store.round_trips - before == (3 if store.backend == "mooncake" else 2)  # no tag commit
        finally:
            client.kv_clear(partition_id=pid)

    def test_describe_and_tag_only_round_trips(self, client: DataPlaneClient) -> None:
        """Describe: 1 controller request for the batch, 2 when some keys are absent (TQ leaves them
        out of its answer unnamed), none listing the partition. A tag-only put: 2 (register, commit the
        tags), no storage write. Fields described are the user's, never the adapter's packs or markers."""
        store: Any = getattr(client, "store")  # noqa: B009 - StoreClient's store
        pid = "describe-trips"
        try:
            keys = [f"k{i}" for i in range(16)]
            client.kv_batch_put(
                keys,
                {"ids": torch.zeros(16, 2, dtype=torch.int64)},
                partition_id=pid,
                tags=[{"i": i} for i in range(16)],
            )
            client.kv_batch_put(keys[:4], {"lp": torch.ones(4)}, partition_id=pid)
            before = store.round_trips
            info = client.kv_describe(keys, partition_id=pid)
            assert store.round_trips - before == 1
            assert [info[k].fields for k in ("k0", "k5")] == [{"ids", "lp"}, {"ids"}] and info["k5"].tags == {"i": 5}
            before = store.round_trips
            info = client.kv_describe(["zz", "k3", "yy", "k9"], partition_id=pid)
            assert store.round_trips - before == 2
            assert list(info) == ["k3", "k9"] and info["k9"].tags == {"i": 9}
            before = store.round_trips
            assert client.kv_describe(["k1"], partition_id=f"{pid}-none") == {}
            assert store.round_trips - before == 1
            before = store.round_trips
            client.kv_batch_put(["k1", "k2", "n1", "n2"], None, partition_id=pid, tags=[{"s": 1}, {}, {"s": 2}, {}])
            assert store.round_trips - before == 2
            before = store.round_trips
            client.kv_batch_put(["k1", "n1"], {}, partition_id=pid, tags=[{}, {}])  # nothing changes: no commit
            assert store.round_trips - before == 1
            info = client.kv_describe(["k1", "k2", "n1", "n2"], partition_id=pid)
            assert {k: (set(r.fields), r.tags) for k, r in info.items()} == {
                "k1": ({"ids", "lp"}, {"i": 1, "s": 1}),
                "k2": ({"ids", "lp"}, {"i": 2}),
                "n1": (set(), {"s": 2}),
                "n2": (set(), {}),
            }
            assert list(client.kv_list(pid)[pid])[-2:] == ["n1", "n2"]
        finally:
            client.kv_clear(partition_id=pid)

    def test_describe_leaves_out_rows_cleared_between_its_two_requests(
        self, client: DataPlaneClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With keys absent, describe names the found rows' indexes in a second request: a row whose
        index is gone by then, or names a key out of the asked order (handed to another key), is
        reported absent rather than under another key's name."""
        ops: Any = getattr(client, "store")._ops  # noqa: B009 - StoreClient's store
        pid = "describe-race"
        try:
            client.kv_batch_put(["a", "b", "c"], {"x": torch.arange(3)}, partition_id=pid, tags=[{"t": 1}] * 3)
            name = ops.client.async_kv_retrieve_keys

            async def renamed(*, global_indexes: list[int], partition_id: str) -> list[str | None]:
                got = await name(global_indexes=global_indexes, partition_id=partition_id)
                return [None if k == "a" else "a" if k == "c" else k for k in got]

            monkeypatch.setattr(ops.client, "async_kv_retrieve_keys", renamed)
            assert list(client.kv_describe(["a", "b", "zz", "c"], partition_id=pid)) == ["b"]
        finally:
            monkeypatch.undo()
            client.kv_clear(partition_id=pid)

    def test_a_failed_tag_only_put_removes_the_keys_it_created(
        self, client: DataPlaneClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store: Any = getattr(client, "store")  # noqa: B009 - StoreClient's store
        ops = store._ops
        pid = "tag-only-failed"
        try:
            client.kv_batch_put(["a"], {"x": torch.ones(1)}, partition_id=pid, tags=[{"t": 1}])

            async def broken(*args: Any) -> None:
                raise RuntimeError("controller gone")

            monkeypatch.setattr(ops, "_set_tags", broken)
            with pytest.raises(BackendUnavailable, match="controller gone"):
                client.kv_batch_put(["a", "new"], None, partition_id=pid, tags=[{"t": 2}, {"t": 3}])
            monkeypatch.undo()
            raw = store.deployment.run(ops._listing, pid, timeout=30)[pid]
            assert "new" not in raw
            assert client.kv_list(pid)[pid] == {"a": {"t": 1}}
            assert client.kv_describe(["a", "new"], partition_id=pid)["a"].fields == {"x"}
        finally:
            client.kv_clear(partition_id=pid)

    def test_rows_rewritten_in_part_read_back_their_latest_values(self, client: DataPlaneClient) -> None:
        """Rows whose fields were last written by different puts (on SimpleStorage: read from
        different packs) come back in the requested order with every field's latest value."""
        pid = "partial-rewrites"
        try:
            keys = [f"r{i}" for i in range(6)]
            ids = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(6)], layout=torch.jagged)
            client.kv_batch_put(keys, {"ids": ids, "lp": torch.zeros(6, 2)}, partition_id=pid)
            client.kv_batch_put(keys[1::2], {"lp": torch.ones(3, 2)}, partition_id=pid)
            client.kv_batch_put(keys[4:], {"lp": torch.full((2, 2), 7.0), "v": torch.ones(2)}, partition_id=pid)
            order = ["r5", "r0", "r3", "r4", "r1", "r2"]
            out = client.kv_batch_get(order, partition_id=pid, select_fields=["lp", "ids"])
            assert out["lp"][:, 0].tolist() == [7.0, 0.0, 1.0, 7.0, 1.0, 0.0]
            assert [len(r) for r in out["ids"].unbind()] == [6, 1, 4, 5, 2, 3]
        finally:
            client.kv_clear(partition_id=pid)

    def test_a_stale_meta_reads_the_rewritten_schema(self, client: DataPlaneClient) -> None:
        """A meta whose partition was cleared and re-written with another dtype since still reads the
        current rows right: the carried schema is checked, and re-read from the store on a mismatch."""
        store: Any = getattr(client, "store")  # noqa: B009 - StoreClient's store
        pid = "stale-meta"
        try:
            keys = ["a", "b"]
            old = client.kv_batch_put(keys, {"x": torch.arange(6).view(2, 3)}, partition_id=pid)
            client.kv_clear(partition_id=pid)
            client.kv_batch_put(keys, {"x": torch.full((2, 3), 0.5)}, partition_id=pid)
            before = store.round_trips
            out = client.kv_batch_get(old, select_fields=["x"])
            assert out["x"].dtype == torch.float32 and torch.equal(out["x"], torch.full((2, 3), 0.5))
            assert store.round_trips - before == 2
        finally:
            client.kv_clear(partition_id=pid)

    def test_a_row_index_handed_to_another_key_is_not_read_as_its_own(self, client: DataPlaneClient) -> None:
        """TransferQueue hands a cleared row's index to a later new key. Here ``a`` is cleared and
        another key ``b`` put at its index (same shapes, so no size tells them apart) right after a
        get took ``a``'s row from the controller and before it read the bytes: the get reads again
        and finds ``a`` gone, and never returns ``b``'s row as ``a``'s."""
        ops: Any = getattr(client, "store")._ops  # noqa: B009 - StoreClient's store
        pid = "handed-on"
        try:
            client.kv_batch_put(["keep", "a"], {"x": torch.tensor([[0, 0], [1, 1]])}, partition_id=pid)
            retrieve = ops._retrieve
            taken: list[int] = []
            handed: list[str] = []  # the key that took a's index

            async def racing(partition_id: str, keys: list[str], *, create: bool = False) -> Any:
                bm = await retrieve(partition_id, keys, create=create)
                if keys == ["a"] and not taken:
                    taken.extend(bm.global_indexes)
                    await ops.clear(partition_id, ["a"])
                    handed.append(await _hand_on(ops, retrieve, partition_id, taken[0], [[2, 2]]))
                return bm

            ops._retrieve = racing
            try:
                with pytest.raises(KeyNotFound, match="'a'"):
                    client.kv_batch_get(["a"], partition_id=pid, select_fields=["x"])
            finally:
                del ops._retrieve
            assert client.kv_batch_get(handed, partition_id=pid, select_fields=["x"])["x"].tolist() == [[2, 2]]
        finally:
            client.kv_clear(partition_id=pid)

    def test_jagged_rows_left_all_of_one_length_read_back(self, client: DataPlaneClient) -> None:
        """When the rows left of a jagged field all have one length (here: the others were cleared),
        TransferQueue records the field as a plain ``[B, L]`` one, without per-row shapes."""
        pid = "one-length-left"
        try:
            x = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
            meta = client.kv_batch_put(["a", "b"], {"x": x}, partition_id=pid)
            client.kv_clear(["a"], partition_id=pid)
            by_keys = client.kv_batch_get(["b"], partition_id=pid, select_fields="x")
            for out in (by_keys, client.kv_batch_get(meta.subset([1]), select_fields="x")):
                assert [r.tolist() for r in out["x"].unbind()] == [[0, 1, 2, 3, 4]]
        finally:
            client.kv_clear(partition_id=pid)


class TestTQSimpleConformance(_TQConformance):
    url = "tq://?backend=simple&timeout_s=60"


@pytest.mark.mooncake
class TestTQMooncakeConformance(_TQConformance):
    url = f"tq://?backend=mooncake&timeout_s=60&segment_bytes={512 << 20}"

    def test_a_late_put_of_a_cleared_key_is_not_read_as_another_keys(self, client: DataPlaneClient) -> None:
        """A put of ``a`` takes ``a``'s row index; before it records what it wrote, ``a`` is cleared and
        another key ``b`` put at that index. The late put then records its objects at ``b``'s index:
        ``b``'s get finds them named for another key and raises ``KeyNotFound``, never returning
        ``a``'s row as ``b``'s."""
        ops: Any = getattr(client, "store")._ops  # noqa: B009 - StoreClient's store
        pid = "late-put"
        try:
            client.kv_batch_put(["keep", "a"], {"x": torch.tensor([[0, 0], [1, 1]])}, partition_id=pid)
            index = client.store.deployment.run(ops._retrieve, pid, ["a"], timeout=30).global_indexes[0]  # type: ignore[attr-defined]
            held_tokens, handed = ops._held_tokens, []

            async def racing(partition_id: str, keys: list[str], *args: Any) -> Any:
                if keys == ["a"] and not handed:  # the put of a, writing: clear a, hand its index on
                    await ops.clear(partition_id, ["a"])
                    handed.append(await _hand_on(ops, ops._retrieve, partition_id, index, [[2, 2]]))
                return await held_tokens(partition_id, keys, *args)

            ops._held_tokens = racing
            try:
                client.kv_batch_put(["a"], {"x": torch.tensor([[3, 3]])}, partition_id=pid)
            finally:
                del ops._held_tokens
            with pytest.raises(KeyNotFound, match="cleared or rewritten"):
                client.kv_batch_get(handed, partition_id=pid, select_fields=["x"])
        finally:
            client.kv_clear(partition_id=pid)

    def test_a_read_whose_objects_are_removed_under_it_is_not_kept(self, client: DataPlaneClient) -> None:
        """Mooncake can hand a removed object's memory to another put while a reader still transfers
        from it, so a get keeps a read only if every object it read still exists afterwards. Here the
        objects are removed right after the transfer (as a concurrent clear or re-put would, mid-read):
        the get does not return what it read, and raises ``KeyNotFound`` once the row stays gone."""
        data: Any = getattr(client, "store")._ops.mooncake  # noqa: B009 - StoreClient's store
        pid = "removed-under-read"

        class RemovedUnderRead:
            def __init__(self, store: Any) -> None:
                self.store, self.reads = store, 0

            def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
                got = list(self.store.batch_get_into(keys, ptrs, sizes))
                self.reads += all(g == s for g, s in zip(got, sizes, strict=True))
                self.store.batch_remove(keys, force=True)
                return got

            def __getattr__(self, name: str) -> Any:
                return getattr(self.store, name)

        try:
            client.kv_batch_put(["a"], {"x": torch.tensor([[1, 1]])}, partition_id=pid)
            store = data._store
            data._store = RemovedUnderRead(store)
            try:
                with pytest.raises(KeyNotFound, match="cleared or rewritten"):
                    client.kv_batch_get(["a"], partition_id=pid, select_fields=["x"])
                assert data._store.reads == 1  # whole, then not kept; later rounds find the objects gone
            finally:
                data._store = store
        finally:
            client.kv_clear(partition_id=pid)
