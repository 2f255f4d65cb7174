"""ObservedClient's byte accounting: what a clear forgets, and that it costs one visit per key."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch

import dataplane
from dataplane.observability import ObservedClient


class CountingKeys(Sequence[str]):
    """A list of keys that counts how many of its elements a caller visits: one per element
    iterated or indexed, and one per element a membership test (``in``, a linear scan, as a
    list's) compares. Clearing n keys must visit O(n) of them, not O(n) per held key."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = list(keys)
        self.visits = 0

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        got = self._keys[i]
        self.visits += len(got) if isinstance(got, list) else 1
        return got

    def __iter__(self) -> Iterator[str]:
        for k in self._keys:
            self.visits += 1
            yield k

    def __contains__(self, key: object) -> bool:
        for k in self._keys:
            self.visits += 1
            if k == key:
                return True
        return False


def _visits_to_clear(n: int) -> int:
    client = ObservedClient(dataplane.connect())
    keys = [f"k{i}" for i in range(n)]
    client.kv_batch_put(keys, {"x": torch.zeros(n, 2, dtype=torch.int8)}, partition_id="p")
    client.kv_batch_put(["other"], {"x": torch.zeros(1, 2, dtype=torch.int8)}, partition_id="q")
    counted = CountingKeys(keys)
    client.kv_clear(counted, partition_id="p")
    assert client.snapshot()["bytes_outstanding"] == 2  # only q's row is left
    client.close()
    return counted.visits


def test_kv_clear_visits_each_key_a_bounded_number_of_times() -> None:
    """Linear, by operation count: 8x the keys cost at most ~8x the visits (a scan of the caller's
    list per held key costs 64x), and a few visits per key in absolute terms."""
    small, large = 500, 4000
    v_small, v_large = _visits_to_clear(small), _visits_to_clear(large)
    assert v_small <= 4 * small, v_small
    assert v_large <= 4 * large, v_large
    assert v_large <= 10 * v_small, (v_small, v_large)


def test_kv_clear_forgets_exactly_the_cleared_rows() -> None:
    client = ObservedClient(dataplane.connect())
    client.kv_batch_put(["a", "b", "c"], {"x": torch.zeros(3, 4, dtype=torch.int8)}, partition_id="p")  # 4 a row
    client.kv_batch_put(["a"], {"y": torch.zeros(1, 2, dtype=torch.int8)}, partition_id="p")  # a: 6
    client.kv_batch_put(["a", "z"], {"x": torch.zeros(2, 8, dtype=torch.int8)}, partition_id="q")  # 8 a row
    assert client.snapshot()["bytes_outstanding"] == 12 + 2 + 16
    client.kv_clear(["a", "missing"], partition_id="p")  # unknown keys are ignored, q's "a" stays
    assert client.snapshot()["bytes_outstanding"] == 8 + 16
    client.kv_clear(partition_id="q")
    assert client.snapshot()["bytes_outstanding"] == 8
    client.kv_clear(["b", "c"], partition_id="p")
    client.kv_clear(["b"], partition_id="p")  # already gone: nothing more to forget
    client.kv_clear(partition_id="never-written")
    snap = client.snapshot()
    assert snap["bytes_outstanding"] == 0 and snap["bytes_peak"] == 30
    client.close()


def test_url_is_the_wrapped_clients() -> None:
    with ObservedClient(dataplane.connect("memory://observed-url")) as client:
        assert client.url == "memory://observed-url"  # a worker handed the wrapper can still tell peers where to join
