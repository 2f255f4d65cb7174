"""Packaging-level promises: light import, registry, connect errors, observability, buffer pool."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dataplane
from dataplane._host import hostcopy
from dataplane._host.bufpool import BufferPool
from dataplane._host.hostcopy import copy_bytes, copy_spans, gather_bytes
from dataplane._host.threads import Helper
from dataplane.errors import BackendUnavailable, ClientClosed, InvalidArgument
from dataplane.observability import CallEvent, ObservedClient
from dataplane.registry import AdapterSpec


def test_import_does_not_import_backends() -> None:
    code = (
        "import sys, dataplane; c = dataplane.connect(); c.close(); "
        "bad = [m for m in ('ray', 'transfer_queue', 'mooncake') if m in sys.modules]; "
        "assert not bad, bad; print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


def test_missing_backend_names_the_extra() -> None:
    spec = AdapterSpec(scheme="x", target="nowhere:connect", requires=("surely_not_installed_pkg",), extra="x-extra")
    with pytest.raises(BackendUnavailable, match=r"pip install 'dataplane\[x-extra\]'"):
        spec.load()


def test_connect_errors_and_registration() -> None:
    with pytest.raises(InvalidArgument, match="no adapter"):
        dataplane.connect("nosuch://")
    with pytest.raises(InvalidArgument):
        dataplane.connect("memory")
    with pytest.raises(InvalidArgument, match="unknown memory"):
        dataplane.connect("memory://?bogus=1")
    for bad in ("memory://?capacity_rows=lots", "memory://?capacity_bytes=1e400", "memory://?timeout_s=soon"):
        with pytest.raises(InvalidArgument, match=r"is not valid|must be a size in bytes"):
            dataplane.connect(bad)
    seen = []

    def fake_connect(url: object, **kw: object) -> dataplane.DataPlaneClient:
        seen.append(url)
        return dataplane.connect("memory://")

    dataplane.register_adapter("mine", fake_connect)
    dataplane.connect("mine://x").close()
    assert seen == ["mine://x"] and dataplane.available_adapters()["mine"]
    assert dataplane.available_adapters()["memory"] is True


def test_named_memory_store_is_shared_until_last_close() -> None:
    a = dataplane.connect("memory://shared-test")
    b = dataplane.connect("memory://shared-test")
    a.kv_batch_put(["k"], {"x": torch.ones(1)}, partition_id="p")
    assert b.kv_batch_get(["k"], partition_id="p", select_fields="x")["x"].tolist() == [1.0]
    a.close()
    assert "k" in b.kv_list("p")["p"]
    b.close()
    c = dataplane.connect("memory://shared-test")
    assert c.kv_list() == {}
    c.close()


def test_observed_client_events_and_snapshot() -> None:
    events: list[CallEvent] = []
    client = ObservedClient(dataplane.connect(), callback=events.append)
    client.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 8)}, partition_id="p")  # 64 bytes
    client.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 8)}, partition_id="p")  # replaces, no growth
    client.kv_batch_put(["a", "b"], {"y": torch.zeros(2, 4)}, partition_id="p")  # adds 32
    client.kv_batch_get(["a"], partition_id="p", select_fields=["x"])
    with pytest.raises(KeyError):
        client.kv_batch_get(["zz"], partition_id="p", select_fields=["x"])
    snap = client.snapshot()
    assert snap["bytes_outstanding"] == 96 and snap["bytes_peak"] == 96
    client.kv_clear(["a"], partition_id="p")
    assert client.snapshot()["bytes_outstanding"] == 48
    assert [e.op for e in events][:4] == ["kv_batch_put"] * 3 + ["kv_batch_get"]
    assert events[3].bytes == 32 and events[3].n_keys == 1 and events[4].status == "KeyNotFound"
    assert snap["ops"]["kv_batch_get"]["count"] == 2 and snap["ops"]["kv_batch_get"]["errors"] == 1
    assert snap["ops"]["kv_batch_put"]["p50_s"] > 0
    client.close()


def test_empty_goes_through_the_store_and_fails_after_close() -> None:
    inner = dataplane.connect()
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []
    empty = inner.store.empty  # type: ignore[attr-defined]
    inner.store.empty = lambda shape, dtype: seen.append((shape, dtype)) or empty(shape, dtype)  # type: ignore[attr-defined]
    client = ObservedClient(inner)  # the wrapper hands out the store's memory too
    t = client.empty([4, 3], torch.bfloat16)
    assert t.shape == (4, 3) and t.dtype == torch.bfloat16 and seen == [((4, 3), torch.bfloat16)]
    client.close()
    with pytest.raises(ClientClosed):
        client.empty(1)


def test_decode_thread_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPLANE_DECODE_THREAD", "sometimes")
    with pytest.raises(InvalidArgument, match="auto, 1 or 0"):
        dataplane.connect()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    for mode, on in (("1", True), ("off", False), ("auto", False)):
        monkeypatch.setenv("DATAPLANE_DECODE_THREAD", mode)
        with dataplane.connect() as c:
            assert (c._beside is not None) is on  # type: ignore[attr-defined]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    with dataplane.connect() as c:  # auto, with a core beside this one
        assert c._beside is not None  # type: ignore[attr-defined]
        assert c.kv_batch_get(  # a store that moves no bytes in finish decodes in line
            c.kv_batch_put(["a"], {"x": torch.ones(1)}, partition_id="p"), select_fields="x"
        )["x"].tolist() == [1.0]
        assert not c._beside.started  # type: ignore[attr-defined]  # its helper thread never started


def test_helper_thread_runs_calls_in_order_and_hands_back_results_and_errors() -> None:
    helper = Helper("dataplane-test")
    assert not helper.started
    gate = threading.Event()
    first = helper.submit(lambda: gate.wait(5) and threading.current_thread().name)
    second = helper.submit(lambda: 1 / 0)
    with pytest.raises(TimeoutError):  # a bounded wait: the first call is still blocked
        first.result(timeout=0.05)
    gate.set()
    assert first.result(timeout=5) == "dataplane-test" and helper.started
    with pytest.raises(ZeroDivisionError):
        second.result(timeout=5)
    helper.close()
    assert not helper.started
    assert helper.submit(lambda: 7).result(timeout=5) == 7  # started again on demand
    helper.close()


def test_helper_thread_keeps_nothing_a_call_returned_once_its_caller_drops_it() -> None:
    """What a call returned (a get's tensors, in shared memory a later client reuses) is freed when
    the caller lets go, not held by the idle helper until its next call."""

    class Result:
        pass

    helper = Helper("dataplane-test")
    task = helper.submit(Result)
    gone = weakref.ref(task.result(timeout=5))
    del task
    for _ in range(100):  # the helper drops its reference right after the call, on its own thread
        gc.collect()
        if gone() is None:
            break
        time.sleep(0.01)
    assert gone() is None
    helper.close()


def test_copy_bytes_is_exact_for_any_size_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))  # split over helper threads
    for n in (0, 1, 4097, (4 << 20) - 3, (9 << 20) + 5, 17 << 20):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        copy_bytes(dst, src)
        assert torch.equal(dst, src), n
    src = torch.randn(3 << 20, dtype=torch.bfloat16, requires_grad=True)  # 6 MiB, two pieces
    dst = torch.empty(src.numel() * 2, dtype=torch.uint8)
    copy_bytes(dst, src)
    assert torch.equal(dst.view(torch.bfloat16), src.detach())
    with pytest.raises(ValueError, match="bytes into"):
        copy_bytes(torch.empty(3, dtype=torch.uint8), torch.empty(1, dtype=torch.float32))


@given(
    spans=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(0, 9), st.integers(0, 2)), max_size=40),
    sources=st.integers(1, 3),
    shuffle=st.randoms(use_true_random=False),
    unit=st.sampled_from([1, 2, 3, 4, 8, 16]),
    index=st.sampled_from([None, 0, 1 << 30]),
    block=st.sampled_from([1, 5, 1 << 20]),
)
@settings(max_examples=400)  # cheap examples, wide inputs
def test_copy_spans_matches_a_loop_of_slice_copies(
    spans: list[tuple[int, int, int, int]],
    sources: int,
    shuffle: random.Random,
    unit: int,
    index: int | None,
    block: int,
) -> None:
    """Spans from several sources, overlapping in a source, adjacent (merged) or empty (skipped), of
    any byte multiple, landing in any order with or without gaps between them: the bytes are those
    of a plain loop, by slices or by element index (in blocks of any size), and nothing outside the
    spans is written. One source, landing back to back in order, is ``gather_bytes``."""
    srcs = [torch.randint(0, 256, (80 * unit + 3,), dtype=torch.uint8) for _ in range(sources)]  # not whole words
    which = np.array([w % sources for w, _, _, _ in spans], dtype=np.int64)
    sizes = np.array([m * unit for _, _, m, _ in spans], dtype=np.int64)
    gaps = np.array([g * unit for _, _, _, g in spans], dtype=np.int64)
    starts = np.array([a * unit for _, a, _, _ in spans], dtype=np.int64)
    for k in range(1, len(spans)):  # often right after the one before (in its source or another)
        if spans[k][1] % 3 == 0:
            starts[k] = min(starts[k - 1] + sizes[k - 1], 70 * unit)
    place = list(range(len(spans)))  # where each span lands: in this order, with its gap before it
    if shuffle.random() < 0.5:
        shuffle.shuffle(place)
    lands = np.zeros(len(spans), dtype=np.int64)
    at = 0
    for k in place:
        at += int(gaps[k])
        lands[k] = at
        at += int(sizes[k])
    want = torch.full((at + unit,), 7, dtype=torch.uint8)
    for w, a, s, m in zip(which.tolist(), lands.tolist(), starts.tolist(), sizes.tolist(), strict=True):
        want[a : a + m] = srcs[w][s : s + m]
    pieces = zip(which.tolist(), starts.tolist(), sizes.tolist(), strict=True)
    flat = torch.cat([srcs[w][s : s + m] for w, s, m in pieces]) if spans else srcs[0][:0]
    saved = hostcopy._INDEX_BELOW, hostcopy._INDEX_BLOCK, hostcopy._SPANS_PER_SOURCE
    if index is not None:  # 0: always slices; huge: always the element index
        hostcopy._INDEX_BELOW = index
        hostcopy._SPANS_PER_SOURCE = 0
    hostcopy._INDEX_BLOCK = block
    try:
        dst = torch.full_like(want, 7)
        copy_spans(dst, srcs, None if sources == 1 else which, lands, starts, sizes)
        one = torch.full((int(sizes.sum()),), 7, dtype=torch.uint8)
        if sources == 1:
            gather_bytes(one, srcs[0], starts, sizes)
    finally:
        hostcopy._INDEX_BELOW, hostcopy._INDEX_BLOCK, hostcopy._SPANS_PER_SOURCE = saved
    assert torch.equal(dst, want)
    if sources == 1:
        assert torch.equal(one, flat)


def test_buffer_pool_reuses_slabs_only_after_release() -> None:
    new: list[int] = []
    pool = BufferPool(64 << 20, min_bytes=1 << 20, on_new=lambda s: new.append(s.nbytes))
    a = pool.empty(3 << 20).view(torch.float32)
    ptr = a.data_ptr()
    b = pool.empty(3 << 20)
    assert b.data_ptr() != ptr and len(new) == 2
    del a
    gc.collect()
    c = pool.empty(3 << 20)
    assert c.data_ptr() == ptr and len(new) == 2 and pool.hits == 1
    small = pool.empty(100)
    assert small.numel() == 100 and len(new) == 2
    big = pool.empty(100 << 20)  # over the budget: a plain allocation
    assert big.numel() == 100 << 20 and len(new) == 2
    pool.close()


def test_buffer_pool_carves_large_entries_from_one_slab() -> None:
    new: list[int] = []
    pool = BufferPool(64 << 20, on_new=lambda s: new.append(s.nbytes))
    carved = pool.carve({"ids": (2 << 20) + 3, "logp": 1 << 20, "reward": 1024})
    assert set(carved) == {"ids", "logp"} and len(new) == 1  # the small one gets no slice
    ids, logp = carved.pop("ids"), carved.pop("logp")
    assert ids.numel() == (2 << 20) + 3 and logp.numel() == 1 << 20
    assert logp.data_ptr() - ids.data_ptr() == (2 << 20) + 64  # next 64-byte boundary, no overlap
    slab = ids.data_ptr()
    del ids
    gc.collect()
    assert pool.carve({"x": 1 << 20, "y": 2 << 20})["x"].data_ptr() != slab  # logp still holds the slab
    del logp
    gc.collect()
    again = pool.carve({"ids": (2 << 20) + 3, "logp": 1 << 20})
    assert again["ids"].data_ptr() == slab and pool.carve({"r": 10}) == {}
    pool.close()


def test_buffer_pool_alloc_hook_makes_every_buffer() -> None:
    made: list[int] = []
    dropped: list[int] = []

    def alloc(n: int) -> np.ndarray:
        made.append(n)
        return np.zeros(n, dtype=np.uint8)

    pool = BufferPool(4 << 20, min_bytes=1, alloc=alloc, on_drop=lambda a: dropped.append(a.nbytes))
    pooled = pool.empty(3 << 20)  # a slab of its size class
    small = pool.empty(10)  # pooled too (min_bytes=1)
    over = pool.empty(2 << 20)  # beyond max_bytes: still from alloc, dropped when its tensor dies
    assert len(made) == 3 and made[-1] == 2 << 20 and over.numel() == 2 << 20
    del over
    gc.collect()
    assert dropped == [2 << 20]
    del pooled, small
    gc.collect()
    assert len(dropped) == 1  # pooled slabs go back to the pool, not to on_drop
    pool.close()
    assert len(dropped) == 3


def test_slot_lookup_marks_absent_keys() -> None:
    """Every key present (one C-level pass), some absent, one key, none, an empty map: the slot of
    each key, or NONE."""
    from dataplane._host.slots import NONE, lookup

    rows = {"a": 3, "b": 0, "c": 7}
    assert lookup(rows, ["c", "a", "b"]).tolist() == [7, 3, 0]
    assert lookup(rows, ["b"]).tolist() == [0]
    assert lookup(rows, ["a", "zz", "c", "yy"]).tolist() == [3, NONE, 7, NONE]
    assert lookup(rows, ["zz"]).tolist() == [NONE]
    assert lookup(rows, []).tolist() == []
    assert lookup({}, ["a", "b"]).tolist() == [NONE, NONE]
    assert lookup(rows, ("a", "c")).dtype == np.int64
