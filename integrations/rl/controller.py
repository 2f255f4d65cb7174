"""Asynchronous GRPO with a single controller: rollouts sample with older weights while the trainers
train, within a staleness bound, through a replay buffer of whole groups.

:class:`AsyncGRPO` is a plain class meant to run as one CPU-only Ray actor
(``ray.remote(AsyncGRPO).options(num_cpus=0)``); it holds the trainer group's handle
(:class:`~integrations.rl.policy.Policy`) and the rollout actors' handles, and never a bulk tensor.
Inside it:

* **a rollout pump per rollout actor** (a thread): reserve slots in the
  :class:`~integrations.rl.replay.ReplayBuffer` -> load the newest published weights into its actor
  if it has older ones -> ``rollout_groups`` (the actor writes the rows) -> commit each group, or
  release its slot (and the rows a failed write left) when the call failed. An actor that died or
  stopped answering is dropped; the others go on.
* **the train pump** (:meth:`AsyncGRPO.step`, one call per optimizer step): evict committed groups
  that can never be trained, wait until the staleness policy
  (:class:`~integrations.rl.staleness.StalenessPolicy`) selects ``groups_per_step`` whole groups,
  then train them exactly as synchronous GRPO trains a step's rollout
  (:meth:`integrations.rl.grpo.GRPO.learn`: group advantages, dynamic sampling, ``prev`` and ``ref``
  logprobs, the split train step) and remove them (their rows are cleared).
* **weight sync**, after a step that moved the version: close the rollout gate, mark the in-flight
  rollouts that would be too stale to train (their slots are released when they return), take a
  ref of the new weights, publish it with the new version, open the gate. Each pump loads the
  published weights into its actor before its next rollout, so no rollout starts with weights
  older than the newest published.

**How many groups may be issued.** Group ``n`` (in issue order) belongs to nominal step
``n // groups_per_step`` and is issued only once step ``n // groups_per_step - max_staleness`` has
begun (the rule AReaL calls bounded off-policyness): at most ``(steps + max_staleness + 1) *
groups_per_step`` groups are issued, trained or waiting, counting neither released nor evicted ones.
So rollouts run at most ``max_staleness`` steps ahead of the trainer and, with prompt-ordered
training, nothing issued is wasted. ``capacity`` bounds the slots reserved or committed at once
(default: ``(max_staleness + 1) * groups_per_step``, which the rule never exceeds).

With ``max_staleness=0`` and every group's rollout finished before the step that trains it, a step
trains the same groups, sampled with the same weights and generators, in the same order as
synchronous GRPO: the runs end with the same parameters (shown by the tests).

>>> cfg = AsyncConfig(groups_per_step=16, max_staleness=1)
>>> cfg.slots, cfg.staleness()
(32, StalenessPolicy(max_staleness=1, ordered=False))
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import dataplane
from dataplane import DataPlaneError, DataPlaneTimeout, InvalidArgument
from dataplane.checks import check_int
from integrations.rl.async_state import load_buffer_rows, save_buffer_rows, slot_from_json, slot_to_json
from integrations.rl.checkpoint import RunCheckpoints
from integrations.rl.grpo import GRPO, GRPOConfig
from integrations.rl.metering import TrafficMeter, add_totals
from integrations.rl.policy import ActorFailure, Policy, gather
from integrations.rl.replay import ReplayBuffer, Slot
from integrations.rl.staleness import StalenessPolicy
from integrations.rl.sync_loop import StepRecord

__all__ = ["AsyncConfig", "AsyncGRPO", "AsyncStepRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncConfig:
    """Settings of an asynchronous GRPO run.

    Attributes:
        grpo: the algorithm (the same settings as synchronous GRPO; its ``timeout_s`` bounds every
            call to a rollout actor and every wait of a step for its groups).
        groups_per_step: groups (prompts) each optimizer step consumes, trained or dropped by dynamic
            sampling (the synchronous run's ``prompts_per_step``).
        group_size: samples per prompt (the rollout actors').
        max_staleness: the most steps a trained group's weights may lag the trainer's (``K``).
        ordered: train groups in the order their prompts were issued (``in_order``); else any
            trainable group, oldest first (``window``).
        capacity: most slots reserved or committed at once (None: ``(K + 1) * groups_per_step``).
        groups_per_rollout: groups per rollout call (None: ``groups_per_step`` split over the actors).
        partition_id: the partition the rollouts write into.
    """

    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    groups_per_step: int = 16
    group_size: int = 8
    max_staleness: int = 1
    ordered: bool = False
    capacity: int | None = None
    groups_per_rollout: int | None = None
    partition_id: str = "grpo-async"

    def __post_init__(self) -> None:
        for name in ("groups_per_step", "group_size"):
            check_int(name, getattr(self, name), low=1)
        for name in ("capacity", "groups_per_rollout"):
            check_int(name, getattr(self, name), low=1, allow_none=True)
        self.staleness()  # validates max_staleness
        if self.capacity is not None and self.capacity < self.groups_per_step:
            raise InvalidArgument(
                f"capacity {self.capacity} is below groups_per_step {self.groups_per_step}: a step could never "
                "gather its groups; give capacity >= groups_per_step"
            )

    def staleness(self) -> StalenessPolicy:
        k = self.max_staleness
        return StalenessPolicy.in_order(k) if self.ordered else StalenessPolicy.window(k)

    @property
    def slots(self) -> int:
        """The buffer's capacity."""
        return self.capacity or (self.max_staleness + 1) * self.groups_per_step


@dataclass(slots=True, kw_only=True)
class AsyncStepRecord(StepRecord):
    """One asynchronous step: a :class:`~integrations.rl.sync_loop.StepRecord` plus

    ``rollout_seconds`` is the time the rollout actors spent sampling and scoring in the calls that
    landed since the last step (summed over actors; it overlaps training).

    Attributes:
        trained_uids: the trained groups (dynamic sampling's drops excluded), in training order.
        group_ids: issue order of every group the step consumed.
        staleness: per trained row, ``version - weight_version`` at the step.
        buffer_occupancy: slots reserved or committed when the step's groups were selected.
        rollout_wait_seconds: how long the trainer waited for rollouts (for trainable groups).
        train_wait_seconds: how long rollout actors sat idle waiting for the trainer since the last
            step (the staleness bound, a full buffer, the closed gate), summed over actors.
        weight_sync_seconds: (here) the gate closed: taking the new weights' ref and publishing it.
        evicted_groups, aborted_groups, failed_rollouts: since the last step.
    """

    trained_uids: list[str] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    buffer_occupancy: int = 0
    rollout_wait_seconds: float = 0.0
    train_wait_seconds: float = 0.0
    evicted_groups: int = 0
    aborted_groups: int = 0
    failed_rollouts: int = 0

    def summary(self) -> dict[str, Any]:
        out = StepRecord.summary(self)
        out.update(
            staleness_max=max(self.staleness, default=0),
            staleness_mean=sum(self.staleness) / len(self.staleness) if self.staleness else 0.0,
            buffer_occupancy=self.buffer_occupancy,
            rollout_wait_seconds=self.rollout_wait_seconds,
            train_wait_seconds=self.train_wait_seconds,
            evicted_groups=self.evicted_groups,
            aborted_groups=self.aborted_groups,
            failed_rollouts=self.failed_rollouts,
        )
        return out


class AsyncGRPO:
    """The single controller; see the module docstring.

    Args:
        policy: the trainer group (its ``"reference"`` model is used when ``config.grpo.kl_coef > 0``).
        rollouts: :class:`~integrations.rl.rollout_actor.RolloutActor` Ray actors, connected to ``url``.
        config: :class:`AsyncConfig`.
        url: the data plane the actors joined (a ``client.url``; it must reach across processes).

    Call :meth:`start` once (after :meth:`resume` to go on from a checkpoint), :meth:`step` per
    optimizer step (:meth:`checkpoint` between steps), :meth:`stop` at the end (also after an
    error: it stops the pumps and clears every row the run still holds).
    """

    MAX_FAILURES = 3  # a rollout actor whose calls fail this many times in a row is dropped

    def __init__(self, policy: Policy, rollouts: Sequence[Any], config: AsyncConfig, *, url: str) -> None:
        if not rollouts:
            raise InvalidArgument("AsyncGRPO needs at least one rollout actor")
        self.config = config
        self.policy = policy
        self.meter = TrafficMeter()
        self._raw = dataplane.connect(url)
        self.client = self.meter.wrap(self._raw)  # the train pump's (closing it closes _raw)
        if not self.client.capabilities.cross_process:
            self.client.close()
            raise InvalidArgument(
                f"{url} keeps rows inside one process, but the rollout and trainer actors are processes of their "
                "own: use mooncake://local, tq://?backend=simple or tq://?backend=mooncake"
            )
        self._pump_client = self.meter.wrap(dataplane.connect(url))  # the rollout pumps' (releases)
        self.grpo = GRPO(policy, None, config.grpo, client=self.client)  # its learn() only: no rollout of its own
        self.buffer = ReplayBuffer(
            self._pump_client, capacity=config.slots, partition_id=config.partition_id, group_size=config.group_size
        )
        self.staleness = config.staleness()
        self.timeout_s = float(config.grpo.timeout_s)
        self.per_call = config.groups_per_rollout or math.ceil(config.groups_per_step / len(rollouts))
        self._actors = {f"rollout {i}": a for i, a in enumerate(rollouts)}
        self._alive = set(self._actors)
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._gate_open = False  # opened by the first publish
        self._paused = False  # no new reservations while a checkpoint drains the rollouts in flight
        self._published: tuple[int, Any] = (-1, None)  # (weight version, ref of the weights)
        self._steps = 0  # steps finished (trained or not): the issue bound moves with it
        self._live = 0  # groups issued and neither released nor evicted
        self._next = 0  # issue index of the next group
        self._aborted: set[int] = set()  # in-flight slot ids to release when their rollout returns
        self._ends: dict[int, str] = {}  # slot id -> "committed" / "released": every reservation ends once
        self._double_ends: list[str] = []  # (never, unless a bug) reservations that ended twice
        self._counts = {"idle": 0.0, "sampling": 0.0, "evicted": 0, "aborted": 0, "failed": 0}
        self._last_counts = dict(self._counts)
        self.lost_actors: list[str] = []
        self.trained_staleness: list[int] = []

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish the current weights and start a rollout pump per actor."""
        if self._threads:
            raise InvalidArgument("start() was called already")
        self._publish(self.policy.version, first=True)
        for name in self._actors:
            t = threading.Thread(target=self._pump, args=(name,), name=f"pump-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> dict[str, Any]:
        """Stop the pumps (each finishes its call in flight, bounded by the timeout), abort an open
        train step, clear every row still held; the run's counts."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        try:
            if self.policy.broken is None:
                self.policy.abort()
        except Exception:
            log.exception("rl: aborting the open train step at stop failed")
        for slot in self.buffer.reserved():  # a pump that did not come back in time
            self._end(slot, "released")
        self.buffer.remove(self.buffer.ready())
        closers = [threading.Thread(target=c.close) for c in (self.client, self._pump_client)]  # ~1 s each
        for t in closers:
            t.start()
        for t in closers:
            t.join(60)
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Counts over the run: the buffer's events, every reservation's end, losses."""
        with self._cond:
            ends = list(self._ends.values())
            return {
                "buffer": dict(self.buffer.stats),
                "peak_occupancy": self.buffer.peak_occupancy,
                "capacity": self.buffer.capacity,
                "reservations_ended": {"committed": ends.count("committed"), "released": ends.count("released")},
                "reservations_ended_twice": list(self._double_ends),
                "evicted_groups": self._counts["evicted"],
                "aborted_groups": self._counts["aborted"],
                "failed_rollouts": self._counts["failed"],
                "lost_actors": list(self.lost_actors),
                "max_trained_staleness": max(self.trained_staleness, default=0),
                "steps": self._steps,
                "version": self.policy.version,
                "traffic": self.meter.totals(),  # this process's own (the trainers and rollouts count theirs)
            }

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, root: str, *, keep: int = 2, driver: dict[str, Any] | None = None) -> dict[str, Any]:
        """Save the run after its last finished step into ``root`` (a
        :class:`~integrations.rl.checkpoint.RunCheckpoints` directory): no new rollout starts, the ones
        in flight finish and commit (bounded by ``timeout_s``), then the trainers' state, a snapshot of
        the buffer's rows, its slots and the controller's counters (with ``driver``'s JSON) are saved
        and the rollouts go on. Returns the step, the directory, seconds, bytes and the groups kept."""
        if self._steps < 1:
            raise InvalidArgument("checkpoint() saves after a step; call step() first")
        t0 = time.perf_counter()
        with self._cond:
            self._paused = True
        try:
            deadline, seen = time.monotonic() + self.timeout_s, self.buffer.changes
            while self.buffer.reserved():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataPlaneTimeout(f"checkpoint: rollouts still in flight after {self.timeout_s:g} s")
                seen = self.buffer.wait_change(seen, min(left, 1.0))
            with self._cond:
                state: dict[str, Any] = {
                    "next": self._next,
                    "steps": self._steps,
                    "live": self._live,
                    "counts": dict(self._counts),
                    "trained_staleness": list(self.trained_staleness),
                    "slots": [slot_to_json(slot) for slot in self.buffer.ready()],
                }
            rows: dict[str, Any] = {}
            path = RunCheckpoints(root, keep=keep).save(
                self._steps - 1,
                self.policy,
                {**(driver or {}), "controller": state},
                # unmetered: a checkpoint's reads are not the steps' traffic (its bytes are reported)
                extra=lambda d: rows.update(save_buffer_rows(self._raw, d, self.config.partition_id)),
            )
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()
        return {
            "step": self._steps - 1,
            "path": str(path),
            "seconds": time.perf_counter() - t0,
            "bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
            "buffer_groups": len(state["slots"]),
            "buffer_rows": int(rows.get("rows", 0)),
        }

    def resume(self, root: str) -> dict[str, Any]:
        """Before :meth:`start`: load the latest checkpoint in ``root`` (the trainers' state, the
        buffer's rows into the emptied partition, its slots and the counters); returns the driver's
        document (``step``, and what the driver saved with :meth:`checkpoint`)."""
        if self._threads:
            raise InvalidArgument("resume() goes before start()")
        ckpt = RunCheckpoints(root)
        doc = ckpt.load(self.policy)
        path = ckpt.latest()
        state = doc.get("controller")
        if path is None or not isinstance(state, dict):
            raise DataPlaneError(
                f"{path} was not saved by an asynchronous run (no controller state); resume it with its own example"
            )
        slots = [slot_from_json(s) for s in state["slots"]]
        loaded = load_buffer_rows(self._raw, path, self.config.partition_id)
        if loaded != sum(len(s.keys) for s in slots):
            raise DataPlaneError(
                f"{path}: the buffer's snapshot holds {loaded} rows, its slots name {sum(len(s.keys) for s in slots)}"
            )
        self.buffer.restore(slots, next_id=int(state["next"]))
        with self._cond:
            self._next, self._steps, self._live = int(state["next"]), int(state["steps"]), int(state["live"])
            self._counts.update(state["counts"])
            self._last_counts = dict(self._counts)
            self.trained_staleness = [int(x) for x in state["trained_staleness"]]
        return doc  # type: ignore[no-any-return]

    # -- the train pump --------------------------------------------------------------------------
    def step(self) -> AsyncStepRecord:
        """One optimizer step over ``groups_per_step`` groups the staleness policy allows; see the module docstring."""
        cfg = self.config
        t0 = time.perf_counter()
        version = self.policy.version
        deadline = time.monotonic() + self.timeout_s
        seen = self.buffer.changes
        while True:
            with self._cond:
                evict = self.staleness.evict(self.buffer.ready(), version)
                if evict:
                    self.buffer.remove(evict)
                    self._live -= len(evict)
                    self._counts["evicted"] += len(evict)
                    self._cond.notify_all()
                alive = bool(self._alive)
            chosen = self.staleness.select(
                self.buffer.ready(), version, cfg.groups_per_step, in_flight=self.buffer.reserved()
            )
            if len(chosen) == cfg.groups_per_step:
                break
            if not alive:
                raise ActorFailure(f"step {self._steps}: every rollout actor is gone ({self.lost_actors})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataPlaneTimeout(
                    f"step {self._steps}: {len(chosen)} of {cfg.groups_per_step} trainable groups after "
                    f"{self.timeout_s:g} s; raise GRPOConfig.timeout_s if the rollouts are just slow"
                )
            seen = self.buffer.wait_change(seen, min(left, 1.0))
        waited = time.perf_counter() - t0
        occupancy = self.buffer.occupancy
        record = self._train(chosen, version)
        record.rollout_wait_seconds, record.buffer_occupancy = waited, occupancy
        t_sync = time.perf_counter()
        self._publish(record.version, moved=record.version != version)
        record.weight_sync_seconds = time.perf_counter() - t_sync
        with self._cond:
            delta = {k: self._counts[k] - self._last_counts[k] for k in self._counts}
            self._last_counts = dict(self._counts)
        record.train_wait_seconds, record.rollout_seconds = float(delta["idle"]), float(delta["sampling"])
        record.evicted_groups, record.aborted_groups = int(delta["evicted"]), int(delta["aborted"])
        record.failed_rollouts = int(delta["failed"])
        record.seconds = time.perf_counter() - t0
        return record

    def _train(self, chosen: list[Slot], version: int) -> AsyncStepRecord:
        cfg = self.config
        meta = chosen[0].meta
        assert meta is not None
        meta = meta.concat(*(s.meta for s in chosen[1:] if s.meta is not None))
        rewards = torch.cat([s.info["rewards"] for s in chosen])
        before = add_totals(self.meter.totals(), *self.policy.traffic())
        t_learn = time.perf_counter()
        try:
            base = self.grpo.learn(self._steps, cfg.partition_id, meta, rewards, None)
        except BaseException:
            if self.policy.broken is None:
                try:
                    self.policy.abort()
                except Exception:
                    log.exception("rl: aborting the train step after a failure failed too")
            raise
        finally:
            self.buffer.remove(chosen)  # trained, dropped or failed: their rows go
        record = AsyncStepRecord(**{f: getattr(base, f) for f in StepRecord.__dataclass_fields__})
        record.train_seconds = time.perf_counter() - t_learn
        record.set_traffic(
            add_totals(add_totals(self.meter.totals(), *self.policy.traffic()), before, sign=-1),
            len(self.policy.actors),
        )
        dropped = set(record.dropped_groups)
        record.group_ids = [s.id for s in chosen]
        record.trained_uids = [s.uid for s in chosen if s.uid not in dropped]
        record.staleness = [version - int(t["weight_version"]) for t in meta.tags or () if str(t["uid"]) not in dropped]
        self.trained_staleness += record.staleness
        return record

    def _publish(self, version: int, *, moved: bool = True, first: bool = False) -> None:
        """After a step (or at the start): weight sync when the version moved (close the gate, mark
        too-stale in-flight rollouts, publish the new weights), then let the issue bound move on."""
        ref = None
        if moved:
            with self._cond:
                self._gate_open = False
                abort = self.staleness.should_abort_inflight(self.buffer.reserved(), version)
                self._aborted.update(s.id for s in abort)
            ref = self.policy.state_dict_ref()
        with self._cond:
            if moved:
                self._published = (version, ref)
            self._steps += 0 if first else 1
            self._gate_open = True
            self._cond.notify_all()

    # -- the rollout pumps -----------------------------------------------------------------------
    def _allowed(self) -> int:  # with the lock held
        return (self._steps + self.config.max_staleness + 1) * self.config.groups_per_step - self._live

    def _pump(self, name: str) -> None:
        """One actor's pump; if it fails outside a rollout call (a clear of the store, say), the
        actor counts as lost, so a step waiting for its groups fails or goes on with the others."""
        try:
            self._pump_loop(name)
        except Exception:
            log.exception("rl: the rollout pump of %s failed; the actor is dropped", name)
            with self._cond:
                if name in self._alive:
                    self._alive.discard(name)
                    self.lost_actors.append(name)
                self._cond.notify_all()

    def _pump_loop(self, name: str) -> None:
        actor = self._actors[name]
        loaded, failures = -1, 0
        while True:
            slots, version, ref = self._reserve()
            if slots is None:
                return
            try:
                if loaded != version:
                    gather(
                        [actor.load_weights.remote(ref, version)],
                        timeout_s=self.timeout_s,
                        what="weight sync",
                        names=[name],
                        on_broken=lambda: self._kill(actor),
                    )
                    loaded = version
                groups = [(s.id // self.config.groups_per_step, s.id % self.config.groups_per_step) for s in slots]
                ro = gather(
                    [actor.rollout_groups.remote(groups, self.config.partition_id)],
                    timeout_s=self.timeout_s,
                    what="rollout",
                    names=[name],
                    on_broken=lambda: self._kill(actor),
                )[0]
            except Exception as e:  # dead or stuck (ActorFailure), or the rollout raised
                log.warning(
                    "rl: a rollout of %s failed (%s: %s); its %d groups are released",
                    name,
                    type(e).__name__,
                    e,
                    len(slots),
                )
                self._release(slots, failed=True)
                failures = failures + 1 if not isinstance(e, ActorFailure) else self.MAX_FAILURES
                if failures < self.MAX_FAILURES:
                    continue
                with self._cond:  # dropped: the other actors go on
                    self._alive.discard(name)
                    self.lost_actors.append(name)
                    self._cond.notify_all()
                self._kill(actor)
                return
            failures = 0
            self._commit(slots, ro)

    def _reserve(self) -> tuple[list[Slot] | None, int, Any]:
        """Wait until the gate is open and the issue bound and the buffer leave room; reserve up to a
        call's worth of slots. ``(None, ...)`` once stopping."""
        t0 = time.perf_counter()
        cfg = self.config
        with self._cond:
            while True:
                if self._stop:
                    self._counts["idle"] += time.perf_counter() - t0
                    return None, -1, None
                room = min(self._allowed(), self.per_call, self.buffer.capacity - self.buffer.occupancy)
                if self._gate_open and not self._paused and room > 0:
                    break
                self._cond.wait(0.5)
            version, ref = self._published
            slots = []
            for _ in range(room):
                n = self._next
                slot = self.buffer.reserve(version, uid=f"s{n // cfg.groups_per_step}p{n % cfg.groups_per_step}")
                assert slot is not None and slot.id == n  # the room was counted under this lock
                self._next += 1
                slots.append(slot)
            self._live += len(slots)
            self._counts["idle"] += time.perf_counter() - t0
        return slots, version, ref

    def _commit(self, slots: list[Slot], ro: Any) -> None:
        size = self.config.group_size
        with self._cond:
            self._counts["sampling"] += float(ro.seconds)
        for k, slot in enumerate(slots):
            rows = list(range(k * size, (k + 1) * size))
            with self._cond:
                aborted = slot.id in self._aborted
            tags = ro.meta.tags[rows[0]] if ro.meta.tags else {}
            if aborted or int(tags.get("weight_version", -1)) != slot.weight_version:
                if not aborted:
                    log.warning("rl: group %s came back sampled with other weights than issued; released", slot.uid)
                self._release([slot], failed=not aborted, aborted=aborted)
                continue
            self._mark(slot, "committed")
            self.buffer.commit(slot, ro.meta.subset(rows), {"rewards": ro.rewards[rows[0] : rows[-1] + 1]})
            with self._cond:
                self._cond.notify_all()

    def _release(self, slots: list[Slot], *, failed: bool = False, aborted: bool = False) -> None:
        for slot in slots:
            self._end(slot, "released")
        with self._cond:
            self._live -= len(slots)
            self._counts["failed"] += int(failed)
            self._counts["aborted"] += len(slots) if aborted else 0
            self._aborted.difference_update(s.id for s in slots)
            self._cond.notify_all()

    def _end(self, slot: Slot, how: str) -> None:
        self._mark(slot, how)
        self.buffer.release(slot)

    def _mark(self, slot: Slot, how: str) -> None:
        with self._cond:
            if slot.id in self._ends:
                self._double_ends.append(f"{slot.uid}: {self._ends[slot.id]}, then {how}")
            self._ends[slot.id] = how

    @staticmethod
    def _kill(actor: Any) -> None:
        import ray

        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
