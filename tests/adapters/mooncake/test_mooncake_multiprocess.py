"""mooncake:// across real processes: spawned writers and readers, a killed store server or master, a dead
owner, teardown, and two deployments side by side."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

import dataplane
from dataplane._host.processes import pid_alive
from dataplane.errors import BackendUnavailable, DataPlaneError, KeyNotFound
from dataplane.meta import RowInfo
from dataplane.store_client import StoreClient
from dataplane.testing.churn import PARTITION, run_churn
from dataplane.testing.strategies import bit_exact

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="Mooncake is not installed (pip install 'dataplane[mooncake]')",
    ),
]

CTX = mp.get_context("forkserver")  # fresh processes, each with its own Mooncake client (tests/conftest.py)


def _batch(seed: int, n: int = 16) -> tuple[list[str], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 300, (n,), generator=g).tolist()
    rows = [torch.randint(0, 150_000, (m,), generator=g) for m in lens]
    fields = {
        "input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
        "logp": torch.randn(n, 7, generator=g).to(torch.bfloat16),
        "reward": torch.randn(n, generator=g),
        "msg": [{"turn": i, "text": "x" * (i % 5)} for i in range(n)],
    }
    return [f"s{seed}_g{i}" for i in range(n)], fields


def _same(out: Any, fields: dict[str, Any]) -> bool:
    ok = out["msg"] == fields["msg"]
    ok &= all(bit_exact(a, b) for a, b in zip(out["input_ids"].unbind(), fields["input_ids"].unbind(), strict=True))
    return bool(ok and bit_exact(out["logp"], fields["logp"]) and bit_exact(out["reward"], fields["reward"]))


def _writer(url: str, pid: str, seed: int, conn: Connection) -> None:
    """Join, put one batch, send the meta, exit (closing the client: its rows must survive)."""
    with dataplane.connect(url) as c:
        keys, fields = _batch(seed)
        conn.send(c.kv_batch_put(keys, fields, partition_id=pid))


def _reader(url: str, metas: list[Any], conn: Connection) -> None:
    with dataplane.connect(url) as c:
        results = []
        for meta in metas:
            _, fields = _batch(int(meta.keys[0].split("_")[0][1:]))
            by_meta = c.kv_batch_get(meta, select_fields=["input_ids", "logp", "reward", "msg"])
            by_keys = c.kv_batch_get(list(meta.keys), partition_id=meta.partition_id, select_fields=list(fields))
            results.append(_same(by_meta, fields) and _same(by_keys, fields))
        conn.send((results, sorted(c.kv_list(metas[0].partition_id)[metas[0].partition_id])))


def _run_all(jobs: list[tuple[Callable[..., None], tuple[Any, ...]]], timeout: float = 120) -> list[Any]:
    """Run every ``(target, args)`` at once, each in a spawned process that sends one answer through
    the pipe passed as its last argument; the answers in order. A process that sends nothing within
    ``timeout`` fails the test, and is stopped."""
    started = []
    for target, args in jobs:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=target, args=(*args, child))
        proc.start()
        started.append((target, parent, proc))
    try:
        answers = []
        for target, parent, _ in started:
            if not parent.poll(timeout):
                raise TimeoutError(f"{target.__name__} sent nothing within {timeout}s")
            answers.append(parent.recv())
    finally:
        for _, _, proc in started:
            proc.join(timeout=60)
            if proc.is_alive():  # a process of this test
                proc.kill()
                proc.join(timeout=10)
    assert [proc.exitcode for _, _, proc in started] == [0] * len(started), "a process failed"
    return answers


def _run(target: Any, *args: Any, timeout: float = 120) -> Any:
    return _run_all([(target, args)], timeout)[0]


@pytest.fixture(scope="module", params=[True, False], ids=["shm", "tcp"])
def owner(request: pytest.FixtureRequest) -> Iterator[StoreClient]:
    c = dataplane.connect(f"mooncake://local?segment_bytes=128MiB&shm={request.param}")
    assert isinstance(c, StoreClient)
    yield c
    c.close()


def test_rows_outlive_their_writer_and_read_bit_exact_elsewhere(owner: StoreClient) -> None:
    url = owner.store.join_url  # type: ignore[attr-defined]
    meta = _run(_writer, url, "xp", 1)  # the writer process has exited when this returns
    results, listed = _run(_reader, url, [meta])
    assert results == [True] and listed == sorted(meta.keys)
    owner.kv_clear(partition_id="xp")


def test_concurrent_writer_processes_share_a_partition(owner: StoreClient) -> None:
    url = owner.store.join_url  # type: ignore[attr-defined]
    metas = _run_all([(_writer, (url, "shared", seed)) for seed in (2, 3, 4)])
    results, listed = _run(_reader, url, metas)
    assert results == [True, True, True]
    assert listed == sorted(k for m in metas for k in m.keys)
    merged = metas[0].concat(*metas[1:])
    out = owner.kv_batch_get(merged, select_fields=["reward"])
    assert out["reward"].shape == (48,)
    owner.kv_clear(partition_id="shared")


def _tagger(url: str, pid: str, conn: Connection) -> None:
    """Join, mark rows with tags alone (a new one and one the owner wrote), clear one row, send what
    ``kv_describe`` shows here."""
    with dataplane.connect(url) as c:
        c.kv_batch_put(["new", "a"], None, partition_id=pid, tags=[{"s": "pending"}, {"s": "done"}])
        c.kv_clear(["b"], partition_id=pid)
        conn.send(c.kv_describe(["a", "b", "c", "new"], partition_id=pid))


def test_describe_and_list_see_another_process_tag_only_puts_and_clears(owner: StoreClient) -> None:
    """A process that described a partition sees another's tag-only puts and clears on its next
    describe, and lists in first-put order, though the clear collected the put ``a`` was first put in
    (``a`` was rewritten in full) and left a birth marker in its place."""
    url, pid = owner.store.join_url, "described"  # type: ignore[attr-defined]
    owner.kv_batch_put(["a", "b"], {"x": torch.arange(2)}, partition_id=pid)
    owner.kv_batch_put(["c"], {"x": torch.arange(1)}, partition_id=pid)
    owner.kv_batch_put(["a"], {"x": torch.ones(1, dtype=torch.int64)}, partition_id=pid, tags=[{"r": 1}])
    assert list(owner.kv_describe(["a", "b", "c", "new"], partition_id=pid)) == ["a", "b", "c"]  # now cached here
    theirs = _run(_tagger, url, pid)
    ours = owner.kv_describe(["a", "b", "c", "new"], partition_id=pid)
    assert (
        ours
        == theirs
        == {
            "a": RowInfo(frozenset({"x"}), {"r": 1, "s": "done"}),
            "c": RowInfo(frozenset({"x"}), {}),
            "new": RowInfo(frozenset(), {"s": "pending"}),
        }
    )
    assert list(owner.kv_list(pid)[pid]) == ["a", "c", "new"]
    assert owner.kv_batch_get(["a", "c"], partition_id=pid, select_fields="x")["x"].tolist() == [1, 0]
    owner.kv_clear(partition_id=pid)


CHURN_SECONDS = 3.0  # per case in CI; test_churn_soak runs the same for SOAK_CHURN_SECONDS
SOAK_CHURN_SECONDS = 60.0


def _churn(owner: StoreClient, scale: int, seconds: float) -> None:
    url = owner.store.join_url  # type: ignore[attr-defined]
    owner.kv_clear(partition_id=PARTITION)  # nothing left over from an earlier case that failed
    report = run_churn(url, seconds=seconds, scale=scale, readers=1, clearer_process=True, writers_clear=False)
    assert not report.problems, f"a torn or foreign row was read, or an error raised: {report.problems}"
    assert report.ok, report  # every role made progress
    owner.kv_clear(partition_id=PARTITION)


@pytest.mark.parametrize("scale", [1, 400], ids=["short-rows", "long-rows"])
def test_reads_are_never_torn_while_rows_are_rewritten_and_cleared(owner: StoreClient, scale: int) -> None:
    """Two writer processes rewrite the same keys, a third clears them, a fourth reads. A clear frees
    objects that a read may be in the middle of and a put fills the space at once: every row read
    must still be one that a put wrote, whole. Long rows (up to 5,200 tokens) make the reads take the
    paths of large buffers: registered pool memory, and ranged reads over TCP."""
    _churn(owner, scale, CHURN_SECONDS)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.parametrize("scale", [1, 400], ids=["short-rows", "long-rows"])
def test_churn_soak(owner: StoreClient, scale: int) -> None:
    """The churn above for a minute per case: rarer interleavings of clear, put and read."""
    _churn(owner, scale, SOAK_CHURN_SECONDS)


def _error_within(call: Callable[[], object], seconds: float) -> tuple[BaseException | None, float]:
    """Run ``call`` on a thread; the error it raised (None if it returned) and how long it took.
    Fails the test if it has not returned after ``seconds`` (a hang)."""
    box: list[BaseException | None] = []
    t0 = time.monotonic()

    def work() -> None:
        try:
            call()
            box.append(None)
        except BaseException as e:  # the typed error is the result
            box.append(e)

    th = threading.Thread(target=work, daemon=True)
    th.start()
    th.join(seconds)
    assert box, f"the call did not return within {seconds}s (hang)"
    return box[0], time.monotonic() - t0


def _kill(proc: Any) -> None:
    """SIGKILL a process this test's deployment started, and reap it."""
    os.kill(proc.pid, signal.SIGKILL)
    proc._proc.wait(timeout=10)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_killed_store_server_gives_typed_errors_in_bounded_time(shm: bool) -> None:
    c = dataplane.connect(f"mooncake://local?segment_bytes=64MiB&client_ttl_s=2&timeout_s=20&shm={shm}")
    try:
        keys, fields = _batch(5)
        meta = c.kv_batch_put(keys, fields, partition_id="doomed")
        _kill(c.store.deployment.server)  # type: ignore[attr-defined]
        err, took = _error_within(lambda: c.kv_batch_get(meta, select_fields=["reward"]), 60)
        assert isinstance(err, (BackendUnavailable, KeyNotFound)), repr(err)
        assert took < 30
        time.sleep(3)  # past client_ttl: the master forgets the dead segment
        err, took = _error_within(lambda: c.kv_batch_get(meta, select_fields=["reward"]), 60)
        assert isinstance(err, (BackendUnavailable, KeyNotFound)), repr(err)
        with pytest.raises(DataPlaneError):
            c.kv_batch_put(keys, fields, partition_id="after")
    finally:
        c.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_killed_master_gives_typed_errors_in_bounded_time(shm: bool) -> None:
    """With the master dead, every call raises BackendUnavailable within about its ``timeout_s``
    (a Mooncake call already under way may overrun it by one RPC's own timeout), and close still
    stops what the client started."""
    c = dataplane.connect(f"mooncake://local?segment_bytes=64MiB&timeout_s=4&shm={shm}")  # a get waits ~4 s
    pids = c.store.deployment.pids  # type: ignore[attr-defined]
    try:
        keys, fields = _batch(6)
        meta = c.kv_batch_put(keys, fields, partition_id="doomed")
        _kill(c.store.deployment.master)  # type: ignore[attr-defined]
        calls: dict[str, Callable[[], object]] = {
            "get by meta": lambda: c.kv_batch_get(meta, select_fields=["reward"]),
            "get by keys": lambda: c.kv_batch_get(keys, partition_id="doomed", select_fields="reward"),
            "put": lambda: c.kv_batch_put(keys, fields, partition_id="after"),
            "list": lambda: c.kv_list(),
            "clear": lambda: c.kv_clear(partition_id="doomed"),
        }
        for name, call in calls.items():
            err, took = _error_within(call, 60)
            assert isinstance(err, BackendUnavailable), (name, repr(err))
            assert took < 30, (name, took)
    finally:
        c.close()
    assert not any(pid_alive(p) for p in pids)


def test_close_leaves_no_process_and_deployments_do_not_interfere() -> None:
    a = dataplane.connect("mooncake://local?segment_bytes=64MiB")
    b = dataplane.connect("mooncake://local?segment_bytes=64MiB")
    pids_a = a.store.deployment.pids  # type: ignore[attr-defined]
    pids_b = b.store.deployment.pids  # type: ignore[attr-defined]
    assert set(pids_a).isdisjoint(pids_b)
    a.kv_batch_put(["k"], {"x": torch.tensor([1])}, partition_id="p")
    b.kv_batch_put(["k"], {"x": torch.tensor([2])}, partition_id="p")
    assert a.kv_batch_get(["k"], partition_id="p", select_fields="x")["x"].tolist() == [1]
    assert b.kv_batch_get(["k"], partition_id="p", select_fields="x")["x"].tolist() == [2]
    a.close()
    assert not any(pid_alive(p) for p in pids_a)
    assert b.kv_batch_get(["k"], partition_id="p", select_fields="x")["x"].tolist() == [2]
    b.close()
    assert not any(pid_alive(p) for p in pids_b)


def _owner_then_sleep(conn: Connection, shm: bool) -> None:
    c = dataplane.connect(f"mooncake://local?segment_bytes=64MiB&shm={shm}")
    conn.send(c.store.deployment.pids)  # type: ignore[attr-defined]
    time.sleep(600)  # killed by the test


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_services_die_with_their_owner(shm: bool) -> None:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_owner_then_sleep, args=(child, shm))
    proc.start()
    assert parent.poll(120), "owner process did not start its deployment"
    pids = parent.recv()
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)  # the owner process this test started
    proc.join(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), f"orphans left: {pids}"
