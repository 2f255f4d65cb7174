"""A group-granular replay buffer for asynchronous RL: slots are reserved before a rollout starts and
committed when its rows are in the store.

A **slot** is one group (the samples of one prompt). The rollout pump ``reserve``\\ s a slot before it
generates (capacity counts reserved and committed slots, so a full buffer pushes back on the
rollouts), then ``commit``\\ s the meta of the rows it wrote, or ``release``\\ s the slot when the
rollout failed. The train pump takes ``ready()`` slots, trains them and ``remove``\\ s them (their
rows are cleared). Metadata lives here; tensors stay in the store.

Every reservation ends in exactly one commit or one release (counted: :attr:`ReplayBuffer.stats`).
A put can write some rows before it raises, so :meth:`ReplayBuffer.commit_put` clears the slot's
keys when the put fails: the keys are deterministic (``f"{uid}_g{i}"``), so the buffer knows them
without the meta the put never returned.

>>> import dataplane, torch
>>> with dataplane.connect() as client:
...     buf = ReplayBuffer(client, capacity=2, partition_id="rl", group_size=2)
...     slot = buf.reserve(weight_version=0)
...     meta = buf.commit_put(slot, lambda s: client.kv_batch_put(s.keys, {"x": torch.zeros(2)}, partition_id="rl"))
...     [s.uid for s in buf.ready()], buf.occupancy
(['g0'], 1)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from dataplane import DataPlaneClient, DataPlaneTimeout, InvalidArgument, KVBatchMeta
from dataplane.checks import check_int, check_number

__all__ = ["ReplayBuffer", "Slot"]


@dataclass(slots=True, eq=False)
class Slot:
    """One group's place in the buffer.

    Attributes:
        id: issue order (0, 1, 2, ...): the order prompts were handed out.
        uid: the group's id (its rows are ``f"{uid}_g{i}"``).
        weight_version: the weights its rollout samples with.
        keys: the group's row keys.
        state: ``"reserved"`` (rollout in flight), ``"committed"`` (rows in the store),
            ``"released"`` or ``"removed"`` (gone).
        meta: the committed rows' meta.
        info: what the rollout reported with the commit (small: per-row rewards, timings).
    """

    id: int
    uid: str
    weight_version: int
    keys: list[str]
    state: Literal["reserved", "committed", "released", "removed"] = "reserved"
    meta: KVBatchMeta | None = None
    info: dict[str, Any] = field(default_factory=dict)
    reserved_at: float = field(default_factory=time.monotonic)


class ReplayBuffer:
    """Slots of whole groups, bounded by ``capacity`` (reserved + committed); thread-safe.

    Args:
        client: where the rows live (clears go through it).
        capacity: most slots reserved or committed at once.
        partition_id: the partition the rollouts write into.
        group_size: samples per prompt (the keys of a slot are ``f"{uid}_g{i}"`` for ``i < group_size``).
        uid_prefix: slot ``n`` gets uid ``f"{uid_prefix}{n}"`` unless ``reserve`` is given one.
    """

    def __init__(
        self, client: DataPlaneClient, *, capacity: int, partition_id: str, group_size: int, uid_prefix: str = "g"
    ) -> None:
        for name, value in (("capacity", capacity), ("group_size", group_size)):
            check_int(name, value, low=1)
        self.client = client
        self.capacity, self.partition_id, self.group_size = capacity, partition_id, group_size
        self.uid_prefix = uid_prefix
        self._cond = threading.Condition()
        self._slots: dict[int, Slot] = {}  # reserved or committed, by id
        self._next = 0
        self.stats = {"reserved": 0, "committed": 0, "released": 0, "removed": 0}
        self.peak_occupancy = 0  # the most slots ever reserved or committed at once
        self._changes = 0

    # -- the rollout side ------------------------------------------------------------------------
    def reserve(self, weight_version: int, *, uid: str | None = None, timeout_s: float = 0.0) -> Slot | None:
        """A slot for one group's rollout, or None when the buffer stayed full for ``timeout_s``
        seconds (0: refuse at once). Every wait is bounded: call again to keep waiting."""
        check_number("timeout_s", timeout_s, low=0, high=math.inf, high_open=True)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._slots) >= self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            slot_id = self._next
            self._next += 1
            name = uid if uid is not None else f"{self.uid_prefix}{slot_id}"
            if any(s.uid == name for s in self._slots.values()):
                raise InvalidArgument(f"uid {name!r} is already in the buffer; give each group its own")
            slot = Slot(slot_id, name, int(weight_version), [f"{name}_g{i}" for i in range(self.group_size)])
            self._slots[slot_id] = slot
            self.stats["reserved"] += 1
            self.peak_occupancy = max(self.peak_occupancy, len(self._slots))
            self._changed()
            return slot

    def commit(self, slot: Slot, meta: KVBatchMeta, info: dict[str, Any] | None = None) -> None:
        """The slot's rows are in the store: ``meta`` must hold exactly its keys; ``info`` is kept in
        ``slot.info``."""
        with self._cond:
            self._require(slot, "reserved", "commit")
            if sorted(meta.keys) != sorted(slot.keys) or meta.partition_id != self.partition_id:
                raise InvalidArgument(
                    f"commit of slot {slot.uid!r}: the meta holds keys {list(meta.keys)[:4]} in {meta.partition_id!r}, "
                    f"the slot {slot.keys[:4]} in {self.partition_id!r}"
                )
            slot.meta, slot.state = meta, "committed"
            slot.info.update(info or {})
            self.stats["committed"] += 1
            self._changed()

    def commit_put(self, slot: Slot, put: Callable[[Slot], KVBatchMeta]) -> KVBatchMeta:
        """Run ``put(slot)`` (it writes the slot's rows and returns their meta), then commit. If the put
        raises, the slot's keys are cleared (a put may have written rows before it raised), the slot
        is released and the error re-raised."""
        try:
            meta = put(slot)
        except BaseException:
            self.release(slot)
            raise
        self.commit(slot, meta)
        return meta

    def release(self, slot: Slot) -> None:
        """End a reservation without a commit (the rollout failed or was aborted): its rows, if any
        were written, are cleared and the slot frees its place. Idempotent for a released slot."""
        with self._cond:
            if slot.state == "released":
                return
            self._require(slot, "reserved", "release")
            self._forget(slot, "released")
        self.client.kv_clear(slot.keys, partition_id=self.partition_id)

    # -- the train side --------------------------------------------------------------------------
    def ready(self) -> list[Slot]:
        """Committed slots, in issue order."""
        with self._cond:
            return sorted((s for s in self._slots.values() if s.state == "committed"), key=lambda s: s.id)

    def reserved(self) -> list[Slot]:
        """Slots whose rollouts are in flight, in issue order."""
        with self._cond:
            return sorted((s for s in self._slots.values() if s.state == "reserved"), key=lambda s: s.id)

    def remove(self, slots: Iterable[Slot]) -> None:
        """Drop committed slots (trained or evicted) and clear their rows."""
        slots = list(slots)
        with self._cond:
            for slot in slots:
                self._require(slot, "committed", "remove")
            for slot in slots:
                self._forget(slot, "removed")
        keys = [k for s in slots for k in s.keys]
        if keys:
            self.client.kv_clear(keys, partition_id=self.partition_id)

    def wait_ready(self, n: int, timeout_s: float) -> list[Slot]:
        """Wait until at least ``n`` slots are committed (or raise ``DataPlaneTimeout``); the ready slots."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while sum(s.state == "committed" for s in self._slots.values()) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataPlaneTimeout(f"{n} committed groups did not arrive within {timeout_s:g} s")
                self._cond.wait(left)
        return self.ready()

    @property
    def changes(self) -> int:
        """How many times a slot was reserved, committed, released or removed (for :meth:`wait_change`)."""
        with self._cond:
            return self._changes

    def wait_change(self, since: int, timeout_s: float) -> int:
        """Block until :attr:`changes` moves past ``since`` or ``timeout_s`` passes; the count now."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._changes == since:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._changes

    @property
    def occupancy(self) -> int:
        """Slots reserved or committed."""
        with self._cond:
            return len(self._slots)

    # -- checkpoints -----------------------------------------------------------------------------
    def restore(self, slots: Iterable[Slot], *, next_id: int) -> None:
        """Put committed slots back (a resumed run: their rows were loaded into the store) into an
        empty buffer; the next reservation gets id ``next_id``."""
        slots = list(slots)
        with self._cond:
            if self._slots:
                raise InvalidArgument(f"restore needs an empty buffer; it holds {len(self._slots)} slots")
            if len(slots) > self.capacity:
                raise InvalidArgument(f"{len(slots)} slots to restore exceed the capacity {self.capacity}")
            for slot in slots:
                if slot.state != "committed" or slot.meta is None or slot.id >= next_id:
                    raise InvalidArgument(f"slot {slot.uid!r} is not a committed slot below id {next_id}")
                self._slots[slot.id] = slot
            self._next = check_int("next_id", next_id, low=0)
            self.peak_occupancy = max(self.peak_occupancy, len(self._slots))
            self._changed()

    # -- internals -------------------------------------------------------------------------------
    def _require(self, slot: Slot, state: str, what: str) -> None:
        if self._slots.get(slot.id) is not slot or slot.state != state:
            raise InvalidArgument(f"{what}: slot {slot.uid!r} is {slot.state}, not {state}")

    def _forget(self, slot: Slot, state: Literal["released", "removed"]) -> None:
        del self._slots[slot.id]
        slot.state = state
        self.stats[state] += 1
        self._changed()

    def _changed(self) -> None:  # with the lock held
        self._changes += 1
        self._cond.notify_all()
