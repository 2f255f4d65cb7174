"""The replay buffer's slot accounting and the staleness policies, on a real (in-process) store."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import dataplane
from dataplane import InvalidArgument
from integrations.rl.replay import ReplayBuffer, Slot
from integrations.rl.staleness import StalenessPolicy

PID = "rl"


def put_rows(client: dataplane.DataPlaneClient):  # type: ignore[no-untyped-def]
    def put(slot: Slot) -> dataplane.KVBatchMeta:
        return client.kv_batch_put(slot.keys, {"x": torch.full((len(slot.keys), 3), float(slot.id))}, partition_id=PID)

    return put


def test_a_failed_put_clears_what_it_wrote_and_frees_the_slot() -> None:
    with dataplane.connect() as client:
        buf = ReplayBuffer(client, capacity=1, partition_id=PID, group_size=3)
        slot = buf.reserve(0)
        assert slot is not None and buf.reserve(0) is None  # full: refused at once

        def half_then_fail(s: Slot) -> dataplane.KVBatchMeta:
            client.kv_batch_put(s.keys[:2], {"x": torch.zeros(2, 3)}, partition_id=PID)
            raise RuntimeError("the rollout died mid-write")

        with pytest.raises(RuntimeError, match="mid-write"):
            buf.commit_put(slot, half_then_fail)
        assert slot.state == "released" and not client.kv_list(PID).get(PID)  # nothing left behind
        again = buf.reserve(0)
        assert again is not None and again.id == 1
        with pytest.raises(InvalidArgument, match="keys"):  # a meta of other rows is refused, nothing changes
            buf.commit(again, client.kv_batch_put(["other_g0"], {"x": torch.zeros(1, 3)}, partition_id=PID))
        assert again.state == "reserved"
        buf.commit_put(again, put_rows(client))
        assert [s.uid for s in buf.ready()] == [again.uid]
        buf.remove(buf.ready())
        client.kv_clear(["other_g0"], partition_id=PID)
        assert not client.kv_list(PID).get(PID) and buf.occupancy == 0
        assert buf.stats == {"reserved": 2, "committed": 1, "released": 1, "removed": 1}


def test_reserve_waits_for_room_and_times_out() -> None:
    with dataplane.connect() as client:
        buf = ReplayBuffer(client, capacity=1, partition_id=PID, group_size=1)
        first = buf.reserve(0)
        assert first is not None
        t0 = time.monotonic()
        assert buf.reserve(0, timeout_s=0.2) is None and time.monotonic() - t0 >= 0.2
        threading.Timer(0.2, buf.release, [first]).start()
        second = buf.reserve(0, timeout_s=10)  # woken by the release
        assert second is not None and second.id == 1
        with pytest.raises(InvalidArgument, match="timeout_s"):  # no unbounded wait
            buf.reserve(0, timeout_s=None)  # type: ignore[arg-type]


def test_concurrent_pumps_never_exceed_capacity_and_every_reservation_ends_once() -> None:
    """Four rollout threads (some puts fail) and a trainer thread that removes what is ready."""
    capacity, groups = 3, 60
    with dataplane.connect() as client:
        buf = ReplayBuffer(client, capacity=capacity, partition_id=PID, group_size=2)
        peak, lock, issued = [0], threading.Lock(), [0]
        stop = threading.Event()
        errors: list[BaseException] = []  # a thread's failed assertion must fail the test

        def guarded(fn):  # type: ignore[no-untyped-def]
            def run(*args: object) -> None:
                try:
                    fn(*args)
                except BaseException as e:
                    errors.append(e)

            return run

        @guarded
        def rollout(seed: int) -> None:
            rng = random.Random(seed)
            while True:
                with lock:
                    if issued[0] >= groups:
                        return
                    issued[0] += 1
                slot = buf.reserve(0, timeout_s=30)
                assert slot is not None
                with lock:
                    peak[0] = max(peak[0], buf.occupancy)
                time.sleep(rng.random() * 0.003)
                if rng.random() < 0.2:
                    with pytest.raises(RuntimeError):
                        buf.commit_put(slot, lambda s: (_ for _ in ()).throw(RuntimeError("failed rollout")))
                else:
                    buf.commit_put(slot, put_rows(client))

        @guarded
        def trainer() -> None:
            while not stop.is_set() or buf.ready():
                ready = buf.ready()
                if ready:
                    buf.remove(ready[:2])
                else:
                    time.sleep(0.001)

        threads = [threading.Thread(target=rollout, args=(i,)) for i in range(4)]
        t = threading.Thread(target=trainer)
        for th in [*threads, t]:
            th.start()
        for th in threads:
            th.join(timeout=30)
        stop.set()
        t.join(timeout=30)
        s = buf.stats
        assert not errors, errors
        assert peak[0] <= capacity and buf.occupancy == 0
        assert s["reserved"] == groups == s["committed"] + s["released"]  # one end per reservation
        assert s["removed"] == s["committed"] and s["released"] > 0
        assert not client.kv_list(PID).get(PID)  # trained, evicted and failed rows all cleared


@pytest.mark.parametrize("k", [0, 1, 3])
def test_window_trains_only_fresh_enough_groups_and_evicts_the_rest(k: int) -> None:
    policy = StalenessPolicy.on_policy() if k == 0 else StalenessPolicy.window(k)
    slots = [Slot(i, f"u{i}", wv, [f"u{i}_g0"], "committed") for i, wv in enumerate([0, 1, 2, 3, 4, 5])]
    for version in range(8):
        chosen = policy.select(slots, version, limit=10)
        assert all(0 <= version - s.weight_version <= k for s in chosen)
        assert [s.id for s in chosen] == sorted(s.id for s in chosen)
        evicted = policy.evict(slots, version)
        assert {s.id for s in evicted} == {s.id for s in slots if version - s.weight_version > k}
        assert not {s.id for s in chosen} & {s.id for s in evicted}
    inflight = [Slot(9, "f", 2, ["f_g0"])]
    assert policy.evict(inflight, 99) == []  # a reserved slot is never evicted ...
    assert policy.should_abort_inflight(inflight, 3 + k) == inflight  # ... its rollout is aborted instead
    assert policy.should_abort_inflight(inflight, 2 + k) == []


def test_in_order_holds_later_groups_behind_an_earlier_one() -> None:
    policy = StalenessPolicy.in_order(1)
    ready = [Slot(i, f"u{i}", 1, [f"u{i}_g0"], "committed") for i in (0, 1, 3, 4)]
    pending = [Slot(2, "u2", 1, ["u2_g0"])]
    assert [s.id for s in policy.select(ready, 1, limit=10, in_flight=pending)] == [0, 1]
    assert [s.id for s in policy.select(ready, 1, limit=10)] == [0, 1, 3, 4]
    stale_first = [Slot(0, "a", 0, ["a_g0"], "committed"), Slot(1, "b", 5, ["b_g0"], "committed")]
    assert policy.select(stale_first, 5, limit=10) == []  # the earliest is not trainable: nothing after it
    with pytest.raises(InvalidArgument, match="max_staleness"):
        StalenessPolicy.window(-1)


def test_committed_slots_round_trip_through_a_snapshot_into_another_deployment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What an asynchronous checkpoint keeps: the committed slots as JSON and their rows as a core
    snapshot; restored into a fresh buffer of another deployment, they train as before (reads work,
    issue ids go on), and a restore into a buffer that holds slots is refused."""
    from integrations.rl.async_state import load_buffer_rows, save_buffer_rows, slot_from_json, slot_to_json

    with dataplane.connect() as old:
        buf = ReplayBuffer(old, capacity=3, partition_id=PID, group_size=2)
        for _ in range(3):
            slot = buf.reserve(4)
            assert slot is not None
            meta = buf.commit_put(slot, put_rows(old))
            slot.info["rewards"] = torch.tensor([0.25, 1.0])
        buf.remove(buf.ready()[:1])  # one trained: two committed slots remain
        saved = [slot_to_json(s) for s in buf.ready()]
        rows = save_buffer_rows(old, tmp_path, PID)
        assert rows["rows"] == 4 and meta.deployment
    with dataplane.connect() as new:
        fresh = ReplayBuffer(new, capacity=3, partition_id=PID, group_size=2)
        assert load_buffer_rows(new, tmp_path, PID) == 4
        fresh.restore([slot_from_json(d) for d in saved], next_id=3)
        ready = fresh.ready()
        assert [(s.id, s.uid, s.weight_version) for s in ready] == [(1, "g1", 4), (2, "g2", 4)]
        assert ready[0].info["rewards"].tolist() == [0.25, 1.0]
        got = new.kv_batch_get(ready[0].meta.concat(ready[1].meta), select_fields=["x"])
        assert got["x"][:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
        nxt = fresh.reserve(4)
        assert nxt is not None and nxt.id == 3  # issue ids go on from the checkpoint
        with pytest.raises(InvalidArgument, match="empty buffer"):
            fresh.restore([], next_id=9)
        with pytest.raises(dataplane.DataPlaneError, match="committed"):
            slot_to_json(nxt)  # a reservation in flight is never saved
