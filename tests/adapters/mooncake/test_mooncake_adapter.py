"""What the Mooncake adapter promises beyond the shared suite: round trips per call, zero copy, stale
hints, GC, key rules, chunking, typed errors and the fork guard (real Mooncake processes)."""

from __future__ import annotations

import ctypes
import importlib.util
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataplane
from dataplane import store_client as store_module
from dataplane._host.mooncake_master import child_env
from dataplane.adapters.mooncake import HINT_KEY, MooncakeConfig, _get, _handle, _partitions, _read, parse_bytes
from dataplane.adapters.mooncake._clear import _ids_before
from dataplane.adapters.mooncake._fold import PartitionState
from dataplane.adapters.mooncake._index import decode_index, index_object_bytes
from dataplane.adapters.mooncake._partitions import _STAGE_BYTES
from dataplane.adapters.mooncake._servers import STREAMING_COPY_ENV, STREAMING_COPY_TUNABLE, store_server_env
from dataplane.codec.jagged import round_up
from dataplane.columns import first_write
from dataplane.errors import (
    BackendUnavailable,
    CapacityExceeded,
    ClientClosed,
    InvalidArgument,
    KeyNotFound,
    SchemaError,
)
from dataplane.meta import KVBatchMeta
from dataplane.store_client import StoreClient
from dataplane.testing.strategies import bit_exact

ROOT = Path(__file__).resolve().parents[3]
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
needs_mooncake = [
    pytest.mark.mooncake,
    pytest.mark.skipif(not HAVE_MOONCAKE, reason="Mooncake is not installed (pip install 'dataplane[mooncake]')"),
]


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _failing_read(*args: Any) -> list[int]:
    raise BackendUnavailable("planted read failure")


# -- configuration (no Mooncake needed) -----------------------------------------------------------
def test_url_options() -> None:
    cfg = MooncakeConfig.from_url("mooncake://local?segment_bytes=256MiB&ns=job1&timeout_s=5")
    assert cfg.master is None and cfg.segment_bytes == 256 << 20 and cfg.ns == "job1" and cfg.timeout_s == 5
    cfg = MooncakeConfig.from_url("mooncake://10.0.0.1:50051?metrics_port=9100&protocol=rdma&rdma_devices=mlx5_0")
    assert cfg.master == "10.0.0.1:50051" and cfg.metrics_port == 9100
    assert cfg.protocol == "rdma" and cfg.rdma_devices == "mlx5_0"
    assert MooncakeConfig.from_url("mooncake://local", pool_bytes="1GiB").pool_bytes == 1 << 30
    assert parse_bytes("1.5GB") == int(1.5 * (1 << 30)) and parse_bytes(4096) == 4096
    for bad in (
        "mooncake://local?nope=1",
        "mooncake://host-without-port",
        "mooncake://local?ns=a/b",
        "mooncake://10.0.0.1:50051?metrics_port=x",
        "mooncake://local?timeout_s=soon",
    ):
        with pytest.raises(InvalidArgument):
            MooncakeConfig.from_url(bad)
    with pytest.raises(InvalidArgument):
        MooncakeConfig.from_url("mooncake://local?protocol=udp")


def test_store_servers_stream_large_copies_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = f"{STREAMING_COPY_TUNABLE}=0x40000"
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(STREAMING_COPY_ENV, raising=False)
    assert store_server_env()["GLIBC_TUNABLES"] == ours
    assert "GLIBC_TUNABLES" not in child_env()  # only the store server: the processes that copy
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert store_server_env()["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{ours}"  # the user's kept
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.arena_max=2:{STREAMING_COPY_TUNABLE}=0x100000")
    assert store_server_env()["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{STREAMING_COPY_TUNABLE}=0x100000"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.setenv(STREAMING_COPY_ENV, "0")
    assert store_server_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


@given(st.integers(1, 10**19 - 1), st.integers(0, 10**19 - 1))
def test_the_orphan_sweep_matches_put_ids_begun_before_its_time(t_ns: int, put_ns: int) -> None:
    """The clear's regex (Mooncake's ECMAScript accepts this subset as Python's re does)."""
    for put in (put_ns, t_ns - 1, t_ns, min(t_ns + 1, 10**19 - 1)):
        assert bool(re.match(f"^({_ids_before(t_ns)})-", f"{put:019d}-w1")) == (put < t_ns)


# -- one deployment for the rest of the module ----------------------------------------------------
@pytest.fixture(scope="module", params=[True, False], ids=["shm", "tcp"])
def owner(request: pytest.FixtureRequest) -> Iterator[StoreClient]:
    """A ``mooncake://local`` deployment, its clients attached through shared memory or over TCP."""
    if not HAVE_MOONCAKE:
        pytest.skip("Mooncake is not installed")
    c = dataplane.connect(f"mooncake://local?segment_bytes=256MiB&timeout_s=60&shm={request.param}")
    assert isinstance(c, StoreClient)
    yield c
    c.close()


def _joined(owner: StoreClient) -> Iterator[StoreClient]:
    """Another client of ``owner``'s deployment (its own Mooncake client and caches), closed after."""
    c = dataplane.connect(owner.store.join_url)  # type: ignore[attr-defined]
    assert isinstance(c, StoreClient)
    yield c
    c.close()


@pytest.fixture(scope="module")
def other(owner: StoreClient) -> Iterator[StoreClient]:
    """A second client of the same deployment."""
    yield from _joined(owner)


@pytest.fixture(scope="module")
def judge(owner: StoreClient) -> Iterator[StoreClient]:
    """A third client that never writes: what its listing says of a partition's schema."""
    yield from _joined(owner)


def _all_keys(client: StoreClient) -> list[str]:
    port = client.store.deployment.master.metrics_port  # type: ignore[attr-defined]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/get_all_keys", timeout=5) as r:
        return [k for k in r.read().decode().split("\n") if k]


def _recording(log: list[tuple[str, str]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, noting its name and the calling thread's in ``log`` first."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log.append((name, threading.current_thread().name))
        return fn(*args, **kwargs)

    return wrapper


def _recording_args(log: list[tuple[str, Any]], name: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` of one argument, noting its name and the argument in ``log`` first."""

    def wrapper(arg: Any) -> Any:
        log.append((name, arg))
        return fn(arg)

    return wrapper


def _rewritten_after_read(
    owner: StoreClient, pid: str, real: Callable[..., list[int]], kind: str, fired: list[list[str]]
) -> Callable[..., list[int]]:
    """``get_into`` that, right after its first read of objects whose keys contain ``kind`` (``/d/``
    data, ``/i/`` index), clears partition ``pid``, puts rows a and b of 7.0 there, and overwrites
    the read's buffers: the bytes a put filling the freed space would have left (noted in ``fired``)."""

    def get_into(keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        codes = real(keys, ptrs, sizes)
        if not fired and any(kind in k for k in keys):
            fired.append(keys)
            owner.kv_clear(partition_id=pid)
            owner.kv_batch_put(["a", "b"], {"x": torch.full((2, 8), 7.0)}, partition_id=pid)
            for ptr, n in zip(ptrs, sizes, strict=True):
                ctypes.memset(ptr, 0xFF, n)
        return codes

    return get_into


def _record_get_calls(monkeypatch: pytest.MonkeyPatch, client: Any, log: list[tuple[str, str]]) -> None:
    """Note in ``log`` each read, index decode and listing of ``client``'s gets, with its thread."""
    store = client.store
    for obj, name in ((store.handle, "get_into"), (store, "_hints"), (store.admin, "start_all_keys")):
        monkeypatch.setattr(obj, name, _recording(log, name, getattr(obj, name)))


class _Spy:
    """Counts calls to methods of an object (listing, Mooncake batch calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, obj: Any, names: list[str]) -> None:
        self.calls: dict[str, int] = dict.fromkeys(names, 0)
        self.args: dict[str, list[tuple[Any, ...]]] = {name: [] for name in names}
        for name in names:
            monkeypatch.setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.args[name].append(args)
            return fn(*args, **kwargs)

        return wrapper


@pytest.mark.mooncake
@pytest.mark.skipif(not HAVE_MOONCAKE, reason="Mooncake is not installed")
class TestMooncakeAdapter:
    def test_round_trips_per_call(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        rows = [torch.arange(n) for n in (3, 1, 4)]
        fields = {"ids": _jagged(rows), "r": torch.tensor([1.0, 2.0, 3.0]), "msg": ["a", "b", "c"]}
        store = other.store
        monkeypatch.setattr(
            _partitions, "_QUERY_COST", 0
        )  # the check after a read queries, however few keys are listed
        spy_admin = _Spy(monkeypatch, store.admin, ["start_all_keys", "start_existing"])  # type: ignore[attr-defined]
        spy_mc = _Spy(monkeypatch, store.handle, ["put_from", "get_into", "get_ranges"])  # type: ignore[attr-defined]
        meta = owner.kv_batch_put(["a", "b", "c"], fields, partition_id="rt")
        try:
            out = other.kv_batch_get(meta, select_fields=["ids", "r", "msg"])  # by meta: data read + listing
            assert [r.tolist() for r in out["ids"].unbind()] == [r.tolist() for r in rows]
            assert spy_admin.calls == {"start_all_keys": 1, "start_existing": 0}
            assert spy_mc.calls == {"put_from": 0, "get_into": 1, "get_ranges": 0}
            meta2 = owner.kv_batch_put(["a", "b", "c"], {"adv": torch.zeros(3)}, partition_id="rt")
            # by keys, an unseen put: listing, index read, query (the index is trusted once still
            # there after its read), data read, query (so is the data)
            other.kv_batch_get(["a", "c"], partition_id="rt", select_fields=["adv", "r"])
            assert spy_admin.calls == {"start_all_keys": 2, "start_existing": 2} and spy_mc.calls["get_into"] == 3
            other.kv_batch_get(["a", "c"], partition_id="rt", select_fields=["adv"])  # seen: listing, data, query
            assert spy_admin.calls == {"start_all_keys": 3, "start_existing": 3} and spy_mc.calls["get_into"] == 4
            other.kv_batch_get(meta2, select_fields=["adv"])  # steady state: data read + listing
            assert spy_admin.calls == {"start_all_keys": 4, "start_existing": 3} and spy_mc.calls["get_into"] == 5
            other.kv_batch_put(["d"], {"r": torch.tensor([4.0])}, partition_id="rt")  # listing + one batch write
            assert spy_admin.calls["start_all_keys"] == 5 and spy_mc.calls["put_from"] == 1
            other.kv_batch_put(["e"], {"r": torch.tensor([5.0])}, partition_id="rt")  # its own put: query + write
            assert spy_admin.calls == {"start_all_keys": 5, "start_existing": 4} and spy_mc.calls["put_from"] == 2
        finally:
            owner.kv_clear(partition_id="rt")

    def test_stale_hint_never_returns_stale_data(self, owner: StoreClient, other: StoreClient) -> None:
        old = owner.kv_batch_put(["a", "b"], {"x": torch.tensor([1, 2])}, partition_id="stale")
        try:
            assert other.kv_batch_get(old, select_fields="x")["x"].tolist() == [1, 2]
            owner.kv_batch_put(["b"], {"x": torch.tensor([20])}, partition_id="stale")
            assert other.kv_batch_get(old, select_fields="x")["x"].tolist() == [1, 20]
            owner.kv_clear(["a"], partition_id="stale")
            with pytest.raises(KeyNotFound, match="'a'"):
                other.kv_batch_get(old, select_fields="x")
            owner.kv_clear(partition_id="stale")
            with pytest.raises(KeyNotFound):
                other.kv_batch_get(old.subset([1]), select_fields="x")
        finally:
            owner.kv_clear(partition_id="stale")

    def test_fields_with_equal_row_lengths_store_their_offsets_once(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Fields built as separate nested tensors with the same row lengths (a rollout's token
        fields, each its own tensor) share one offsets array in the index, so a get plans their rows
        once; a field with other lengths keeps its own. What is read back is unchanged."""
        lens = [3, 0, 5]
        ids = _jagged([torch.arange(n) for n in lens])
        lp = _jagged([torch.randn(n, 2).to(torch.bfloat16) for n in lens])  # equal, not the same tensor
        other_lens = _jagged([torch.arange(n) for n in (1, 2, 5)])  # same total, other rows
        assert ids.offsets() is not lp.offsets()
        pid = "shared-offsets"
        try:
            meta = owner.kv_batch_put(["a", "b", "c"], {"ids": ids, "lp": lp, "o": other_lens}, partition_id=pid)
            ((key, body),) = meta.extra_info[HINT_KEY].items()
            index = decode_index(key, key.rsplit("/", 1)[1].rsplit(".", 1)[0], body)
            entries = index.fields
            assert entries["ids"].offsets is entries["lp"].offsets
            assert entries["o"].offsets is not entries["ids"].offsets
            spans = _Spy(monkeypatch, _read._Spans, ["of"])
            got = other.kv_batch_get(["c", "a"], partition_id=pid, select_fields=["ids", "lp", "o"])
            assert spans.calls["of"] == 2  # ids and lp together, o alone
            assert [r.tolist() for r in got["ids"].unbind()] == [list(range(5)), list(range(3))]
            assert bit_exact(got["lp"].values(), torch.cat([lp.unbind()[2], lp.unbind()[0]]))
            assert [r.tolist() for r in got["o"].unbind()] == [list(range(5)), [0]]
        finally:
            owner.kv_clear(partition_id=pid)

    def test_get_of_one_whole_put_skips_folding_rows(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        rows = [torch.arange(n) for n in (3, 1, 4)]
        keys = ["a", "b", "c"]
        meta = owner.kv_batch_put(
            keys, {"ids": _jagged(rows), "m": _jagged([r > 1 for r in rows])}, partition_id="fast"
        )
        spy = _Spy(monkeypatch, PartitionState, ["apply"])
        try:
            out = other.kv_batch_get(meta, select_fields=["ids", "m"])
            assert spy.calls["apply"] == 0  # resolved from the listing and the meta's index alone
            assert [r.tolist() for r in out["ids"].unbind()] == [r.tolist() for r in rows]
            assert out["ids"]._offsets is out["m"]._offsets  # one ragged dim
            back = other.kv_batch_get(keys[::-1], partition_id="fast", select_fields=["ids"])  # by keys: folded
            assert spy.calls["apply"] == 1
            assert [r.tolist() for r in back["ids"].unbind()] == [r.tolist() for r in rows[::-1]]
            owner.kv_batch_put(["b"], {"ids": _jagged([torch.tensor([7, 7])])}, partition_id="fast")
            again = other.kv_batch_get(meta, select_fields="ids")  # another put listed: the checked path
            assert [r.tolist() for r in again["ids"].unbind()] == [[0, 1, 2], [7, 7], [0, 1, 2, 3]]
        finally:
            owner.kv_clear(partition_id="fast")

    def test_each_step_reads_its_put_without_folding_after_the_writer_clears(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        spy = _Spy(monkeypatch, PartitionState, ["apply"])
        try:
            for step in range(3):  # the RL loop: put, read by meta, writer clears
                meta = owner.kv_batch_put(["a", "b"], {"x": torch.tensor([step, -step])}, partition_id="steps")
                assert other.kv_batch_get(meta, select_fields="x")["x"].tolist() == [step, -step]
                owner.kv_clear(partition_id="steps")
            assert spy.calls["apply"] == 0  # the reader's cache of earlier, cleared steps is dropped, not folded
            with pytest.raises(KeyNotFound, match="no longer in the store"):
                other.kv_batch_get(meta, select_fields="x")
        finally:
            owner.kv_clear(partition_id="steps")

    def test_an_unread_listing_answer_is_never_taken_for_a_later_one(
        self, owner: StoreClient, other: StoreClient
    ) -> None:
        admin = owner.store.admin  # type: ignore[attr-defined]
        admin.start_all_keys(5.0)  # asked, never read (as when the caller raises in between)
        other.kv_batch_put(["z"], {"x": torch.ones(1)}, partition_id="unread")
        try:
            assert any("/i/" in k and "unread" in k for k in admin.all_keys(5.0))  # the fresh answer
        finally:
            other.kv_clear(partition_id="unread")

    def test_a_put_asks_for_the_listing_before_checking_its_arguments(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        order: list[tuple[str, str]] = []
        admin = other.store.admin  # type: ignore[attr-defined]
        monkeypatch.setattr(admin, "start_all_keys", _recording(order, "listing", admin.start_all_keys))
        monkeypatch.setattr(store_module, "check_keys", _recording(order, "check", store_module.check_keys))
        try:
            other.kv_batch_put(["a", "b"], {"x": torch.ones(2)}, partition_id="early")
            assert [name for name, _ in order] == ["listing", "check"]
            with pytest.raises(InvalidArgument, match="unique"):  # asked, then refused (the answer left unread)
                other.kv_batch_put(["c", "c"], {"x": torch.ones(2)}, partition_id="early")
            with pytest.raises(SchemaError):  # the next put still checks against the first one
                other.kv_batch_put(["d"], {"x": torch.ones(1, dtype=torch.int8)}, partition_id="early")
            other.kv_batch_put(["e"], {"x": torch.ones(1)}, partition_id="early")
            assert sorted(other.kv_list("early")["early"]) == ["a", "b", "e"]  # the refused puts wrote nothing
        finally:
            other.kv_clear(partition_id="early")

    def test_a_put_into_a_partition_it_wrote_before_asks_only_for_its_own_puts(
        self, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The listing costs ~1 us per key in the master (anyone's): rows put one at a time made each
        put list every earlier put. Once a client has put a field, its next put of that field with the
        same schema asks only whether its own put is still there; a new field or another schema lists."""
        pid, store = "mine", other.store
        spy = _Spy(monkeypatch, store.admin, ["start_all_keys", "start_existing"])  # type: ignore[attr-defined]
        try:
            for i in range(4):
                other.kv_batch_put([f"k{i}"], {"x": torch.full((1, 2), float(i))}, partition_id=pid)
            assert spy.calls == {"start_all_keys": 1, "start_existing": 3}
            other.kv_batch_put(["k4"], {"x": torch.ones(1, 2), "y": torch.ones(1)}, partition_id=pid)  # new field
            assert spy.calls == {"start_all_keys": 2, "start_existing": 4}
            with pytest.raises(SchemaError, match="'x'"):
                other.kv_batch_put(["k5"], {"x": torch.ones(1, 3)}, partition_id=pid)
            assert spy.calls == {"start_all_keys": 3, "start_existing": 5}
            got = other.kv_batch_get([f"k{i}" for i in range(5)], partition_id=pid, select_fields="x")
            assert got["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 1.0]
            # a master that cannot answer the query (an older one): every put lists, and still checks
            monkeypatch.setattr(store.admin, "start_existing", lambda keys, timeout_s: lambda: None)  # type: ignore[attr-defined]
            listings = spy.calls["start_all_keys"]
            other.kv_batch_put(["k6"], {"x": torch.ones(1, 2)}, partition_id=pid)
            with pytest.raises(SchemaError, match="'x'"):
                other.kv_batch_put(["k7"], {"x": torch.ones(1, 3)}, partition_id=pid)
            assert spy.calls["start_all_keys"] == listings + 2
        finally:
            other.kv_clear(partition_id=pid)
        other.kv_batch_put(["k"], {"x": torch.ones(1, 3)}, partition_id=pid)  # cleared: the schema is forgotten
        other.kv_clear(partition_id=pid)

    @pytest.mark.parametrize("clear", ["partition", "keys"])
    def test_a_put_checks_the_listing_once_its_own_earlier_put_is_gone(
        self, owner: StoreClient, other: StoreClient, clear: str
    ) -> None:
        """Another client clears this client's rows (the whole partition, or every row of its put, which
        removes that put) and puts the field with another dtype: this client's next put of the old
        dtype must raise, not land where readers would ignore it."""
        pid = f"gone-{clear}"
        try:
            owner.kv_batch_put(["a", "b"], {"x": torch.zeros(2)}, partition_id=pid)
            owner.kv_batch_put(["c"], {"x": torch.zeros(1)}, partition_id=pid)
            if clear == "partition":
                other.kv_clear(partition_id=pid)
            else:
                other.kv_clear(["a", "b", "c"], partition_id=pid)
            other.kv_batch_put(["d"], {"x": torch.ones(1, dtype=torch.int8)}, partition_id=pid)
            with pytest.raises(SchemaError, match="int8"):
                owner.kv_batch_put(["e"], {"x": torch.zeros(1)}, partition_id=pid)
            owner.kv_batch_put(["e"], {"x": torch.full((1,), 5, dtype=torch.int8)}, partition_id=pid)
            assert other.kv_batch_get(["d", "e"], partition_id=pid, select_fields="x")["x"].tolist() == [1, 5]
        finally:
            other.kv_clear(partition_id=pid)

    @settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        ops=st.lists(
            st.tuples(
                st.integers(0, 1),  # which client
                st.sampled_from(["put", "put", "put", "clear keys", "clear"]),
                st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True),
                st.sampled_from(["x", "y"]),
                st.sampled_from([torch.float32, torch.int8]),
            ),
            min_size=1,
            max_size=10,
        )
    )
    def test_a_put_is_refused_exactly_when_the_listing_says_so(
        self, owner: StoreClient, other: StoreClient, judge: StoreClient, ops: list[tuple[Any, ...]]
    ) -> None:
        """Two clients put, clear rows and clear the partition in turn: each put is refused with
        ``SchemaError`` exactly when a listing of the partition (taken by a client that never wrote
        there) shows its field with another dtype, whether the put asked the listing or only whether
        its client's own earlier put is still there."""
        pid, store = f"judged-{random.getrandbits(32):08x}", judge.store
        clients = [owner, other]
        try:
            for who, op, keys, field, dtype in ops:
                if op == "clear":
                    clients[who].kv_clear(partition_id=pid)
                    continue
                if op == "clear keys":
                    clients[who].kv_clear(keys, partition_id=pid)
                    continue
                deadline = time.monotonic() + 30
                part = store._part(pid)  # type: ignore[attr-defined]
                with part.lock:
                    listed = store._refresh(pid, part, store._listing(deadline), {}, deadline)  # type: ignore[attr-defined]
                    known = listed.schema.get(field)
                value = torch.ones(len(keys), dtype=dtype)
                if known is not None and known.dtype != dtype:
                    with pytest.raises(SchemaError):
                        clients[who].kv_batch_put(keys, {field: value}, partition_id=pid)
                else:
                    clients[who].kv_batch_put(keys, {field: value}, partition_id=pid)
        finally:
            owner.kv_clear(partition_id=pid)

    def test_the_check_after_a_read_queries_only_where_that_costs_less_than_a_listing(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The master answers a query ~7x slower per key it names than a listing per key it holds: a
        read from a few puts asks for their index objects, a read from most puts in the master lists."""
        pid = "query-or-list"
        # enough single-row puts (an index and a data object each) to be most of what the master holds
        n = max(24, len(_all_keys(owner)) // (_partitions._QUERY_COST - 2) + 1)
        spy = _Spy(monkeypatch, other.store.admin, ["start_all_keys", "start_existing"])  # type: ignore[attr-defined]
        try:
            for i in range(n):
                owner.kv_batch_put([f"k{i}"], {"x": torch.full((1,), float(i))}, partition_id=pid)
            got = other.kv_batch_get([f"k{i}" for i in range(n)], partition_id=pid, select_fields="x")
            assert got["x"].tolist() == [float(i) for i in range(n)]
            # listing; n index reads checked by a listing; the data read from n puts, by a listing
            assert spy.calls == {"start_all_keys": 3, "start_existing": 0}
            assert other.kv_batch_get(["k3"], partition_id=pid, select_fields="x")["x"].tolist() == [3.0]
            assert spy.calls == {"start_all_keys": 4, "start_existing": 1}  # listing; one put: a query
            monkeypatch.setattr(_partitions, "_QUERY_MAX_KEYS", 0)  # more names than one query takes: a listing
            assert other.kv_batch_get(["k4"], partition_id=pid, select_fields="x")["x"].tolist() == [4.0]
            assert spy.calls == {"start_all_keys": 6, "start_existing": 1}
        finally:
            owner.kv_clear(partition_id=pid)

    def test_the_existence_query_asks_the_master_for_the_keys_alone(self, owner: StoreClient) -> None:
        store = owner.store  # type: ignore[attr-defined]
        buf = owner.empty(8, torch.uint8)
        keys = ["dataplane/q%2Fx/i/1.8", "dataplane/q/i/2.8"]  # a percent-encoded partition name
        store._write(keys, [buf.data_ptr()] * 2, [8, 8], "q", time.monotonic() + 10)
        try:
            assert store.admin.start_existing([*keys, "dataplane/q/i/3.8"], 5.0)() == set(keys)
            # never blocks past its time, and a failure answers None (the caller then lists)
            silent = _handle.AdminClient("127.0.0.1", store.deployment.master.rpc_port)
            t0 = time.monotonic()
            assert silent.start_existing(keys, 0.5)() is None
            assert time.monotonic() - t0 < 5  # a hang check (10x its 0.5 s limit), not a timing claim
            silent.close()
        finally:
            store.handle.remove(keys)

    def test_index_bodies_go_out_from_reused_staging_buffers(self, owner: StoreClient) -> None:
        store = owner.store  # type: ignore[attr-defined]
        small, large = bytes(range(256)) * 8, b"\x07" * (_STAGE_BYTES + 1)
        a_ptr, a = store._sendable_bytes(small)
        if store.handle.shm is None:  # over TCP from a copy with room for the padding of an index object
            assert a.nbytes == index_object_bytes(len(small)) == 4096 and ctypes.string_at(a_ptr, len(small)) == small
            return
        b_ptr, b = store._sendable_bytes(small)  # the first still in use: another buffer
        assert a_ptr != b_ptr and ctypes.string_at(a_ptr, len(small)) == ctypes.string_at(b_ptr, len(small)) == small
        store._unstage(a)
        store._unstage(b)
        big_ptr, big = store._sendable_bytes(large)
        assert ctypes.string_at(big_ptr, len(large)) == large
        store._unstage(big)  # too large to keep
        again, holder = store._sendable_bytes(small[::-1])
        assert again in (a_ptr, b_ptr) and ctypes.string_at(again, len(small)) == small[::-1]
        assert store.handle.reaches(again, len(small)) and store.handle.reaches(big_ptr, len(large))  # shared
        store._unstage(holder)

    def test_whole_put_lands_in_a_registered_buffer(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        values = torch.randn(64, 8192)  # 2 MiB: pooled
        meta = owner.kv_batch_put([f"k{i}" for i in range(64)], {"x": values}, partition_id="zc")
        try:
            got = other.kv_batch_get(meta, select_fields="x")["x"]
            assert bit_exact(got, values)
            handle = other.store.handle  # type: ignore[attr-defined]
            if handle.shm is None:
                assert handle.covers(got.data_ptr(), got.numel() * 4)
                return
            # the real client wrote it straight into this client's shared memory ...
            assert handle.shm.holds(got.data_ptr(), got.numel() * 4)
            # ... and a write-back of it is sent from there, with no staging copy
            spy = _Spy(monkeypatch, other.store.pool, ["empty"])  # type: ignore[attr-defined]
            got.mul_(2)
            other.kv_batch_put(meta.keys, {"y": got}, partition_id="zc")
            assert all(n < got.numel() * 4 for n, *_ in spy.args["empty"])  # only the small index
            back = owner.kv_batch_get(meta.keys, partition_id="zc", select_fields="y")["y"]
            assert bit_exact(back, values * 2)
        finally:
            owner.kv_clear(partition_id="zc")

    def test_put_of_client_empty_memory_is_sent_without_a_copy(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lengths = torch.tensor([3000, 1, 170_000, 500])  # over 1 MiB in all: not packed (a copy)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        ids = other.empty(int(offsets[-1]), torch.int64)  # rollout tokens built straight into it
        ids.copy_(torch.randint(0, 150_000, ids.shape))
        logp = other.empty((4, 8192), torch.bfloat16)
        logp.copy_(torch.randn(4, 8192))
        fields = {"ids": torch.nested.nested_tensor_from_jagged(ids, offsets), "logp": logp}
        spy = _Spy(monkeypatch, other.store.pool, ["empty"])  # type: ignore[attr-defined]
        try:
            meta = other.kv_batch_put(["a", "b", "c", "d"], fields, partition_id="zcput")
            staged = [n for n, *_ in spy.args["empty"]]
            assert all(n < logp.numel() * 2 for n in staged)  # at most the small index object
            got = owner.kv_batch_get(meta, select_fields=["ids", "logp"])
            assert bit_exact(got["ids"].values(), ids) and torch.equal(got["ids"].offsets(), offsets)
            assert bit_exact(got["logp"], logp)
        finally:
            other.kv_clear(partition_id="zcput")

    def test_first_write_gathers_padded_tokens_into_sendable_memory(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        ids = torch.randint(0, 150_000, (8, 4096))
        lens = [4096, 1, 3000, 17, 2048, 4000, 5, 999]
        store = other.store  # type: ignore[attr-defined]
        spy = _Spy(monkeypatch, store, ["_staged"])
        sends = _Spy(monkeypatch, store.handle, ["put_from"])
        meta = first_write(
            other, {"input_ids": ids}, uids=["p0", "p1"], group_size=4, partition_id="fw",
            token_fields=["input_ids"], lengths=lens,
        )  # fmt: skip
        try:
            _, ptrs, sizes = sends.args["put_from"][0]
            stored = round_up(8 * sum(lens), store._pad)  # padded to a page where sent from shared memory
            big = [ptr for ptr, n in zip(ptrs, sizes, strict=True) if n == stored]
            assert len(big) == 1 and all(n < 8 * sum(lens) for _, n, _ in spy.args["_staged"])  # one object, no copy:
            assert store.handle.shm is None or store.handle.reaches(big[0], 8 * sum(lens))  # sent where gathered
            got = owner.kv_batch_get(meta, select_fields="input_ids")["input_ids"]
            assert all(bit_exact(row, ids[i, :n]) for i, (row, n) in enumerate(zip(got.unbind(), lens, strict=True)))
        finally:
            other.kv_clear(partition_id="fw")

    def test_small_subset_uses_ranged_reads_over_tcp(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        rows = [torch.randint(0, 1000, (int(n),)) for n in torch.randint(1000, 5000, (64,))]
        keys = [f"k{i}" for i in range(64)]
        owner.kv_batch_put(keys, {"ids": _jagged(rows), "x": torch.randn(64, 4096)}, partition_id="rng")
        spy = _Spy(monkeypatch, other.store.handle, ["get_ranges", "get_into"])  # type: ignore[attr-defined]
        try:
            pick = [40, 3, 4, 5, 60]
            out = other.kv_batch_get([keys[i] for i in pick], partition_id="rng", select_fields=["ids", "x"])
            # a shared-memory client has no ranged reads: it reads whole objects and gathers
            assert spy.calls["get_ranges"] == (other.store.handle.shm is None)  # type: ignore[attr-defined]
            assert all(bit_exact(a, rows[i]) for a, i in zip(out["ids"].unbind(), pick, strict=True))
            full = other.kv_batch_get(list(reversed(keys)), partition_id="rng", select_fields=["ids"])
            assert all(bit_exact(a, b) for a, b in zip(full["ids"].unbind(), reversed(rows), strict=True))
        finally:
            owner.kv_clear(partition_id="rng")

    def test_ranged_reads_beside_small_fields(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A data-parallel rank's scattered rows: ranged reads of the large field and whole reads of
        the small ones (their buffers are under the pool's minimum, so not registered) in one get.
        Mooncake's ranged call refused those with -600 until whole reads went by ``get_into``."""
        rows = [torch.randint(0, 1000, (int(n),)) for n in torch.randint(3000, 5000, (64,))]
        keys = [f"s{i}" for i in range(64)]
        fields = {"ids": _jagged(rows), "reward": torch.randn(64), "mask": torch.rand(64, 3) > 0.5}
        owner.kv_batch_put(keys, fields, partition_id="rng_small")
        spy = _Spy(monkeypatch, other.store.handle, ["get_ranges", "get_into"])  # type: ignore[attr-defined]
        try:
            pick = list(range(5, 64, 16))  # every 16th row: a few pieces of the large object
            out = other.kv_batch_get([keys[i] for i in pick], partition_id="rng_small", select_fields=list(fields))
            assert spy.calls["get_ranges"] == (other.store.handle.shm is None)  # type: ignore[attr-defined]
            assert all(bit_exact(a, rows[i]) for a, i in zip(out["ids"].unbind(), pick, strict=True))
            assert bit_exact(out["reward"], fields["reward"][pick]) and bit_exact(out["mask"], fields["mask"][pick])
        finally:
            owner.kv_clear(partition_id="rng_small")

    def test_large_fields_match_the_memory_store(self, owner: StoreClient, other: StoreClient) -> None:
        """Random puts, gets (by keys or by a meta, subsets and reorders, some fields) and clears give
        what ``memory://`` gives, with fields large enough for pooled, registered buffers and ranged
        reads beside small, multi-dim and object ones. The shared suite's state machine uses small
        data, which never takes those paths (a run like this one found the -600 of a mixed ranged
        read; this one fails on it too)."""
        rng = random.Random(7)
        gen = torch.Generator().manual_seed(7)
        keys = [f"f{i}" for i in range(64)]
        names = ["big", "mid", "small", "dense", "image", "obj"]

        def column(field: str, n: int) -> Any:
            if field == "obj":
                return [
                    rng.choice([None, "s" * rng.randint(0, 40), {"a": rng.randint(0, 9)}, [1, 2.5]]) for _ in range(n)
                ]
            if field == "image":
                return torch.randint(0, 255, (n, 2, 3, 5), dtype=torch.uint8, generator=gen)
            if field == "dense":
                return torch.rand(n, 3, generator=gen) > 0.5
            if field == "small":
                return torch.randn(n, generator=gen)
            top, dtype = (6000, torch.int64) if field == "big" else (2000, torch.bfloat16)
            rows = [torch.randn(rng.randint(1, top), generator=gen).to(dtype) for _ in range(n)]
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

        def same(a: Any, b: Any) -> bool:
            if not isinstance(a, torch.Tensor):
                return list(a) == list(b)
            if not a.is_nested:
                return bit_exact(a, b)
            return len(a.unbind()) == len(b.unbind()) and all(map(bit_exact, a.unbind(), b.unbind()))

        mem = dataplane.connect("memory://")
        metas: list[KVBatchMeta] = []
        gets = 0
        try:
            for step in range(120):
                op = rng.random()
                if op < 0.35:
                    ks = rng.sample(keys, rng.randint(1, 64))
                    data = {f: column(f, len(ks)) for f in rng.sample(names, rng.randint(1, len(names)))}
                    metas = [*metas[-7:], owner.kv_batch_put(ks, data, partition_id="fuzz")]
                    mem.kv_batch_put(ks, data, partition_id="fuzz")
                elif op < 0.9:
                    meta = rng.choice(metas) if metas and rng.random() < 0.5 else None
                    if meta is not None:
                        if rng.random() < 0.5:
                            meta = meta.subset(rng.sample(range(len(meta.keys)), rng.randint(1, len(meta.keys))))
                        ks, fs = list(meta.keys), rng.sample(list(meta.fields), rng.randint(1, len(meta.fields)))
                    else:
                        ks, fs = rng.sample(keys, rng.randint(1, 64)), rng.sample(names, 2)
                    try:
                        want = mem.kv_batch_get(ks, select_fields=fs, partition_id="fuzz")
                    except KeyNotFound:
                        with pytest.raises(KeyNotFound):
                            other.kv_batch_get(meta or ks, select_fields=fs, partition_id=None if meta else "fuzz")
                        continue
                    got = other.kv_batch_get(meta or ks, select_fields=fs, partition_id=None if meta else "fuzz")
                    assert all(same(got[f], want[f]) for f in fs), f"step {step}: {fs} differ"
                    gets += 1
                elif rng.random() < 0.3:
                    owner.kv_clear(partition_id="fuzz")
                    mem.kv_clear(partition_id="fuzz")
                    metas = []
                else:
                    cleared = rng.sample(keys, rng.randint(1, 16))
                    owner.kv_clear(cleared, partition_id="fuzz")
                    mem.kv_clear(cleared, partition_id="fuzz")
            assert gets >= 20  # the run compared real reads, not only misses
        finally:
            owner.kv_clear(partition_id="fuzz")
            mem.close()

    def test_rows_put_one_at_a_time_are_read_once_per_put_in_any_order(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Rows streamed in one put each (an asynchronous rollout worker), some of them empty, then
        read by keys in a shuffled order, beside rows of a batch put: each streamed row is one packed
        object, read whole once whatever fields the get takes from it, and the result is what
        ``memory://`` gives."""
        rng = random.Random(3)
        gen = torch.Generator().manual_seed(3)
        mem = dataplane.connect("memory://")
        pid = "stream"
        try:
            for i in range(40):
                n = 0 if i % 7 == 3 else rng.randint(1, 300)
                row = {
                    "ids": _jagged([torch.randint(0, 9, (n,), generator=gen)]),
                    "lp": _jagged([torch.randn(n, 2, generator=gen).to(torch.bfloat16)]),
                    "r": torch.tensor([float(i)]),
                    "msg": [f"m{i}" * (i % 3)],
                }
                adv = {"adv": _jagged([torch.randn(n, generator=gen)])}  # a write-back: one field, not packed
                for c in (owner, mem):
                    c.kv_batch_put([f"s{i}"], row, partition_id=pid)
                    c.kv_batch_put([f"s{i}"], adv, partition_id=pid)
            batch = {
                "ids": _jagged([torch.arange(5), torch.arange(0)]),
                "lp": _jagged([torch.ones(5, 2, dtype=torch.bfloat16), torch.ones(0, 2, dtype=torch.bfloat16)]),
                "r": torch.tensor([-1.0, -2.0]),
                "msg": ["x", "y"],
            }
            # rows of two puts that lie back to back both in the result and in the objects: "p1" ends
            # where "q1" (jagged) and "q2" (dense) start in theirs, and each lands right after it
            p_rows = {"ids": _jagged([torch.arange(2), torch.arange(3)]), "r": torch.tensor([1.0, 2.0])}
            q_rows = {
                "ids": _jagged([torch.arange(5) + 10, torch.arange(4) + 20, torch.arange(1)]),
                "r": torch.arange(3.0),
            }
            for c in (owner, mem):
                c.kv_batch_put(["b0", "b1"], batch, partition_id=pid)
                c.kv_batch_put(["p0", "p1"], p_rows, partition_id="pq")
                c.kv_batch_put(["q0", "q1", "q2"], q_rows, partition_id="pq")
            for ks in (["p0", "p1", "q1"], ["p0", "p1", "q2"]):
                a = other.kv_batch_get(ks, partition_id="pq", select_fields=["ids", "r"])
                b = mem.kv_batch_get(ks, partition_id="pq", select_fields=["ids", "r"])
                assert bit_exact(a["r"], b["r"]) and bit_exact(a["ids"].values(), b["ids"].values()), ks
            # a packed put whose rows of the field read are all empty: nothing of it is read
            empty = {"ids": _jagged([torch.arange(3), torch.arange(2)]), "z": _jagged([torch.ones(0), torch.ones(0)])}
            owner.kv_batch_put(["e0", "e1"], {**empty, "r": torch.ones(2)}, partition_id="pq")
            owner.kv_batch_put(
                ["f0"], {"ids": _jagged([torch.arange(4)]), "z": _jagged([torch.ones(2)])}, partition_id="pq"
            )
            z = other.kv_batch_get(["e1", "e0", "f0"], partition_id="pq", select_fields=["z"])
            assert z["z"].offsets().tolist() == [0, 0, 0, 2] and z["z"].values().tolist() == [1.0, 1.0]
            keys = [f"s{i}" for i in range(40)]
            rng.shuffle(keys)
            reads = _Spy(monkeypatch, other.store.handle, ["get_into"])  # type: ignore[attr-defined]
            fields = ["ids", "lp", "r", "msg"]
            got = other.kv_batch_get(keys, partition_id=pid, select_fields=fields)
            objects = [k for call in reads.args["get_into"] for k in call[0] if "/d/" in k]
            assert len(objects) == 40 and all(k.endswith("/.all") for k in objects)  # each put whole, once
            gathers: list[Any] = []
            real_copy = _read.copy_spans
            monkeypatch.setattr(_read, "copy_spans", lambda *a: (gathers.append(a), real_copy(*a)))
            adv = other.kv_batch_get(keys, partition_id=pid, select_fields=["adv"])
            # a one-field put's object is its row: read in place, unless padded (no room for the padding there)
            assert (gathers == []) == (other.store._pad == 1)  # type: ignore[attr-defined]
            assert all(len(g[1]) == 1 for g in gathers)  # padded: all 40 objects staged in one buffer
            want_adv = mem.kv_batch_get(keys, partition_id=pid, select_fields=["adv"])
            assert bit_exact(adv["adv"].values(), want_adv["adv"].values())
            mixed = [*keys[:10], "b1", *keys[10:20], "b0"]
            want = mem.kv_batch_get(mixed, partition_id=pid, select_fields=fields)
            got_mixed = other.kv_batch_get(mixed, partition_id=pid, select_fields=fields)
            for out, ks in ((got, keys), (got_mixed, mixed)):
                ref = want if ks is mixed else mem.kv_batch_get(ks, partition_id=pid, select_fields=fields)
                assert out["msg"] == ref["msg"] and bit_exact(out["r"], ref["r"])
                for f in ("ids", "lp"):
                    assert bit_exact(out[f].offsets(), ref[f].offsets()) and bit_exact(out[f].values(), ref[f].values())
        finally:
            owner.kv_clear(partition_id=pid)
            owner.kv_clear(partition_id="pq")
            mem.close()

    def test_a_packed_put_serving_one_field_whole_and_another_in_part_is_read_once(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``x`` is every row of the packed put, in order (its columns view the object); ``y`` of row b
        was re-written since, so ``y`` is gathered from two puts. The packed object must be read
        once: named twice in one batch read, Mooncake fills only the last buffer and reports both as
        read (a differential fuzz over TCP found ``x`` as garbage)."""
        x = _jagged([torch.arange(40) + 1, torch.arange(30) + 100])
        owner.kv_batch_put(["a", "b"], {"x": x, "y": torch.tensor([1.0, 2.0])}, partition_id="once")
        owner.kv_batch_put(["b"], {"y": torch.tensor([20.0])}, partition_id="once")
        reads = _Spy(monkeypatch, other.store.handle, ["get_into"])  # type: ignore[attr-defined]
        try:
            got = other.kv_batch_get(["a", "b"], partition_id="once", select_fields=["x", "y"])
            assert got["y"].tolist() == [1.0, 20.0]
            assert all(map(bit_exact, got["x"].unbind(), x.unbind()))
            (call,) = [c for c in reads.args["get_into"] if any("/d/" in k for k in c[0])]
            assert len(call[0]) == len(set(call[0])) == 2  # the packed put and the re-write of y, once each
        finally:
            owner.kv_clear(partition_id="once")

    def test_a_key_named_twice_in_one_read_fills_every_buffer(self, owner: StoreClient) -> None:
        handle = owner.store.handle  # type: ignore[attr-defined]
        src = owner.empty((5000,), torch.uint8)
        src.copy_(torch.arange(5000) % 251)
        handle.put_from(["twice/a", "twice/b"], [src.data_ptr()] * 2, [5000] * 2)
        try:
            bufs = [owner.empty((5000,), torch.uint8).fill_(0) for _ in range(4)]
            codes = handle.get_into(
                ["twice/a", "twice/b", "twice/a", "twice/a"], [b.data_ptr() for b in bufs], [5000] * 4
            )
            assert codes == [5000] * 4 and all(torch.equal(b, src) for b in bufs)
        finally:
            handle.remove(["twice/a", "twice/b"])

    @pytest.mark.parametrize(("a_bytes", "packed"), [((1 << 20) - 100, 1 << 20), ((1 << 20) - 40, 0)])
    def test_a_put_is_packed_only_when_its_one_object_fits_the_bound(
        self, owner: StoreClient, other: StoreClient, a_bytes: int, packed: int
    ) -> None:
        """The bound counts the object as stored, alignment included: 1 MiB - 100 bytes and 8 bytes
        make exactly 1 MiB; 1 MiB - 40 bytes and 8 bytes make 64 bytes more, and go as two objects."""
        fields = {"a": torch.randint(0, 255, (1, a_bytes), dtype=torch.uint8), "b": torch.tensor([7.0])}
        meta = owner.kv_batch_put(["k"], fields, partition_id="bound")
        try:
            assert meta.extra_info["mooncake_read"][5] == packed
            got = other.kv_batch_get(meta, select_fields=["a", "b"])
            assert bit_exact(got["a"], fields["a"]) and got["b"].tolist() == [7.0]
        finally:
            owner.kv_clear(partition_id="bound")

    def test_batches_are_chunked(self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_handle, "MAX_KEYS_PER_CALL", 2)
        fields = {f"f{j}": torch.full((3, 2), j) for j in range(5)}
        metas = [other.kv_batch_put([f"p{i}a", f"p{i}b", f"p{i}c"], fields, partition_id="chunk") for i in range(3)]
        try:
            keys = [k for m in metas for k in m.keys]
            out = other.kv_batch_get(keys[::-1], partition_id="chunk", select_fields=list(fields))
            assert all(out[f"f{j}"].eq(j).all() for j in range(5)) and out.batch_size[0] == 9
        finally:
            other.kv_clear(partition_id="chunk")

    def test_clear_collects_superseded_objects(self, owner: StoreClient) -> None:
        pid = "gc"
        first = owner.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 4)}, partition_id=pid)
        owner.kv_batch_put(["a", "b"], {"x": torch.ones(2, 4)}, partition_id=pid)  # supersedes the first put
        owner.kv_batch_put(["c"], {"x": torch.ones(1, 4)}, partition_id=pid)
        head = "dataplane/gc/"
        assert sum(k.startswith(head) for k in _all_keys(owner)) == 6  # 3 puts x (data + index)
        owner.kv_clear(["a"], partition_id=pid)  # first put collected; a tombstone for a (b still reads put 2)
        (first_index,) = first.extra_info[HINT_KEY]
        left = [k for k in _all_keys(owner) if k.startswith(head)]
        # b was first put in the first put: its birth marker (an index object, no data) stands in for it
        markers = [k for k in left if k.startswith(first_index.rsplit(".", 1)[0] + "-")]
        assert len(markers) == 1 and "/i/" in markers[0] and first_index not in left
        assert len(left) == 6  # puts 2 and 3 (data + index), the tombstone, the marker
        assert list(owner.kv_list(pid)[pid]) == ["b", "c"]
        assert owner.kv_batch_get(["b", "c"], partition_id=pid, select_fields="x")["x"].eq(1).all()
        owner.kv_clear(["b", "c"], partition_id=pid)  # nothing left: every object goes
        assert not [k for k in _all_keys(owner) if k.startswith(head)]
        assert owner.kv_list(pid) == {}

    def test_index_objects_go_before_the_data_they_name(
        self, owner: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A reader trusts its bytes only while the put's index is still listed after the read, so no
        data object may go while its index can still be listed."""
        pid = "order"
        first = owner.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 4), "y": torch.zeros(2)}, partition_id=pid)
        owner.kv_batch_put(["a", "b"], {"x": torch.ones(2, 4), "y": torch.ones(2)}, partition_id=pid)  # supersedes
        calls: list[tuple[str, Any]] = []
        handle = owner.store.handle  # type: ignore[attr-defined]
        for name in ("remove", "remove_regex"):
            monkeypatch.setattr(handle, name, _recording_args(calls, name, getattr(handle, name)))
        try:
            owner.kv_clear(["a"], partition_id=pid)  # collects the first put: its index, then its data
            (index_key,) = first.extra_info[HINT_KEY]
            head = "dataplane/order/d/"
            assert [(n, sorted(a)) for n, a in calls] == [
                ("remove", [index_key]),
                ("remove", [f"{head}{index_key.rsplit('/', 1)[1].rsplit('.', 1)[0]}/.all"]),  # packed: x and y
            ]
            calls.clear()
            listed = sorted(k for k in _all_keys(owner) if k.startswith("dataplane/order/i/"))  # put 2, a tombstone
            owner.kv_clear(partition_id=pid)  # every listed index, then the data of those puts
            ids = "|".join(k.rsplit("/", 1)[1].rsplit(".", 1)[0] for k in listed)
            assert [(n, sorted(a) if n == "remove" else a) for n, a in calls[:2]] == [
                ("remove", listed),
                ("remove_regex", f"^dataplane/order/d/({ids})/"),
            ]
            assert len(calls) == 4 and calls[2][1].startswith("^dataplane/order/d/(")  # old orphans (below)
            assert calls[3] == ("remove_regex", "^dataplane/order/(c/|f$)")  # claim markers, finished mark
            assert not [k for k in _all_keys(owner) if k.startswith("dataplane/order/")]
        finally:
            monkeypatch.undo()
            owner.kv_clear(partition_id=pid)

    def test_a_clear_leaves_a_put_it_did_not_list_whole(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A put that lands after a clear's listing is not part of that clear: it stays whole (a sweep
        of the partition's data by prefix would have left its index naming nothing)."""
        pid = "race"
        owner.kv_batch_put(["a"], {"x": torch.zeros(1, 4)}, partition_id=pid)
        store = owner.store
        before = store._listing(time.monotonic() + 10)  # type: ignore[attr-defined]
        other.kv_batch_put(["b"], {"x": torch.ones(1, 4)}, partition_id=pid)  # lands after the clear lists
        monkeypatch.setattr(store, "_listing", lambda deadline: before)
        owner.kv_clear(partition_id=pid)
        monkeypatch.undo()
        try:
            with pytest.raises(KeyNotFound):
                other.kv_batch_get(["a"], partition_id=pid, select_fields="x")
            assert other.kv_batch_get(["b"], partition_id=pid, select_fields="x")["x"].eq(1).all()
            assert list(owner.kv_list(pid)[pid]) == ["b"]
        finally:
            owner.kv_clear(partition_id=pid)
        assert not [k for k in _all_keys(owner) if k.startswith("dataplane/race/")]

    def test_a_clear_sweeps_data_of_writers_that_died_mid_put(self, owner: StoreClient) -> None:
        """Data objects no index names (their writer died before the index was written) go with the
        partition's clear once their put began over 10 minutes ago; younger ones may still be
        getting their index, and stay."""
        pid, store = "orphans", owner.store
        now = time.time_ns()
        old, young = f"{now - 11 * 60 * 10**9:019d}-dead0001", f"{now:019d}-live0001"
        keys = [f"dataplane/orphans/d/{put_id}/x" for put_id in (old, young)]
        buf = owner.empty(8, torch.uint8)
        store._write(keys, [buf.data_ptr()] * 2, [8, 8], pid, time.monotonic() + 10)  # type: ignore[attr-defined]
        owner.kv_batch_put(["a"], {"x": torch.zeros(1)}, partition_id=pid)
        owner.kv_clear(partition_id=pid)
        assert [k for k in _all_keys(owner) if k.startswith("dataplane/orphans/")] == [keys[1]]
        store.handle.remove([keys[1]])  # type: ignore[attr-defined]

    @pytest.mark.parametrize(("cpus", "mb", "held"), [(2, 4, True), (2, 1, False), (16, 4, False)])
    @pytest.mark.parametrize("by", ["meta", "keys"])
    def test_planning_beside_a_large_read_on_a_small_host_starts_once_the_read_is_under_way(
        self, owner: StoreClient, monkeypatch: pytest.MonkeyPatch, cpus: int, mb: int, held: bool, by: str
    ) -> None:
        """On a host of few CPUs, Python run beside the start of a read slows the read down by as
        long as it runs: the helper thread's planning and decoding of a large read begin only
        ``_BESIDE_AFTER_S`` after the read is issued. Small reads, and any read on a larger host,
        are not held. What the get returns is the same either way."""
        pid = f"gate-{by}-{cpus}-{mb}"
        x = torch.arange(mb << 18, dtype=torch.float32).view(4, -1)  # mb MiB
        meta = owner.kv_batch_put(["a", "b", "c", "d"], {"x": x}, partition_id=pid)
        monkeypatch.setenv("DATAPLANE_DECODE_THREAD", "1")
        monkeypatch.setattr(_get, "usable_cpus", lambda: cpus)
        passed: list[tuple[bool, float | None, float, bool]] = []  # (held, read issued, wait over, on helper)

        class Gate(_get._Gate):
            __slots__ = ("opened",)

            def open(self) -> None:
                self.opened = time.perf_counter()
                super().open()

            def wait(self, deadline: float) -> None:
                super().wait(deadline)
                helper = threading.current_thread() is not threading.main_thread()
                passed.append((self._hold, getattr(self, "opened", None), time.perf_counter(), helper))

        monkeypatch.setattr(_get, "_Gate", Gate)
        reader = dataplane.connect(owner.store.join_url)  # type: ignore[attr-defined]
        try:
            if by == "meta":
                got = reader.kv_batch_get(meta, select_fields="x")
            else:
                reader.kv_batch_get(["a"], partition_id=pid, select_fields="x")  # its index is now cached
                passed.clear()
                got = reader.kv_batch_get(["a", "b", "c", "d"], partition_id=pid, select_fields="x")
            assert bit_exact(got["x"], x)
            ((hold, opened, over, helper),) = passed  # one read, planned or decoded beside it
            assert helper and hold is held
            if held:
                assert opened is not None and over - opened >= _get._BESIDE_AFTER_S
        finally:
            monkeypatch.undo()
            reader.close()
            owner.kv_clear(partition_id=pid)

    @pytest.mark.parametrize("how", ["by_meta", "by_meta_beside", "by_keys", "by_keys_listing"])
    def test_a_read_whose_put_goes_under_it_is_not_trusted(
        self, owner: StoreClient, monkeypatch: pytest.MonkeyPatch, how: str
    ) -> None:
        """A clear may free an object while another client reads it, and a put may fill the space: the
        read then returns that put's bytes with no error. Here the partition is cleared and rewritten
        right after the read, and the read's buffers overwritten as the new put's bytes would: the get
        must not return them, but read the rows again (by meta with the helper thread off and on; by
        keys, where the check after the read asks for the puts' index objects, and where that query
        fails, as on a master without it, and the check lists instead)."""
        pid = "under"
        meta = owner.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 8)}, partition_id=pid)
        monkeypatch.setenv("DATAPLANE_DECODE_THREAD", "1" if how == "by_meta_beside" else "0")
        reader = dataplane.connect(owner.store.join_url)  # type: ignore[attr-defined]
        monkeypatch.setattr(_partitions, "_QUERY_COST", 0)  # the check queries, however few keys are listed
        if how == "by_keys_listing":
            monkeypatch.setattr(reader.store.admin, "start_existing", lambda keys, timeout_s: lambda: None)  # type: ignore[attr-defined]
        if how.startswith("by_keys"):
            reader.kv_batch_get(["a", "b"], partition_id=pid, select_fields="x")  # its index is now cached
        handle = reader.store.handle  # type: ignore[attr-defined]
        fired: list[list[str]] = []
        monkeypatch.setattr(handle, "get_into", _rewritten_after_read(owner, pid, handle.get_into, "/d/", fired))
        try:
            if how.startswith("by_keys"):
                got = reader.kv_batch_get(["a", "b"], partition_id=pid, select_fields="x")
            else:
                got = reader.kv_batch_get(meta, select_fields="x")
            assert fired and got["x"].eq(7).all()
        finally:
            monkeypatch.undo()
            reader.close()
            owner.kv_clear(partition_id=pid)

    def test_an_index_read_whose_put_goes_under_it_is_not_decoded(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As above, for the index object of a put this client has not seen: its bytes are decoded
        only once a listing after the read still shows it. Here it is gone, so the get sees the
        partition as it was between the clear and the new put (no rows), never an unreadable index."""
        pid = "under_index"
        owner.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 8)}, partition_id=pid)
        handle = other.store.handle  # type: ignore[attr-defined]
        fired: list[list[str]] = []
        monkeypatch.setattr(handle, "get_into", _rewritten_after_read(owner, pid, handle.get_into, "/i/", fired))
        try:
            with pytest.raises(KeyNotFound):
                other.kv_batch_get(["a", "b"], partition_id=pid, select_fields="x")
            assert fired
            assert other.kv_batch_get(["a", "b"], partition_id=pid, select_fields="x")["x"].eq(7).all()
        finally:
            monkeypatch.undo()
            owner.kv_clear(partition_id=pid)

    def test_partition_names_are_isolated(self, owner: StoreClient) -> None:
        names = ["a", "a/i", "a.b", "über/1", "a%2Fi"]
        try:
            for i, name in enumerate(names):
                owner.kv_batch_put(["k"], {"x": torch.tensor([i])}, partition_id=name)
            for i, name in enumerate(names):
                assert owner.kv_batch_get(["k"], partition_id=name, select_fields="x")["x"].tolist() == [i]
            assert set(names) <= set(owner.kv_list())
            owner.kv_clear(partition_id="a")
            assert all(owner.kv_list(n).get(n) for n in names[1:])
        finally:
            for name in names:
                owner.kv_clear(partition_id=name)

    def test_any_key_the_core_takes_is_read_by_another_client(self, owner: StoreClient, other: StoreClient) -> None:
        """Non-ASCII keys and keys holding a newline (an index then stores them as a list) are read
        from the index objects by a client that did not write them; the core bounds the length."""
        keys = ["ключ", "a\nb", "鍵" * 512]
        try:
            owner.kv_batch_put(keys, {"x": torch.arange(3)}, partition_id="keys")
            assert other.kv_batch_get(keys[::-1], partition_id="keys", select_fields="x")["x"].tolist() == [2, 1, 0]
            assert list(other.kv_list("keys")["keys"]) == keys
            with pytest.raises(InvalidArgument, match="513 characters"):
                owner.kv_batch_put(["k" * 513], {"x": torch.zeros(1, dtype=torch.int64)}, partition_id="keys")
        finally:
            owner.kv_clear(partition_id="keys")

    def test_empty_fields_store_no_object(self, owner: StoreClient, other: StoreClient) -> None:
        meta = owner.kv_batch_put(["a", "b"], {"t": _jagged([torch.zeros(0), torch.zeros(0)])}, partition_id="empty")
        try:
            assert not [k for k in _all_keys(owner) if k.startswith("dataplane/empty/d/")]
            got = other.kv_batch_get(meta, select_fields="t")["t"]
            assert [r.numel() for r in got.unbind()] == [0, 0]
        finally:
            owner.kv_clear(partition_id="empty")

    def test_objects_fill_whole_pages_where_the_store_server_streams_its_copies(
        self, owner: StoreClient, other: StoreClient
    ) -> None:
        server = owner.store.deployment.server  # type: ignore[attr-defined]
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert f"GLIBC_TUNABLES={store_server_env()['GLIBC_TUNABLES']}".encode() in environ
        store = other.store  # type: ignore[attr-defined]
        fields = {  # odd sizes: a jagged field, a [B] one, and one over the packing bound (objects of its own)
            "ids": _jagged([torch.arange(n) for n in (3, 1001, 7)]),
            "r": torch.arange(3.0),
            "big": torch.randn(3, 100_003),
        }
        meta = other.kv_batch_put(["a", "b", "c"], fields, partition_id="pages")
        try:
            ((key, body),) = meta.extra_info[HINT_KEY].items()
            put = decode_index(key, key.rsplit("/", 1)[1].split(".")[0], body)
            with store.handle._enter() as st:
                sizes = {k: st.get_size(k) for k in put.object_keys()}
            assert sizes[key] == index_object_bytes(len(body)) and sizes[key] % 4096 == 0  # index objects: always
            data = [put.fields[f].nbytes for f in ("ids", "r", "big")]
            assert put.pad == store._pad == (4096 if store.handle.shm is not None else 1)
            assert sorted(n for k, n in sizes.items() if k != key) == sorted(round_up(n, put.pad) for n in data)
            got = owner.kv_batch_get(meta, select_fields=["ids", "r", "big"])  # by the meta: its read hint
            assert bit_exact(got["big"], fields["big"]) and bit_exact(got["r"], fields["r"])
            assert bit_exact(got["ids"].values(), fields["ids"].values())
            by_keys = owner.kv_batch_get(["c", "a"], partition_id="pages", select_fields=["big", "ids"])
            assert bit_exact(by_keys["big"], fields["big"][[2, 0]])
            assert [r.tolist() for r in by_keys["ids"].unbind()] == [list(range(7)), list(range(3))]
        finally:
            other.kv_clear(partition_id="pages")

    def test_reads_take_each_put_at_the_padding_its_index_names(
        self, owner: StoreClient, other: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(other.store, "_pad", 1)  # a writer that sends its objects as they are (TCP)
        small = {"ids": _jagged([torch.arange(5), torch.arange(9)]), "r": torch.ones(2)}  # packed
        big = {"x": torch.randn(2, 300_001)}  # one object of its own
        metas = [
            other.kv_batch_put(["a", "b"], small, partition_id="unpadded"),
            other.kv_batch_put(["c", "d"], big, partition_id="unpadded"),
        ]
        monkeypatch.setattr(other.store, "_pad", owner.store._pad)  # type: ignore[attr-defined]
        metas.append(other.kv_batch_put(["e", "f"], {"x": torch.randn(2, 300_001)}, partition_id="unpadded"))
        try:
            assert metas[0].extra_info["mooncake_read"][-1] == metas[1].extra_info["mooncake_read"][-1] == 1
            got = owner.kv_batch_get(metas[0], select_fields=["ids", "r"])
            assert bit_exact(got["ids"].values(), small["ids"].values()) and bit_exact(got["r"], small["r"])
            assert bit_exact(owner.kv_batch_get(metas[1], select_fields="x")["x"], big["x"])
            mixed = owner.kv_batch_get(["f", "c", "e", "d"], partition_id="unpadded", select_fields="x")["x"]
            want = other.kv_batch_get(metas[2], select_fields="x")["x"]
            assert bit_exact(mixed, torch.stack([want[1], big["x"][0], want[0], big["x"][1]]))
        finally:
            other.kv_clear(partition_id="unpadded")

    def test_decode_beside_the_transfer_matches_decode_before_it(
        self, owner: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        rows = [torch.arange(n, dtype=torch.int32) for n in (3, 0, 5)]
        fields = {"ids": _jagged(rows), "m": _jagged([r % 2 for r in rows]), "r": torch.tensor([1.0, 2.0, 3.0])}
        meta = owner.kv_batch_put(["a", "b", "c"], fields, partition_id="beside")
        threads: list[str] = []
        decode = dataplane.store_client.decode_columns

        def spy(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return decode(*args, **kwargs)

        monkeypatch.setattr(dataplane.store_client, "decode_columns", spy)
        got: dict[str, Any] = {}
        try:
            for mode in ("0", "1"):
                monkeypatch.setenv("DATAPLANE_DECODE_THREAD", mode)
                with dataplane.connect(owner.store.join_url) as c:  # type: ignore[attr-defined]
                    assert (c._beside is not None) == (mode == "1")  # type: ignore[attr-defined]
                    with torch.inference_mode():  # the caller's autograd mode holds on the helper thread
                        got[mode] = c.kv_batch_get(meta, select_fields=["ids", "m", "r"])
                    plain = c.kv_batch_get(meta, select_fields=["ids", "m", "r"])
                    assert not plain["ids"].is_inference() and not plain["r"].is_inference()
                    monkeypatch.setattr(c.store.handle, "get_into", _failing_read)  # type: ignore[attr-defined]
                    with pytest.raises(BackendUnavailable, match="planted"):  # finish's error, typed
                        c.kv_batch_get(meta, select_fields=["ids"])
        finally:
            owner.kv_clear(partition_id="beside")
        assert threads[0] == threading.current_thread().name
        assert threads[3].startswith("dataplane-decode")
        for mode in ("0", "1"):
            assert bit_exact(got[mode]["r"], fields["r"])
            assert [r.tolist() for r in got[mode]["ids"].unbind()] == [r.tolist() for r in rows]
            assert got[mode]["ids"]._offsets is got[mode]["m"]._offsets
            assert got[mode]["ids"].is_inference() and got[mode]["r"].is_inference()

    def test_a_get_by_meta_reads_beside_decoding_the_index(
        self, owner: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        rows = [torch.arange(n) for n in (2, 3)]
        meta = owner.kv_batch_put(["a", "b"], {"ids": _jagged(rows), "r": torch.ones(2)}, partition_id="early")
        order: list[tuple[str, str]] = []
        monkeypatch.setenv("DATAPLANE_DECODE_THREAD", "1")
        try:
            with dataplane.connect(owner.store.join_url) as c:  # type: ignore[attr-defined]
                _record_get_calls(monkeypatch, c, order)
                for m in (meta, KVBatchMeta.from_msgpack(meta.to_msgpack())):  # the hint survives msgpack
                    order.clear()
                    out = c.kv_batch_get(m, select_fields=["ids", "r"])
                    assert [r.tolist() for r in out["ids"].unbind()] == [r.tolist() for r in rows]
                    main = threading.current_thread().name
                    assert [t for name, t in order if name == "get_into"] == [main]  # one read, by the caller
                    helper = {t for name, t in order if name == "_hints"}
                    assert len(helper) == 1 and helper != {main}  # the index is decoded beside the read
                    # the one listing is asked for after the read (what was read is trusted only while
                    # its put is still listed after it), by the caller
                    assert [(name, t) for name, t in order if name != "_hints"] == [
                        ("get_into", main),
                        ("start_all_keys", main),
                    ]
                owner.kv_batch_put(["a", "b"], {"adv": torch.zeros(2)}, partition_id="early")  # other fields
                for reads in (2, 1):  # the data, plus the other put's index while this client has not seen it
                    order.clear()
                    assert c.kv_batch_get(meta, select_fields="r")["r"].tolist() == [1.0, 1.0]
                    assert [name for name, _ in order].count("get_into") == reads  # what was read still stands
                owner.kv_batch_put(["b"], {"r": torch.tensor([5.0])}, partition_id="early")  # a newer row
                assert c.kv_batch_get(meta, select_fields="r")["r"].tolist() == [1.0, 5.0]  # read again
                owner.kv_clear(partition_id="early")
                with pytest.raises(KeyNotFound, match="no longer in the store"):  # its objects vanished
                    c.kv_batch_get(meta, select_fields=["ids", "r"])
        finally:
            owner.kv_clear(partition_id="early")

    def test_in_line_a_get_by_meta_lists_while_it_decodes(
        self, owner: StoreClient, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without a helper thread: the read, then the listing request, then the index is decoded
        (the master answers meanwhile), all on the caller's thread."""
        rows = [torch.arange(n) for n in (2, 3)]
        meta = owner.kv_batch_put(["a", "b"], {"ids": _jagged(rows)}, partition_id="inline")
        order: list[tuple[str, str]] = []
        monkeypatch.setenv("DATAPLANE_DECODE_THREAD", "0")
        try:
            with dataplane.connect(owner.store.join_url) as c:  # type: ignore[attr-defined]
                _record_get_calls(monkeypatch, c, order)
                out = c.kv_batch_get(meta, select_fields="ids")
                assert [r.tolist() for r in out["ids"].unbind()] == [r.tolist() for r in rows]
                main = threading.current_thread().name
                assert order == [("get_into", main), ("start_all_keys", main), ("_hints", main)]
        finally:
            owner.kv_clear(partition_id="inline")

    @pytest.mark.parametrize("packed", [False, True], ids=["per-field", "packed"])
    def test_a_read_hint_naming_another_put_is_never_trusted(
        self, owner: StoreClient, other: StoreClient, packed: bool
    ) -> None:
        more = {"y": torch.tensor([5.0, 6.0])} if packed else {}  # two small fields: one packed object
        old = owner.kv_batch_put(["a", "b"], {"x": torch.tensor([1, 2]), **more}, partition_id="forged")
        new = owner.kv_batch_put(["a", "b"], {"x": torch.tensor([3, 4]), **more}, partition_id="forged")
        hint = new.extra_info["mooncake_read"]
        assert (hint[5] > 0) is packed
        try:  # the old put's objects are still stored (re-written, never cleared): a read of them succeeds
            forged = new.with_extra_info(mooncake_read=old.extra_info["mooncake_read"])
            assert other.kv_batch_get(forged, select_fields="x")["x"].tolist() == [3, 4]
            prefix = old.extra_info["mooncake_read"][:4]
            for junk in (
                None,
                "x",
                [1, 2, 3, 4, 5, 6],
                ["nope", 2, "a", "b", {"x": 16}, 0],
                [*prefix, {"x": "8"}, 0],
                [*prefix, {"x": -8}, 0],
                [*prefix, {"x": 1 << 40}, 0],  # never allocated: over the bound
                [*hint[:5]],  # no packed size
                [*hint[:5], -64],
                [*hint[:5], "64"],
                [*hint[:5], 1 << 40],  # never allocated: over the bound
                [*hint[:5], hint[5] + 64],  # the wrong size of the packed object (or one where there is none)
                [*hint[:5], max(0, hint[5] - 64)],  # too small (or, for the packed put: per-field objects)
            ):
                bad = new.with_extra_info(mooncake_read=junk)
                assert other.kv_batch_get(bad, select_fields="x")["x"].tolist() == [3, 4]
            ((index_key, body),) = new.extra_info["mooncake_index"].items()
            broken = new.with_extra_info(mooncake_index={index_key: b"\xc1" * len(body)})
            for mode in ("0", "1"):  # an unreadable index: a typed error, on and off the helper thread
                with pytest.MonkeyPatch.context() as mp:
                    mp.setenv("DATAPLANE_DECODE_THREAD", mode)
                    with dataplane.connect(owner.store.join_url) as c:  # type: ignore[attr-defined]
                        with pytest.raises(BackendUnavailable, match="unreadable"):
                            c.kv_batch_get(broken, select_fields="x")
                        assert c.kv_batch_get(new, select_fields="x")["x"].tolist() == [3, 4]
        finally:
            owner.kv_clear(partition_id="forged")

    def test_closed_handle_raises_instead_of_crashing(self, owner: StoreClient) -> None:
        c = dataplane.connect(owner.store.join_url)  # type: ignore[attr-defined]
        handle = c.store.handle  # type: ignore[attr-defined]
        c.close()
        with pytest.raises(ClientClosed):
            handle.get_into(["x"], [0], [1])
        with pytest.raises(ClientClosed):
            c.store.get("p", ["a"], ["x"], meta=None, timeout_s=5)  # type: ignore[attr-defined]

    def test_forked_child_gets_a_typed_error(self) -> None:
        script = textwrap.dedent(
            """
            import os, sys, torch, dataplane
            from dataplane.errors import BackendUnavailable
            c = dataplane.connect("mooncake://local?segment_bytes=64MiB")
            meta = c.kv_batch_put(["a"], {"x": torch.ones(1)}, partition_id="f")
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    c.kv_batch_get(meta, select_fields="x")
                    msg = b"no error"
                except BackendUnavailable as e:
                    msg = b"typed" if b"fork" in str(e).encode() else str(e).encode()
                except BaseException as e:
                    msg = repr(e).encode()
                os.write(w, msg)
                os._exit(0)
            os.close(w)
            got = os.read(r, 1000)
            _, status = os.waitpid(pid, 0)
            assert c.kv_batch_get(meta, select_fields="x")["x"].tolist() == [1.0]  # the parent still works
            c.close()
            print(got.decode(), status)
            """
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["typed", "0"], out.stdout

    def test_full_store_raises_capacity_exceeded_and_writes_nothing(self) -> None:
        with dataplane.connect("mooncake://local?segment_bytes=32MiB") as small:
            small.kv_batch_put(["a"], {"x": torch.zeros(1, 1024)}, partition_id="cap")
            before = small.kv_list()
            with pytest.raises(CapacityExceeded):
                small.kv_batch_put(
                    ["b", "c"], {"x": torch.zeros(2, 1024), "big": torch.zeros(2, 6 << 20)}, partition_id="cap"
                )
            assert small.kv_list() == before
            assert [k for k in _all_keys(small) if "/d/" in k and not k.endswith("/x")] == []
            small.kv_batch_put(["b"], {"x": torch.ones(1, 1024)}, partition_id="cap")
            assert small.kv_batch_get(["a", "b"], partition_id="cap", select_fields="x")["x"][1].eq(1).all()


def test_a_claim_of_more_rows_than_one_marker_call_takes_them_all_once(owner: StoreClient, other: StoreClient) -> None:
    """Claim markers go out at most 1,024 a call (bounded shared memory): a claim of 2,000 rows over
    1,100 ready ones takes every one in first-put order, and another client of the task gets none."""
    keys = [f"m{i:05d}" for i in range(1100)]
    owner.kv_batch_put(keys, {"x": torch.ones(len(keys))}, partition_id="many-claims")
    try:
        got = owner.claim_meta("t", partition_id="many-claims", required_fields=["x"], batch_size=2000)
        assert got.keys == tuple(keys)
        assert other.claim_meta("t", partition_id="many-claims", required_fields=["x"], batch_size=2000).size == 0
    finally:
        owner.kv_clear(partition_id="many-claims")
