"""The client boundary: :class:`DataPlaneClient` and its :class:`Capabilities`.

Method names mirror TransferQueue's KV API (``kv_batch_put``, ``kv_batch_get``, ``kv_clear``,
``kv_list``) so code written against TransferQueue reads the same. Every I/O method has an
``async_`` twin; the sync methods never start an event loop, so they work from a plain thread and
from inside a running loop (a Ray async actor) alike.
"""

from __future__ import annotations

import asyncio
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from dataplane.claims import ConsumptionStatus
from dataplane.codec.jagged import PadValue
from dataplane.codec.wire import Layout
from dataplane.errors import InvalidArgument
from dataplane.meta import KVBatchMeta, RowInfo

__all__ = ["Capabilities", "DataPlaneClient", "FieldsIn", "KeysOrMeta", "PadValues", "check_shape"]

FieldsIn = TensorDictBase | Mapping[str, Any]
KeysOrMeta = Sequence[str] | KVBatchMeta
PadValues = PadValue | Mapping[str, PadValue] | None
Listing = dict[str, dict[str, dict[str, Any]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a backend can do; callers branch on these, never on the adapter's type.

    Attributes:
        backend: adapter name ("memory", "transfer_queue", "mooncake", ...).
        cross_process: rows written by one process can be read by another.
        cross_node: ... and by a process on another host.
        zero_copy: reads land in (registered) buffers without an intermediate staging copy.
        device_tensors: puts accept accelerator tensors without a host copy.
        max_keys_per_call: the adapter splits larger batches itself; informational.
    """

    backend: str
    cross_process: bool
    cross_node: bool
    zero_copy: bool = False
    device_tensors: bool = False
    max_keys_per_call: int | None = None


def check_shape(shape: Sequence[int] | int, dtype: object) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or ``InvalidArgument`` (for :meth:`DataPlaneClient.empty`).
    Integer scalars of numpy and torch count as ints; bools do not."""
    items = shape if isinstance(shape, Sequence) and not isinstance(shape, str) else (shape,)
    try:
        if any(isinstance(d, bool) for d in items):
            raise TypeError("a bool is not a dim")
        dims = tuple(operator.index(d) for d in items)
        if min(dims, default=0) < 0:
            raise TypeError("negative dim")
    except TypeError:
        raise InvalidArgument(
            f"shape must be an int or a sequence of ints >= 0, e.g. (256, 1024); got {shape!r}"
        ) from None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if math.prod(dims) * dtype.itemsize >= 1 << 48:
        raise InvalidArgument(f"shape {dims} of {dtype} is too large to allocate")
    return dims


class DataPlaneClient(ABC):
    """A client of one data-plane store. Use it as a context manager or call :meth:`close`."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @property
    def url(self) -> str:
        """The URL another process passes to ``dataplane.connect()`` to reach the same deployment,
        or "" when this store cannot be joined from elsewhere (a private ``memory://`` store).

        A process that started a deployment also exports it as ``$DATAPLANE_URL`` to the processes it
        starts afterwards, where ``dataplane.connect()`` with no argument joins it.

        >>> import dataplane
        >>> with dataplane.connect("memory://rollouts") as client:
        ...     client.url  # memory is per process: this names it for clients of this process only
        'memory://rollouts'
        """
        return ""

    @abstractmethod
    def kv_batch_put(
        self,
        keys: Sequence[str],
        fields: FieldsIn | None,
        *,
        partition_id: str,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write one row per key. Validated completely before any byte is written.

        Writing a field a key does not have adds a column; writing one it has replaces it. Tags merge
        into the key's tags (``dict.update``). With ``fields=None`` (or no fields) and ``tags`` the put
        writes tags only: a key that does not exist yet becomes a **tag-only row**, listed by
        :meth:`kv_list` with its tags and holding no field until a later put adds one (status markers
        of prompts in flight, say). Returns the meta of the written rows (``fields`` = the fields of
        this put; ``()`` for a tag-only put).
        """

    @abstractmethod
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
        """Read exactly these rows, in this order, with exactly these fields -- or raise ``KeyNotFound``."""

    @abstractmethod
    def kv_clear(self, keys: Sequence[str] | None = None, *, partition_id: str) -> None:
        """Remove rows (unknown keys are ignored); ``keys=None`` removes the whole partition and its schema."""

    @abstractmethod
    def kv_list(self, partition_id: str | None = None) -> Listing:
        """``{partition_id: {key: tags}}`` for one partition or all. Within a partition, keys come in
        the order they were first put (a key cleared and put again comes last)."""

    def kv_describe(self, keys: Sequence[str], *, partition_id: str) -> dict[str, RowInfo]:
        """What each of ``keys`` holds: ``{key: RowInfo(fields, tags)}`` for the keys that exist, in
        the order asked; absent keys are left out (no error). Tag-only rows have no fields.

        It answers from the partition's index, without reading any field and without listing the
        partition: use it to learn which fields a batch of rows shares before a get, or the merged
        tags other processes wrote.

        >>> import dataplane, torch
        >>> with dataplane.connect() as c:
        ...     _ = c.kv_batch_put(["a"], {"x": torch.ones(1)}, partition_id="p", tags=[{"s": 1}])
        ...     _ = c.kv_batch_put(["b"], None, partition_id="p", tags=[{"s": 2}])  # tag-only
        ...     c.kv_describe(["a", "b", "zz"], partition_id="p")
        {'a': RowInfo(fields=frozenset({'x'}), tags={'s': 1}), 'b': RowInfo(fields=frozenset(), tags={'s': 2})}
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement kv_describe")

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
        """Claim for ``task_name`` up to ``batch_size`` rows of the partition that hold every one of
        ``required_fields`` (and whose tags equal ``tag_filter``'s) and that the task has not claimed.

        Each row is handed to a task at most once, also when several processes of one deployment
        claim at the same time (TransferQueue's ``get_meta(mode="fetch", task_name=...)``), until it
        is cleared (a key put again is a new row) or :meth:`reset_consumption` forgets the task's
        claims. Tasks need no registration: one that never claimed has claimed nothing. Claimed rows
        stay readable by anyone until cleared; a claim is not a lease (a consumer that dies loses its
        rows for that task).

        Args:
            task_name: the consumer ("train", "ref_logprobs", ...).
            partition_id: the partition.
            required_fields: the fields a row must hold to be ready for the task.
            batch_size: the most rows returned.
            tag_filter: ``{tag: value}`` a row's tags must hold, or None.
            min_rows: with ``timeout_s`` > 0, wait until at least this many rows are claimed.
            timeout_s: 0 (default): claim what is ready now, maybe nothing. Otherwise wait at most this
                long for ``min_rows``; then return what was claimed (maybe fewer, maybe none).
            length_tag: a tag holding each row's sequence length, copied into
                ``meta.sequence_lengths`` (for :func:`dataplane.preshard.shard_meta_for_dp`).

        Returns:
            A meta of the claimed rows in first-put order (``fields`` = ``required_fields``, ``tags``
            the rows' merged tags, ``task_name`` set); no keys when none was claimed.

        Raises:
            InvalidArgument: a bad argument, such as a task name that is not a non-empty printable str
                (nothing was claimed).
            SchemaError: a required field that is no field name, a tag filter that is no dict.

        >>> import dataplane, torch
        >>> with dataplane.connect() as c:
        ...     _ = c.kv_batch_put(["a", "b"], {"x": torch.ones(2)}, partition_id="p", tags=[{"v": 1}, {"v": 2}])
        ...     c.claim_meta("train", partition_id="p", required_fields="x", batch_size=4, tag_filter={"v": 2}).keys
        ('b',)
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement claim_meta")

    def consumption_status(
        self,
        task_name: str,
        *,
        partition_id: str,
        required_fields: Sequence[str] | str | None = None,
        tag_filter: Mapping[str, Any] | None = None,
    ) -> ConsumptionStatus:
        """Where ``task_name`` stands on the partition: rows claimed, ready and not ready for it (ready:
        holding every one of ``required_fields`` and matching ``tag_filter``; with neither, every
        unclaimed row), and whether a producer marked the partition finished."""
        raise NotImplementedError(f"{type(self).__name__} does not implement consumption_status")

    def check_consumption_status(self, task_name: str, *, partition_id: str) -> bool:
        """True when the partition holds rows and ``task_name`` has claimed every one of them
        (TransferQueue's ``check_consumption_status``)."""
        return self.consumption_status(task_name, partition_id=partition_id).all_consumed

    def reset_consumption(self, task_name: str | None = None, *, partition_id: str) -> None:
        """Forget what ``task_name`` (None: every task) claimed in the partition, so its rows are
        handed out again (TransferQueue's ``reset_consumption``). The rows stay."""
        raise NotImplementedError(f"{type(self).__name__} does not implement reset_consumption")

    def mark_finished(self, *, partition_id: str, finished: bool = True) -> None:
        """Say that no more rows will be put into the partition: a :func:`dataplane.stream` over it
        ends once every row is claimed. ``finished=False`` takes it back. The mark stays when rows are
        cleared; ``kv_clear(partition_id=...)`` of the whole partition removes it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement mark_finished")

    @abstractmethod
    def close(self) -> None:
        """Release this client (idempotent). Owners also tear down what they started."""

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised host tensor that a put of this client sends without copying it first.

        Build rollout data straight into it (or into a jagged field's ``values``), then put it.
        Backends that can only send memory they registered (Mooncake over shared memory or RDMA)
        hand out that memory here, and would otherwise copy each put into it; elsewhere this is
        ``torch.empty``. The tensor belongs to the caller like any other; tensors a get of this
        client returned are sent without a copy too (a write-back).
        """
        return torch.empty(check_shape(shape, dtype), dtype=dtype)

    # -- async twins: run the sync call on a worker thread, never block the caller's loop ----------
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        fields: FieldsIn | None,
        *,
        partition_id: str,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return await asyncio.to_thread(self.kv_batch_put, keys, fields, partition_id=partition_id, tags=tags)

    async def async_kv_batch_get(
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
        return await asyncio.to_thread(
            self.kv_batch_get,
            keys_or_meta,
            select_fields=select_fields,
            partition_id=partition_id,
            layout=layout,
            pad_values=pad_values,
            pad_to_multiple=pad_to_multiple,
            pad_to_length=pad_to_length,
        )

    async def async_kv_clear(self, keys: Sequence[str] | None = None, *, partition_id: str) -> None:
        await asyncio.to_thread(self.kv_clear, keys, partition_id=partition_id)

    async def async_kv_list(self, partition_id: str | None = None) -> Listing:
        return await asyncio.to_thread(self.kv_list, partition_id)

    async def async_kv_describe(self, keys: Sequence[str], *, partition_id: str) -> dict[str, RowInfo]:
        return await asyncio.to_thread(self.kv_describe, keys, partition_id=partition_id)

    async def async_claim_meta(
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
        return await asyncio.to_thread(
            self.claim_meta,
            task_name,
            partition_id=partition_id,
            required_fields=required_fields,
            batch_size=batch_size,
            tag_filter=tag_filter,
            min_rows=min_rows,
            timeout_s=timeout_s,
            length_tag=length_tag,
        )

    async def async_consumption_status(
        self,
        task_name: str,
        *,
        partition_id: str,
        required_fields: Sequence[str] | str | None = None,
        tag_filter: Mapping[str, Any] | None = None,
    ) -> ConsumptionStatus:
        return await asyncio.to_thread(
            self.consumption_status,
            task_name,
            partition_id=partition_id,
            required_fields=required_fields,
            tag_filter=tag_filter,
        )

    async def async_check_consumption_status(self, task_name: str, *, partition_id: str) -> bool:
        return await asyncio.to_thread(self.check_consumption_status, task_name, partition_id=partition_id)

    async def async_reset_consumption(self, task_name: str | None = None, *, partition_id: str) -> None:
        await asyncio.to_thread(self.reset_consumption, task_name, partition_id=partition_id)

    async def async_mark_finished(self, *, partition_id: str, finished: bool = True) -> None:
        await asyncio.to_thread(self.mark_finished, partition_id=partition_id, finished=finished)

    async def async_close(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> DataPlaneClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.async_close()
