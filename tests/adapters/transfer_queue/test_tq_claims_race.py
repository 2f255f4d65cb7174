"""``tq://`` claims when a row is cleared, and its index handed to a new key, between the claimant's
read of the indexes and its fetch (a hook runs the clear at that point, deterministically): the
fetch never marks the freed index for the task, so the new key is claimed once like any row, and the
task's status never counts a row it was not handed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dataplane
from dataplane.adapters.transfer_queue._layout import stored_keys

pytestmark = [pytest.mark.tq]


def test_the_claim_sampler_takes_only_live_ready_unconsumed_rows_in_the_claimants_order() -> None:
    """The controller-side check (no Ray): an index freed after the claimant read it, one now holding
    a key that lacks the field, one the task consumed, one whose tags fail the filter are all
    skipped; the rest come in the order given, at most n; other requests sample sequentially."""
    from types import SimpleNamespace

    from dataplane.adapters.transfer_queue._layout import MARKER, join_fields
    from dataplane.adapters.transfer_queue._sampler import CLAIM_KEY

    ready, lacking = join_fields({"x", "y"}), join_fields({"y"})
    meta = {
        1: {MARKER: ready, "split": "train"},
        2: {MARKER: lacking, "split": "train"},  # another key now: lacks x
        3: {MARKER: ready, "split": "train"},  # consumed by the task (not among ready_indexes)
        5: {MARKER: ready, "split": "eval"},  # fails the filter
        6: {MARKER: ready, "split": "train"},
        7: {MARKER: ready, "split": "train"},
    }
    part = SimpleNamespace(global_indexes={1, 2, 3, 5, 6, 7}, custom_meta=meta)  # 4 was freed
    spec = {"order": [7, 4, 2, 3, 5, 1, 6], "fields": ["x"], "tag_filter": {"split": "train"}, "n": 2}
    pytest.importorskip("transfer_queue", reason="needs TransferQueue: pip install 'dataplane[tq]'")
    from dataplane.adapters.transfer_queue._claim_sampler import ClaimSampler

    sampler = ClaimSampler()
    unconsumed = [1, 2, 4, 5, 6, 7]
    assert sampler(unconsumed, 1, partition=part, **{CLAIM_KEY: spec}) == ([7, 1], [7, 1])
    assert sampler(unconsumed, 1, partition=part, **{CLAIM_KEY: {**spec, "n": 9}}) == ([7, 1, 6], [7, 1, 6])
    assert sampler([0, 1], 1) == ([0], [0])  # not a claim: SequentialSampler's answer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_row_cleared_between_read_and_fetch_never_costs_a_later_row(ray_cluster: None) -> None:
    with dataplane.connect("tq://?backend=simple&timeout_s=60") as client:
        pid = "race"
        client.kv_batch_put(["a", "b", "c", "d"], {"x": torch.arange(4.0)}, partition_id=pid)
        claims = client.store._claims
        read = claims._indexes
        fired: list[int] = []

        async def clear_after_the_read(partition_id: str, keys: list[str]) -> Any:
            where = await read(partition_id, keys)
            if not fired:
                fired.append(1)
                await claims.ops.clear(pid, list(stored_keys(["b"])))  # b's index is free now
            return where

        claims._indexes = clear_after_the_read
        try:
            first = client.claim_meta("train", partition_id=pid, required_fields=["x"], batch_size=4)
        finally:
            claims._indexes = read
        assert fired and "b" not in first.keys
        client.kv_batch_put(["e"], {"x": torch.tensor([9.0])}, partition_id=pid)  # reuses b's index
        second = client.claim_meta("train", partition_id=pid, required_fields=["x"], batch_size=4)
        assert sorted(first.keys + second.keys) == ["a", "c", "d", "e"], (first.keys, second.keys)
        status = client.consumption_status("train", partition_id=pid, required_fields=["x"])
        assert (status.claimed, status.ready) == (4, 0) and client.check_consumption_status("train", partition_id=pid)
        got = client.kv_batch_get(first.concat(second) if second.size else first, select_fields=["x"])
        assert sorted(got["x"].tolist()) == [0.0, 2.0, 3.0, 9.0]
