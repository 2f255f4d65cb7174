"""Which committed groups an asynchronous trainer may train now, which it never can, and which
in-flight rollouts a weight sync should abort.

A group sampled with weights ``weight_version`` is ``version - weight_version`` steps stale when the
trainer is at ``version``. Policies:

* ``on_policy``: staleness 0 only (what a synchronous trainer does);
* ``window(k)``: staleness at most ``k``;
* ``in_order``: like ``window(k)``, but groups are trained in the order their prompts were issued:
  a group whose rollout is still in flight holds back every later one.

>>> from integrations.rl.replay import Slot
>>> slots = [Slot(0, "a", 0, ["a_g0"], "committed"), Slot(1, "b", 1, ["b_g0"], "committed")]
>>> [s.uid for s in StalenessPolicy.window(1).select(slots, version=2, limit=4)]
['b']
>>> [s.uid for s in StalenessPolicy.window(1).evict(slots, version=2)]
['a']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dataplane.checks import check_int
from integrations.rl.replay import Slot

__all__ = ["StalenessPolicy"]


@dataclass(frozen=True, slots=True)
class StalenessPolicy:
    """How stale a trained group may be; see the module docstring. Build with :meth:`on_policy`,
    :meth:`window` or :meth:`in_order`."""

    max_staleness: int
    ordered: bool = False

    def __post_init__(self) -> None:
        check_int("max_staleness", self.max_staleness, low=0)

    @classmethod
    def on_policy(cls) -> StalenessPolicy:
        return cls(0)

    @classmethod
    def window(cls, k: int) -> StalenessPolicy:
        return cls(k)

    @classmethod
    def in_order(cls, k: int = 0) -> StalenessPolicy:
        return cls(k, ordered=True)

    def trainable(self, slot: Slot, version: int) -> bool:
        """Whether the group may be trained at ``version``."""
        return 0 <= version - slot.weight_version <= self.max_staleness

    def select(self, ready: Sequence[Slot], version: int, limit: int, *, in_flight: Sequence[Slot] = ()) -> list[Slot]:
        """Up to ``limit`` committed groups to train at ``version``, in issue order. With ``ordered``,
        nothing issued after the earliest group still in flight (``in_flight``) or not yet trainable."""
        chosen: list[Slot] = []
        first_pending = min((s.id for s in in_flight), default=None)
        for slot in sorted(ready, key=lambda s: s.id):
            if len(chosen) >= limit:
                break
            if self.ordered and first_pending is not None and slot.id > first_pending:
                break
            if self.trainable(slot, version):
                chosen.append(slot)
            elif self.ordered:
                break
        return chosen

    def evict(self, ready: Sequence[Slot], version: int) -> list[Slot]:
        """Committed groups that can never be trained (too stale at ``version``; versions only grow).
        Reserved slots are never evicted: their rollouts still run (see :meth:`should_abort_inflight`)."""
        return [s for s in ready if s.state == "committed" and version - s.weight_version > self.max_staleness]

    def should_abort_inflight(self, in_flight: Sequence[Slot], new_version: int) -> list[Slot]:
        """In-flight rollouts whose groups would be too stale to train once the trainer is at
        ``new_version``: cancel them at the weight sync (and release their slots)."""
        return [s for s in in_flight if s.state == "reserved" and new_version - s.weight_version > self.max_staleness]
