"""The conformance suite's tests of consumption by task (``claim_meta`` and friends,
``docs/claims.md``): two tasks each see every row once, in first-put order; a row is claimed only
once it holds every required field and matches the tag filter; waits are bounded by ``timeout_s``
and ``min_rows``; threads claiming at once never share a row; a clear takes the claims of its rows
with it and never lets a claim hand out a cleared row's data; resets, finished marks, typed errors
for bad arguments that change nothing. Part of :class:`~dataplane.testing.conformance.ClientConformance`.

An adapter that does not implement claims (its store's ``claim`` raises ``NotImplementedError``)
has these tests skipped, with that reason.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch

from dataplane.client import DataPlaneClient
from dataplane.errors import InvalidArgument, KeyNotFound, SchemaError
from dataplane.meta import KVBatchMeta
from dataplane.streaming import stream
from dataplane.testing._conformance_base import ConformanceBase, _jagged

__all__ = ["ConformanceClaims", "claim_all"]


def claim_all(client: DataPlaneClient, task: str, pid: str, fields: Any, batch: int, **kw: Any) -> list[KVBatchMeta]:
    """Claim for ``task`` until a claim comes back empty; every non-empty meta, in order."""
    out: list[KVBatchMeta] = []
    while True:
        meta = client.claim_meta(task, partition_id=pid, required_fields=fields, batch_size=batch, **kw)
        if not len(meta):
            return out
        out.append(meta)


def _put(client: DataPlaneClient, pid: str, keys: list[str], **fields_tags: Any) -> None:
    tags = fields_tags.pop("tags", None)
    fields = {
        name: (value if value is not None else torch.arange(len(keys), dtype=torch.float32))
        for name, value in fields_tags.items()
    }
    client.kv_batch_put(keys, fields or None, partition_id=pid, tags=tags)


class ConformanceClaims(ConformanceBase):
    """Consumption by task (see the module docstring)."""

    @pytest.fixture
    def claims(self, client: DataPlaneClient, pid: str) -> None:
        """Skips the test where the adapter does not implement claims (every test here asks for it)."""
        try:
            client.consumption_status("probe", partition_id=pid)
        except NotImplementedError as e:
            pytest.skip(f"the adapter does not implement consumption by task: {e}")

    def test_two_tasks_each_see_every_row_once_in_first_put_order(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        keys = [f"r{i}" for i in range(10)]
        for at in (0, 4, 7):
            _put(client, pid, keys[at : at + (4 if at == 0 else 3)], x=None, tags=None)
        for task in ("train", "ref"):
            metas = claim_all(client, task, pid, "x", 3)
            assert [len(m) for m in metas] == [3, 3, 3, 1]
            assert [k for m in metas for k in m.keys] == keys
            assert all(m.task_name == task and m.fields == ("x",) and m.partition_id == pid for m in metas)
            got = client.kv_batch_get(metas[0], select_fields="x")["x"]  # a claimed meta reads like a put's
            assert got.tolist() == [0.0, 1.0, 2.0]
        assert not len(client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=5))

    def test_a_row_is_claimed_only_once_it_holds_every_required_field(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        _put(client, pid, ["a", "b"], x=None)
        _put(client, pid, ["c"], x=None, y=None)
        _put(client, pid, ["d"], tags=[{"s": "pending"}])  # a tag-only row holds no field
        both = client.claim_meta("t", partition_id=pid, required_fields=["x", "y"], batch_size=10)
        assert both.keys == ("c",)
        _put(client, pid, ["a", "d"], y=None)
        assert client.claim_meta("t", partition_id=pid, required_fields=["y", "x"], batch_size=10).keys == ("a",)
        status = client.consumption_status("t", partition_id=pid, required_fields=["x", "y"])
        assert (status.claimed, status.ready, status.not_ready) == (2, 0, 2)  # b lacks y, d lacks x
        assert client.claim_meta("u", partition_id=pid, required_fields="z", batch_size=10).keys == ()

    def test_tag_filter_claims_matching_rows_only(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        _put(client, pid, ["a", "b", "c", "d"], x=None, tags=[{"v": 1}, {"v": 2}, {"v": 1, "u": "z"}, {}])
        meta = client.claim_meta("t", partition_id=pid, required_fields="x", batch_size=9, tag_filter={"v": 1})
        assert meta.keys == ("a", "c") and meta.tags == ({"v": 1}, {"v": 1, "u": "z"})
        status = client.consumption_status("t", partition_id=pid, required_fields="x", tag_filter={"v": 1})
        assert (status.claimed, status.ready, status.not_ready) == (2, 0, 2)
        assert client.claim_meta("t", partition_id=pid, required_fields="x", batch_size=9).keys == ("b", "d")

    def test_claim_meta_advances_consumption(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        _put(client, pid, [f"k{i}" for i in range(6)], x=None)
        seen: list[str] = []
        for claimed in (2, 4, 6):
            meta = client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=2)
            assert len(meta) == 2 and not set(meta.keys) & set(seen)
            seen += meta.keys
            status = client.consumption_status("train", partition_id=pid, required_fields="x")
            assert (status.claimed, status.ready, status.total) == (claimed, 6 - claimed, 6)

    def test_check_consumption_status_only_true_when_all_consumed(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        assert client.check_consumption_status("train", partition_id=pid) is False  # nothing put: False, as in TQ
        _put(client, pid, ["a", "b", "c"], x=None)
        client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=2)
        assert client.check_consumption_status("train", partition_id=pid) is False
        client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=2)
        assert client.check_consumption_status("train", partition_id=pid) is True
        assert client.check_consumption_status("ref", partition_id=pid) is False  # per task
        _put(client, pid, ["d"], x=None)
        assert client.check_consumption_status("train", partition_id=pid) is False

    def test_unknown_tasks_start_from_nothing_and_bad_task_names_raise(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        """Tasks need no registration (TransferQueue's semantics): a task never seen has claimed
        nothing and sees every row. What raises is a name that is no task name, before anything
        is claimed."""
        _put(client, pid, ["a", "b"], x=None)
        client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=9)
        fresh = client.consumption_status("never-claimed", partition_id=pid, required_fields="x")
        assert (fresh.claimed, fresh.ready) == (0, 2) and not fresh.all_consumed
        for bad in (None, "", 3, "a\nb", "t" * 201):
            with pytest.raises(InvalidArgument):
                client.claim_meta(bad, partition_id=pid, required_fields="x", batch_size=9)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument):
                client.consumption_status(bad, partition_id=pid)  # type: ignore[arg-type]
        assert client.claim_meta("new", partition_id=pid, required_fields="x", batch_size=9).keys == ("a", "b")

    def test_bad_arguments_raise_typed_errors_and_claim_nothing(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        _put(client, pid, ["a", "b"], x=None)
        bad: list[tuple[type[Exception], dict[str, Any]]] = [
            (InvalidArgument, {"batch_size": 0}),
            (InvalidArgument, {"batch_size": 2, "min_rows": 3}),
            (InvalidArgument, {"batch_size": 2, "timeout_s": -1}),
            (InvalidArgument, {"batch_size": 2, "required_fields": []}),
            (InvalidArgument, {"batch_size": 2, "required_fields": ["x", "x"]}),
            (SchemaError, {"batch_size": 2, "required_fields": ["bad field!"]}),
            (SchemaError, {"batch_size": 2, "tag_filter": ["v", 1]}),
            (InvalidArgument, {"batch_size": 2, "length_tag": 3}),
        ]
        for error, kw in bad:
            args = {"required_fields": "x", **kw}
            with pytest.raises(error):
                client.claim_meta("t", partition_id=pid, **args)
        with pytest.raises(InvalidArgument):
            client.claim_meta("t", partition_id="", required_fields="x", batch_size=1)
        assert client.consumption_status("t", partition_id=pid, required_fields="x").claimed == 0

    def test_waits_are_bounded_by_timeout_and_min_rows(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        t0 = time.monotonic()
        assert not len(client.claim_meta("t", partition_id=pid, required_fields="x", batch_size=4))
        now = time.monotonic() - t0
        t0 = time.monotonic()
        empty = client.claim_meta("t", partition_id=pid, required_fields="x", batch_size=4, timeout_s=0.4)
        waited = time.monotonic() - t0
        assert not len(empty) and 0.35 <= waited < 0.4 + 2 + 2 * now, waited
        _put(client, pid, ["a"], x=None)
        t0 = time.monotonic()
        short = client.claim_meta("t", partition_id=pid, required_fields="x", batch_size=4, min_rows=2, timeout_s=0.4)
        assert short.keys == ("a",) and time.monotonic() - t0 >= 0.35  # fewer than min_rows: all it got, at the bound

        def later() -> None:
            time.sleep(0.2)
            _put(client, pid, ["b", "c"], x=None)

        producer = threading.Thread(target=later)
        producer.start()
        t0 = time.monotonic()
        got = client.claim_meta("t", partition_id=pid, required_fields="x", batch_size=4, min_rows=2, timeout_s=30)
        producer.join()
        assert got.keys == ("b", "c") and time.monotonic() - t0 < 15  # back as soon as min_rows arrived

    def test_threads_claiming_at_once_never_share_a_row(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        keys = [f"k{i:03d}" for i in range(60)]
        _put(client, pid, keys, x=None)
        got: list[list[str]] = [[] for _ in range(4)]
        errors: list[BaseException] = []

        def consume(i: int) -> None:
            try:
                for meta in claim_all(client, "train", pid, "x", 4):
                    got[i] += meta.keys
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        counts = Counter(k for g in got for k in g)
        assert sorted(counts) == keys and set(counts.values()) == {1}, counts

    def test_reset_consumption_hands_rows_out_again(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        _put(client, pid, ["a", "b"], x=None)
        for task in ("train", "ref"):
            assert client.claim_meta(task, partition_id=pid, required_fields="x", batch_size=9).keys == ("a", "b")
        client.reset_consumption("train", partition_id=pid)
        assert client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=9).keys == ("a", "b")
        assert not len(client.claim_meta("ref", partition_id=pid, required_fields="x", batch_size=9))
        client.reset_consumption(partition_id=pid)  # every task
        assert client.consumption_status("ref", partition_id=pid).claimed == 0
        assert client.claim_meta("ref", partition_id=pid, required_fields="x", batch_size=9).keys == ("a", "b")
        client.reset_consumption("t", partition_id=f"{pid}-never-put")  # nothing there: no error

    def test_a_clear_takes_the_claims_of_its_rows(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        _put(client, pid, ["a", "b", "c"], x=None)
        assert len(client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=9)) == 3
        client.kv_clear(["b"], partition_id=pid)
        status = client.consumption_status("train", partition_id=pid)
        assert (status.claimed, status.total, status.all_consumed) == (2, 2, True)
        _put(client, pid, ["b"], x=torch.tensor([7.0]))  # the key put again is a new row: unclaimed
        meta = client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=9)
        assert meta.keys == ("b",) and client.kv_batch_get(meta, select_fields="x")["x"].tolist() == [7.0]
        client.mark_finished(partition_id=pid)
        client.kv_clear(["a", "b", "c"], partition_id=pid)  # rows go; the finished mark stays
        assert client.consumption_status("train", partition_id=pid).finished
        _put(client, pid, ["a"], x=None)
        assert client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=9).keys == ("a",)
        client.kv_clear(partition_id=pid)  # the whole partition: rows, claims and the mark
        status = client.consumption_status("train", partition_id=pid)
        assert (status.total, status.finished) == (0, False)
        _put(client, pid, ["a"], x=None)
        assert client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=9).keys == ("a",)

    def test_a_clear_during_claiming_never_hands_out_a_cleared_rows_data(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        """A producer puts rows (each key once, its value a function of its key) while a clearer
        clears some: no claim returns a row whose clear ended before the claim began, and a read of
        any claimed row returns that row's own value or raises KeyNotFound."""
        n = 48
        cleared_at: dict[str, float] = {}
        errors: list[BaseException] = []
        stop = threading.Event()

        def produce_and_clear() -> None:
            try:
                for i in range(0, n, 4):
                    keys = [f"k{j:03d}" for j in range(i, i + 4)]
                    client.kv_batch_put(keys, {"x": torch.arange(i, i + 4, dtype=torch.float32)}, partition_id=pid)
                    client.kv_clear(keys[1::2], partition_id=pid)
                    now = time.monotonic()
                    cleared_at.update(dict.fromkeys(keys[1::2], now))
            except BaseException as e:
                errors.append(e)
            finally:
                stop.set()

        worker = threading.Thread(target=produce_and_clear)
        worker.start()
        claimed: list[str] = []
        while True:
            began = time.monotonic()
            done = stop.is_set()
            meta = client.claim_meta("train", partition_id=pid, required_fields="x", batch_size=3)
            stale = [k for k in meta.keys if cleared_at.get(k, began + 1) < began]
            assert not stale, f"claimed rows cleared before the claim began: {stale}"
            claimed += meta.keys
            for k in meta.keys:
                try:
                    value = client.kv_batch_get([k], partition_id=pid, select_fields="x")["x"].item()
                except KeyNotFound:
                    continue
                assert value == float(int(k[1:])), (k, value)
            if done and not len(meta):
                break
        worker.join()
        assert not errors, errors
        assert len(claimed) == len(set(claimed))
        assert set(claimed) >= {f"k{j:03d}" for j in range(0, n, 2)}  # every row never cleared was claimed

    def test_async_twins(self, client: DataPlaneClient, pid: str, claims: None) -> None:
        _put(client, pid, ["a", "b"], x=None)

        async def run() -> tuple[KVBatchMeta, bool]:
            meta = await client.async_claim_meta("t", partition_id=pid, required_fields="x", batch_size=9)
            await client.async_mark_finished(partition_id=pid)
            done = await client.async_check_consumption_status("t", partition_id=pid)
            status = await client.async_consumption_status("t", partition_id=pid)
            assert status.finished and status.drained
            await client.async_reset_consumption("t", partition_id=pid)
            return meta, done

        meta, done = asyncio.run(run())
        assert meta.keys == ("a", "b") and done
        assert client.consumption_status("t", partition_id=pid).claimed == 0

    def test_stream_yields_every_row_once_and_ends_when_finished(
        self, client: DataPlaneClient, pid: str, claims: None
    ) -> None:
        keys = [f"k{i:02d}" for i in range(14)]

        def produce() -> None:
            for at in range(0, len(keys), 3):
                client.kv_batch_put(
                    keys[at : at + 3],
                    {"ids": _jagged([torch.arange(at + 1)] * len(keys[at : at + 3]))},
                    partition_id=pid,
                )
                time.sleep(0.05)
            client.mark_finished(partition_id=pid)

        producer = threading.Thread(target=produce)
        producer.start()
        batches = list(
            stream(client, "train", partition_id=pid, required_fields="ids", batch_rows=4, idle_timeout_s=30)
        )
        producer.join()
        assert [len(b) for b in batches] == [4, 4, 4, 2]
        assert [k for b in batches for k in b.keys] == keys
