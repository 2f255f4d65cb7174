"""The client every adapter shares: :class:`StoreClient` puts the client semantics on top of a
:class:`~dataplane.storage.KVStore`.

It does everything every backend must agree on exactly once: argument validation, encoding and
decoding, ordering and completeness checks of what a store returns, and the closed state. A get
decodes on a helper thread while the store's transfer runs where the store's
:class:`~dataplane.storage.PendingGet` allows it (see :func:`decode_beside`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from dataplane._host.threads import Helper, usable_cpus
from dataplane.checks import check_int, check_number
from dataplane.claims import ConsumptionStatus, check_required, check_tag_filter, check_task
from dataplane.client import (
    Capabilities,
    DataPlaneClient,
    FieldsIn,
    KeysOrMeta,
    Listing,
    PadValues,
    check_shape,
)
from dataplane.codec.wire import Column, Layout, decode_columns, encode_fields, validate_field_name
from dataplane.errors import (
    ClientClosed,
    DataPlaneError,
    DataPlaneTimeout,
    DeploymentMismatch,
    InvalidArgument,
    SchemaError,
)
from dataplane.meta import KVBatchMeta, RowInfo, check_keys, trusted_meta
from dataplane.storage import ClaimedRow, KVStore, PendingGet

__all__ = ["DECODE_THREAD_ENV", "StoreClient", "decode_beside"]

log = logging.getLogger(__name__)


DECODE_THREAD_ENV = "DATAPLANE_DECODE_THREAD"
_CLAIM_POLL_S = (0.005, 0.1)  # a waiting claim asks again after this long, doubling up to the second
_MIN_CPUS_BESIDE = 2


def decode_beside() -> bool:
    """Whether a get decodes on a helper thread while its transfer runs: ``$DATAPLANE_DECODE_THREAD``
    = ``1`` or ``0``, or ``auto`` (the default): on when this process may run on at least 2 CPUs.
    Over Mooncake's shared memory the copy runs in the store server, so a second core of the reader
    is free for the decoding (the adapter holds it back while the read starts on a small host); over
    TCP it helps on 2 cores too."""
    mode = os.environ.get(DECODE_THREAD_ENV, "auto").strip().lower()
    if mode in ("1", "on", "true", "yes"):
        return True
    if mode in ("0", "off", "false", "no"):
        return False
    if mode != "auto":
        raise InvalidArgument(f"${DECODE_THREAD_ENV}={mode!r}: set it to auto, 1 or 0 (or unset it)")
    return usable_cpus() >= _MIN_CPUS_BESIDE


def _check_partition(partition_id: object) -> str:
    if not isinstance(partition_id, str) or not partition_id or len(partition_id) > 200:
        raise InvalidArgument(f"partition_id must be a non-empty str of at most 200 characters, got {partition_id!r}")
    if not partition_id.isprintable():
        raise InvalidArgument(f"partition_id {partition_id!r} contains control characters")
    if partition_id.startswith("__dataplane__"):
        raise InvalidArgument(
            f"partition_id {partition_id!r} begins with '__dataplane__', which dataplane keeps for its own "
            "partitions (claims' finished marks); name it otherwise"
        )
    return partition_id


def _check_tags(tags: object, n: int) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    if isinstance(tags, Mapping) or not isinstance(tags, Sequence):
        raise SchemaError("tags must be a list with one dict per key")
    out = list(tags)
    if len(out) != n:
        raise InvalidArgument(f"{len(out)} tag dicts for {n} keys; give one per key")
    for t in out:
        if not isinstance(t, Mapping) or not all(isinstance(k, str) for k in t):
            raise SchemaError("each tag must be a dict with str keys")
        for k, v in t.items():
            if not _is_primitive(v):
                raise SchemaError(f"tag {k!r}={v!r}: tag values must be str/int/float/bool/None or lists/dicts of them")
    return [dict(t) for t in out]


def _is_primitive(v: object) -> bool:
    if v is None or isinstance(v, (str, int, float, bool)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_primitive(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_primitive(x) for k, x in v.items())
    return False


def _check_select(select_fields: object) -> list[str]:
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    if not select_fields or not isinstance(select_fields, Sequence):
        raise InvalidArgument(
            "select_fields is required and must name at least one field (there is no fetch-all); "
            "meta.fields lists what a put wrote"
        )
    out = [validate_field_name(f) for f in select_fields]
    if len(set(out)) != len(out):
        raise InvalidArgument(f"select_fields has duplicates: {out}")
    return out


def _no_fields(fields: object, n: int) -> bool:
    """Whether a put names no field (None, an empty dict, a TensorDict without keys of ``n`` rows)."""
    if fields is None:
        return True
    if isinstance(fields, TensorDictBase):
        if fields.keys():
            return False
        if fields.batch_dims < 1 or fields.batch_size[0] != n:
            raise InvalidArgument(
                f"TensorDict batch_size {list(fields.batch_size)} does not match {n} keys; "
                "its first batch dim must equal len(keys)"
            )
        return True
    return isinstance(fields, Mapping) and not fields


def _common_lengths(columns: Mapping[str, Column]) -> tuple[int, ...] | None:
    """Row lengths when every jagged field of the put agrees on them."""
    found: torch.Tensor | None = None
    for col in columns.values():
        if col.schema.kind != "jagged":
            continue
        offsets = col.offsets
        assert offsets is not None
        if found is None:
            found = offsets
        elif offsets is not found and not torch.equal(found, offsets):  # equal offsets <=> equal lengths
            return None
    return None if found is None else tuple(np.diff(found.numpy()).tolist())  # CPU int64 (encode_fields)


def _lengths_of(rows: Sequence[ClaimedRow], length_tag: str | None) -> list[int] | None:
    """Each row's ``length_tag`` as ``sequence_lengths``, or None (with a warning when some row lacks
    it: the rows are claimed already, so the claim must not fail now)."""
    if length_tag is None or not rows:
        return None
    out = [t.get(length_tag) for _, t in rows]
    if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in out):
        return out  # type: ignore[return-value]
    bad = next(k for (k, _), x in zip(rows, out, strict=True) if not isinstance(x, int) or isinstance(x, bool) or x < 0)
    log.warning(
        "dataplane: row %r has no int tag %r >= 0; the claimed meta has no sequence_lengths (tag every row "
        "with its length at put time)",
        bad,
        length_tag,
    )
    return None


class StoreClient(DataPlaneClient):
    """The one implementation of the client semantics, over any :class:`KVStore`.

    Args:
        store: the adapter's store.
        timeout_s: bound on every blocking call.
        pickle_fields: object fields this client may write and read with pickle (opt-in by name:
            unpickling store contents runs code from whoever wrote them).
        on_close: extra teardown run once by :meth:`close` after the store is closed (owners use
            it to stop services they started).
    """

    def __init__(
        self,
        store: KVStore,
        *,
        timeout_s: float = 60.0,
        pickle_fields: Collection[str] = (),
        on_close: Sequence[Any] = (),
    ) -> None:
        check_number("timeout_s", timeout_s, low=0, low_open=True)
        self._store = store
        self.timeout_s = float(timeout_s)
        self.pickle_fields = frozenset(pickle_fields)
        self._on_close = list(on_close)
        self._closed = False
        self._close_lock = threading.Lock()
        self._beside = Helper("dataplane-decode") if decode_beside() else None
        self._deployment = store.deployment_id  # constant for the store's life: asked once
        self._deployment_url = store.url

    @property
    def store(self) -> KVStore:
        return self._store

    @property
    def capabilities(self) -> Capabilities:
        return self._store.capabilities

    @property
    def url(self) -> str:
        return self._store.url

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(
                f"this {self.capabilities.backend} client is closed; create a new one with dataplane.connect()"
            )

    def kv_batch_put(
        self,
        keys: Sequence[str],
        fields: FieldsIn | None,
        *,
        partition_id: str,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        self._check_open()
        partition_id = _check_partition(partition_id)
        pending = self._store.begin_put(partition_id, timeout_s=self.timeout_s)  # its questions travel meanwhile
        key_list = check_keys(keys)
        self._store.validate_keys(key_list)
        tag_list = _check_tags(tags, len(key_list))
        if _no_fields(fields, len(key_list)):
            if tag_list is None:
                raise InvalidArgument("a put needs fields, tags or both; this one has neither")
            columns: dict[str, Column] = {}  # a tag-only put
        else:
            assert fields is not None
            columns = encode_fields(fields, len(key_list), pickle_fields=self.pickle_fields)
        # Built before the write: right after moving many bytes, the same Python work runs slower
        # (cold caches), and nothing here depends on the write but the adapter's extra_info.
        meta = trusted_meta(  # every part checked above
            partition_id=partition_id,
            keys=tuple(key_list),
            fields=tuple(columns),
            sequence_lengths=_common_lengths(columns),
            tags=None if tag_list is None else tuple(tag_list),
            deployment=self._deployment,
            deployment_url=self._deployment_url if self._deployment else "",
        )
        extra = pending.write(key_list, columns, tag_list)
        if extra:
            meta.extra_info.update(extra)  # the meta's own dict, not yet shared with anyone
        return meta

    def _resolve(self, keys_or_meta: KeysOrMeta, partition_id: str | None) -> tuple[str, list[str], KVBatchMeta | None]:
        if isinstance(keys_or_meta, KVBatchMeta):
            if partition_id is not None and partition_id != keys_or_meta.partition_id:
                raise InvalidArgument(
                    f"partition_id={partition_id!r} contradicts the meta's {keys_or_meta.partition_id!r}; drop one"
                )
            if not keys_or_meta.keys:
                raise InvalidArgument("the meta has no keys; give at least one")
            if keys_or_meta.deployment and self._deployment and keys_or_meta.deployment != self._deployment:
                raise self._mismatch(keys_or_meta)
            return keys_or_meta.partition_id, list(keys_or_meta.keys), keys_or_meta  # checked when it was made
        if partition_id is None:
            raise InvalidArgument("partition_id is required when reading by keys (a meta carries its own)")
        return _check_partition(partition_id), check_keys(keys_or_meta), None

    def _mismatch(self, meta: KVBatchMeta) -> DeploymentMismatch:
        theirs = meta.deployment_url or f"deployment {meta.deployment!r}"
        ours = self._deployment_url or f"a private {self.capabilities.backend}:// store"
        if meta.deployment.startswith("memory://"):
            fix = "memory is per process: read it in the process that wrote it, or use mooncake:// or tq://"
        elif meta.deployment_url:
            fix = f"read it through a client of that deployment: dataplane.connect({meta.deployment_url!r})"
        else:
            fix = "read it through a client of that deployment: dataplane.connect(url) with its client.url"
        if theirs == ours:
            ours += " (the same URL, but a deployment started again since that put)"
        return DeploymentMismatch(
            f"this meta's rows were written to {theirs}, not to this client's deployment {ours} "
            f"(ids {meta.deployment!r} and {self._deployment!r}), which does not hold them; {fix}"
        )

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
        self._check_open()
        partition_id, keys, meta = self._resolve(keys_or_meta, partition_id)
        fields = _check_select(select_fields)
        if layout not in ("jagged", "padded"):
            raise InvalidArgument(f"layout must be 'jagged' or 'padded', got {layout!r}")
        check_int("pad_to_multiple", pad_to_multiple, low=1)
        check_int("pad_to_length", pad_to_length, low=0, allow_none=True)
        pending = self._store.begin_get(partition_id, keys, fields, meta=meta, timeout_s=self.timeout_s)
        decode = functools.partial(
            self._decode,
            fields=fields,
            num_rows=len(keys),
            layout=layout,
            pad_values=pad_values,
            pad_to_multiple=pad_to_multiple,
            pad_to_length=pad_to_length,
        )

        def start(beside: bool) -> tuple[Mapping[str, Column] | None, TensorDict | None]:
            """The planned columns, decoded when that needs none of their bytes (jagged and dense
            fields are views of the buffers; padding and object decoding read the bytes)."""
            cols = pending.plan(beside=beside)
            if cols is None or layout == "padded" or any(c.schema.kind == "object" for c in cols.values()):
                return cols, None
            return cols, decode(cols)

        if pending.overlaps and self._beside is not None:
            cols, out, again = self._start_beside(start, pending)
        else:
            try:
                cols, out = start(False)
            except BaseException:
                with contextlib.suppress(Exception):  # a transfer it began must end before its buffers go
                    pending.finish()
                raise
            again = pending.finish()
        if again is not None:
            return decode(again)
        if cols is None:
            raise DataPlaneError(
                f"{self.capabilities.backend} adapter planned no columns and finished with none; "
                "this is an adapter bug, please report it"
            )
        return decode(cols) if out is None else out

    def _start_beside(
        self,
        start: Callable[[bool], tuple[Mapping[str, Column] | None, TensorDict | None]],
        pending: PendingGet,
    ) -> tuple[Mapping[str, Column] | None, TensorDict | None, Mapping[str, Column] | None]:
        """Plan and decode on the helper thread while this one runs ``pending.finish`` (the transfer,
        which holds no GIL): planning and decoding then cost the get nothing. Submitted just before
        ``finish``, so this thread runs no Python the helper could hold it up in."""
        assert self._beside is not None
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def run() -> tuple[Mapping[str, Column] | None, TensorDict | None]:  # autograd modes are per thread
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return start(True)

        done = self._beside.submit(run)
        try:
            again = pending.finish()
        except BaseException:
            with contextlib.suppress(BaseException):  # the decode only wraps the buffers; let it end first
                done.result(timeout=self.timeout_s)
            raise
        try:
            cols, out = done.result(timeout=self.timeout_s)  # plan's errors surface here
        except TimeoutError:
            raise DataPlaneTimeout(
                f"decoding a get took over timeout_s={self.timeout_s}s; the host is overloaded, or raise timeout_s"
            ) from None
        return cols, out, again

    def _decode(
        self,
        columns: Mapping[str, Column],
        *,
        fields: list[str],
        num_rows: int,
        layout: Layout,
        pad_values: PadValues,
        pad_to_multiple: int,
        pad_to_length: int | None,
    ) -> TensorDict:
        for f in fields:
            col = columns.get(f)
            if col is None or col.num_rows != num_rows:
                got = "no column" if col is None else f"{col.num_rows} rows"
                raise DataPlaneError(
                    f"{self.capabilities.backend} adapter returned {got} for field {f!r} of {num_rows} keys; "
                    "this is an adapter bug, please report it"
                )
        return decode_columns(
            {f: columns[f] for f in fields},
            num_rows,
            layout=layout,
            pad_values=pad_values,
            pad_to_multiple=pad_to_multiple,
            pad_to_length=pad_to_length,
            pickle_fields=self.pickle_fields,
        )

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._check_open()
        return self._store.empty(check_shape(shape, dtype), dtype)

    def kv_clear(self, keys: Sequence[str] | None = None, *, partition_id: str) -> None:
        self._check_open()
        partition_id = _check_partition(partition_id)
        key_list = None if keys is None else check_keys(keys)
        self._store.clear(partition_id, key_list, timeout_s=self.timeout_s)

    def kv_list(self, partition_id: str | None = None) -> Listing:
        self._check_open()
        partition_id = None if partition_id is None else _check_partition(partition_id)
        return self._store.list(partition_id, timeout_s=self.timeout_s)

    def kv_describe(self, keys: Sequence[str], *, partition_id: str) -> dict[str, RowInfo]:
        self._check_open()
        partition_id = _check_partition(partition_id)
        key_list = check_keys(keys)
        self._store.validate_keys(key_list)
        found = self._store.describe(partition_id, key_list, timeout_s=self.timeout_s)
        if len(found) != len(key_list):
            raise AssertionError(f"the store described {len(found)} rows for {len(key_list)} keys")
        return {k: row for k, row in zip(key_list, found, strict=True) if row is not None}

    # -- consumption by task (docs/claims.md) ------------------------------------------------------
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
        self._check_open()
        partition_id = _check_partition(partition_id)
        task = check_task(task_name)
        fields = check_required(required_fields)
        check_int("batch_size", batch_size, low=1)
        check_int("min_rows", min_rows, low=0, high=batch_size)
        check_number("timeout_s", timeout_s, low=0)
        wanted = check_tag_filter(tag_filter)
        if length_tag is not None and not isinstance(length_tag, str):
            raise InvalidArgument(f"length_tag must be a tag name (str) or None, got {length_tag!r}")
        deadline = time.monotonic() + float(timeout_s)
        pause, rounds = _CLAIM_POLL_S[0], 0
        rows: list[ClaimedRow] = []
        while True:
            try:
                got = self._store.claim(
                    partition_id, task, fields, batch_size - len(rows), wanted, timeout_s=self.timeout_s
                )
            except DataPlaneError as e:
                if not rows:
                    raise
                log.warning("dataplane: claiming more rows failed (%s); returning the %d claimed so far", e, len(rows))
                break
            if got:
                rows += got
                rounds += 1
            left = deadline - time.monotonic()
            if len(rows) >= min_rows or len(rows) >= batch_size or left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(2 * pause, _CLAIM_POLL_S[1])
        if rounds > 1:  # rows claimed at different times: first-put order, without rows cleared meanwhile
            listed = self._store.list(partition_id, timeout_s=self.timeout_s).get(partition_id, {})
            place = {k: i for i, k in enumerate(listed)}
            rows = sorted((r for r in rows if r[0] in place), key=lambda r: place[r[0]])
        lengths = _lengths_of(rows, length_tag)
        return KVBatchMeta(
            partition_id=partition_id,
            keys=tuple(k for k, _ in rows),
            fields=fields,
            sequence_lengths=None if lengths is None else tuple(lengths),
            tags=tuple(t for _, t in rows),
            task_name=task,
            deployment=self._deployment,
            deployment_url=self._deployment_url if self._deployment else "",
        )

    def consumption_status(
        self,
        task_name: str,
        *,
        partition_id: str,
        required_fields: Sequence[str] | str | None = None,
        tag_filter: Mapping[str, Any] | None = None,
    ) -> ConsumptionStatus:
        self._check_open()
        partition_id = _check_partition(partition_id)
        task = check_task(task_name)
        fields = check_required(required_fields, allow_none=True)
        wanted = check_tag_filter(tag_filter)
        return self._store.consumption(partition_id, task, fields, wanted, timeout_s=self.timeout_s)

    def reset_consumption(self, task_name: str | None = None, *, partition_id: str) -> None:
        self._check_open()
        partition_id = _check_partition(partition_id)
        task = None if task_name is None else check_task(task_name)
        self._store.reset_claims(partition_id, task, timeout_s=self.timeout_s)

    def mark_finished(self, *, partition_id: str, finished: bool = True) -> None:
        self._check_open()
        partition_id = _check_partition(partition_id)
        if not isinstance(finished, bool):
            raise InvalidArgument(f"finished must be True or False, got {finished!r}")
        self._store.mark_finished(partition_id, finished, timeout_s=self.timeout_s)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._beside is not None:
                self._beside.close()
            self._store.close()
        finally:
            for fn in self._on_close:
                try:
                    fn()
                except Exception:  # teardown must go on for the rest
                    log.exception("dataplane: teardown step %r failed", fn)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} backend={self.capabilities.backend} {state}>"
