"""Consumption by task on ``tq://`` (``docs/claims.md``), on TransferQueue's own consumption tracking.

TQ's controller keeps, per partition and task, a consumed bit per row, and its ``get_meta(mode=
"fetch", task_name=...)`` picks rows whose listed fields are all produced and that the task has not
consumed, and marks them consumed, in one request of its one request thread: that is the claim,
atomic across every process of the deployment. ``reset_consumption`` zeroes a task's bits, and a
clear releases a row's bits with its index, so a key put again is a new, unclaimed row.

What does not map is which rows are ready: TQ's production bits are per TQ field, and a row's
fields here are in its marker (on SimpleStorage several fields travel as one packed TQ field), and
tags are ours too. So a claim (1) lists the partition and picks the rows that hold every required
field and match the filter, in first-put order, (2) reads their global indexes, and (3) sends one
fetch whose ``sampling_config`` names those indexes, the fields and the filter: the controller's
sampler (:class:`~dataplane.adapters.transfer_queue._claim_sampler.ClaimSampler`, which dataplane starts
the controller with) takes, in that order, the first ``n`` that are still rows of the partition, not
consumed by the task and ready by their marker and tags as the controller holds them, and the
controller marks them consumed in the same step of its one request thread. A row cleared after (2)
is never marked (its index is no longer the partition's, or now another key's, checked anew).
Dataplane starts TQ with ``controller.polling_mode`` on (TQ's default sleeps 5 s in the request
thread when too few rows are ready, stalling every client) and refuses claims on a TQ started
without it or with another sampler.

A finished mark is a tag-only row ``__dataplane__/finished/<partition>`` of the partition
``__dataplane__/marks``, hidden from listings like every reserved key, removed by a clear of the
whole partition.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from dataplane.adapters.transfer_queue._layout import MARKER, RESERVED_PREFIX, is_reserved, user_key
from dataplane.adapters.transfer_queue._ops import TQOps
from dataplane.adapters.transfer_queue._sampler import CLAIM_KEY, CLAIM_SAMPLER_NAME
from dataplane.adapters.transfer_queue._tokens import marker_fields
from dataplane.claims import ConsumptionStatus, count_status, tags_match
from dataplane.errors import BackendUnavailable
from dataplane.storage import ClaimedRow

__all__ = ["MARKS_PARTITION", "TQClaims"]

log = logging.getLogger(__name__)

MARKS_PARTITION = RESERVED_PREFIX + "/marks"


def _finished_key(partition_id: str) -> str:
    return f"{RESERVED_PREFIX}/finished/{partition_id}"


def _user_tags(tags: Mapping[str, Any]) -> dict[str, Any]:
    return {t: v for t, v in tags.items() if t != MARKER}


class TQClaims:
    """Claims, consumption, resets and finished marks over one process's :class:`TQOps`."""

    def __init__(self, ops: TQOps, conf: Any) -> None:
        self.ops = ops
        controller = getattr(conf, "controller", None) if conf is not None else None
        self.polling = bool(getattr(controller, "polling_mode", False))
        self.claim_sampler = getattr(controller, "sampler", None) == CLAIM_SAMPLER_NAME

    async def _rows(self, partition_id: str) -> dict[str, dict[str, Any]]:
        """The committed rows of the partition (stored key -> tags with the marker), first-put order."""
        rows = (await self.ops._listing(partition_id)).get(partition_id, {})
        return {k: t for k, t in rows.items() if not is_reserved(k) and isinstance(t.get(MARKER), str)}

    async def _indexes(self, partition_id: str, keys: list[str]) -> dict[str, int]:
        """The global index of each of ``keys`` still there (one request; two when some are gone)."""
        bm = await self.ops._retrieve(partition_id, keys)
        if bm.size == len(keys):
            return dict(zip(keys, bm.global_indexes, strict=True))
        if bm.size == 0:
            return {}
        self.ops.round_trips += 1
        names = await self.ops.client.async_kv_retrieve_keys(
            global_indexes=list(bm.global_indexes), partition_id=partition_id
        )
        return {n: gi for n, gi in zip(names, bm.global_indexes, strict=False) if isinstance(n, str) and n in keys}

    async def _consumed(self, partition_id: str, task_name: str) -> set[int]:
        self.ops.round_trips += 1
        gidx, status = await self.ops.client.async_get_consumption_status(
            task_name=task_name, partition_id=partition_id
        )
        if gidx is None or status is None or not len(status):
            return set()
        return set(gidx[status == 1].tolist())

    async def claim(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        n: int,
        tag_filter: Mapping[str, Any] | None,
        budget_s: float,
    ) -> list[ClaimedRow]:
        if not self.polling or not self.claim_sampler:
            raise BackendUnavailable(
                "claims on tq:// need TransferQueue's controller in polling mode with dataplane's claim sampler, "
                "and this TransferQueue was started without them (a tq_conf that sets controller.sampler or turns "
                "polling_mode off, or a TransferQueue started outside dataplane); start it through dataplane "
                "(tq://?backend=...) with the default sampler"
            )
        need = frozenset(fields)
        rows = await self._rows(partition_id)
        ready = [
            k for k, t in rows.items() if need <= marker_fields(t[MARKER]) and tags_match(_user_tags(t), tag_filter)
        ]
        if not ready:
            return []
        where = await self._indexes(partition_id, ready)
        order = [where[k] for k in ready if k in where]
        if not order:
            return []
        # one request: the controller's sampler checks each index again and marks what it returns
        # consumed in the same step (_sampler.ClaimSampler), so no index is marked for a row not seen ready
        spec = {"order": order, "fields": sorted(need), "tag_filter": dict(tag_filter or {}), "n": n}
        self.ops.round_trips += 1
        got = await self.ops.client.async_get_meta(
            data_fields=[],
            batch_size=1,
            partition_id=partition_id,
            mode="fetch",
            task_name=task_name,
            sampling_config={CLAIM_KEY: spec},
        )
        if not got.size:
            return []
        return await self._named(partition_id, got, rows, need, tag_filter)

    async def _named(
        self,
        partition_id: str,
        got: Any,
        listed: Mapping[str, Any],
        need: frozenset[str],
        tag_filter: Mapping[str, Any] | None,
    ) -> list[ClaimedRow]:
        """The rows a fetch handed out, by key, in first-put order (the controller's sampler checked
        each as ready in the step that marked it; a row that fails the check here again is logged
        and left out, never handed out unready)."""
        self.ops.round_trips += 1
        names = await self.ops.client.async_kv_retrieve_keys(
            global_indexes=list(got.global_indexes), partition_id=partition_id
        )
        place = {k: i for i, k in enumerate(listed)}
        out: list[tuple[int, str, dict[str, Any]]] = []
        for name, tags in zip(names, got.custom_meta, strict=False):
            marker = tags.get(MARKER) if isinstance(tags, Mapping) else None
            if not isinstance(name, str) or not isinstance(marker, str):
                continue  # cleared meanwhile
            if need <= marker_fields(marker) and tags_match(_user_tags(tags), tag_filter):
                out.append((place.get(name, len(place)), user_key(name), _user_tags(tags)))
            else:
                log.warning("dataplane: tq:// claim took row %r, which is not ready for it; it is skipped", name)
        out.sort(key=lambda r: r[0])
        return [(k, t) for _, k, t in out]

    async def consumption(
        self, partition_id: str, task_name: str, fields: Sequence[str], tag_filter: Mapping[str, Any] | None
    ) -> ConsumptionStatus:
        rows, finished = await asyncio.gather(self._rows(partition_id), self.finished(partition_id))
        claimed: set[str] = set()
        if rows:
            keys = list(rows)
            where, consumed = await asyncio.gather(
                self._indexes(partition_id, keys), self._consumed(partition_id, task_name)
            )
            claimed = {k for k, gi in where.items() if gi in consumed}
        return count_status(
            partition_id,
            task_name,
            ((k in claimed, marker_fields(t[MARKER]), _user_tags(t)) for k, t in rows.items()),
            fields,
            tag_filter,
            finished=finished,
        )

    async def reset(self, partition_id: str, task_name: str | None) -> None:
        self.ops.round_trips += 1
        try:
            await self.ops.client.async_reset_consumption(partition_id=partition_id, task_name=task_name)
        except RuntimeError as e:  # a partition TQ does not know: nothing claimed there
            log.debug("dataplane: reset_consumption of %r: %s", partition_id, e)

    async def finished(self, partition_id: str) -> bool:
        bm = await self.ops._retrieve(MARKS_PARTITION, [_finished_key(partition_id)])
        return bool(bm.size) and bm.custom_meta[0].get("finished") is True

    async def mark(self, partition_id: str, finished: bool, budget_s: float) -> None:
        key = _finished_key(partition_id)
        if finished:
            deadline = asyncio.get_running_loop().time() + budget_s
            await self.ops._put_tags(MARKS_PARTITION, [key], [{"finished": True}], deadline)
            return
        bm = await self.ops._retrieve(MARKS_PARTITION, [key])
        if bm.size:  # forget the row alone: the marks partition holds every partition's marks
            self.ops.round_trips += 2
            await self.ops.client._mark_clearing_in_controller(bm)
            await self.ops.client._clear_meta_in_controller(bm)
