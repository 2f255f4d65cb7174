"""Fetch to a GPU and write-back from it through the pinned pool, on one CUDA device: bit-exact
against the plain path, two fetches in flight on different streams, a failing read that returns
every buffer, pinned memory within the cap. ``python -m benchmarks.gpu_path`` measures it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_worker import FIELDS, PAD, PARTITION, fingerprint, make_rows

import dataplane
from dataplane import KVBatchMeta
from dataplane.worker import DataPlaneWorkerMixin
from dataplane.worker.pinned import process_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

URLS = ["memory://", "mooncake://local"]


class Plain(DataPlaneWorkerMixin):
    pass


def _client(url: str) -> Any:
    if url.startswith("mooncake"):
        pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")
    return dataplane.connect(url)


@pytest.mark.parametrize("url", URLS)
def test_fetch_and_write_back_on_the_gpu_equal_the_cpu_path(url: str) -> None:
    keys, fields = make_rows(40)
    with _client(url) as client:
        meta = client.kv_batch_put(keys, fields, partition_id=PARTITION)
        plain, pooled, staged = Plain(), Plain(), Plain()
        plain.data_plane_pinned = "never"
        staged.data_plane_direct = False  # read first, then stage: the path before reads landed in the pool
        for w in (plain, pooled, staged):
            w.setup_data_plane(client)
        for layout in ("jagged", "padded"):
            want = plain.fetch(meta, select_fields=FIELDS, layout=layout, pad_values=PAD, device="cpu")
            for w in (pooled, staged):
                got = w.fetch(meta, select_fields=FIELDS, layout=layout, pad_values=PAD, device="cuda")
                assert got.get("ids").device.type == "cuda"
                assert fingerprint(got.cpu()) == fingerprint(want), layout
        lp = pooled.fetch(meta, select_fields=["logp"], device="cuda").get("logp").float() * 0.5
        plain.write_back(meta, {"old": lp.cpu()}, token_fields=["old"])
        want_old = client.kv_batch_get(meta, select_fields=["old"]).get("old")
        for w in (pooled, staged):
            w.write_back(meta, {"old": lp}, token_fields=["old"])
            via_pool = client.kv_batch_get(meta, select_fields=["old"]).get("old")
            assert torch.equal(via_pool.values(), want_old.values())
            assert torch.equal(via_pool.offsets(), want_old.offsets())
        stats = process_pool().stats()
        assert stats["buffers_in_use"] == 0 and stats["peak_bytes_in_use"] <= stats["cap_bytes"]


def test_two_fetches_in_flight_on_different_streams_do_not_mix() -> None:
    with dataplane.connect("memory://") as client:
        metas = []
        for seed in (1, 2):
            keys, fields = make_rows(64, seed=seed)
            metas.append(client.kv_batch_put(keys, fields, partition_id=f"{PARTITION}{seed}"))
        want = [fingerprint(_plain_fetch(client, m)) for m in metas]
        errors: list[BaseException] = []

        def loop(i: int) -> None:
            w = Plain()
            w.setup_data_plane(client)
            stream = torch.cuda.Stream()
            try:
                with torch.cuda.stream(stream):
                    for _ in range(20):
                        td = w.fetch(metas[i], select_fields=FIELDS, pad_values=PAD, device="cuda")
                        stream.synchronize()
                        assert fingerprint(td.cpu()) == want[i]
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a fetch hung"
        assert not errors, errors
        assert process_pool().stats()["buffers_in_use"] == 0


def _plain_fetch(client: Any, meta: KVBatchMeta, fields: list[str] = FIELDS) -> Any:
    w = Plain()
    w.data_plane_pinned = "never"
    w.setup_data_plane(client)
    return w.fetch(meta, select_fields=fields, pad_values=PAD, device="cpu")


def test_a_failing_read_raises_typed_and_returns_every_buffer() -> None:
    with dataplane.connect("memory://") as client:
        keys, fields = make_rows(8)
        meta = client.kv_batch_put(keys, fields, partition_id=PARTITION)
        bad = KVBatchMeta(
            partition_id=PARTITION, keys=[*meta.keys, "missing"], sequence_lengths=[*meta.sequence_lengths, 3]
        )
        w = Plain()
        w.setup_data_plane(client)
        with pytest.raises(dataplane.KeyNotFound, match="missing"):
            w.fetch(bad, select_fields=FIELDS, device="cuda")
        assert process_pool().stats()["buffers_in_use"] == 0
        assert fingerprint(w.fetch(meta, select_fields=FIELDS, pad_values=PAD, device="cuda").cpu()) == fingerprint(
            _plain_fetch(client, meta)
        )


def test_a_read_failing_mid_pipeline_raises_typed_and_returns_every_buffer() -> None:
    from test_read_into import FIELDS as MORE_FIELDS
    from test_read_into import _SeamStore, filled

    from dataplane.errors import DataPlaneError
    from dataplane.store_client import StoreClient

    store = _SeamStore()
    with StoreClient(store) as client:
        meta = filled(client)
        w = Plain()
        w.setup_data_plane(client)
        store.fail_after = 2  # the first field's window went to the GPU, the second read fails
        with pytest.raises(DataPlaneError, match="mid-read"):
            w.fetch(meta, select_fields=MORE_FIELDS, device="cuda")
        torch.cuda.synchronize()
        assert process_pool().stats()["buffers_in_use"] == 0
        store.fail_after = None
        got = w.fetch(meta, select_fields=MORE_FIELDS, pad_values=PAD, device="cuda")
        assert fingerprint(got.cpu()) == fingerprint(_plain_fetch(client, meta, MORE_FIELDS))
