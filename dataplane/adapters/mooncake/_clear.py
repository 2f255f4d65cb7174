"""Clears of the Mooncake store: a tombstone for ``kv_clear(keys)`` and removal of the puts nothing
reads any more; for a whole partition, every put its listing shows (index objects first) and data
left by writers that died mid-put."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from dataplane.adapters.mooncake._fold import PartitionState, birth_marker
from dataplane.adapters.mooncake._index import (
    claims_prefix,
    data_prefix,
    decode_index,
    encode_index,
    index_and_claim_lines,
    index_object_bytes,
    index_prefix,
    new_put_id,
    partition_prefix,
)
from dataplane.adapters.mooncake._partitions import PartitionCache, _Part
from dataplane.errors import (
    CapacityExceeded,
)

__all__ = ["Clears"]

_IDS_PER_SWEEP = 64  # put ids per regex of a partition's clear (each sweep scans the master's keys once)
_ORPHAN_AGE_NS = 600 * 10**9  # a clear sweeps data no index names once its put began this long ago


def _ids_before(t_ns: int) -> str:
    """A regex matching the time part of put ids (19 digits, :func:`new_put_id`) below ``t_ns``."""
    t = f"{max(0, t_ns):019d}"
    alts = []
    for i, d in enumerate(t):
        if d != "0":
            below = "0" if d == "1" else f"[0-{int(d) - 1}]"
            alts.append(t[:i] + below + (f"[0-9]{{{18 - i}}}" if i < 18 else ""))
    return "|".join(alts) or "(?!)"


def _literal(text: str) -> str:
    """``text`` matched literally by Mooncake's regex (ECMAScript): only its metacharacters escaped."""
    return re.sub(r"([.^$|?*+()\[\]{}\\])", r"\\\1", text)


class Clears(PartitionCache):
    """The clear half of :class:`~dataplane.adapters.mooncake._store.MooncakeStore`."""

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        part = self._part(partition_id)
        if keys is None:
            lines = self._listing(deadline)
            with part.lock:
                self._remove_listed(partition_id, part, lines)
                part.known, part.state, part.mine = {}, PartitionState(), {}
            self._forget(partition_id, part)
            # claim markers (of every task) and the finished mark: a marker a claimant writes for a row
            # after its clear names a row id no later row has (PartitionState.row_ids), so it claims
            # nothing; the partition's next whole clear sweeps it
            self.handle.remove_regex(f"^{_literal(partition_prefix(self.ns, partition_id))}(c/|f$)")
            return
        head = claims_prefix(self.ns, partition_id)  # the listing names the partition's claim markers too
        lines = self.admin.start_all_keys(self._time_left(deadline), index_and_claim_lines(self.ns, head))()
        with part.lock:
            state = self._refresh(partition_id, part, lines, {}, deadline)
            doomed = [k for k in keys if k in state.rows]
            if not doomed:
                return
            gone_ids = {i for i in state.row_ids(doomed) if i is not None}
            garbage, need_tombstone, reborn = state.garbage_after_delete(doomed)
            known = dict(part.known)
            doomed_objects = [k for p in garbage for k in p.object_keys()]
            # index objects written before anything goes: the tombstone (removing first could briefly
            # resurrect older values of doomed keys), and the birth markers of the puts collected
            # that surviving rows were first put in (removing first could briefly reorder them)
            first: list[tuple[str, bytes]] = []
            if need_tombstone:
                put_id = new_put_id(self.writer)
                body = encode_index(doomed, {}, None, op="del")
                key = f"{index_prefix(self.ns, partition_id)}{put_id}.{len(body)}"
                first.append((key, body))
                known[put_id] = decode_index(key, put_id, body)
            for p in reborn:
                marker, body = birth_marker(p, self.writer)
                first.append((marker.key, body))
                known[marker.put_id] = marker
            if first:
                try:
                    self._write_indexes(first, partition_id, deadline)
                except CapacityExceeded:  # a full store must still be clearable: free space, then retry
                    self._remove(doomed_objects)
                    doomed_objects = []
                    self._write_indexes(first, partition_id, deadline)
            self._remove(doomed_objects)
            for p in garbage:
                known.pop(p.put_id, None)
            part.known = known
            part.state = part.state.refresh(known)
        if not known:
            self._forget(partition_id, part)
        markers = [ln for ln in lines if ln.startswith(head) and ln.rsplit("/", 1)[-1] in gone_ids]
        if markers:
            self._remove(markers)

    def _write_indexes(self, objects: Sequence[tuple[str, bytes]], partition_id: str, deadline: float) -> None:
        """Write index objects ``objects`` ((key, body) each) in one all-or-nothing batch."""
        held = [self._sendable_bytes(body) for _, body in objects]
        try:
            self._write(
                [key for key, _ in objects],
                [ptr for ptr, _ in held],
                [index_object_bytes(len(body)) for _, body in objects],
                partition_id,
                deadline,
            )
        finally:
            for _, buf in held:
                self._unstage(buf)

    def _remove_listed(self, partition_id: str, part: _Part, lines: Sequence[str]) -> None:
        """Remove every put of the partition that ``lines`` list: their index objects, then their data
        objects (see :meth:`_remove`), matched by put id; then data objects that no index names, of
        puts begun over 10 minutes ago (their writer died mid-put). A put listed only later (one
        racing this clear) is left whole: sweeping the partition's data by prefix could take the
        data of a put whose index lands between the two removals, leaving an index naming nothing."""
        listed = part.lines.update(lines, index_prefix(self.ns, partition_id))  # call with part.lock held
        self._remove([key for key, _ in listed.values()])
        head = _literal(data_prefix(self.ns, partition_id))
        ids = [_literal(put_id) for put_id in sorted(listed)]
        for at in range(0, len(ids), _IDS_PER_SWEEP):
            self.handle.remove_regex(f"^{head}({'|'.join(ids[at : at + _IDS_PER_SWEEP])})/")
        # data no index names: a writer died mid-put. Only puts begun long ago: a younger one may still
        # be writing its index, and put ids begin with the writer's clock.
        self.handle.remove_regex(f"^{head}({_ids_before(time.time_ns() - _ORPHAN_AGE_NS)})-")

    def _forget(self, partition_id: str, part: _Part) -> None:
        """Drop the cache of a partition left empty (jobs often use a fresh partition per step)."""
        with self._parts_lock:
            if self._parts.get(partition_id) is part and not part.known and not part.pending:
                del self._parts[partition_id]
