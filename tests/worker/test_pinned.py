"""The pinned pool's chunking and accounting on the CPU, and fetch / write-back through it on every
backend, bit-exact against the plain path (``data_plane_pinned="never"``). On a CPU the pool's
buffers are plain host memory and its copies synchronous; ``tests/worker/test_pinned_gpu.py`` runs
the overlapped CUDA path.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from test_worker import FIELDS, PAD, PARTITION, fingerprint, make_rows

import dataplane
from dataplane.worker import DataPlaneWorkerMixin
from dataplane.worker.pinned import PinnedPool, process_pool

DTYPES = [torch.int64, torch.int32, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8]


def sample(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 120, (numel,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copies_are_bit_exact_across_chunk_boundaries(dtype: torch.dtype) -> None:
    pool = PinnedPool(cap_bytes=64, chunk_bytes=16)
    sizes = [0, 1, 7, 16, 17, 63, 200]  # empty, under, at and across chunk edges, over the whole pool
    tensors = [sample(dtype, n, seed=n) for n in sizes]
    tensors.append(sample(dtype, 60, seed=9).view(6, 10)[:, ::2])  # not contiguous
    for out in (pool.to_device(tensors, torch.device("cpu")), pool.to_host(tensors)):
        for src, got in zip(tensors, out, strict=True):
            assert got.dtype == src.dtype and got.shape == src.shape and got.is_contiguous()
            assert torch.equal(got, src)
            assert got.numel() == 0 or got.data_ptr() != src.data_ptr(), "a copy, not the source"
    stats = pool.stats()
    assert stats["buffers_in_use"] == 0 and stats["allocated_bytes"] <= stats["cap_bytes"] == 64
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert stats["copied_bytes"] == 2 * total
    pool.close()
    assert pool.stats()["allocated_bytes"] == 0


def test_threads_share_the_pool_within_its_cap() -> None:
    pool = PinnedPool(cap_bytes=48, chunk_bytes=16)  # three buffers for eight threads
    errors: list[BaseException] = []
    results: dict[int, bool] = {}

    def copy(i: int) -> None:
        try:
            src = [sample(torch.float32, 100 + i, seed=i), sample(torch.int64, 37 * i, seed=i)]
            for _ in range(20):
                out = pool.to_device(src, torch.device("cpu")) + pool.to_host(src)
                results[i] = all(torch.equal(a, b) for a, b in zip(src + src, out, strict=True))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(results.values()) and len(results) == 8
    stats = pool.stats()
    assert stats["peak_bytes_in_use"] <= stats["cap_bytes"] and stats["allocated_bytes"] <= stats["cap_bytes"]
    assert stats["buffers_in_use"] == 0


def test_a_failing_copy_returns_its_buffers() -> None:
    pool = PinnedPool(cap_bytes=32, chunk_bytes=16)
    with pytest.raises(AttributeError):
        pool.to_device([torch.ones(40), "not a tensor"], torch.device("cpu"))  # type: ignore[list-item]
    assert pool.stats()["buffers_in_use"] == 0
    assert torch.equal(pool.to_device([torch.ones(40)], torch.device("cpu"))[0], torch.ones(40))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(dataplane.InvalidArgument, match="cap_bytes"):
        PinnedPool(cap_bytes=8, chunk_bytes=16)
    with pytest.raises(dataplane.InvalidArgument, match="chunk_bytes"):
        PinnedPool(chunk_bytes=0)


class Plain(DataPlaneWorkerMixin):
    pass


@pytest.mark.parametrize("url", ["memory://", "mooncake://local"])
def test_fetch_and_write_back_through_the_pool_equal_the_plain_path(url: str) -> None:
    if url.startswith("mooncake"):
        pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")
    keys, fields = make_rows(24)
    with dataplane.connect(url) as client:
        meta = client.kv_batch_put(keys, fields, partition_id=PARTITION)
        assert 0 in meta.sequence_lengths, "rows of length 0 are part of the case"
        meta = meta.with_extra_info(pad_to_length=max(meta.sequence_lengths) + 3)
        plain, pooled = Plain(), Plain()
        plain.data_plane_pinned, pooled.data_plane_pinned = "never", "always"
        for w in (plain, pooled):
            w.setup_data_plane(client)
        before = process_pool().stats()["copied_bytes"]
        for layout in ("jagged", "padded"):
            want = plain.fetch(meta, select_fields=FIELDS, layout=layout, pad_values=PAD, device="cpu")
            got = pooled.fetch(meta, select_fields=FIELDS, layout=layout, pad_values=PAD, device="cpu")
            assert fingerprint(got) == fingerprint(want), layout
        assert process_pool().stats()["copied_bytes"] > before, "the pooled fetch went through the pool"
        td = plain.fetch(meta, select_fields=["logp"])
        results: dict[str, Any] = {"old": td.get("logp").float(), "r": torch.arange(meta.size, dtype=torch.float32)}
        pooled.write_back(meta, results, token_fields=["old"])
        via_pool = client.kv_batch_get(meta, select_fields=["old", "r"])
        plain.write_back(meta, results, token_fields=["old"])
        direct = client.kv_batch_get(meta, select_fields=["old", "r"])
        assert torch.equal(via_pool.get("old").values(), direct.get("old").values())
        assert torch.equal(via_pool.get("old").offsets(), direct.get("old").offsets())
        assert torch.equal(via_pool.get("r"), direct.get("r"))
        pooled.close_data_plane()
        assert process_pool().stats()["buffers_in_use"] == 0


def test_a_buffer_whose_copy_never_ends_times_out_and_stays_in_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stuck copy's buffer raises DataPlaneTimeout (bounded, not a hang) and goes back to the pool:
    nothing stays checked out, and once its copy is done it serves again."""
    from dataplane.worker import pinned

    class Never:
        def query(self) -> bool:
            return False

    monkeypatch.setattr(pinned, "_WAIT_S", 0.05)
    pool = pinned.PinnedPool(cap_bytes=64, chunk_bytes=64)  # one buffer
    buf = pool._take()
    buf.event = Never()
    pool._give(buf)
    for _ in range(3):
        with pytest.raises(dataplane.DataPlaneTimeout, match="stuck"):
            pool._take()
        assert pool.stats()["buffers_in_use"] == 0
    buf.event = None  # the copy ended
    assert pool._take() is buf
