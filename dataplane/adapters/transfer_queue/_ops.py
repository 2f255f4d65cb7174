"""The TQ adapter's operations, as coroutines run on the TransferQueue client's loop thread.

Controller round trips (ZMQ requests to the ``TransferQueueController``), measured by
``tests/test_tq_conformance.py::test_round_trips``:

* put: 3, like TQ's own ``kv_batch_put`` -- ``kv_retrieve_meta(create=True)`` for the schema keys of
  the put's fields plus its keys (one request: allocates the new keys, returns recorded schemas,
  tags and which keys exist), the storage write with its data-update notify, and one
  ``set_custom_meta`` that commits row tags, markers and new schemas together. A write-back of
  existing rows without tags that leaves their markers as they were (on SimpleStorage: the same
  field set as the rows' last put; on Mooncake: no new field) skips the last one (2). On Mooncake,
  a put of fields that rows already hold also asks for the tokens of the objects it replaces, sent
  beside the storage write (one request per set of such fields, usually one).
* get by meta (schema carried in ``meta.extra_info`` by the put): 1, like TQ's ``kv_batch_get``.
  The carried schema is checked against what the rows were written with (TQ's record of each field
  on Mooncake, the blobs' schema tokens on SimpleStorage); on a mismatch the get reads the schema
  keys (1 more).
* get by keys: 2, sent concurrently (the rows' metadata and the requested fields' schema keys), so
  the latency is about one.
* tag-only put (no field): 2 -- the same ``kv_retrieve_meta(create=True)`` and one
  ``set_custom_meta`` with the merged tags; no storage write. A key without a committed row becomes a
  row whose marker is empty (no field).
* describe: 1, ``kv_retrieve_meta(create=False)`` for the keys (their tags and markers: a row's
  fields are those its marker names); 2 when some keys are absent, because TQ leaves them out of its
  answer without saying which, so ``kv_retrieve_keys`` names the found rows' indexes. No listing.

On SimpleStorage a put's fields travel as one packed TQ field (:mod:`dataplane.adapters.transfer_queue._pack`),
so TQ's per-(row, field) cost is paid once per row.

Everything before the storage write is validation: a schema conflict raises ``SchemaError`` and
only un-registers the keys the put had just created.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from tensordict import TensorDict

from dataplane.adapters.transfer_queue._deployment import TQDeployment
from dataplane.adapters.transfer_queue._layout import (
    MARKER,
    RowsChanged,
    decode_schemas,
    is_reserved,
    join_fields,
    schema_key,
    schema_tag,
    signature_matches,
    split_fields,
    to_tq,
    user_key,
)
from dataplane.adapters.transfer_queue._mooncake_backend import (
    MooncakeData,
    ReadPlan,
    key_prefix,
    new_version,
    row_tokens,
    token_of,
)
from dataplane.adapters.transfer_queue._pack import (
    ParsedPack,
    StaleSchema,
    column_of,
    key_stamps,
    marker_after_put,
    pack_columns,
    pack_field,
    packs_of_marker,
    parse_pack,
)
from dataplane.adapters.transfer_queue._tokens import TokenLookups, marker_fields
from dataplane.client import Listing
from dataplane.codec.wire import Column
from dataplane.errors import BackendUnavailable, DataPlaneError, KeyNotFound, SchemaError, missing_rows_error
from dataplane.schema import FieldSchema, check_compatible

__all__ = ["SCHEMA_EXTRA", "Described", "TQOps"]

log = logging.getLogger(__name__)

SCHEMA_EXTRA = "tq_schema"  # meta.extra_info key of the schemas a put wrote
ROLLBACK_TIMEOUT_S = 10.0

Described = list[tuple[frozenset[str], dict[str, Any]] | None]
"""What :meth:`TQOps.describe` returns: per asked key, its fields and tags, or None (absent)."""


@functools.lru_cache(maxsize=4096)
def _marker_with(marker: str | None, fields: frozenset[str]) -> str:
    """Mooncake layout's row marker: the row's fields, sorted, comma-joined."""
    return join_fields(split_fields(marker) | fields)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("dataplane: rolling back a failed put failed; its new keys may remain: %s", fut.exception())


def _aligned(asked: Sequence[str], names: Sequence[str | None]) -> list[int | None]:
    """Position in ``asked`` of each found row, from the keys TQ names for the found rows' indexes
    (TQ answers for the asked keys in order, leaving out the absent ones). A name that is gone, not
    asked, or out of order belongs to a row cleared (its index perhaps handed to another key)
    between the two requests: None, i.e. absent."""
    where = {k: i for i, k in enumerate(asked)}
    out: list[int | None] = []
    last = -1
    for name in names:
        pos = where.get(name) if isinstance(name, str) else None
        if pos is None or pos <= last:
            out.append(None)
            continue
        out.append(pos)
        last = pos
    return out


_CLEARED_RETRIES = 4  # reads of a get whose rows another process clears meanwhile


def _cleared_under_read(e: BaseException) -> bool:
    """Whether ``e`` is TransferQueue's ``StorageKeyNotFoundError``: a storage unit no longer held a
    row the controller had just named (a concurrent clear)."""
    try:
        from transfer_queue.storage import StorageKeyNotFoundError
    except ImportError:  # pragma: no cover - other TransferQueue versions: by its marker
        return isinstance(e, KeyError) and "TQKeyNotFound" in str(e)
    return isinstance(e, StorageKeyNotFoundError)


def _missing_fields(
    partition_id: str,
    keys: Sequence[str],
    absent: Sequence[str],
    markers: Sequence[set[str]],
    known: Mapping[str, FieldSchema],
) -> KeyNotFound:
    """``KeyNotFound`` naming, per absent field, the rows that lack it (all of them when the
    partition has no schema for it)."""
    missing = {}
    for f in absent:
        lacking = [k for k, m in zip(keys, markers, strict=False) if f not in m or f not in known]
        missing[f] = [user_key(k) for k in lacking or keys]
    return missing_rows_error(partition_id, (), missing)


class TQOps(TokenLookups):
    """Put / get / clear / list over one process's TransferQueue client."""

    def __init__(self, dep: TQDeployment) -> None:
        self.client = dep.client
        self.manager = self.client.storage_manager
        self.mooncake: MooncakeData | None = None
        if dep.storage == "mooncake":
            self.mooncake = MooncakeData(self.manager.storage_client)
        else:  # SimpleStorage: we read the units' rows ourselves, with TQ 0.1.11's own requests
            needed = ("_group_by_hash", "_request_with_retry", "_get_from_single_storage_unit")
            lacking = [a for a in needed if not hasattr(self.manager, a)]
            if lacking:
                raise BackendUnavailable(
                    f"this TransferQueue's storage manager lacks {lacking}; install transferqueue==0.1.11 "
                    "(pip install 'dataplane[tq]')"
                )
        self.round_trips = 0  # controller requests sent through these ops
        self._background: set[asyncio.Future[Any]] = set()

    # ------------------------------------------------------------------ controller requests
    async def _retrieve(self, partition_id: str, keys: list[str], *, create: bool = False) -> Any:
        self.round_trips += 1
        return await self.client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=create)

    async def _set_tags(self, partition_id: str, gis: list[int], tags: list[dict[str, Any]]) -> None:
        from transfer_queue.metadata import BatchMeta

        if gis:
            self.round_trips += 1
            await self.client.async_set_custom_meta(BatchMeta(gis, [partition_id] * len(gis), custom_meta=tags))

    async def _listing(self, partition_id: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        self.round_trips += 1
        out: dict[str, dict[str, dict[str, Any]]] = await self.client.async_kv_list(partition_id)
        return out

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ------------------------------------------------------------------ put
    async def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        budget_s: float,
    ) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + budget_s
        if not columns:
            if tags is None:  # pragma: no cover - StoreClient rejects a put of neither
                raise DataPlaneError("a put of no field needs tags; this is a dataplane bug")
            return await self._put_tags(partition_id, keys, tags, deadline)
        fields = list(columns)
        nf = len(fields)
        bm = await self._retrieve(partition_id, [schema_key(f) for f in fields] + list(keys), create=True)
        if bm.size != nf + len(keys):
            raise BackendUnavailable(f"TransferQueue registered {bm.size} of {nf + len(keys)} keys; is it overloaded?")
        recorded = decode_schemas(bm.custom_meta[:nf])
        old_tags: list[dict[str, Any]] = bm.custom_meta[nf:]
        gis: list[int] = bm.global_indexes[nf:]
        new = [i for i, t in enumerate(old_tags) if MARKER not in t]
        new_gis = [gis[i] for i in new]
        try:
            for f, col in columns.items():
                if f in recorded:
                    check_compatible(partition_id, f, recorded[f], col.schema)
        except SchemaError:
            try:
                await self._unregister(partition_id, new_gis)
            except Exception as e:  # the SchemaError is what the caller must see
                log.warning("dataplane: could not unregister %d keys of a rejected put: %s", len(new_gis), e)
            raise
        from transfer_queue.metadata import BatchMeta, extract_field_schema

        rows = BatchMeta(gis, [partition_id] * len(gis))
        writing: asyncio.Future[Any] | None = None
        tokens: list[str] = []  # Mooncake: each row's token, in the names of the objects this put writes
        replaced: list[tuple[int, dict[str, str]]] = []  # (row, tokens) of the objects it replaces
        notified = False
        try:
            if self.mooncake is None:
                packed = pack_columns(columns, len(keys), keys=keys)
                td = TensorDict({pack_field(packed.pack): packed.rows}, batch_size=[len(keys)])
                self.round_trips += 1  # the storage manager's data-update notify
                await self.manager.put_data(td, rows)
                marking = functools.partial(marker_after_put, pack=packed.pack)
            else:
                td = TensorDict({f: to_tq(c) for f, c in columns.items()}, batch_size=[len(keys)])
                version = new_version()  # see _mooncake_backend: a put never writes over an object
                tokens = [token_of(st, version) for st in key_stamps(keys).tolist()]
                writing = asyncio.ensure_future(self._in_thread(self.mooncake.put, gis, tokens, columns))
                # what this put replaces, asked while it writes (rows holding none of its fields: nothing)
                replaced = await self._held_tokens(partition_id, keys, gis, old_tags, frozenset(fields))
                await asyncio.shield(writing)  # a timeout must not orphan the write (see _rollback)
                self.round_trips += 1
                written = {gi: dict.fromkeys(fields, t) for gi, t in zip(gis, tokens, strict=True)}
                await self.manager.notify_data_update(partition_id, gis, extract_field_schema(td), written)
                notified = True
                marking = functools.partial(_marker_with, fields=frozenset(fields))
            commit_gis, commit_tags = [], []
            for i, (gi, old) in enumerate(zip(gis, old_tags, strict=True)):
                was = old.get(MARKER)
                marked = marking(was if isinstance(was, str) else None)
                if tags is None and was == marked:
                    continue  # nothing to change: skip, and leave concurrent tag updates alone
                commit_gis.append(gi)
                commit_tags.append({**old, **(tags[i] if tags is not None else {}), MARKER: marked})
            for j, f in enumerate(fields):
                if f not in recorded:
                    commit_gis.append(bm.global_indexes[j])
                    commit_tags.append(schema_tag(f, columns[f].schema))
            if replaced:  # recorded: no reader is sent to them any more (one that was checks its read)
                assert self.mooncake is not None
                await asyncio.gather(
                    self._set_tags(partition_id, commit_gis, commit_tags),
                    self._in_thread(self.mooncake.remove, *zip(*replaced, strict=True)),
                )
            else:
                await self._set_tags(partition_id, commit_gis, commit_tags)
        except BaseException as e:
            # once recorded, the put's objects are the existing rows' data: then only the new rows' go
            at = range(len(tokens)) if not notified else new
            ours = [(gis[i], dict.fromkeys(fields, tokens[i])) for i in at]
            rollback = self._rollback(partition_id, new_gis, ours, writing)
            await self._undo(e, rollback, deadline)
            raise
        return {SCHEMA_EXTRA: {f: c.schema.to_dict() for f, c in columns.items()}}

    async def _put_tags(
        self, partition_id: str, keys: Sequence[str], tags: Sequence[Mapping[str, Any]], deadline: float
    ) -> dict[str, Any]:
        """A put of tags alone: 2 round trips (register the keys, commit the merged tags), no storage
        write. A key that had no committed row becomes one with an empty marker, i.e. a row without
        fields (listed, described, cleared like any other); a row's own marker is kept, so its fields
        stay as they were. A present row whose tags do not change is left out of the commit."""
        bm = await self._retrieve(partition_id, list(keys), create=True)
        if bm.size != len(keys):
            raise BackendUnavailable(f"TransferQueue registered {bm.size} of {len(keys)} keys; is it overloaded?")
        gis: list[int] = bm.global_indexes
        new_gis = [gi for gi, old in zip(gis, bm.custom_meta, strict=True) if MARKER not in old]
        commit_gis, commit_tags = [], []
        for gi, old, t in zip(gis, bm.custom_meta, tags, strict=True):
            was = old.get(MARKER)
            if MARKER in old and not t:
                continue  # nothing to change: leave concurrent tag updates alone
            commit_gis.append(gi)
            commit_tags.append({**old, **t, MARKER: was if isinstance(was, str) else ""})
        try:
            await self._set_tags(partition_id, commit_gis, commit_tags)
        except BaseException as e:
            await self._undo(e, self._unregister(partition_id, new_gis), deadline)
            raise
        return {SCHEMA_EXTRA: {}}

    async def _undo(self, error: BaseException, rollback: Any, deadline: float) -> None:
        """Run ``rollback`` (a coroutine undoing a failed put) in the background, bounded by
        ``ROLLBACK_TIMEOUT_S``, and wait for it while the call's budget lasts; ``error`` is what
        made the put fail (a cancellation is the caller's timeout: the rollback outlives it)."""
        if isinstance(error, asyncio.CancelledError) and (task := asyncio.current_task()) is not None:
            task.uncancel()  # the caller has timed out already: the rollback goes on in the background
        undo = asyncio.ensure_future(asyncio.wait_for(rollback, ROLLBACK_TIMEOUT_S))
        self._background.add(undo)
        undo.add_done_callback(self._background.discard)
        undo.add_done_callback(_log_failure)
        left = deadline - asyncio.get_running_loop().time() - 0.25  # answer before the caller's own bound
        with contextlib.suppress(Exception):  # wait for it while the call's budget lasts
            await asyncio.wait_for(asyncio.shield(undo), max(0.0, left))

    async def _unregister(self, partition_id: str, gis: list[int]) -> None:
        """Forget keys that hold no data (controller only)."""
        from transfer_queue.metadata import BatchMeta

        if gis:
            self.round_trips += 1
            await self.client._clear_meta_in_controller(BatchMeta(gis, [partition_id] * len(gis)))

    async def _rollback(
        self, partition_id: str, new_gis: list[int], ours: list[tuple[int, dict[str, str]]], writing: Any
    ) -> None:
        """Undo a failed put: remove its bytes (SimpleStorage: the new rows'; Mooncake: the objects
        ``ours`` names), then forget the keys it created (at ``new_gis``)."""
        from transfer_queue.metadata import BatchMeta

        if writing is not None and not writing.done():
            await asyncio.shield(writing)  # let the Mooncake write finish before removing what it wrote
        try:  # best effort: a dead storage unit must not keep the keys registered
            if self.mooncake is None:
                if new_gis:
                    meta = BatchMeta(new_gis, [partition_id] * len(new_gis))
                    await asyncio.wait_for(self.manager.clear_data(meta), ROLLBACK_TIMEOUT_S / 2)
            elif writing is not None and ours:
                removing = self._in_thread(self.mooncake.remove, *zip(*ours, strict=True))
                await asyncio.wait_for(removing, ROLLBACK_TIMEOUT_S / 2)
        except Exception as e:
            log.warning("dataplane: rollback could not remove the data of %d rows: %s", len(ours), e)
        await self._unregister(partition_id, new_gis)

    # ------------------------------------------------------------------ get
    async def get(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], carried: Mapping[str, Any] | None
    ) -> dict[str, Column]:
        for attempt in range(_CLEARED_RETRIES):
            try:
                if self.mooncake is None:
                    return await self._packed_get(partition_id, keys, list(fields), carried)
                return await self._mooncake_get(partition_id, keys, fields, carried)
            except Exception as e:  # a row cleared or rewritten between the controller's answer and the read
                if not isinstance(e, RowsChanged) and not _cleared_under_read(e):
                    raise
                last = e
                if attempt:  # under heavy churn, let a burst of clears pass
                    await asyncio.sleep(0.005 * 2**attempt)
        # the next round finds the rows rewritten and reads them, or finds them gone and names them;
        # here every round lost its rows to another clear or rewrite
        if isinstance(last.__cause__, DataPlaneError):  # a record that never matched: not churn
            raise last.__cause__
        raise KeyNotFound(
            f"partition {partition_id!r}: rows of this get were cleared or rewritten while it read them, "
            f"{_CLEARED_RETRIES} times in a row ({last}); another process keeps rewriting and clearing them. "
            "Read rows once their writers are done with them"
        ) from last

    async def _mooncake_get(
        self, partition_id: str, keys: Sequence[str], fields: Sequence[str], carried: Mapping[str, Any] | None
    ) -> dict[str, Column]:
        assert self.mooncake is not None
        skeys = [schema_key(f) for f in fields]
        known = {f: FieldSchema.from_dict(carried[f]) for f in fields if carried and f in carried}
        if len(known) == len(fields):
            bm = await self._retrieve(partition_id, list(keys))
            seen = bm.field_schema
            if not all(signature_matches(known[f], seen[f]) for f in fields if f in seen):
                known = decode_schemas((await self._retrieve(partition_id, skeys)).custom_meta)
        else:
            bm, sm = await asyncio.gather(self._retrieve(partition_id, list(keys)), self._retrieve(partition_id, skeys))
            known = decode_schemas(sm.custom_meta)
        if bm.size != len(keys):
            raise await self._missing_keys(partition_id, keys)
        absent = [f for f in fields if f not in bm.field_schema or f not in known]
        if absent:
            markers = [split_fields(t.get(MARKER)) for t in bm.custom_meta]
            raise _missing_fields(partition_id, keys, absent, markers, known)
        n = len(keys)
        try:
            tokens = [row_tokens(m) for m in bm._custom_backend_meta]
            prefixes = [key_prefix(st) for st in key_stamps(keys).tolist()]
            plans = {
                f: ReadPlan(
                    known[f], self._tokens_of(f, tokens, prefixes), self._lengths(f, known[f], bm.field_schema[f], n)
                )
                for f in fields
            }
        except DataPlaneError as e:  # read mid-way through another process's put or clear of these rows?
            raise RowsChanged(str(e)) from e
        got: dict[str, Column] = await self._in_thread(self.mooncake.get, bm.global_indexes, plans)
        return got

    async def _packed_get(
        self, partition_id: str, keys: Sequence[str], fields: list[str], carried: Mapping[str, Any] | None
    ) -> dict[str, Column]:
        """SimpleStorage get: group the rows by the packs holding the fields, read each group's packs
        straight from the units (TQ's ``get_data`` would first build a nested tensor per pack), and
        cut the fields out of the blobs (one copy per field)."""
        skeys = [schema_key(f) for f in fields]
        known = {f: FieldSchema.from_dict(carried[f]) for f in fields if carried and f in carried}
        trusted = len(known) == len(fields)  # carried by the meta; the blobs' schema tokens check it
        if trusted:
            bm = await self._retrieve(partition_id, list(keys))
        else:
            bm, sm = await asyncio.gather(self._retrieve(partition_id, list(keys)), self._retrieve(partition_id, skeys))
            known = decode_schemas(sm.custom_meta)
        if bm.size != len(keys):
            raise await self._missing_keys(partition_id, keys)
        groups: dict[tuple[str, ...], list[int]] = {}
        resolved: dict[str | None, tuple[str, ...] | None] = {}
        lacking: list[int] = []
        for pos, tags in enumerate(bm.custom_meta):
            marker = tags.get(MARKER)
            marker = marker if isinstance(marker, str) else None  # a foreign tag may not even hash
            if marker not in resolved:
                where = packs_of_marker(marker) if marker is not None else {}
                resolved[marker] = tuple(where[f] for f in fields) if all(f in where for f in fields) else None
            packs = resolved[marker]
            if packs is None:
                lacking.append(pos)
            else:
                groups.setdefault(packs, []).append(pos)
        if lacking or any(f not in known for f in fields):
            markers = [split_fields(t.get(MARKER)) for t in bm.custom_meta]
            absent = [f for f in fields if f not in known or any(f not in markers[p] for p in lacking)]
            raise _missing_fields(partition_id, keys, absent, markers, known)
        gis = bm.global_indexes
        reads = [
            self._read_rows([gis[p] for p in positions], list(dict.fromkeys(packs)))
            for packs, positions in groups.items()
        ]
        sources: dict[str, list[ParsedPack]] = {f: [] for f in fields}
        for (packs, positions), blobs in zip(groups.items(), await asyncio.gather(*reads), strict=True):
            parsed = {p: parse_pack(p, blobs[p], positions, keys=keys) for p in dict.fromkeys(packs)}
            for f, p in zip(fields, packs, strict=True):
                sources[f].append(parsed[p])
        n = len(keys)
        while True:
            try:
                return {f: column_of(f, known[f], n, sources[f]) for f in fields}
            except StaleSchema as e:
                if not trusted:
                    raise SchemaError(
                        f"{e}; the partition was probably written by something other than dataplane"
                    ) from e
            # the meta's schemas are stale (the partition was cleared and re-written since): read them, once
            trusted = False
            known = decode_schemas((await self._retrieve(partition_id, skeys)).custom_meta)
            if any(f not in known for f in fields):
                raise _missing_fields(partition_id, keys, [f for f in fields if f not in known], [], known)

    async def _read_rows(self, gis: list[int], packs: list[str]) -> dict[str, list[Any]]:
        """Each pack's blob of each row, in the order of ``gis``, from the units that hold them."""
        m = self.manager
        names = [pack_field(p) for p in packs]
        routing = m._group_by_hash(gis)
        results = await asyncio.gather(
            *(
                m._request_with_retry(
                    "get",
                    su,
                    f"samples={len(group.global_indexes)} fields={names}",
                    partial(m._get_from_single_storage_unit, group.global_indexes, names, target_storage_unit=su),
                )
                for su, group in routing.items()
            )
        )
        if len(results) == 1:
            data = results[0][1]
            return {p: list(data[name]) for p, name in zip(packs, names, strict=True)}
        out: dict[str, list[Any]] = {}
        for p, name in zip(packs, names, strict=True):
            rows: list[Any] = [None] * len(gis)
            for group, (_, data) in zip(routing.values(), results, strict=True):
                for i, pos in enumerate(group.batch_positions):
                    rows[pos] = data[name][i]
            out[p] = rows
        return out

    async def _missing_keys(self, partition_id: str, keys: Sequence[str]) -> KeyNotFound:
        rows = (await self._listing(partition_id)).get(partition_id, {})
        missing = [k for k in keys if k not in rows]
        return missing_rows_error(partition_id, [user_key(k) for k in missing or keys])

    # ------------------------------------------------------------------ clear / list
    async def clear(self, partition_id: str, keys: Sequence[str] | None) -> None:
        if keys is None:
            await self._drop_partition(partition_id)
            return
        asked = [k for k in keys if not is_reserved(k)]
        bm = await self._retrieve(partition_id, asked)
        if bm.size == 0:
            return
        fields = set(bm.field_names).union(*(split_fields(t.get(MARKER)) for t in bm.custom_meta))
        held = await self._all_tokens(partition_id, asked, bm) if fields and self.mooncake is not None else []
        self.round_trips += 1
        await self.client._mark_clearing_in_controller(bm)
        if not fields:
            pass  # tag-only rows: nothing in storage
        elif self.mooncake is None:
            await self.manager.clear_data(bm)
        elif held:
            await self._in_thread(self.mooncake.remove, *zip(*held, strict=True))
        self.round_trips += 1
        await self.client._clear_meta_in_controller(bm)
        rows = (await self._listing(partition_id)).get(partition_id)
        if rows is not None and all(is_reserved(k) for k in rows):
            await self._drop_partition(partition_id)  # its last row is gone: forget its schema too

    async def _drop_partition(self, partition_id: str) -> None:
        self.round_trips += 1
        meta = await self.client._get_partition_meta(partition_id)  # every row, with every field's token
        if meta is None:
            return
        if meta.size:
            self.round_trips += 1
            await self.client._mark_clearing_in_controller(meta)
            if meta.field_names:
                if self.mooncake is None:
                    await self.manager.clear_data(meta)
                else:
                    tokens = [row_tokens(m) for m in meta._custom_backend_meta]
                    await self._in_thread(self.mooncake.remove, meta.global_indexes, tokens)
        self.round_trips += 1
        await self.client._clear_partition_in_controller(partition_id)

    async def describe(self, partition_id: str, keys: Sequence[str]) -> Described:
        """Each key's fields (from its row marker) and tags, or None where it has no committed row:
        one ``kv_retrieve_meta(create=False)`` for the batch, and one ``kv_retrieve_keys`` more when
        some keys are absent (TQ leaves them out of its answer without saying which, so the found
        rows' indexes are named). Reads no field and lists nothing."""
        asked = list(keys)
        bm = await self._retrieve(partition_id, asked)
        out: Described = [None] * len(asked)
        if bm.size == 0:
            return out
        if bm.size == len(asked):
            positions: list[int | None] = list(range(len(asked)))
        else:
            self.round_trips += 1
            try:
                names = await self.client.async_kv_retrieve_keys(
                    global_indexes=list(bm.global_indexes), partition_id=partition_id
                )
            except RuntimeError as e:  # TQ 0.1.11 answers [] for a partition it no longer has
                if "no corresponding keys" not in str(e):
                    raise
                return out  # dropped between the two requests
            positions = _aligned(asked, names)
        for pos, tags in zip(positions, bm.custom_meta, strict=True):
            marker = tags.get(MARKER)
            if pos is None or not isinstance(marker, str):
                continue  # cleared meanwhile, or a put not committed (hidden from kv_list too)
            out[pos] = (marker_fields(marker), {t: v for t, v in tags.items() if t != MARKER})
        return out

    async def list(self, partition_id: str | None) -> Listing:
        out: Listing = {}
        for p, rows in (await self._listing(partition_id)).items():
            visible = {
                k: {t: v for t, v in tags.items() if t != MARKER}
                for k, tags in rows.items()
                if MARKER in tags and not is_reserved(k)
            }
            if visible:
                out[p] = visible
        return out
