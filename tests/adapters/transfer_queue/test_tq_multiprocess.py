"""``tq://`` across processes: Ray actors attach with ``connect("tq://")`` and share rows bit-exactly.

The driver owns the deployment. A writer actor puts a batch, the driver and a reader actor read it;
then the writer closes its client (and later a worker is killed outright), and the deployment keeps
working for everyone else.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.meta import KVBatchMeta
from dataplane.testing.strategies import bit_exact, random_tensor

pytestmark = [pytest.mark.tq, pytest.mark.multiprocess]

FIELDS = ["ids", "logp", "adv", "mask", "msg"]


def make_batch(seed: int, n: int = 24) -> tuple[list[str], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 40, (n,), generator=g).tolist()
    lens[0] = 0  # a zero-length row
    keys = [f"s{seed}_r{i}" for i in range(n)]
    fields = {
        "ids": torch.nested.as_nested_tensor(
            [random_tensor((m,), torch.int64, seed + i) for i, m in enumerate(lens)], layout=torch.jagged
        ),
        "logp": torch.nested.as_nested_tensor(
            [random_tensor((m,), torch.bfloat16, seed + 100 + i) for i, m in enumerate(lens)], layout=torch.jagged
        ),
        "adv": random_tensor((n,), torch.float32, seed + 1),
        "mask": random_tensor((n, 3, 2), torch.bool, seed + 2),
        "msg": [{"turn": i, "text": "x" * (i % 7), "seed": seed} for i in range(n)],
    }
    return keys, fields


def plain(out: Any) -> dict[str, Any]:
    """A TensorDict from a get as picklable plain values (rows for jagged fields)."""
    res: dict[str, Any] = {}
    for f in FIELDS:
        v = out[f]
        if isinstance(v, torch.Tensor):
            res[f] = list(v.unbind()) if v.is_nested else v
        else:
            res[f] = list(v)
    return res


def check(got: dict[str, Any], keys: list[str], fields: dict[str, Any]) -> None:
    for f in ("ids", "logp"):
        want = list(fields[f].unbind())
        assert len(got[f]) == len(keys) and all(bit_exact(a, b) for a, b in zip(got[f], want, strict=True)), f
    for f in ("adv", "mask"):
        assert bit_exact(got[f], fields[f]), f
    assert got["msg"] == fields["msg"]


def _worker_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self) -> None:
            self.client: DataPlaneClient = dataplane.connect("tq://")  # attach, no arguments

        def put(self, seed: int, pid: str) -> KVBatchMeta:
            keys, fields = make_batch(seed)
            return self.client.kv_batch_put(keys, fields, partition_id=pid)

        def get(self, meta: KVBatchMeta) -> dict[str, Any]:
            return plain(self.client.kv_batch_get(meta, select_fields=FIELDS))

        def get_keys(self, keys: list[str], pid: str) -> dict[str, Any]:
            return plain(self.client.kv_batch_get(keys, partition_id=pid, select_fields=FIELDS))

        def close(self) -> None:
            self.client.close()

        def is_owner(self) -> bool:
            return bool(getattr(self.client, "store").deployment.owner)  # noqa: B009

    return Worker


class _Multiprocess:
    url = ""

    @pytest.fixture(scope="class")
    @classmethod
    def owner(cls, ray_cluster: None) -> Iterator[DataPlaneClient]:
        client = dataplane.connect(cls.url)
        yield client
        client.close()

    def test_actor_rows_bit_exact_everywhere(self, owner: DataPlaneClient) -> None:
        import ray

        worker = _worker_class()
        pid = f"mp-{self.url.split('=')[1].split('&')[0]}"
        writer, reader = worker.remote(), worker.remote()
        try:
            assert ray.get([writer.is_owner.remote(), reader.is_owner.remote()], timeout=120) == [False, False]
            keys, fields = make_batch(7)
            meta = ray.get(writer.put.remote(7, pid), timeout=120)
            assert list(meta.keys) == keys and meta.sequence_lengths[0] == 0
            check(plain(owner.kv_batch_get(meta, select_fields=FIELDS)), keys, fields)  # the driver
            check(ray.get(reader.get.remote(meta), timeout=120), keys, fields)  # another actor, by meta
            check(ray.get(reader.get_keys.remote(keys, pid), timeout=120), keys, fields)  # ... and by keys

            # the writer closes its client: the deployment goes on for the driver and the reader
            ray.get(writer.close.remote(), timeout=120)
            check(plain(owner.kv_batch_get(meta, select_fields=FIELDS)), keys, fields)
            check(ray.get(reader.get.remote(meta), timeout=120), keys, fields)
            keys2, fields2 = make_batch(8)
            meta2 = ray.get(reader.put.remote(8, pid), timeout=120)
            check(plain(owner.kv_batch_get(meta2, select_fields=FIELDS)), keys2, fields2)

            # a worker that dies without closing takes nothing with it (workers lend no storage)
            ray.kill(reader)
            check(plain(owner.kv_batch_get(meta2, select_fields=FIELDS)), keys2, fields2)
            fresh = worker.remote()
            check(ray.get(fresh.get.remote(meta), timeout=120), keys, fields)
            ray.kill(fresh)
        finally:
            for a in (writer, reader):
                ray.kill(a)
            owner.kv_clear(partition_id=pid)

    def test_clients_in_one_process_share_the_attachment(self, owner: DataPlaneClient) -> None:
        from dataplane.adapters.transfer_queue import attached_clients

        refs = attached_clients()
        extra = [dataplane.connect("tq://") for _ in range(3)]
        assert attached_clients() == refs + 3
        extra[0].kv_batch_put(["a"], {"x": torch.ones(1, 2)}, partition_id="share")
        extra[0].close()
        extra[0].close()
        assert extra[1].kv_batch_get(["a"], partition_id="share", select_fields="x")["x"].eq(1).all()
        for c in extra[1:]:
            c.close()
        assert attached_clients() == refs
        assert owner.kv_batch_get(["a"], partition_id="share", select_fields="x")["x"].eq(1).all()
        owner.kv_clear(partition_id="share")


# Soak only (CI time): on backend=simple, Ray actors joining and reading the owner's rows bit-exact
# run in CI through the README recipe (tests/multiprocess/test_join.py), and the deployment
# handling below (writer closing, worker killed) is the same code the mooncake class runs in CI.
@pytest.mark.soak
class TestTQSimpleMultiprocess(_Multiprocess):
    url = "tq://?backend=simple&timeout_s=60"


# soak only: 30 s of CI for what TestTQSimpleMultiprocess and the tq-mooncake conformance suite cover
@pytest.mark.mooncake
@pytest.mark.soak
class TestTQMooncakeMultiprocess(_Multiprocess):
    url = f"tq://?backend=mooncake&timeout_s=60&segment_bytes={256 << 20}"
