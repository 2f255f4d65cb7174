"""Claims across real processes: 4 consumer processes of one task stream rows (``dataplane.stream``)
while 2 producer processes put them, on ``mooncake://local`` (forkserver processes, each its own
Mooncake client) and ``tq://?backend=simple`` (Ray workers, each its own TransferQueue client, on
the session's local Ray with fractional CPUs). Every row is claimed exactly once (counted), none is
lost, every claimed row reads back as its producer wrote it, and no consumer meets an untyped error.

A row becomes ready only once its second put adds the required ``reward`` (producers write
``ids`` first), and the test marks the partition finished once both producers are done, which ends
every consumer's stream. The ``soak`` variant runs ten times the rows.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import time
import uuid
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

import dataplane
from dataplane.errors import DataPlaneError

pytestmark = [pytest.mark.multiprocess]

CTX = mp.get_context("forkserver")  # fresh processes, each with its own backend client (tests/conftest.py)
CONSUMERS = 4
PRODUCERS = 2


def _value(key: str) -> float:
    return float(sum(key.encode()) % 9973)


def produce(url: str, pid: str, index: int, batches: int, rows: int) -> list[str]:
    """Put ``batches`` batches of ``rows`` rows, each in two puts (``ids``, then ``reward``); the keys."""
    out: list[str] = []
    with dataplane.connect(url) as c:
        for b in range(batches):
            keys = [f"p{index}_b{b}_r{i}" for i in range(rows)]
            ids = torch.nested.as_nested_tensor([torch.arange(1 + i % 5) for i in range(rows)], layout=torch.jagged)
            c.kv_batch_put(keys, {"ids": ids}, partition_id=pid, tags=[{"len": 1 + i % 5} for i in range(rows)])
            c.kv_batch_put(keys, {"reward": torch.tensor([_value(k) for k in keys])}, partition_id=pid)
            out += keys
            time.sleep(0.01 * (index + 1))
    return out


def consume(url: str, pid: str, batch_rows: int) -> dict[str, Any]:
    """Stream the partition for task ``train``; the keys claimed, in order, and any error met (typed or not)."""
    keys: list[str] = []
    bad: list[str] = []
    errors: list[str] = []
    t0 = time.monotonic()
    try:
        with dataplane.connect(url) as c:
            for meta in dataplane.stream(
                c,
                "train",
                partition_id=pid,
                required_fields=["ids", "reward"],
                batch_rows=batch_rows,
                idle_timeout_s=90,
            ):
                keys += meta.keys
                got = c.kv_batch_get(meta, select_fields=["reward", "ids"])
                bad += [k for k, r in zip(meta.keys, got["reward"].tolist(), strict=True) if r != _value(k)]
    except DataPlaneError as e:
        errors.append(f"typed {type(e).__name__}: {e}")
    except Exception as e:  # an untyped error fails the test
        errors.append(f"UNTYPED {type(e).__name__}: {e}")
    return {"keys": keys, "bad": bad, "errors": errors, "seconds": time.monotonic() - t0}


def _in_process(target: Callable[..., Any], args: tuple[Any, ...], conn: Connection) -> None:
    conn.send(target(*args))


def _check(results: list[dict[str, Any]], produced: list[list[str]], seconds: float, backend: str) -> None:
    every = [k for p in produced for k in p]
    counts = Counter(k for r in results for k in r["keys"])
    twice = [k for k, n in counts.items() if n > 1]
    lost = sorted(set(every) - set(counts))
    figures = (
        f"{backend}: {len(every)} rows from {PRODUCERS} producers, {CONSUMERS} consumers claimed "
        f"{[len(r['keys']) for r in results]} ({sum(counts.values())} claims, {len(counts)} distinct) in {seconds:.1f}s"
    )
    print(figures)
    assert not [e for r in results for e in r["errors"]], (figures, [r["errors"] for r in results])
    assert not twice and not lost, (figures, twice[:5], lost[:5])
    assert sorted(counts) == sorted(every) and set(counts.values()) == {1}, figures
    assert not [b for r in results for b in r["bad"]], figures


def _mooncake_case(batches: int, rows: int) -> None:
    with dataplane.connect("mooncake://local?segment_bytes=256MiB") as owner:
        url, pid = owner.url, f"claims-{uuid.uuid4().hex[:8]}"
        started = []
        t0 = time.monotonic()
        jobs = [(consume, (url, pid, 4)) for _ in range(CONSUMERS)]
        jobs += [(produce, (url, pid, i, batches, rows)) for i in range(PRODUCERS)]
        for target, args in jobs:
            parent, child = CTX.Pipe()
            proc = CTX.Process(target=_in_process, args=(target, args, child))
            proc.start()
            started.append((parent, proc))
        try:
            produced = [
                started[CONSUMERS + i][0].recv() for i in range(PRODUCERS) if started[CONSUMERS + i][0].poll(120)
            ]
            assert len(produced) == PRODUCERS, "a producer sent nothing within 120 s"
            owner.mark_finished(partition_id=pid)
            results = [parent.recv() for parent, _ in started[:CONSUMERS] if parent.poll(180)]
            assert len(results) == CONSUMERS, "a consumer sent nothing within 180 s"
            seconds = time.monotonic() - t0
        finally:
            for _, proc in started:
                proc.join(timeout=60)
                if proc.is_alive():  # a process this test started
                    proc.kill()
                    proc.join(timeout=10)
        assert [proc.exitcode for _, proc in started] == [0] * len(started)
        _check(results, produced, seconds, "mooncake://local")
        owner.kv_clear(partition_id=pid)


def _tq_case(batches: int, rows: int) -> None:
    import ray

    remote = ray.remote(num_cpus=0.25, max_retries=0)
    with dataplane.connect("tq://?backend=simple&timeout_s=60") as owner:
        pid = f"claims-{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        consumers = [remote(consume).remote("tq://", pid, 4) for _ in range(CONSUMERS)]
        producers = [remote(produce).remote("tq://", pid, i, batches, rows) for i in range(PRODUCERS)]
        produced = ray.get(producers, timeout=180)
        owner.mark_finished(partition_id=pid)
        results = ray.get(consumers, timeout=240)
        seconds = time.monotonic() - t0
        _check(results, produced, seconds, "tq://?backend=simple")
        owner.kv_clear(partition_id=pid)


@pytest.mark.mooncake
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake is not installed")
def test_four_consumer_processes_claim_every_row_once_on_mooncake() -> None:
    _mooncake_case(batches=10, rows=8)


@pytest.mark.tq
def test_four_consumer_processes_claim_every_row_once_on_tq(ray_cluster: None) -> None:
    _tq_case(batches=10, rows=8)


@pytest.mark.soak
@pytest.mark.mooncake
def test_claims_soak_on_mooncake() -> None:
    _mooncake_case(batches=50, rows=16)


@pytest.mark.soak
@pytest.mark.tq
def test_claims_soak_on_tq(ray_cluster: None) -> None:
    _tq_case(batches=50, rows=16)
