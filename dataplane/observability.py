"""Metrics for any client: a wrapper that times every call and reports one event per call.

>>> import dataplane, torch
>>> events = []
>>> client = ObservedClient(dataplane.connect(), callback=events.append)
>>> _ = client.kv_batch_put(["a"], {"x": torch.zeros(1, 4)}, partition_id="p")
>>> events[0].op, events[0].n_keys, events[0].bytes, events[0].status
('kv_batch_put', 1, 16, 'ok')
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from dataplane._host.quiet import BACKEND_LOGS_ENV, backend_logs, filtered_stderr
from dataplane.claims import ConsumptionStatus
from dataplane.client import Capabilities, DataPlaneClient, FieldsIn, KeysOrMeta, Listing, PadValues
from dataplane.codec.wire import Layout
from dataplane.meta import KVBatchMeta, RowInfo

__all__ = [
    "BACKEND_LOGS_ENV",
    "CallEvent",
    "ObservedClient",
    "backend_logs",
    "filtered_stderr",
    "payload_bytes",
]

# Backend logs: ``filtered_stderr()`` around a native backend call drops only the harmless lines a
# healthy run prints there (Mooncake's glog: hot cache fd, dummy client reconnect probe) and writes
# every other line back; ``$DATAPLANE_BACKEND_LOGS=1`` (``backend_logs()``) turns the filtering off. dataplane's own
# clients use it already; it is public for code that drives a backend's own client beside them.

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CallEvent:
    """One finished call. ``status`` is ``"ok"`` or the exception's class name."""

    op: str
    partition_id: str | None
    n_keys: int
    n_fields: int
    bytes: int
    seconds: float
    status: str


def _tensor_bytes(t: torch.Tensor) -> int:
    values = getattr(t, "_values", None)  # a jagged nested tensor's buffer (on other tensors, a method)
    if isinstance(values, torch.Tensor):  # ~0.2 us where t.values() and t.is_nested take ~45 and ~6
        return int(values.numel() * values.element_size())
    if t.is_nested:
        return int(t.values().numel() * t.values().element_size())
    return int(t.numel() * t.element_size())


def _value_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _tensor_bytes(value)
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value if isinstance(v, torch.Tensor))
    return 0


def payload_bytes(fields: FieldsIn | TensorDict) -> int:
    """Bytes of tensor data in a put's fields or a get's result (object columns count 0)."""
    items: Any = fields.items() if isinstance(fields, (Mapping, TensorDictBase)) else ()
    return sum(_value_bytes(value) for _, value in items)


@dataclass
class _OpStats:
    count: int = 0
    errors: int = 0
    bytes: int = 0
    seconds: deque[float] = field(default_factory=deque)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


class ObservedClient(DataPlaneClient):
    """Wraps a client; every call sends a :class:`CallEvent` to ``callback`` and feeds :meth:`snapshot`.

    Args:
        inner: the client to wrap (it is closed with this one).
        callback: called with each event, from the calling thread; its exceptions are logged, not raised.
        keep_last: latency samples kept per op for the percentiles.
    """

    def __init__(
        self, inner: DataPlaneClient, callback: Callable[[CallEvent], None] | None = None, *, keep_last: int = 10_000
    ) -> None:
        self.inner = inner
        self.callback = callback
        self.keep_last = keep_last
        self._lock = threading.Lock()
        self._ops: dict[str, _OpStats] = {}
        self._held: dict[str, dict[str, dict[str, int]]] = {}  # partition -> key -> field -> bytes
        self._held_bytes: dict[str, int] = {}  # partition -> the sum of its _held bytes
        self._outstanding = 0
        self._peak = 0

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def url(self) -> str:
        """The wrapped client's URL (another process joins the same deployment with it)."""
        return self.inner.url

    @contextmanager
    def _observe(self, op: str, partition_id: str | None, n_keys: int, n_fields: int) -> Iterator[list[int]]:
        box = [0]  # the call fills in its byte count
        status = "ok"
        t0 = time.perf_counter()
        try:
            yield box
        except BaseException as e:
            status = type(e).__name__
            raise
        finally:
            seconds = time.perf_counter() - t0
            event = CallEvent(
                op=op,
                partition_id=partition_id,
                n_keys=n_keys,
                n_fields=n_fields,
                bytes=box[0],
                seconds=seconds,
                status=status,
            )
            with self._lock:
                st = self._ops.get(op)
                if st is None:
                    st = self._ops[op] = _OpStats(seconds=deque(maxlen=self.keep_last))
                st.count += 1
                st.errors += status != "ok"
                st.bytes += box[0]
                st.seconds.append(seconds)  # the oldest falls out past keep_last (a list's del moved them all)
            if self.callback is not None:
                try:
                    self.callback(event)
                except Exception:
                    log.exception("dataplane: observability callback failed")

    def kv_batch_put(
        self,
        keys: Sequence[str],
        fields: FieldsIn | None,
        *,
        partition_id: str,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        n_fields = 0 if fields is None else len(list(fields.keys()))  # None: a tag-only put
        with self._observe("kv_batch_put", partition_id, len(keys), n_fields) as box:
            meta = self.inner.kv_batch_put(keys, fields, partition_id=partition_id, tags=tags)
            per_field = {} if fields is None else {f: _value_bytes(v) for f, v in fields.items()}
            box[0] = sum(per_field.values())
            self._account_put(partition_id, list(keys), per_field)
            return meta

    def _account_put(self, partition_id: str, keys: list[str], per_field: Mapping[str, int]) -> None:
        """Bytes held per (key, field); a re-write replaces, a new field adds."""
        n = max(len(keys), 1)
        shares = {f: nbytes // n for f, nbytes in per_field.items()}
        row_bytes = sum(shares.values())
        added = 0
        with self._lock:
            rows = self._held.setdefault(partition_id, {})
            if rows.keys().isdisjoint(keys):  # only new rows (the common case): no Python loop over them
                before = len(rows)
                rows.update(dict.fromkeys(keys, shares))  # they share one dict, copied before any change
                keys, added = [], row_bytes * (len(rows) - before)
            for k in keys:
                held = rows.get(k)
                if held is None:  # a new row beside re-written ones: shares the put's dict
                    rows[k] = shares
                    added += row_bytes
                    continue
                held = rows[k] = dict(held)  # copied before a change: new rows of a put share one dict
                for f, share in shares.items():
                    added += share - held.get(f, 0)
                    held[f] = share
            self._outstanding += added
            self._held_bytes[partition_id] = self._held_bytes.get(partition_id, 0) + added
            self._peak = max(self._peak, self._outstanding)

    def kv_batch_get(
        self,
        keys_or_meta: KeysOrMeta,
        *,
        select_fields: Sequence[str] | str,
        partition_id: str | None = None,
        layout: Layout = "jagged",
        pad_values: PadValues = None,
        pad_to_multiple: int = 1,
        pad_to_length: int | None = None,
    ) -> TensorDict:
        pid = keys_or_meta.partition_id if isinstance(keys_or_meta, KVBatchMeta) else partition_id
        n_fields = 1 if isinstance(select_fields, str) else len(select_fields or ())
        with self._observe("kv_batch_get", pid, len(keys_or_meta), n_fields) as box:
            out = self.inner.kv_batch_get(
                keys_or_meta,
                select_fields=select_fields,
                partition_id=partition_id,
                layout=layout,
                pad_values=pad_values,
                pad_to_multiple=pad_to_multiple,
                pad_to_length=pad_to_length,
            )
            box[0] = payload_bytes(out)
            return out

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.empty(shape, dtype)

    def kv_clear(self, keys: Sequence[str] | None = None, *, partition_id: str) -> None:
        with self._observe("kv_clear", partition_id, len(keys) if keys is not None else 0, 0):
            self.inner.kv_clear(keys, partition_id=partition_id)
            self._account_clear(partition_id, keys)

    def _account_clear(self, partition_id: str, keys: Sequence[str] | None) -> None:
        """Forget the bytes of the cleared rows: one dict lookup per key, never a scan of the caller's
        list (16K keys would be 16K scans of 16K keys)."""
        with self._lock:
            rows = self._held.get(partition_id)
            if rows is None:
                return
            if keys is None:
                del self._held[partition_id]
                self._outstanding -= self._held_bytes.pop(partition_id, 0)
                return
            freed = 0
            for k in keys:
                held = rows.pop(k, None)
                if held is not None:
                    freed += sum(held.values())
            self._outstanding -= freed
            self._held_bytes[partition_id] = self._held_bytes.get(partition_id, 0) - freed
            if not rows:
                del self._held[partition_id]
                del self._held_bytes[partition_id]

    def kv_list(self, partition_id: str | None = None) -> Listing:
        with self._observe("kv_list", partition_id, 0, 0):
            return self.inner.kv_list(partition_id)

    def kv_describe(self, keys: Sequence[str], *, partition_id: str) -> dict[str, RowInfo]:
        with self._observe("kv_describe", partition_id, len(keys), 0):
            return self.inner.kv_describe(keys, partition_id=partition_id)

    def claim_meta(
        self,
        task_name: str,
        *,
        partition_id: str,
        required_fields: Sequence[str] | str,
        batch_size: int,
        tag_filter: Mapping[str, Any] | None = None,
        min_rows: int = 1,
        timeout_s: float = 0.0,
        length_tag: str | None = None,
    ) -> KVBatchMeta:
        # bad arguments reach the client's own checks (typed errors), never a TypeError here
        n_fields = (
            1
            if isinstance(required_fields, str)
            else len(required_fields)
            if isinstance(required_fields, Sequence)
            else 0
        )
        with self._observe("claim_meta", partition_id, 0, n_fields):
            return self.inner.claim_meta(
                task_name,
                partition_id=partition_id,
                required_fields=required_fields,
                batch_size=batch_size,
                tag_filter=tag_filter,
                min_rows=min_rows,
                timeout_s=timeout_s,
                length_tag=length_tag,
            )

    def consumption_status(
        self,
        task_name: str,
        *,
        partition_id: str,
        required_fields: Sequence[str] | str | None = None,
        tag_filter: Mapping[str, Any] | None = None,
    ) -> ConsumptionStatus:
        with self._observe("consumption_status", partition_id, 0, 0):
            return self.inner.consumption_status(
                task_name, partition_id=partition_id, required_fields=required_fields, tag_filter=tag_filter
            )

    def reset_consumption(self, task_name: str | None = None, *, partition_id: str) -> None:
        with self._observe("reset_consumption", partition_id, 0, 0):
            self.inner.reset_consumption(task_name, partition_id=partition_id)

    def mark_finished(self, *, partition_id: str, finished: bool = True) -> None:
        with self._observe("mark_finished", partition_id, 0, 0):
            self.inner.mark_finished(partition_id=partition_id, finished=finished)

    def close(self) -> None:
        self.inner.close()

    def held(self) -> dict[str, tuple[int, int]]:
        """Partition -> (rows, bytes) put through this client and not yet cleared through it: what
        this process holds in the store (another process's clear of them is not seen here).

        >>> import dataplane, torch
        >>> client = ObservedClient(dataplane.connect())
        >>> _ = client.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 4)}, partition_id="p")
        >>> client.held()
        {'p': (2, 32)}
        >>> client.kv_clear(["a"], partition_id="p")
        >>> client.held()
        {'p': (1, 16)}
        """
        with self._lock:
            return {p: (len(rows), self._held_bytes.get(p, 0)) for p, rows in self._held.items()}

    def snapshot(self) -> dict[str, Any]:
        """Per-op count, errors, bytes and p50/p90/p99 seconds; bytes outstanding (put, not yet cleared
        through this client) and their peak."""
        with self._lock:
            ops = {}
            for op, st in self._ops.items():
                lat = sorted(st.seconds)
                ops[op] = {
                    "count": st.count,
                    "errors": st.errors,
                    "bytes": st.bytes,
                    "p50_s": _quantile(lat, 0.50),
                    "p90_s": _quantile(lat, 0.90),
                    "p99_s": _quantile(lat, 0.99),
                }
            return {"ops": ops, "bytes_outstanding": self._outstanding, "bytes_peak": self._peak}
