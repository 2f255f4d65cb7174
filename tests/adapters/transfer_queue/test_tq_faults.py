"""``tq://`` when things go wrong: a full store, a killed storage unit, a dead controller, teardown.

Each test runs its own deployment (a small capacity needs its own TransferQueue) on the session's Ray.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dataplane
from dataplane.adapters.transfer_queue._deploy_config import CONTROLLER_NAME, STORAGE_UNIT_NAME, TQ_NAMESPACE
from dataplane.errors import BackendUnavailable, CapacityExceeded, DataPlaneTimeout

pytestmark = [pytest.mark.tq, pytest.mark.slow]

TIMEOUT_S = 4.0  # TQ then gives up on a dead storage unit after 3 s (2 tries of 1 s + a 1 s probe)
SLACK_S = 3.0  # scheduling noise on a loaded 2-core box


def _pid_of(actor: Any) -> int:
    import ray

    pid: int = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    return pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pending(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks(loop) if not t.done()]


def _eventually(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def _actor_exists(name: str, namespace: str | None = None) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def _timed(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    t0 = time.monotonic()
    err: BaseException | None = None
    try:
        fn()
    except BaseException as e:
        err = e
    took = time.monotonic() - t0
    print(f"[tq faults] {type(err).__name__} after {took:.2f}s: {str(err)[:160]}")  # shown with -s
    return err, took


@pytest.mark.soak  # 35-45 s of CI (a storage unit and a controller killed, each a bounded wait); the
# tq-mooncake fault test below keeps the typed-error paths in CI
def test_simple_capacity_dead_unit_dead_controller_teardown(ray_cluster: None) -> None:
    import ray

    owner = dataplane.connect(f"tq://?backend=simple&units=2&capacity_rows=16&timeout_s={TIMEOUT_S}")
    try:
        units = [ray.get_actor(STORAGE_UNIT_NAME.format(i)) for i in range(2)]
        controller = ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE)
        pids = [_pid_of(a) for a in (*units, controller)]

        # capacity: 8 per unit; a put that does not fit raises CapacityExceeded and leaves no key
        keys = [f"k{i}" for i in range(8)]
        owner.kv_batch_put(keys, {"x": torch.arange(8)}, partition_id="cap")
        before = owner.kv_list()
        with pytest.raises(CapacityExceeded):
            owner.kv_batch_put([f"n{i}" for i in range(40)], {"x": torch.arange(40)}, partition_id="cap")
        with pytest.raises(CapacityExceeded):
            owner.kv_batch_put([f"n{i}" for i in range(40)], {"y": torch.ones(40, 2)}, partition_id="other")
        assert owner.kv_list() == before
        owner.kv_batch_put(keys, {"x": torch.arange(8) + 1}, partition_id="cap")  # rewrites still fit
        assert owner.kv_batch_get(keys, partition_id="cap", select_fields="x")["x"].tolist() == list(range(1, 9))

        # a killed storage unit: typed errors within the configured timeout, no phantom keys
        ray.kill(units[1])
        assert _eventually(lambda: not _alive(pids[1]))
        err, took = _timed(lambda: owner.kv_batch_get(keys, partition_id="cap", select_fields="x"))
        assert isinstance(err, (BackendUnavailable, DataPlaneTimeout)), err
        assert took < TIMEOUT_S + SLACK_S, took
        err, took = _timed(lambda: owner.kv_batch_put(["p0", "p1"], {"x": torch.arange(2)}, partition_id="cap"))
        assert isinstance(err, (BackendUnavailable, DataPlaneTimeout)), err
        assert took < TIMEOUT_S + SLACK_S, took
        assert _eventually(lambda: owner.kv_list() == before), owner.kv_list()

        # a dead controller: DataPlaneTimeout within the timeout, on every call
        ray.kill(controller)
        assert _eventually(lambda: not _alive(pids[2]))
        for call in (
            lambda: owner.kv_batch_get(keys, partition_id="cap", select_fields="x"),
            lambda: owner.kv_list(),
        ):
            err, took = _timed(call)
            assert isinstance(err, (DataPlaneTimeout, BackendUnavailable)), err
            assert took < TIMEOUT_S + SLACK_S, took

        # a call still pending on TQ's loop when the client closes is cancelled there and ends, not
        # left for the garbage collector to close later in whatever runs then
        import transfer_queue.interface as itf

        loop = itf._TQ_CLIENT._loop
        hung = threading.Thread(target=lambda: _timed(owner.kv_list), daemon=True)
        hung.start()
        assert _eventually(lambda: bool(_pending(loop)), 5.0)
        pending = _pending(loop)
    finally:
        t0 = time.monotonic()
        owner.close()
        assert time.monotonic() - t0 < 60
    assert pending and all(t.done() for t in pending), pending
    hung.join(TIMEOUT_S + SLACK_S)
    gc.collect()  # a coroutine closed here would be reported as unraisable: an error under pytest
    assert _eventually(lambda: not any(_alive(p) for p in pids)), [p for p in pids if _alive(p)]
    assert not _actor_exists(CONTROLLER_NAME, TQ_NAMESPACE)
    assert not any(_actor_exists(STORAGE_UNIT_NAME.format(i)) for i in range(2))


@pytest.mark.mooncake
def test_mooncake_capacity_teardown_and_foreign_master(ray_cluster: None) -> None:
    import ray

    from dataplane._host.mooncake_master import start_master

    foreign = start_master()  # stands in for another user's master on this host
    try:
        owner = dataplane.connect(f"tq://?backend=mooncake&segment_bytes={32 << 20}&timeout_s=30")
        try:
            store: Any = getattr(owner, "store")  # noqa: B009
            master = store.deployment.master
            assert master is not None and master.pid != foreign.pid
            pids = [master.pid, _pid_of(ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE))]

            row = 4 << 20  # 4 MiB rows in a 32 MiB pool
            keys = [f"k{i}" for i in range(4)]
            owner.kv_batch_put(keys, {"x": torch.zeros(4, row, dtype=torch.uint8)}, partition_id="cap")
            before = owner.kv_list()
            with pytest.raises(CapacityExceeded):
                owner.kv_batch_put(
                    [f"n{i}" for i in range(6)], {"x": torch.ones(6, row, dtype=torch.uint8)}, partition_id="cap"
                )
            assert owner.kv_list() == before
            owner.kv_clear(partition_id="cap")
            owner.kv_batch_put(  # the space of the failed put came back
                [f"n{i}" for i in range(6)], {"x": torch.ones(6, row, dtype=torch.uint8)}, partition_id="cap"
            )
            assert owner.kv_batch_get(["n5"], partition_id="cap", select_fields="x")["x"].eq(1).all()
            assert foreign.healthy()
        finally:
            owner.close()
        assert _eventually(lambda: not any(_alive(p) for p in pids)), [p for p in pids if _alive(p)]
        assert not _actor_exists(CONTROLLER_NAME, TQ_NAMESPACE)
        assert _alive(foreign.pid) and foreign.healthy()
    finally:
        foreign.stop()
