"""Consumption by task beyond the conformance suite (which runs on every backend): the peer suite's
claim and consumption cases through a NeMo-RL-style name shim, the streaming loader feeding two DP
ranks while rows arrive, its idle timeout and ``async for``, the wrapper client, the status record.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import dataplane
from dataplane import ConsumptionStatus, DataPlaneClient, KVBatchMeta
from dataplane.errors import DataPlaneTimeout
from dataplane.observability import ObservedClient
from dataplane.storage import KVStore


class NemoStyleShim:
    """NeMo-RL's data-plane names over a dataplane client, names only: ``register_partition``
    declares a partition's consumer tasks (a claim by another task raises ``KeyError``, as NeMo-RL's
    fixture does; dataplane itself, like TransferQueue, needs no registration), ``claim_meta`` and
    ``check_consumption_status`` map one to one."""

    def __init__(self, client: DataPlaneClient) -> None:
        self.client = client
        self.consumers: dict[str, list[str]] = {}

    def register_partition(
        self, partition_id: str, fields: list[str], num_samples: int, consumer_tasks: list[str]
    ) -> None:
        self.consumers[partition_id] = list(consumer_tasks)

    def put_samples(
        self, sample_ids: list[str], partition_id: str, fields: Any = None, tags: Any = None
    ) -> KVBatchMeta:
        return self.client.kv_batch_put(sample_ids, fields, partition_id=partition_id, tags=tags)

    def claim_meta(
        self, partition_id: str, task_name: str, required_fields: list[str], batch_size: int, timeout_s: float = 0.0
    ) -> KVBatchMeta:
        if task_name not in self.consumers.get(partition_id, []):
            raise KeyError(f"task {task_name!r} not registered as a consumer of partition {partition_id!r}")
        return self.client.claim_meta(
            task_name,
            partition_id=partition_id,
            required_fields=required_fields,
            batch_size=batch_size,
            timeout_s=timeout_s,
        )

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        return all(self.client.check_consumption_status(t, partition_id=partition_id) for t in task_names)


@pytest.fixture
def shim() -> Iterator[NemoStyleShim]:
    with dataplane.connect() as c:
        s = NemoStyleShim(c)
        s.register_partition("train", ["input_ids", "rewards"], 4, ["logprob", "train"])
        yield s


def _rows(n: int, at: int = 0) -> tuple[list[str], dict[str, torch.Tensor]]:
    return [f"s{i}" for i in range(at, at + n)], {"input_ids": torch.ones(n, 3), "rewards": torch.zeros(n)}


def test_peer_claim_meta_advances_consumption(shim: NemoStyleShim) -> None:
    keys, fields = _rows(4)
    shim.put_samples(keys, "train", fields)
    first = shim.claim_meta("train", "logprob", ["input_ids"], 2)
    second = shim.claim_meta("train", "logprob", ["input_ids"], 2)
    assert first.keys == ("s0", "s1") and second.keys == ("s2", "s3")
    assert not len(shim.claim_meta("train", "logprob", ["input_ids"], 2))
    assert shim.claim_meta("train", "train", ["input_ids", "rewards"], 4).keys == tuple(keys)  # another task


def test_peer_claim_meta_unregistered_task_raises(shim: NemoStyleShim) -> None:
    keys, fields = _rows(2)
    shim.put_samples(keys, "train", fields)
    with pytest.raises(KeyError):
        shim.claim_meta("train", "not-a-consumer", ["input_ids"], 2)
    # dataplane's own semantics under the shim: an unknown task is a fresh one, a bad name raises
    assert shim.client.claim_meta(
        "not-a-consumer", partition_id="train", required_fields="input_ids", batch_size=9
    ).keys
    with pytest.raises(ValueError):
        shim.client.claim_meta("", partition_id="train", required_fields="input_ids", batch_size=9)


def test_peer_check_consumption_status_only_true_when_all_consumed(shim: NemoStyleShim) -> None:
    assert not shim.check_consumption_status("train", ["logprob"])  # nothing put yet
    keys, fields = _rows(3)
    shim.put_samples(keys, "train", fields)
    shim.claim_meta("train", "logprob", ["input_ids"], 2)
    assert not shim.check_consumption_status("train", ["logprob"])
    shim.claim_meta("train", "logprob", ["input_ids"], 2)
    assert shim.check_consumption_status("train", ["logprob"])
    assert not shim.check_consumption_status("train", ["logprob", "train"])
    more, fields = _rows(1, at=3)
    shim.put_samples(more, "train", fields)
    assert not shim.check_consumption_status("train", ["logprob"])


def _producer(client: DataPlaneClient, pid: str, script: list[tuple[float, int]]) -> list[str]:
    """Put rows on a script of (delay before, rows), each row tagged with its length, then mark the
    partition finished; the keys put."""
    keys: list[str] = []
    for step, (delay, n) in enumerate(script):
        time.sleep(delay)
        lens = [3 + (7 * (len(keys) + i)) % 29 for i in range(n)]
        batch = [f"b{step}_r{i}" for i in range(n)]
        ids = torch.nested.as_nested_tensor([torch.arange(m) for m in lens], layout=torch.jagged)
        client.kv_batch_put(batch, {"ids": ids}, partition_id=pid, tags=[{"len": m} for m in lens])
        keys += batch
    client.mark_finished(partition_id=pid)
    return keys


@pytest.mark.parametrize(
    "url",
    [
        "memory://",
        pytest.param(
            "mooncake://local",
            marks=[
                pytest.mark.mooncake,
                pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed"),
            ],
        ),
    ],
)
def test_stream_feeds_two_dp_ranks_equal_microbatch_counts_while_rows_arrive(url: str) -> None:
    script = [(0.0, 5), (0.15, 3), (0.05, 9), (0.3, 1), (0.1, 6), (0.2, 4)]  # 28 rows, uneven and late
    with dataplane.connect(url) as c:
        pid = "stream-dp"
        produced: list[str] = []
        producer = threading.Thread(target=lambda: produced.extend(_producer(c, pid, script)))
        producer.start()
        steps = list(
            dataplane.stream(
                c,
                "train",
                partition_id=pid,
                required_fields="ids",
                batch_rows=8,
                dp_size=2,
                max_tokens_per_microbatch=40,
                length_tag="len",
                idle_timeout_s=30,
            )
        )
        producer.join()
        try:
            assert [sum(len(s) for s in shards) for shards in steps] == [8, 8, 8, 4]
            for shards in steps:
                assert len(shards) == 2
                plans = [s.extra_info["microbatches"] for s in shards]
                assert len(plans[0]) == len(plans[1]) >= 1, plans  # equal microbatch counts on both ranks
                for s, plan in zip(shards, plans, strict=True):
                    assert sorted(i for mb in plan for i in mb) == list(range(len(s)))
                    assert s.sequence_lengths == tuple(t["len"] for t in s.tags or ())
                    assert all(sum(s.sequence_lengths[i] for i in mb) <= 40 or len(mb) == 1 for mb in plan)
            streamed = [k for shards in steps for s in shards for k in s.keys]
            assert sorted(streamed) == sorted(produced) and len(streamed) == len(set(streamed))
            assert c.check_consumption_status("train", partition_id=pid)
        finally:
            c.kv_clear(partition_id=pid)


def test_stream_idle_timeout_stops_or_raises_and_async_for() -> None:
    with dataplane.connect() as c:
        c.kv_batch_put(["a", "b", "c"], {"x": torch.ones(3)}, partition_id="p")
        t0 = time.monotonic()
        got = list(dataplane.stream(c, "t", partition_id="p", required_fields="x", batch_rows=2, idle_timeout_s=0.3))
        assert [m.keys for m in got] == [("a", "b"), ("c",)] and time.monotonic() - t0 < 10  # no finish mark: timeout
        c.kv_batch_put(["d"], {"x": torch.ones(1)}, partition_id="p")
        s = dataplane.stream(
            c, "u", partition_id="p", required_fields="x", batch_rows=5, idle_timeout_s=0.2, on_timeout="raise"
        )
        with pytest.raises(DataPlaneTimeout):
            next(s)
        assert s.pending is not None and s.pending.keys == ("a", "b", "c", "d")  # claimed rows are kept, not lost
        c.mark_finished(partition_id="p")

        async def drain() -> list[tuple[str, ...]]:
            return [m.keys async for m in dataplane.stream(c, "v", partition_id="p", required_fields="x", batch_rows=3)]

        assert asyncio.run(drain()) == [("a", "b", "c"), ("d",)]


def test_claim_waits_for_min_rows_and_reorders_what_arrives_in_pieces() -> None:
    with dataplane.connect() as c:
        c.kv_batch_put(["a", "b"], {"y": torch.ones(2)}, partition_id="p")  # not ready: no x yet

        def later() -> None:
            time.sleep(0.1)
            c.kv_batch_put(["b"], {"x": torch.ones(1)}, partition_id="p")
            deadline = time.monotonic() + 20  # a only once the waiting claim holds b: two pieces for sure
            while c.consumption_status("t", partition_id="p", required_fields="x").claimed < 1:
                assert time.monotonic() < deadline, "the waiting claim never took b"
                time.sleep(0.01)
            c.kv_batch_put(["a"], {"x": torch.ones(1)}, partition_id="p")

        t = threading.Thread(target=later)
        t.start()
        meta = c.claim_meta("t", partition_id="p", required_fields="x", batch_size=2, min_rows=2, timeout_s=20)
        t.join()
        assert meta.keys == ("a", "b")  # claimed b first, then a: handed out in first-put order


def test_observed_client_and_status_record() -> None:
    events: list[Any] = []
    with ObservedClient(dataplane.connect(), events.append) as c:
        c.kv_batch_put(["a"], {"x": torch.ones(1)}, partition_id="p")
        assert c.claim_meta("t", partition_id="p", required_fields="x", batch_size=1).keys == ("a",)
        c.mark_finished(partition_id="p")
        status = c.consumption_status("t", partition_id="p")
        c.reset_consumption("t", partition_id="p")
        assert c.check_consumption_status("t", partition_id="p") is False
    ops = [e.op for e in events]
    assert ops[1:] == ["claim_meta", "mark_finished", "consumption_status", "reset_consumption", "consumption_status"]
    assert status == ConsumptionStatus(partition_id="p", task_name="t", claimed=1, ready=0, not_ready=0, finished=True)
    assert pickle.loads(pickle.dumps(status)) == status == ConsumptionStatus.from_dict(status.to_dict())
    assert status.all_consumed and status.drained and status.total == 1


def test_every_shipped_adapter_implements_claims() -> None:
    """The conformance suite skips claim tests for an adapter without them: make sure ours never are."""
    from dataplane.adapters.memory import MemoryStore

    stores: list[type[KVStore]] = [MemoryStore]
    try:
        from dataplane.adapters.mooncake import MooncakeStore

        stores.append(MooncakeStore)
    except ImportError:  # pragma: no cover - mooncake not installed
        pass
    from dataplane.adapters.transfer_queue import TQStore

    stores.append(TQStore)
    for store in stores:
        for name in ("claim", "consumption", "reset_claims", "mark_finished"):
            assert getattr(store, name) is not getattr(KVStore, name), (store.__name__, name)
