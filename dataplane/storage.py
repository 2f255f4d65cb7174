"""The storage interface: what an adapter implements so that :class:`~dataplane.store_client.StoreClient`
gives its users the whole client API.

An adapter is a :class:`KVStore`: six abstract members (:attr:`~KVStore.capabilities`,
:meth:`~KVStore.put`, :meth:`~KVStore.get`, :meth:`~KVStore.clear`, :meth:`~KVStore.list`,
:meth:`~KVStore.close`) over columns in wire form (:class:`Column`). The client does everything every
backend must agree on exactly once: argument validation, encoding and decoding, ordering and
completeness checks of what a store returns, the closed state. The store keeps the rows and enforces
the per-(partition, field) schema atomically in ``put``, with :class:`SchemaRegistry` (schemas kept
in process) or :func:`check_compatible` (schemas kept in the backend).

One more method, :meth:`KVStore.describe` (which fields and tags each key holds, for
``kv_describe``), has a default that raises ``NotImplementedError``; every shipped adapter implements
it, and the conformance suite checks it. So do the four of consumption by task (``claim_meta`` and
friends, ``docs/claims.md``): :meth:`KVStore.claim`, :meth:`KVStore.consumption`,
:meth:`KVStore.reset_claims` and :meth:`KVStore.mark_finished`.

Two optional hooks let a store overlap its own round trips with the client's work; their defaults
call ``put`` and ``get``, so a plain adapter never touches them:

* :meth:`KVStore.begin_put` returns a :class:`PendingPut`: the put begins before the client has
  checked and encoded its arguments (a store that must ask its backend something on every put asks
  here), and :meth:`PendingPut.write` finishes it.
* :meth:`KVStore.begin_get` returns a :class:`PendingGet`: :meth:`PendingGet.plan` makes the
  columns (their buffers possibly not yet filled) and :meth:`PendingGet.finish` moves the bytes, so
  the client can decode on a helper thread while the transfer runs.

A minimal adapter (a dict of rows per partition) looks like this; ``docs/extending.md`` walks through
a complete one, its registration and the conformance suite it must pass::

    class DictStore(KVStore):
        capabilities = Capabilities(backend="dict", cross_process=False, cross_node=False)

        def put(self, partition_id, keys, columns, tags, *, timeout_s): ...
        def get(self, partition_id, keys, fields, *, meta, timeout_s): ...
        def clear(self, partition_id, keys, *, timeout_s): ...
        def list(self, partition_id, *, timeout_s): ...
        def describe(self, partition_id, keys, *, timeout_s): ...
        def close(self): ...

    def connect(url_or_config=None, **options):
        return StoreClient(DictStore(), timeout_s=options.get("timeout_s", 60.0))
"""

from __future__ import annotations

import builtins
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataplane.claims import ConsumptionStatus
from dataplane.client import Capabilities, Listing
from dataplane.codec.wire import Column
from dataplane.errors import DataPlaneTimeout, missing_rows_error
from dataplane.meta import KVBatchMeta, RowInfo
from dataplane.schema import FieldKind, FieldSchema, SchemaRegistry, check_compatible, schema_of

__all__ = [
    "Capabilities",
    "ClaimedRow",
    "Column",
    "ConsumptionStatus",
    "FieldKind",
    "FieldSchema",
    "KVBatchMeta",
    "KVStore",
    "Listing",
    "PendingGet",
    "PendingPut",
    "SchemaRegistry",
    "check_compatible",
    "missing_rows_error",
    "schema_of",
]


ClaimedRow = tuple[str, dict[str, Any]]
"""A row :meth:`KVStore.claim` handed out: its key and its merged tags."""


class PendingPut(ABC):
    """A put begun by :meth:`KVStore.begin_put` before the client checked its arguments.

    The client calls :meth:`write` once it has validated and encoded the put, or never, when the
    check fails (then nothing may have been written). A store whose put must ask its backend
    something first (a listing for the schema check, say) asks in ``begin_put``, so the answer
    travels while the client works, and waits for it in :meth:`write`.
    """

    @abstractmethod
    def write(
        self, keys: Sequence[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]] | None
    ) -> dict[str, Any] | None:
        """Write the put: exactly what :meth:`KVStore.put` does with these arguments (the partition
        and the clock were given to ``begin_put``).

        Args:
            keys: the rows' keys, checked (unique, valid).
            columns: one column per field, each with ``len(keys)`` rows.
            tags: one dict per key, or None.

        Returns:
            A dict merged into the returned meta's ``extra_info``, or None.
        """


class PendingGet(ABC):
    """A get begun by :meth:`KVStore.begin_get`, split in two so the client can decode while the
    bytes move.

    :meth:`plan` returns the columns (their shapes and offsets final, their buffers possibly not yet
    filled) and moves none of the get's bytes (it may ask for a listing). :meth:`finish` moves or
    waits for the bytes on the calling thread. The client calls them in one of two ways, and says
    which to ``plan``:

    * ``beside=False``: ``plan`` then ``finish``, both on the calling thread;
    * ``beside=True`` (only when :attr:`overlaps` is true and the client has a helper thread):
      ``plan`` on the client's helper thread while ``finish`` runs on the calling thread, so
      ``finish`` may start before ``plan`` has and must wait for ``plan`` itself where it needs what
      ``plan`` found.

    Either way the client always calls ``finish`` once ``plan`` has started (also when ``plan``
    raised: a transfer that began must end before its buffers go) and hands nothing out before
    ``finish`` returns. Decoding beside the transfer matters: right after a large transfer the same
    Python work runs several times slower on a small host (cold caches), and on a larger one it runs
    on a spare core.
    """

    overlaps: bool = True
    """Whether :meth:`finish` moves bytes that :meth:`plan` and the client's decoding can overlap
    (False: the client calls both on its own thread)."""

    @abstractmethod
    def plan(self, *, beside: bool) -> Mapping[str, Column] | None:
        """The get's columns, or None when :meth:`finish` will return them.

        Args:
            beside: True when this runs on the client's helper thread while :meth:`finish` runs on
                the calling thread; False when it runs on the calling thread before ``finish``.
        """

    @abstractmethod
    def finish(self) -> Mapping[str, Column] | None:
        """Move (or wait for) the get's bytes; raise what :meth:`KVStore.get` would raise.

        Returns:
            None to keep what :meth:`plan` returned, or other columns to use instead (read again
            after an object vanished under the first read, say). When ``plan`` raised, the client
            raises that error whatever this returns.
        """


class _PutBeforeDeadline(PendingPut):
    """:meth:`KVStore.begin_put`'s default: a plain :meth:`KVStore.put` with the time left."""

    __slots__ = ("_deadline", "_partition_id", "_store")

    def __init__(self, store: KVStore, partition_id: str, timeout_s: float) -> None:
        self._store = store
        self._partition_id = partition_id
        self._deadline = time.monotonic() + timeout_s

    def write(
        self, keys: Sequence[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]] | None
    ) -> dict[str, Any] | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DataPlaneTimeout("the put ran out of time before it was written; raise timeout_s")
        return self._store.put(self._partition_id, keys, columns, tags, timeout_s=left)


class _FinishedGet(PendingGet):
    """:meth:`KVStore.begin_get`'s default: a plain :meth:`KVStore.get`, already done."""

    __slots__ = ("_columns",)
    overlaps = False

    def __init__(self, columns: Mapping[str, Column]) -> None:
        self._columns = columns

    def plan(self, *, beside: bool) -> Mapping[str, Column] | None:
        return self._columns

    def finish(self) -> Mapping[str, Column] | None:
        return None


class KVStore(ABC):
    """What an adapter implements. All arguments arrive validated by the client.

    Contract:
        * ``put`` is all-or-nothing: it checks every column against the partition's recorded schema
          (raising ``SchemaError``, see :func:`check_compatible`), checks capacity
          (``CapacityExceeded``), and on any failure after it started writing removes what it wrote
          before raising. Tags merge into existing tags (``dict.update``). It may return a dict
          merged into the returned meta's ``extra_info``. ``columns`` may be empty (then ``tags`` is
          not None): a tag-only put, which merges the tags and makes absent keys rows with no field.
        * ``get`` returns one column per requested field with exactly ``len(keys)`` rows in key
          order, or raises ``KeyNotFound`` (built with :func:`missing_rows_error`). The returned
          tensors belong to the caller.
        * ``clear`` ignores unknown keys; ``keys=None`` drops the partition and its schema, and so
          does removing its last row.
        * ``list`` gives a partition's keys in the order they were first put (a key cleared and put
          again comes last); ``describe`` answers per key without listing the partition.
        * Every blocking call honours ``timeout_s`` (``DataPlaneTimeout``).
        * Methods may be called from several threads at once.
    """

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend can do (:class:`Capabilities`); constant for the store's life."""

    @abstractmethod
    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        """Write ``columns`` (one per field, ``len(keys)`` rows each) under ``keys``, all or nothing.

        Args:
            partition_id: the partition written.
            keys: the rows' keys (unique; checked by the client and :meth:`validate_keys`).
            columns: field name -> column in wire form. A key written again keeps its other fields.
            tags: one dict per key merged into its tags, or None.
            timeout_s: bound on the call.

        Returns:
            A dict merged into the returned meta's ``extra_info`` (small: it travels with the
            meta), or None.

        Raises:
            SchemaError: a column contradicts the field's recorded schema.
            CapacityExceeded: the store is full.
            DataPlaneTimeout: out of time.
        """

    @abstractmethod
    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        """Read ``fields`` of the rows ``keys``, in that order.

        Args:
            partition_id: the partition read.
            keys: the rows, in the order the columns must hold them.
            fields: the fields to return (no duplicates).
            meta: the meta the caller read by, when it did (its ``extra_info`` holds what ``put``
                returned), else None.
            timeout_s: bound on the call.

        Returns:
            Field name -> column with exactly ``len(keys)`` rows; the caller owns its tensors.

        Raises:
            KeyNotFound: a key or one of its fields is absent (:func:`missing_rows_error`).
            DataPlaneTimeout: out of time.
        """

    @abstractmethod
    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        """Remove the rows ``keys`` (unknown ones ignored), or with None the partition and its schema."""

    @abstractmethod
    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        """``{partition_id: {key: tags}}`` for one partition (None: every partition with rows)."""

    def describe(self, partition_id: str, keys: Sequence[str], *, timeout_s: float) -> builtins.list[RowInfo | None]:
        """What each of ``keys`` holds, in order: a :class:`RowInfo` (its fields, its merged tags), or
        None where the key is absent. Served from the partition's index: it reads no field and should
        not cost a listing of the partition.

        The default raises ``NotImplementedError``: adapters written before ``kv_describe`` existed
        keep working for everything else.
        """
        raise NotImplementedError(
            f"the {self.capabilities.backend!r} adapter does not implement KVStore.describe (kv_describe)"
        )

    # -- consumption by task (optional; see docs/claims.md) ------------------------------------------
    def claim(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        n: int,
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> builtins.list[ClaimedRow]:
        """Claim for ``task_name`` up to ``n`` rows that hold every one of ``fields``, match
        ``tag_filter`` (:func:`dataplane.claims.tags_match`) and that the task has not claimed, and
        return them (key, merged tags) in first-put order; ``[]`` when none is ready. Never waits
        for rows (the client does). Arguments arrive validated.

        Contract: a row is handed to a task at most once, also when processes of one deployment
        claim at the same time, until it is cleared (its claims go with it: the key put again is a
        new row) or the task's claims are reset; a row cleared before the call returns is not
        returned.
        """
        raise NotImplementedError(
            f"the {self.capabilities.backend!r} adapter does not implement KVStore.claim (claim_meta)"
        )

    def consumption(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> ConsumptionStatus:
        """Where ``task_name`` stands on the partition (:class:`~dataplane.claims.ConsumptionStatus`,
        built with :func:`~dataplane.claims.count_status`); ``fields`` may be empty (every unclaimed
        row is then ready)."""
        raise NotImplementedError(
            f"the {self.capabilities.backend!r} adapter does not implement KVStore.consumption (consumption_status)"
        )

    def reset_claims(self, partition_id: str, task_name: str | None, *, timeout_s: float) -> None:
        """Forget the claims of ``task_name`` on the partition (None: of every task), so its rows can
        be claimed again. The rows stay."""
        raise NotImplementedError(
            f"the {self.capabilities.backend!r} adapter does not implement KVStore.reset_claims (reset_consumption)"
        )

    def mark_finished(self, partition_id: str, finished: bool, *, timeout_s: float) -> None:
        """Record that no more rows will be put into the partition (``finished=False`` takes it back).
        The mark outlives the partition's rows and goes with ``clear(partition_id, None)`` only."""
        raise NotImplementedError(f"the {self.capabilities.backend!r} adapter does not implement KVStore.mark_finished")

    @abstractmethod
    def close(self) -> None:
        """Release the store's resources; the client calls it once."""

    @property
    def url(self) -> str:
        """The URL another process passes to ``dataplane.connect()`` to reach this store's deployment
        (``client.url``); "" (the default) when it cannot be joined from elsewhere."""
        return ""

    @property
    def deployment_id(self) -> str:
        """Equal for every client of one deployment and different for different deployments (also
        for one started later on the same ports). Puts stamp it into the meta they return, and a get
        by a meta stamped with another deployment's id raises ``DeploymentMismatch`` before any I/O.
        "" (the default) means unknown: metas are then neither stamped nor checked."""
        return ""

    def begin_put(self, partition_id: str, *, timeout_s: float) -> PendingPut:
        """Begin a put before the client has checked its arguments (see :class:`PendingPut`).

        ``timeout_s`` bounds the whole put, from now. The default defers everything to :meth:`put`.
        """
        return _PutBeforeDeadline(self, partition_id, timeout_s)

    def begin_get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> PendingGet:
        """Begin a get that the client finishes in two steps (see :class:`PendingGet`); arguments as
        :meth:`get`. The default runs :meth:`get` here and overlaps nothing."""
        return _FinishedGet(self.get(partition_id, keys, fields, meta=meta, timeout_s=timeout_s))

    def validate_keys(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Adapter-specific key rules (raise ``InvalidArgument``); the client checks the common ones."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory that :meth:`put` sends without a staging copy (``DataPlaneClient.empty``,
        arguments already checked); by default any memory."""
        return torch.empty(shape, dtype=dtype)
