"""Prometheus export of the data plane, served over HTTP on loopback unless told otherwise.

:class:`PrometheusMetrics` turns the :class:`~dataplane.observability.CallEvent` of every call of an
:class:`~dataplane.observability.ObservedClient` into counters and latency histograms per operation
and partition, reads the rows and bytes each observed client holds in the store when scraped, and
times the fetches and write-backs of every :class:`~dataplane.worker.DataPlaneWorkerMixin` of the
process. Each exporter has its own registry; every series carries the exporter's ``process`` and
``rank`` labels, so the processes of one job each serve their own endpoint and a dashboard tells them
apart. ``prometheus-client`` is an optional extra (``pip install 'dataplane[metrics]'``), imported
only when an exporter is made. Metric names, labels and the dashboard: ``docs/metrics.md``.

>>> import dataplane, torch, urllib.request
>>> metrics = serve_metrics(0, labels={"process": "trainer", "rank": "0"})  # port 0: a free port
>>> client = metrics.observe(dataplane.connect())
>>> _ = client.kv_batch_put(["a"], {"x": torch.zeros(1, 4)}, partition_id="train")
>>> text = urllib.request.urlopen(metrics.url, timeout=10).read().decode()
>>> 'dataplane_calls_total{op="kv_batch_put",partition="train",process="trainer",rank="0"} 1.0' in text
True
>>> 'dataplane_bytes_held{partition="train",process="trainer",rank="0"} 16.0' in text
True
>>> metrics.close()
>>> client.close()
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import accumulate
from pathlib import Path
from socketserver import TCPServer, ThreadingMixIn
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from dataplane.client import DataPlaneClient
from dataplane.errors import InvalidArgument
from dataplane.observability import CallEvent, ObservedClient
from dataplane.worker.stats import FetchStats, WriteBackStats, add_stats_observer

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = [
    "LATENCY_BUCKETS",
    "MetricsServer",
    "PrometheusMetrics",
    "default_partition_label",
    "serve_metrics",
]

log = logging.getLogger(__name__)

# Seconds: 100 us (a small memory:// get) to a minute (a stuck store), about 2.5x apart.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
OTHER_PARTITIONS = "_other"  # the partition label once ``max_partitions`` labels are in use
_DIRECTION = {"kv_batch_put": "in", "kv_batch_get": "out"}  # bytes into the store, out of it
_FETCH_PHASES = ("read", "stage", "wait", "broadcast", "materialize")
_RESERVED = frozenset({"op", "partition", "error", "direction", "policy", "role", "phase", "source", "le"})
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_DIGITS = re.compile(r"\d+")
_CHILD_CACHE = 4096  # (op, partition id) pairs remembered; past it the cache starts over
SERVER_CLOSE_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 10.0  # a scraper that connects and sends nothing holds a thread this long at most


def _prometheus() -> ModuleType:
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("dataplane.metrics needs prometheus-client: pip install 'dataplane[metrics]'") from e
    return prometheus_client


def default_partition_label(partition_id: str | None) -> str:
    """The ``partition`` label of a partition id: runs of digits become ``*``, so the partitions of
    every step (``rl-step17``, ``rl-step18``) share one set of series; ``-`` for calls that name no
    partition (a listing of all of them).

    >>> default_partition_label("rl-step17"), default_partition_label("train"), default_partition_label(None)
    ('rl-step*', 'train', '-')
    """
    return "-" if partition_id is None else _DIGITS.sub("*", partition_id)


def _default_process() -> str:
    """The script's name (``put_get`` for ``python -m benchmarks.put_get``); ``python`` for ``-c``."""
    arg = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if arg is None or arg.name.startswith("-"):
        return "python"
    return arg.parent.name if arg.stem == "__main__" else arg.stem


def _const_labels(labels: Mapping[str, object] | None) -> dict[str, str]:
    out = {"process": _default_process(), "rank": os.environ.get("RANK", "0")}
    for name, value in (labels or {}).items():
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__") or name in _RESERVED:
            raise InvalidArgument(
                f"bad label name {name!r}: use [a-zA-Z_][a-zA-Z0-9_]*, not starting with '__', "
                f"none of {sorted(_RESERVED)}"
            )
        out[name] = str(value)
    return out


class _CallSeries:
    """The counts of one (op, partition label): plain numbers, turned into families when scraped
    (a call costs a dict lookup, a bisect and a few additions under one lock)."""

    __slots__ = ("buckets", "bytes", "calls", "direction", "op", "partition", "rows", "seconds")

    def __init__(self, op: str, partition: str, n_buckets: int) -> None:
        self.op, self.partition, self.direction = op, partition, _DIRECTION.get(op)
        self.calls = self.rows = self.bytes = 0
        self.seconds = 0.0
        self.buckets = [0] * (n_buckets + 1)  # per bound, then +Inf; not cumulative


class _Quiet(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # every scrape would print a line
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:  # HTTPServer's looks the host's name up in DNS: not needed, may hang
        TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class MetricsServer:
    """The HTTP endpoint of a registry, on a thread; :meth:`close` stops it.

    Args:
        registry: what to serve (a ``prometheus_client.CollectorRegistry``).
        port: TCP port; 0 picks a free one (read :attr:`port`).
        host: address to bind: loopback unless the caller asks for another (``"0.0.0.0"``: all).
    """

    def __init__(self, registry: Any, port: int = 0, host: str = "127.0.0.1") -> None:
        prom = _prometheus()
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be 0..65535 (0: a free port), got {port}")
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror as e:
            raise InvalidArgument(f"cannot bind metrics to host {host!r}: {e}") from e
        server_class = type("_MetricsServer", (_Server,), {"address_family": family})
        app = prom.make_wsgi_app(registry)
        self._httpd: WSGIServer = make_server(host, port, app, server_class=server_class, handler_class=_Quiet)
        self.host: str = str(self._httpd.server_address[0])
        self.port: int = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="dataplane-metrics", daemon=True
        )
        self._thread.start()
        log.info("dataplane: serving metrics on %s", self.url)

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout_s: float = SERVER_CLOSE_TIMEOUT_S) -> None:
        """Stop serving and close the socket (idempotent); waits at most ``timeout_s`` for the thread."""
        if not self._thread.is_alive():
            self._httpd.server_close()
            return
        stopper = threading.Thread(target=self._httpd.shutdown, name="dataplane-metrics-stop", daemon=True)
        stopper.start()  # shutdown() itself waits without a bound
        stopper.join(timeout_s)
        self._thread.join(timeout_s)
        self._httpd.server_close()
        if self._thread.is_alive():
            log.warning("dataplane: the metrics server thread did not stop within %.1f s", timeout_s)


class PrometheusMetrics:
    """Prometheus metrics of this process's data plane, in a registry of their own.

    Args:
        labels: labels on every series; ``process`` (default: the script's name) and ``rank``
            (default: ``$RANK`` or ``0``) are always there, others may be added (``run``, ``node``).
        partition_label: maps a partition id to its ``partition`` label (default
            :func:`default_partition_label`, which folds per-step partitions into one).
        max_partitions: distinct partition labels kept; later ones are counted under ``_other``
            (a bound on the series a job can create).
        buckets: latency histogram bounds in seconds.
        workers: also time every worker mixin's fetch and write-back in this process.

    Attach clients with :meth:`observe`, serve with :meth:`serve` (or make both at once with
    :func:`serve_metrics`); :meth:`close` stops the server and the worker timing.
    """

    def __init__(
        self,
        labels: Mapping[str, object] | None = None,
        *,
        partition_label: Callable[[str | None], str] = default_partition_label,
        max_partitions: int = 256,
        buckets: Sequence[float] = LATENCY_BUCKETS,
        workers: bool = True,
    ) -> None:
        prom = _prometheus()
        self.labels = _const_labels(labels)
        self.partition_label = partition_label
        self.max_partitions = max_partitions
        self.registry = prom.CollectorRegistry()
        self._lock = threading.Lock()  # partition labels and caches
        self._count_lock = threading.Lock()  # the call counts
        self._const = tuple(self.labels.values())
        self._series: dict[tuple[str, str | None], _CallSeries] = {}  # by (op, partition id): the fast path
        self._by_label: dict[tuple[str, str], _CallSeries] = {}  # by (op, partition label)
        self._partitions: dict[str | None, str] = {}  # partition id -> label
        self._labels_used: dict[str, None] = {}  # ordered set of partition labels in use
        self._held_seen: dict[str, None] = {}  # ordered set of partition labels ever held
        self._clients: weakref.WeakSet[ObservedClient] = weakref.WeakSet()
        self._server: MetricsServer | None = None
        self._closed = False
        names, reg = list(self.labels), self.registry
        fetch = [*names, "policy", "role"]
        self._bounds = b = tuple(sorted(float(x) for x in buckets))
        if not b or b[0] <= 0 or b[-1] == float("inf"):
            raise InvalidArgument(f"buckets must be positive finite bounds in seconds (+Inf is added), got {buckets}")
        self._errors: dict[tuple[str, str, str], int] = {}  # (op, partition label, error class) -> calls
        self._fetch_seconds = prom.Histogram(
            "dataplane_worker_fetch_duration_seconds", "Seconds per worker fetch.", fetch, buckets=b, registry=reg
        )
        self._broadcast_seconds = prom.Histogram(
            "dataplane_worker_broadcast_duration_seconds",
            "Seconds of a leader-broadcast fetch's broadcasts.",
            fetch,
            buckets=b,
            registry=reg,
        )
        self._phase_seconds = prom.Counter(
            "dataplane_worker_fetch_phase_seconds", "Fetch seconds by phase.", [*fetch, "phase"], registry=reg
        )
        self._fetch_rows = prom.Counter("dataplane_worker_fetch_rows", "Rows fetched.", fetch, registry=reg)
        self._fetch_bytes = prom.Counter(
            "dataplane_worker_fetch_bytes",
            "Bytes a fetch read from the store or moved through the replica group.",
            [*fetch, "source"],
            registry=reg,
        )
        self._wb_seconds = prom.Histogram(
            "dataplane_worker_write_back_duration_seconds", "Seconds per write-back.", names, buckets=b, registry=reg
        )
        self._wb_rows = prom.Counter("dataplane_worker_write_back_rows", "Rows written back.", names, registry=reg)
        self.registry.register(_CallCollector(self))
        self._remove_observer = add_stats_observer(self.record_worker) if workers else None

    # -- clients ------------------------------------------------------------------------------------
    def observe(self, client: DataPlaneClient) -> ObservedClient:
        """``client`` publishing here: wrapped in an :class:`ObservedClient` (an observed one keeps its
        own callback too). The exporter keeps no strong reference; use the returned client."""
        if isinstance(client, ObservedClient):
            previous = client.callback
            if previous is None:
                client.callback = self.record
            elif not _publishes_to(previous, self.record):
                client.callback = _Both(previous, self.record)
            observed = client
        else:
            observed = ObservedClient(client, callback=self.record)
        self._clients.add(observed)
        return observed

    def _partition(self, partition_id: str | None) -> str:
        label = self._partitions.get(partition_id)
        if label is not None:
            return label
        with self._lock:
            label = self.partition_label(partition_id)
            if label not in self._labels_used:
                if len(self._labels_used) >= self.max_partitions:
                    if OTHER_PARTITIONS not in self._labels_used:
                        log.warning(
                            "dataplane: %d partition labels in use; later partitions are counted as %r "
                            "(raise max_partitions or pass a coarser partition_label)",
                            self.max_partitions,
                            OTHER_PARTITIONS,
                        )
                    label = OTHER_PARTITIONS
                self._labels_used[label] = None
            if len(self._partitions) >= _CHILD_CACHE:
                self._partitions.clear()
            self._partitions[partition_id] = label
            return label

    def _call_series(self, op: str, partition_id: str | None) -> _CallSeries:
        part = self._partition(partition_id)
        with self._lock:
            series = self._by_label.get((op, part))
            if series is None:  # bounded: ops x max_partitions
                series = self._by_label[(op, part)] = _CallSeries(op, part, len(self._bounds))
            if len(self._series) >= _CHILD_CACHE:
                self._series.clear()
            self._series[(op, partition_id)] = series
        return series

    def record(self, event: CallEvent) -> None:
        """Count one finished call (the callback :meth:`observe` installs)."""
        series = self._series.get((event.op, event.partition_id)) or self._call_series(event.op, event.partition_id)
        bucket = bisect_left(self._bounds, event.seconds)  # the first bound >= seconds (le), else +Inf
        with self._count_lock:
            series.calls += 1
            series.seconds += event.seconds
            series.buckets[bucket] += 1
            if event.status == "ok":
                series.rows += event.n_keys
                series.bytes += event.bytes
            else:
                key = (event.op, series.partition, event.status)
                self._errors[key] = self._errors.get(key, 0) + 1

    def held(self) -> dict[str, tuple[int, int]]:
        """Partition label -> (rows, bytes) the observed clients hold now (what a scrape reports)."""
        out: dict[str, tuple[int, int]] = {}
        for client in list(self._clients):
            for pid, (rows, nbytes) in client.held().items():
                label = self._partition(pid)
                r, b = out.get(label, (0, 0))
                out[label] = (r + rows, b + nbytes)
        return out

    # -- workers ------------------------------------------------------------------------------------
    def record_worker(self, stats: FetchStats | WriteBackStats) -> None:
        """Count one worker fetch or write-back (the observer installed with ``workers=True``)."""
        if isinstance(stats, WriteBackStats):
            self._wb_seconds.labels(*self._const).observe(stats.seconds)
            self._wb_rows.labels(*self._const).inc(stats.rows)
            return
        labels = (*self._const, stats.policy, stats.role)
        self._fetch_seconds.labels(*labels).observe(stats.total_s)
        if stats.policy == "leader_broadcast":
            self._broadcast_seconds.labels(*labels).observe(stats.broadcast_s)
        for phase in _FETCH_PHASES:
            self._phase_seconds.labels(*labels, phase).inc(max(0.0, getattr(stats, f"{phase}_s")))
        self._fetch_rows.labels(*labels).inc(stats.rows)
        self._fetch_bytes.labels(*labels, "store").inc(stats.store_bytes)
        self._fetch_bytes.labels(*labels, "broadcast").inc(stats.broadcast_bytes)

    # -- serving ------------------------------------------------------------------------------------
    def serve(self, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
        """Serve the registry at ``http://HOST:PORT/metrics``: loopback unless ``host`` says otherwise;
        port 0 picks a free port (read :attr:`port`). One server per exporter."""
        if self._closed:
            raise InvalidArgument("this PrometheusMetrics is closed; make a new one")
        if self._server is not None:
            raise InvalidArgument(f"already serving at {self._server.url}; close() first or make another exporter")
        self._server = MetricsServer(self.registry, port, host)
        return self._server

    @property
    def port(self) -> int | None:
        """The port served on (None when not serving)."""
        return None if self._server is None else self._server.port

    @property
    def url(self) -> str | None:
        """``http://HOST:PORT/metrics`` (None when not serving)."""
        return None if self._server is None else self._server.url

    def text(self) -> str:
        """The exposition a scrape would get now (Prometheus text format)."""
        prom = _prometheus()
        return bytes(prom.generate_latest(self.registry)).decode()

    def close(self) -> None:
        """Stop serving and timing workers (idempotent); the observed clients stay open and usable."""
        self._closed = True
        if self._remove_observer is not None:
            self._remove_observer()
            self._remove_observer = None
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def __enter__(self) -> PrometheusMetrics:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Both:
    """Two callbacks in turn (an observed client's own and the exporter's)."""

    def __init__(self, first: Callable[[CallEvent], None], second: Callable[[CallEvent], None]) -> None:
        self.first, self.second = first, second

    def __call__(self, event: CallEvent) -> None:
        try:
            self.first(event)
        finally:
            self.second(event)


def _publishes_to(callback: Callable[[CallEvent], None], record: Callable[[CallEvent], None]) -> bool:
    if callback == record:
        return True
    return isinstance(callback, _Both) and (_publishes_to(callback.first, record) or callback.second == record)


class _CallCollector:
    """The client-side families, built from the plain counts when scraped: calls, errors, the
    latency histograms, rows, bytes, and the rows and bytes held, read from the observed clients (a
    partition label once seen reads 0 when nothing is held under it)."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._metrics = weakref.ref(metrics)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        m = self._metrics()
        if m is None:
            return
        names, const = list(m.labels), list(m._const)
        call = [*names, "op", "partition"]
        with m._count_lock:
            series = [(x.op, x.partition, x.direction, x.calls, x.rows, x.bytes, x.seconds, list(x.buckets))
                      for x in list(m._by_label.values())]  # fmt: skip
            errors = dict(m._errors)
        calls = CounterMetricFamily("dataplane_calls", "Finished calls (any outcome).", labels=call)
        errs = CounterMetricFamily("dataplane_errors", "Calls that raised, by error class.", labels=[*call, "error"])
        hist = HistogramMetricFamily("dataplane_call_duration_seconds", "Seconds per call (any outcome).", labels=call)
        rows = CounterMetricFamily("dataplane_rows", "Rows named by successful calls.", labels=call)
        nbytes = CounterMetricFamily(
            "dataplane_bytes",
            "Tensor bytes of successful puts (direction in) and gets (out).",
            labels=[*call, "direction"],
        )
        bounds = [floatToGoString(b) for b in m._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for op, part, direction, n, r, b, seconds, per_bucket in series:
            values = [*const, op, part]
            calls.add_metric(values, n)
            rows.add_metric(values, r)
            if direction is not None:
                nbytes.add_metric([*values, direction], b)
            cumulative = list(accumulate(per_bucket))
            hist.add_metric(values, buckets=list(zip(bounds, cumulative, strict=True)), sum_value=seconds)
        for (op, part, error), n in errors.items():
            errs.add_metric([*const, op, part, error], n)
        yield from (calls, errs, hist, rows, nbytes)
        held_rows = GaugeMetricFamily(
            "dataplane_rows_held",
            "Rows put through this process and not cleared through it.",
            labels=[*names, "partition"],
        )
        held_bytes = GaugeMetricFamily(
            "dataplane_bytes_held",
            "Tensor bytes put through this process and not cleared through it.",
            labels=[*names, "partition"],
        )
        held = m.held()
        m._held_seen.update(dict.fromkeys(held))
        for label in list(m._held_seen):
            r, b = held.get(label, (0, 0))
            held_rows.add_metric([*const, label], r)
            held_bytes.add_metric([*const, label], b)
        yield held_rows
        yield held_bytes


def serve_metrics(
    port: int = 0, host: str = "127.0.0.1", labels: Mapping[str, object] | None = None, **options: Any
) -> PrometheusMetrics:
    """A :class:`PrometheusMetrics` (``labels`` and ``options`` go to it) serving at
    ``http://HOST:PORT/metrics``; loopback unless ``host`` says otherwise, port 0 picks a free one.

    Each process of a job serves its own (a port per process, or port 0 and publish ``.port``) with
    its own ``process``/``rank`` labels. Call ``close()`` on the result to stop it.
    """
    metrics = PrometheusMetrics(labels, **options)
    try:
        metrics.serve(port, host)
    except BaseException:
        metrics.close()
        raise
    return metrics
