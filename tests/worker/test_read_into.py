"""The worker's direct path on the CPU (``data_plane_direct``): a fetch that reads into the pinned pool
and a write-back whose host copies the store keeps, bit-exact against the plain path and the staged
one on every backend (those without the surfaces fall back), for jagged and padded layouts, rows of
length 0, several dtypes, rows from several puts; the GPU-direct seam; a read failing midway.
``tests/worker/test_pinned_gpu.py`` runs the same on a GPU."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from test_worker import PAD, PARTITION, fingerprint, make_rows

import dataplane
from dataplane import KVBatchMeta
from dataplane.adapters.memory import MemoryStore
from dataplane.errors import DataPlaneError
from dataplane.store_client import StoreClient
from dataplane.worker import DataPlaneWorkerMixin, pinned
from dataplane.worker.pinned import PinnedPool, process_pool

FIELDS = ["ids", "logp", "mask", "adv", "emb", "msgs", "i32", "f64", "u8"]
URLS = [
    "memory://",
    pytest.param("mooncake://local", marks=pytest.mark.mooncake),
    pytest.param("tq://?backend=simple", marks=pytest.mark.tq),
]


class Worker(DataPlaneWorkerMixin):
    pass


@pytest.fixture(autouse=True)
def small_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[PinnedPool]:
    """A pool of 4 chunks of 64 bytes: windows cut rows and elements at every field's edges."""
    pool = PinnedPool(cap_bytes=256, chunk_bytes=64)
    monkeypatch.setattr(pinned, "_PROCESS_POOL", pool)
    yield pool
    assert pool.stats()["buffers_in_use"] == 0
    assert pool.stats()["peak_bytes_in_use"] <= pool.stats()["cap_bytes"]
    pool.close()


def rows(n: int, seed: int) -> tuple[list[str], dict[str, Any]]:
    keys, fields = make_rows(n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in fields["ids"].offsets().diff()]
    fields["i32"] = torch.nested.as_nested_tensor(
        [torch.randint(-9, 9, (k, 2), generator=g, dtype=torch.int32) for k in lengths], layout=torch.jagged
    )
    fields["f64"] = torch.randn(n, generator=g, dtype=torch.float64)
    fields["u8"] = torch.nested.as_nested_tensor(
        [torch.randint(0, 255, (k + 1,), generator=g, dtype=torch.uint8) for k in lengths], layout=torch.jagged
    )
    return [f"s{seed}_{k}" for k in keys], fields


def filled(client: Any) -> KVBatchMeta:
    """Rows of two puts plus a rewrite of some, read in an order that alternates between them."""
    k1, f1 = rows(20, seed=1)
    k2, f2 = rows(20, seed=2)
    client.kv_batch_put(k1, f1, partition_id=PARTITION)
    client.kv_batch_put(k2, f2, partition_id=PARTITION)
    k3, f3 = rows(20, seed=1)  # the same keys as the first put, other values
    f3 = {f: v for f, v in f3.items()}
    f3["adv"] = f3["adv"] + 1
    client.kv_batch_put(k3[5:15], {f: _take(v, range(5, 15)) for f, v in f3.items()}, partition_id=PARTITION)
    keys = [k for pair in zip(k1, k2, strict=True) for k in pair]
    lengths = [0] * len(keys)
    meta = KVBatchMeta(partition_id=PARTITION, keys=keys, sequence_lengths=lengths)
    got = client.kv_batch_get(meta, select_fields=["ids"]).get("ids")
    lengths = [int(x) for x in got.offsets().diff()]
    assert 0 in lengths, "rows of length 0 are part of the case"
    return KVBatchMeta(partition_id=PARTITION, keys=keys, sequence_lengths=lengths, extra_info={"pad_to_length": 20})


def _take(value: Any, index: Sequence[int]) -> Any:
    if isinstance(value, list):
        return [value[i] for i in index]
    if value.is_nested:
        return torch.nested.as_nested_tensor([value[i] for i in index], layout=torch.jagged)
    return value[list(index)]


def _workers(client: Any) -> dict[str, Worker]:
    out = {"plain": Worker(), "staged": Worker(), "direct": Worker()}
    out["plain"].data_plane_pinned = "never"
    out["staged"].data_plane_pinned = out["direct"].data_plane_pinned = "always"
    out["staged"].data_plane_direct = False
    for w in out.values():
        w.setup_data_plane(client)
    return out


def _client(url: str) -> Any:
    return dataplane.connect(url)


@pytest.mark.parametrize("url", URLS)
def test_fetch_and_write_back_are_bit_exact_on_every_path(url: str, request: pytest.FixtureRequest) -> None:
    if url.startswith("tq"):
        request.getfixturevalue("ray_cluster")
    with _client(url) as client:
        meta = filled(client)
        workers = _workers(client)
        for layout in ("jagged", "padded"):
            got = {
                name: w.fetch(meta, select_fields=FIELDS, layout=layout, pad_values=PAD, device="cpu")
                for name, w in workers.items()
            }
            assert fingerprint(got["direct"]) == fingerprint(got["plain"]) == fingerprint(got["staged"]), layout
        td = workers["plain"].fetch(meta, select_fields=["logp", "i32"])
        mine = torch.arange(meta.size, dtype=torch.float32)
        results: dict[str, Any] = {"old": td.get("logp").float() * 0.5, "pair": td.get("i32"), "r": mine}
        written = {}
        for name in ("direct", "staged", "plain"):
            workers[name].write_back(meta, results, token_fields=["old"], check_lengths=False)
            written[name] = fingerprint(client.kv_batch_get(meta, select_fields=["old", "pair", "r"]))
        mine.fill_(-1)  # the caller's own tensor was copied, not kept
        assert client.kv_batch_get(meta, select_fields="r").get("r").tolist() == list(map(float, range(meta.size)))
        assert written["direct"] == written["plain"] == written["staged"]


def test_the_direct_path_copies_the_host_bytes_once(small_pool: PinnedPool) -> None:
    store = _SeamStore()
    with StoreClient(store) as client:
        meta = filled(client)
        workers = _workers(client)
        copied, gets, got = {}, {}, {}
        for name in ("staged", "direct"):
            before, store.gets = small_pool.stats()["copied_bytes"], 0
            got[name] = workers[name].fetch(meta, select_fields=FIELDS, layout="jagged", device="cpu")
            copied[name], gets[name] = small_pool.stats()["copied_bytes"] - before, store.gets
        values, offsets = 0, {}
        for f in FIELDS[:5] + FIELDS[6:]:  # not the object field: it decodes on the host
            v = got["direct"].get(f)
            values += v.values().nbytes if v.is_nested else v.nbytes
            if v.is_nested:
                offsets[v.offsets().data_ptr()] = v.offsets().nbytes
        # every byte of the tensor fields went through the pool once (offsets shared by fields once)...
        assert copied["direct"] == values + sum(offsets.values()) <= copied["staged"]
        # ... but only the staged path had read them into host memory of the get's first
        assert gets == {"staged": 1, "direct": 0}


class _SeamStore(MemoryStore):
    """A memory store whose reads say they take device memory (the GPU-direct seam) or fail midway."""

    direct = False
    fail_after: int | None = None
    gets = 0

    def get(self, partition_id: str, keys: Sequence[str], fields: Sequence[str], *, meta: Any, timeout_s: float) -> Any:
        self.gets += 1
        return super().get(partition_id, keys, fields, meta=meta, timeout_s=timeout_s)

    def begin_read_into(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], *, meta: Any, timeout_s: float
    ) -> Any:
        return _SeamRead(super().begin_read_into(partition_id, keys, fields, meta=meta, timeout_s=timeout_s), self)


class _SeamRead:
    def __init__(self, inner: Any, store: _SeamStore) -> None:
        self.inner, self.store, self.calls = inner, store, 0
        self.device_direct = store.direct
        self.sizes: list[int] = []

    @property
    def columns(self) -> Mapping[str, Any]:
        return self.inner.columns  # type: ignore[no-any-return]

    def read_into(self, field: str, start: int, dst: torch.Tensor) -> None:
        self.calls += 1
        self.sizes.append(dst.numel())
        if self.store.fail_after is not None and self.calls > self.store.fail_after:
            raise DataPlaneError("the store lost its connection mid-read")
        self.inner.read_into(field, start, dst)


def test_a_device_direct_read_gets_the_destination_itself(small_pool: PinnedPool) -> None:
    store = _SeamStore()
    store.direct = True
    with StoreClient(store) as client:
        meta = filled(client)
        direct, plain = Worker(), Worker()
        direct.data_plane_pinned, plain.data_plane_pinned = "always", "never"
        for w in (direct, plain):
            w.setup_data_plane(client)
        before = small_pool.stats()["copied_bytes"]
        got = direct.fetch(meta, select_fields=["ids", "adv"], device="cpu")
        offsets_bytes = 8 * (meta.size + 1)
        assert small_pool.stats()["copied_bytes"] - before == offsets_bytes, "only the offsets went through the pool"
        assert fingerprint(got) == fingerprint(plain.fetch(meta, select_fields=["ids", "adv"], device="cpu"))


def test_a_read_failing_midway_raises_typed_and_returns_every_buffer(small_pool: PinnedPool) -> None:
    store = _SeamStore()
    with StoreClient(store) as client:
        meta = filled(client)
        w = Worker()
        w.data_plane_pinned = "always"
        w.setup_data_plane(client)
        store.fail_after = 5  # windows of 64 bytes: several fields in
        with pytest.raises(DataPlaneError, match="mid-read"):
            w.fetch(meta, select_fields=FIELDS, device="cpu")
        assert small_pool.stats()["buffers_in_use"] == 0
        store.fail_after = None
        assert process_pool() is small_pool
        plain = Worker()
        plain.data_plane_pinned = "never"
        plain.setup_data_plane(client)
        want = plain.fetch(meta, select_fields=FIELDS, device="cpu")
        assert fingerprint(w.fetch(meta, select_fields=FIELDS, device="cpu")) == fingerprint(want)


def test_a_meta_of_another_store_still_raises_its_typed_error() -> None:
    with dataplane.connect("memory://") as a, dataplane.connect("memory://") as b:
        meta = a.kv_batch_put(["x"], {"t": torch.ones(1)}, partition_id=PARTITION)
        w = Worker()
        w.data_plane_pinned = "always"
        w.setup_data_plane(b)
        with pytest.raises(dataplane.DeploymentMismatch):
            w.fetch(meta, select_fields="t", device="cpu")
