"""Prometheus export (``dataplane.metrics``): a scripted workload's counters and histogram counts,
scraped over HTTP from the endpoint, equal what the workload did; the endpoint listens on loopback
unless asked; rows and bytes held go back to 0 after clears; the worker mixin's fetch and write-back
are timed. Every value is read back through the text format's own parser."""

from __future__ import annotations

import doctest
import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dataplane
import dataplane.metrics
import dataplane.observability
import dataplane.worker.stats
from dataplane.errors import InvalidArgument, KeyNotFound
from dataplane.metrics import PrometheusMetrics, serve_metrics
from dataplane.observability import CallEvent, ObservedClient
from dataplane.testing.netns import parse_tcp_listeners
from dataplane.worker import DataPlaneWorkerMixin, FetchStats

parser = pytest.importorskip(
    "prometheus_client.parser", reason="needs prometheus-client: pip install 'dataplane[metrics]'"
)

ROOT = Path(__file__).resolve().parents[1]
LABELS = {"process": "trainer", "rank": "3"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as r:
        return _parse(r.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one series ``name`` whose labels include ``labels`` (0 when there is none)."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
    return found[0] if found else 0.0


@pytest.fixture
def metrics() -> Iterator[PrometheusMetrics]:
    m = serve_metrics(0, labels=LABELS)
    yield m
    m.close()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize(
    "url", ["memory://", pytest.param("mooncake://local", marks=pytest.mark.mooncake, id="mooncake")]
)
def test_scrape_after_a_workload_equals_the_workload(url: str, metrics: PrometheusMetrics) -> None:
    if url.startswith("mooncake"):
        pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ids = [torch.arange(n, dtype=torch.int64) for n in (2, 1, 3)]  # 48 bytes: 16 per row
    e = torch.ones(2, 4, dtype=torch.float64)
    put_train, put_eval = nbytes(x) + sum(nbytes(t) for t in ids), nbytes(e)
    assert (put_train, put_eval) == (96, 64)
    assert metrics.url is not None and metrics.url.startswith("http://127.0.0.1:")
    with metrics.observe(dataplane.connect(url)) as client:
        meta = client.kv_batch_put(["t0", "t1", "t2"], {"x": x, "ids": ids}, partition_id="train")
        client.kv_batch_put(["e0", "e1"], {"e": e}, partition_id="eval")
        got = client.kv_batch_get(meta, select_fields=["x", "ids"])
        assert torch.equal(got["x"], x)
        client.kv_batch_get(["t0", "t2"], select_fields="x", partition_id="train")
        with pytest.raises(KeyNotFound):
            client.kv_batch_get(["nope"], select_fields="x", partition_id="train")
        client.kv_describe(["t1"], partition_id="train")
        mid = scrape(metrics.url)
        client.kv_clear(["e0", "e1"], partition_id="eval")
        client.kv_clear(partition_id="train")
        client.kv_list()
        end = scrape(metrics.url)

    def calls(op: str, part: str) -> float:
        return value(end, "dataplane_calls_total", op=op, partition=part, **LABELS)

    expected_calls = {
        ("kv_batch_put", "train"): 1, ("kv_batch_put", "eval"): 1, ("kv_batch_get", "train"): 3,
        ("kv_describe", "train"): 1, ("kv_clear", "eval"): 1, ("kv_clear", "train"): 1, ("kv_list", "-"): 1,
    }  # fmt: skip
    for (op, part), n in expected_calls.items():
        assert calls(op, part) == n, (op, part)
        assert value(end, "dataplane_call_duration_seconds_count", op=op, partition=part) == n, (op, part)
        assert value(end, "dataplane_call_duration_seconds_bucket", op=op, partition=part, le="+Inf") == n
    assert sum(v for (n, _), v in end.items() if n == "dataplane_calls_total") == sum(expected_calls.values())
    # the failing get: counted under its class, and nothing else failed
    assert value(end, "dataplane_errors_total", op="kv_batch_get", partition="train", error="KeyNotFound") == 1
    assert sum(v for (n, _), v in end.items() if n == "dataplane_errors_total") == 1
    # bytes in (puts) and out (gets: the whole batch, then x of two rows), rows of successful calls
    assert value(end, "dataplane_bytes_total", op="kv_batch_put", partition="train", direction="in") == put_train
    assert value(end, "dataplane_bytes_total", op="kv_batch_put", partition="eval", direction="in") == put_eval
    assert value(end, "dataplane_bytes_total", op="kv_batch_get", partition="train", direction="out") == 96 + 32
    assert value(end, "dataplane_rows_total", op="kv_batch_get", partition="train") == 3 + 2
    assert value(end, "dataplane_rows_total", op="kv_batch_put", partition="eval") == 2
    # held: what was put before the clears, then nothing (the series stay, at 0)
    assert value(mid, "dataplane_rows_held", partition="train") == 3
    assert value(mid, "dataplane_bytes_held", partition="train") == put_train
    assert value(mid, "dataplane_rows_held", partition="eval") == 2
    assert value(mid, "dataplane_bytes_held", partition="eval") == put_eval
    for part in ("train", "eval"):
        assert ("dataplane_rows_held", frozenset({**LABELS, "partition": part}.items())) in end
        assert value(end, "dataplane_rows_held", partition=part) == 0
        assert value(end, "dataplane_bytes_held", partition=part) == 0


def _listeners(port: int) -> set[str]:
    """Addresses with a listening TCP socket on ``port`` (IPv4 and IPv6)."""
    out = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            text = Path(table).read_text()
        except OSError:
            continue
        out |= {lst.address for lst, _ in parse_tcp_listeners(text, v6=v6) if lst.port == port}
    return out


def test_the_endpoint_listens_on_loopback_unless_asked(metrics: PrometheusMetrics) -> None:
    assert metrics.port is not None and metrics.port > 0  # port 0 picked a free one and says which
    assert _listeners(metrics.port) == {"127.0.0.1"}
    wide = serve_metrics(0, host="0.0.0.0")  # asked for: every interface
    try:
        assert wide.port is not None and _listeners(wide.port) == {"0.0.0.0"}
    finally:
        wide.close()


def test_close_stops_the_server() -> None:
    m = serve_metrics(0)
    port = m.port
    assert port is not None and scrape(f"http://127.0.0.1:{port}/metrics") is not None
    m.close()
    m.close()  # idempotent
    assert m.port is None and _listeners(port) == set()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(InvalidArgument, match="closed"):
        m.serve(0)


class Plain(DataPlaneWorkerMixin):
    pass


def test_worker_fetch_and_write_back_are_timed(metrics: PrometheusMetrics) -> None:
    assert metrics.url is not None
    w = Plain()
    w.setup_data_plane(metrics.observe(dataplane.connect()))
    ids = [torch.arange(n) for n in (3, 1, 2, 2)]
    meta = w.data_plane.kv_batch_put(["a", "b", "c", "d"], {"ids": ids}, partition_id="rollout")
    w.fetch(meta, select_fields=["ids"], pad_values={"ids": -1})
    stats = w.last_fetch_stats
    assert stats is not None and stats.store_bytes > 0
    w.write_back(meta, {"r": torch.arange(4.0)})
    s = scrape(metrics.url)
    reader = {"policy": "independent", "role": "reader", **LABELS}
    assert value(s, "dataplane_worker_fetch_duration_seconds_count", **reader) == 1
    assert value(s, "dataplane_worker_fetch_duration_seconds_sum", **reader) == pytest.approx(stats.total_s)
    assert value(s, "dataplane_worker_fetch_rows_total", **reader) == 4
    assert value(s, "dataplane_worker_fetch_bytes_total", source="store", **reader) == stats.store_bytes
    assert value(s, "dataplane_worker_fetch_phase_seconds_total", phase="read", **reader) == pytest.approx(stats.read_s)
    assert value(s, "dataplane_worker_broadcast_duration_seconds_count", **reader) == 0  # no group: no broadcast
    assert value(s, "dataplane_worker_write_back_duration_seconds_count", **LABELS) == 1
    assert value(s, "dataplane_worker_write_back_rows_total", **LABELS) == 4
    assert value(s, "dataplane_calls_total", op="kv_batch_put", partition="rollout") == 2  # the put, the write-back
    # a leader-broadcast fetch (as a rank of a replica group reports it) feeds the broadcast histogram
    metrics.record_worker(
        FetchStats(policy="leader_broadcast", role="sibling", group_size=2, rows=4, fields=("ids",), broadcast_s=0.02,
                   broadcast_bytes=100, total_s=0.03)
    )  # fmt: skip
    s = scrape(metrics.url)
    sibling = {"policy": "leader_broadcast", "role": "sibling"}
    assert value(s, "dataplane_worker_broadcast_duration_seconds_count", **sibling) == 1
    assert value(s, "dataplane_worker_broadcast_duration_seconds_bucket", le="0.025", **sibling) == 1
    assert value(s, "dataplane_worker_broadcast_duration_seconds_bucket", le="0.01", **sibling) == 0
    assert value(s, "dataplane_worker_fetch_bytes_total", source="broadcast", **sibling) == 100
    metrics.close()  # the worker is no longer timed
    w.fetch(meta, select_fields=["ids"])
    assert value(_parse(metrics.text()), "dataplane_worker_fetch_duration_seconds_count", **reader) == 1
    w.data_plane.close()
    w.close_data_plane()


def test_processes_serve_their_own_endpoints_with_their_labels() -> None:
    ranks = [serve_metrics(0, labels={"process": "trainer", "rank": r}) for r in ("0", "1")]
    try:
        assert ranks[0].port != ranks[1].port
        for i, m in enumerate(ranks):
            with m.observe(dataplane.connect()) as client:
                for _ in range(i + 1):
                    client.kv_batch_put(["k"], {"x": torch.zeros(1)}, partition_id="p")
        for i, m in enumerate(ranks):
            assert m.url is not None
            s = scrape(m.url)
            assert {dict(ls)["rank"] for (_, ls) in s} == {str(i)}
            assert value(s, "dataplane_calls_total", op="kv_batch_put", partition="p") == i + 1
    finally:
        for m in ranks:
            m.close()


def test_partition_labels_fold_steps_and_are_bounded() -> None:
    m = PrometheusMetrics(max_partitions=2, workers=False)
    try:
        for pid in ("rl-step1", "rl-step2", "eval", "other"):
            m.record(
                CallEvent(op="kv_list", partition_id=pid, n_keys=0, n_fields=0, bytes=0, seconds=1e-3, status="ok")
            )
        s = _parse(m.text())
        assert value(s, "dataplane_calls_total", partition="rl-step*") == 2
        assert value(s, "dataplane_calls_total", partition="eval") == 1
        assert value(s, "dataplane_calls_total", partition="_other") == 1  # past max_partitions
    finally:
        m.close()
    keep = PrometheusMetrics(partition_label=lambda p: p or "-", workers=False)
    keep.record(CallEvent(op="kv_list", partition_id="s7", n_keys=0, n_fields=0, bytes=0, seconds=0.0, status="ok"))
    assert value(_parse(keep.text()), "dataplane_calls_total", partition="s7") == 1
    keep.close()


def test_an_observed_clients_own_callback_still_runs() -> None:
    seen: list[CallEvent] = []
    m = PrometheusMetrics(workers=False)
    client = m.observe(ObservedClient(dataplane.connect(), callback=seen.append))
    try:
        client.kv_batch_put(["a"], {"x": torch.zeros(1, 2)}, partition_id="p")
        assert [e.op for e in seen] == ["kv_batch_put"]
        assert value(_parse(m.text()), "dataplane_calls_total", op="kv_batch_put") == 1
        assert m.observe(client) is client  # observing twice adds no second count
        client.kv_clear(partition_id="p")
        assert value(_parse(m.text()), "dataplane_calls_total", op="kv_clear") == 1
    finally:
        client.close()
        m.close()


@pytest.mark.parametrize("labels", [{"op": "x"}, {"bad-name": "x"}, {"__x": "y"}])
def test_bad_label_names_are_refused(labels: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument, match="label name"):
        PrometheusMetrics(labels)


def test_prometheus_client_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import sys, dataplane, dataplane.metrics, dataplane.worker; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # importing dataplane (and dataplane.metrics) does not import it
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'dataplane\[metrics\]'"):
        serve_metrics(0)


@pytest.mark.parametrize("module", [dataplane.metrics, dataplane.worker.stats, dataplane.observability])
def test_doctests(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_the_grafana_dashboard_plots_series_the_exporter_serves() -> None:
    """Every metric a panel queries is served, with every label the panel groups by, and every served
    series is on some panel."""
    dashboard = json.loads((ROOT / "docs" / "grafana" / "dataplane.json").read_text())
    m = PrometheusMetrics(workers=False)
    with m.observe(dataplane.connect()) as client:
        client.kv_batch_put(["a"], {"x": torch.zeros(1, 2)}, partition_id="p")
        client.kv_batch_get(["a"], select_fields="x", partition_id="p")
        with pytest.raises(KeyNotFound):
            client.kv_batch_get(["b"], select_fields="x", partition_id="p")
        m.record_worker(FetchStats(policy="leader_broadcast", role="leader", group_size=2, rows=1, fields=("x",)))
        m.record_worker(dataplane.worker.stats.WriteBackStats(rows=1, fields=("y",), seconds=0.1))
        labels: dict[str, set[str]] = {}
        for (name, ls), _ in _parse(m.text()).items():
            labels.setdefault(name, set()).update(k for k, _ in ls)
    m.close()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert dashboard["title"] == "dataplane" and len(panels) >= 10
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = re.findall(r"\b(dataplane_\w+)\{", expr)
            assert names, expr
            by = {x.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for x in group.split(",")} - {"le"}
            for name in names:
                assert name in labels, f"{panel['title']}: {name} is not served"
                assert by <= labels[name], f"{panel['title']}: {name} has no label {by - labels[name]}"
                queried.add(name)
    unplotted = {n for n in labels if not n.endswith(("_created", "_count", "_sum"))} - queried
    assert not unplotted, f"served but on no panel: {unplotted}"


def test_rows_and_bytes_held_follow_random_puts_rewrites_and_clears() -> None:
    """``ObservedClient.held()`` (what the held gauges read) against a model of every (row, field)."""
    g = torch.Generator().manual_seed(7)
    model: dict[str, dict[str, dict[str, int]]] = {}  # partition -> key -> field -> bytes
    with ObservedClient(dataplane.connect()) as client:
        for _ in range(60):
            part = f"p{int(torch.randint(0, 2, (1,), generator=g))}"
            keys = [f"k{int(i)}" for i in torch.randperm(8, generator=g)[: int(torch.randint(1, 6, (1,), generator=g))]]
            if torch.rand(1, generator=g) < 0.7:
                width = int(torch.randint(1, 4, (1,), generator=g))  # a field's width is fixed by its schema
                field = f"f{width}"
                client.kv_batch_put(keys, {field: torch.zeros(len(keys), width)}, partition_id=part)
                for k in keys:
                    model.setdefault(part, {}).setdefault(k, {})[field] = width * 4  # float32
            elif torch.rand(1, generator=g) < 0.8:
                client.kv_clear(keys, partition_id=part)
                for k in keys:
                    model.get(part, {}).pop(k, None)
            else:
                client.kv_clear(partition_id=part)
                model.pop(part, None)
            want = {p: (len(rows), sum(sum(f.values()) for f in rows.values())) for p, rows in model.items() if rows}
            assert {p: v for p, v in client.held().items() if v[0]} == want
            assert client.snapshot()["bytes_outstanding"] == sum(b for _, b in want.values())


def test_overhead_benchmark_runs_every_way_and_checks_the_endpoints_counts(tmp_path: Path) -> None:
    from benchmarks.metrics_overhead import WAYS, main

    out = tmp_path / "overhead"
    argv = ["--backends", "memory", "--sizes", "1", "--fields", "1,4", "--repeat", "3", "--warmup", "1"]
    assert (
        main([*argv, "--min-sample-ms", "1", "--scrape-s", "0.05", "--out", str(out)]) == 0
    )  # raises if the counters disagree
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["benchmark"] == "metrics_overhead" and len(report["results"]) == 2
    for row in report["results"]:
        assert set(row["samples_s"]) == set(WAYS) and all(len(t["put"]) == 3 for t in row["samples_s"].values())
        assert row["on_vs_off"]["put_get"]["n"] == 3 and row["added_us"]["on"] > 0
        assert row["scrapes"] > 0
    assert "**on/off put+get**" in out.with_suffix(".md").read_text()
