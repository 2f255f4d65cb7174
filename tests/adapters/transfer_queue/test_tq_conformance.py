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
from dataplane.errors import KeyNotFound
from dataplane.testing import ClientConformance, make_state_machine

pytestmark = [pytest.mark.tq]


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
        """Controller requests per call: put 3 (2 for a plain write-back of the same fields), get by meta 1,
        by keys 2."""
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
            assert store.round_trips - before == 2  # markers unchanged: no tag commit
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

    def test_a_row_index_handed_to_another_key_is_not_read_as_its_own(
        self, client: DataPlaneClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """TransferQueue hands a cleared row's index to the next new key: a get that took ``a``'s
        index before a clear can find ``b``'s row there. Here the controller answers every retrieve
        of ``a`` with ``b``'s row (same shapes, so no size tells them apart): the get reads again,
        and never returns ``b``'s row as ``a``'s."""
        ops: Any = getattr(client, "store")._ops  # noqa: B009 - StoreClient's store
        pid = "handed-on"
        try:
            client.kv_batch_put(["a", "b"], {"x": torch.tensor([[1, 1], [2, 2]])}, partition_id=pid)
            retrieve = ops._retrieve

            async def handed_on(partition_id: str, keys: list[str], *, create: bool = False) -> Any:
                return await retrieve(partition_id, ["b" if k == "a" else k for k in keys], create=create)

            monkeypatch.setattr(ops, "_retrieve", handed_on)
            with pytest.raises(KeyNotFound, match="cleared or rewritten while it read them"):
                client.kv_batch_get(["a"], partition_id=pid, select_fields=["x"])
            monkeypatch.undo()
            assert client.kv_batch_get(["a"], partition_id=pid, select_fields=["x"])["x"].tolist() == [[1, 1]]
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
