"""A streaming loader over claims: batches of rows as they become ready for a task.

:func:`stream` (or :class:`ClaimStream`) claims rows of a partition for a task
(:meth:`~dataplane.DataPlaneClient.claim_meta`) while producers are still putting them, and yields a
meta of ``batch_rows`` rows each time that many are claimed -- or, with ``dp_size``, one meta per
data-parallel rank from :func:`~dataplane.preshard.shard_meta_for_dp`, every rank with the same
number of microbatches. It ends once a producer has marked the partition finished
(:meth:`~dataplane.DataPlaneClient.mark_finished`) and every row is claimed (the last batch may be
short), or when no row arrived for ``idle_timeout_s``. It is what a train pump or a custom trainer
consumes from; TransferQueue users know it as ``StreamingDataLoader``.

>>> import dataplane, torch
>>> with dataplane.connect() as c:
...     _ = c.kv_batch_put([f"k{i}" for i in range(5)], {"x": torch.arange(5)}, partition_id="p")
...     c.mark_finished(partition_id="p")  # the producer is done
...     [m.keys for m in dataplane.stream(c, "train", partition_id="p", required_fields="x", batch_rows=2)]
[('k0', 'k1'), ('k2', 'k3'), ('k4',)]
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Literal

from dataplane.checks import check_int, check_number
from dataplane.claims import check_required, check_tag_filter, check_task
from dataplane.client import DataPlaneClient
from dataplane.errors import DataPlaneTimeout, InvalidArgument
from dataplane.meta import KVBatchMeta
from dataplane.preshard import shard_meta_for_dp

__all__ = ["ClaimStream", "stream"]

log = logging.getLogger(__name__)

_WINDOW_S = 0.5  # a claim waits this long for a full batch before the stream looks at the status


class ClaimStream:
    """Iterate batches of rows of ``partition_id`` as they become ready for ``task_name``.

    Args:
        client: any client of the deployment.
        task_name: the task that claims (rows it claimed before are not handed out again).
        partition_id: the partition.
        required_fields: the fields a row holds before it is ready.
        batch_rows: rows per batch (the last one may hold fewer).
        tag_filter: ``{tag: value}`` a row must match, or None.
        dp_size: yield ``dp_size`` metas per batch instead of one, balanced by
            :func:`~dataplane.preshard.shard_meta_for_dp` (by tokens when the rows carry
            ``length_tag``, else by rows).
        max_tokens_per_microbatch: with ``dp_size``, plan microbatches of at most this many tokens
            (rows, without lengths), the same number on every rank.
        equal_rows: with ``dp_size``, the same row count on every rank (+-1 when it does not divide).
        length_tag: the tag holding each row's sequence length (see ``claim_meta``).
        idle_timeout_s: end (or raise) when no row was claimed for this long.
        on_timeout: ``"stop"`` ends the iteration (after a short last batch, if any was claimed);
            ``"raise"`` raises ``DataPlaneTimeout`` (rows claimed and not yet yielded stay in the
            stream's ``pending``).
    """

    def __init__(
        self,
        client: DataPlaneClient,
        task_name: str,
        *,
        partition_id: str,
        required_fields: Sequence[str] | str,
        batch_rows: int,
        tag_filter: Mapping[str, Any] | None = None,
        dp_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        equal_rows: bool = False,
        length_tag: str | None = None,
        idle_timeout_s: float = 60.0,
        on_timeout: Literal["stop", "raise"] = "stop",
    ) -> None:
        self.client = client
        self.task_name = check_task(task_name)
        self.partition_id = partition_id
        self.required_fields = check_required(required_fields)
        self.batch_rows = check_int("batch_rows", batch_rows, low=1)
        self.tag_filter = check_tag_filter(tag_filter)
        self.dp_size = check_int("dp_size", dp_size, low=1, allow_none=True)
        self.max_tokens_per_microbatch = check_int(
            "max_tokens_per_microbatch", max_tokens_per_microbatch, low=1, allow_none=True
        )
        self.equal_rows = bool(equal_rows)
        self.length_tag = length_tag
        self.idle_timeout_s = check_number("idle_timeout_s", idle_timeout_s, low=0, low_open=True)
        if on_timeout not in ("stop", "raise"):
            raise InvalidArgument(f"on_timeout must be 'stop' or 'raise', got {on_timeout!r}")
        self.on_timeout = on_timeout
        self.pending: KVBatchMeta | None = None  # claimed, not yet yielded
        self.batches = 0  # batches yielded so far
        self._done = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        """The next batch: a :class:`~dataplane.KVBatchMeta`, or with ``dp_size`` a list of one per rank."""
        if self._done:
            raise StopIteration
        last = time.monotonic()
        while True:
            held = 0 if self.pending is None else len(self.pending)
            need = self.batch_rows - held
            window = max(0.0, min(_WINDOW_S, last + self.idle_timeout_s - time.monotonic()))
            got = self.client.claim_meta(
                self.task_name,
                partition_id=self.partition_id,
                required_fields=self.required_fields,
                batch_size=need,
                tag_filter=self.tag_filter,
                min_rows=need,
                timeout_s=window,
                length_tag=self.length_tag,
            )
            if len(got):
                self.pending = got if self.pending is None else self.pending.concat(got)
                last = time.monotonic()
                if len(self.pending) >= self.batch_rows:
                    return self._emit()
            if self._drained():
                self._done = True
                if self.pending is not None:
                    return self._emit()
                raise StopIteration
            if time.monotonic() - last >= self.idle_timeout_s:
                return self._idle()

    def _drained(self) -> bool:
        """Whether a producer marked the partition finished and no row is left for this task: none
        ready, and none waiting for a required field (rows that hold the fields but fail the tag
        filter never will be ready)."""
        status = self.client.consumption_status(
            self.task_name,
            partition_id=self.partition_id,
            required_fields=self.required_fields,
            tag_filter=self.tag_filter,
        )
        if not status.finished or status.ready:
            return False
        if not status.not_ready or self.tag_filter is None:
            return not status.not_ready
        fields_only = self.client.consumption_status(
            self.task_name, partition_id=self.partition_id, required_fields=self.required_fields
        )
        return fields_only.not_ready == 0

    def _idle(self) -> Any:
        self._done = True
        what = (
            f"no row of partition {self.partition_id!r} became ready for task {self.task_name!r} in "
            f"{self.idle_timeout_s:g}s and no producer marked it finished (mark_finished)"
        )
        if self.on_timeout == "raise":
            raise DataPlaneTimeout(what + "; raise idle_timeout_s, or check the producers are alive")
        log.warning("dataplane: %s; the stream ends", what)
        if self.pending is not None:
            return self._emit()
        raise StopIteration

    def _emit(self) -> Any:
        meta = self.pending
        assert meta is not None
        if len(meta) > self.batch_rows:  # pragma: no cover - claims never return more than asked
            meta, self.pending = meta.slice(0, self.batch_rows), meta.slice(self.batch_rows, len(meta))
        else:
            self.pending = None
        self.batches += 1
        if self.dp_size is None:
            return meta
        return shard_meta_for_dp(
            meta,
            self.dp_size,
            max_tokens_per_microbatch=self.max_tokens_per_microbatch,
            equal_rows=self.equal_rows,
            missing_lengths="count_rows" if meta.sequence_lengths is None else "raise",
        )

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._async_iter()

    async def _async_iter(self) -> AsyncIterator[Any]:
        """The same batches for ``async for``: each step runs on a worker thread, never blocking the loop."""
        while True:
            try:
                batch = await asyncio.to_thread(self._step)
            except _End:
                return
            yield batch

    def _step(self) -> Any:
        try:
            return next(self)
        except StopIteration:
            raise _End from None


class _End(Exception):
    """StopIteration cannot cross ``asyncio.to_thread`` (a future cannot hold it)."""


def stream(
    client: DataPlaneClient,
    task_name: str,
    *,
    partition_id: str,
    required_fields: Sequence[str] | str,
    batch_rows: int,
    tag_filter: Mapping[str, Any] | None = None,
    dp_size: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    equal_rows: bool = False,
    length_tag: str | None = None,
    idle_timeout_s: float = 60.0,
    on_timeout: Literal["stop", "raise"] = "stop",
) -> ClaimStream:
    """Batches of rows of ``partition_id`` as they become ready for ``task_name``: a :class:`ClaimStream`
    (see it for the arguments). Iterate it with ``for`` or ``async for``."""
    return ClaimStream(
        client,
        task_name,
        partition_id=partition_id,
        required_fields=required_fields,
        batch_rows=batch_rows,
        tag_filter=tag_filter,
        dp_size=dp_size,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        equal_rows=equal_rows,
        length_tag=length_tag,
        idle_timeout_s=idle_timeout_s,
        on_timeout=on_timeout,
    )
