"""A hypothesis state machine that drives a client and a plain dict model with the same operations."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dataplane.client import DataPlaneClient
from dataplane.errors import KeyNotFound
from dataplane.testing.strategies import bit_exact, object_values

__all__ = ["make_state_machine"]

_KEYS = [f"u{i}_g{j}" for i in range(3) for j in range(2)]
# fixed schema per field, so every put is valid: the model checks data, not validation
_FIELDS = ("ids", "logp", "reward", "msg")


def _value(field: str, n: int, seed: int, lens: list[int]) -> Any:
    g = torch.Generator().manual_seed(seed)
    if field == "ids":
        return [torch.randint(0, 50_000, (m,), generator=g) for m in lens]
    if field == "logp":
        return torch.randn(n, 4, generator=g).to(torch.bfloat16)
    if field == "reward":
        return torch.randn(n, generator=g)
    raise AssertionError(field)


def make_state_machine(factory: Callable[[], DataPlaneClient]) -> type[RuleBasedStateMachine]:
    """A state machine class over clients from ``factory``; run it with ``run_state_machine_as_test``
    or expose ``.TestCase`` to pytest. The factory may return a shared client: every example uses its
    own partitions and clears them at teardown (the client is not closed).
    """

    class ClientMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.client = factory()
            tag = uuid.uuid4().hex[:8]
            self.parts = [f"sm-{tag}-a", f"sm-{tag}-b"]
            # model: partition -> key -> field -> row value; and key -> tags
            self.model: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in self.parts}
            self.tags: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in self.parts}
            # partition -> task -> keys it claimed (a clear drops them; None: the adapter has no claims)
            self.claimed: dict[str, dict[str, set[str]]] | None = {p: {} for p in self.parts}

        @rule(
            part=st.integers(0, 1),
            keys=st.lists(st.sampled_from(_KEYS), min_size=1, max_size=4, unique=True),
            fields=st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3, unique=True),
            seed=st.integers(0, 2**20),
            data=st.data(),
        )
        def put(self, part: int, keys: list[str], fields: list[str], seed: int, data: st.DataObject) -> None:
            pid = self.parts[part]
            n = len(keys)
            lens = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n), label="lens")
            values: dict[str, Any] = {}
            for f in fields:
                values[f] = (
                    data.draw(st.lists(object_values, min_size=n, max_size=n))
                    if f == "msg"
                    else _value(f, n, seed, lens)
                )
            tags = data.draw(
                st.lists(st.fixed_dictionaries({"r": st.integers(-3, 3)}), min_size=n, max_size=n), label="tags"
            )
            send = {
                f: (torch.nested.as_nested_tensor(v, layout=torch.jagged) if f == "ids" else v)
                for f, v in values.items()
            }
            self.client.kv_batch_put(keys, send, partition_id=pid, tags=tags)
            for i, k in enumerate(keys):
                row = self.model[pid].setdefault(k, {})
                for f, v in values.items():
                    row[f] = v[i]
                self.tags[pid].setdefault(k, {}).update(tags[i])

        @rule(
            part=st.integers(0, 1),
            keys=st.lists(st.sampled_from(_KEYS), min_size=1, max_size=4, unique=True),
            fields=st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3, unique=True),
        )
        def get(self, part: int, keys: list[str], fields: list[str]) -> None:
            pid = self.parts[part]
            rows = self.model[pid]
            present = all(k in rows and all(f in rows[k] for f in fields) for k in keys)
            if not present:
                try:
                    self.client.kv_batch_get(keys, partition_id=pid, select_fields=fields)
                except KeyNotFound:
                    return
                raise AssertionError(f"get of absent rows/fields {keys} {fields} did not raise KeyNotFound")
            out = self.client.kv_batch_get(keys, partition_id=pid, select_fields=fields)
            assert list(out.keys()) == fields
            for f in fields:
                if f == "msg":
                    assert out[f] == [rows[k][f] for k in keys]
                    continue
                got = list(out[f].unbind()) if out[f].is_nested else list(out[f].unbind(0))
                for k, g in zip(keys, got, strict=True):
                    assert bit_exact(g, rows[k][f]), (f, k)

        @rule(
            part=st.integers(0, 1),
            keys=st.lists(st.sampled_from(_KEYS), min_size=1, max_size=4, unique=True),
            data=st.data(),
        )
        def put_tags(self, part: int, keys: list[str], data: st.DataObject) -> None:
            """A tag-only put: absent keys become rows without fields, present ones merge the tags."""
            pid = self.parts[part]
            tags = data.draw(
                st.lists(
                    st.fixed_dictionaries(
                        {}, optional={"s": st.sampled_from(["pending", "done"]), "r": st.integers(-3, 3)}
                    ),
                    min_size=len(keys),
                    max_size=len(keys),
                ),
                label="tags",
            )
            self.client.kv_batch_put(keys, None, partition_id=pid, tags=tags)
            for k, t in zip(keys, tags, strict=True):
                self.model[pid].setdefault(k, {})
                self.tags[pid].setdefault(k, {}).update(t)

        @rule(
            part=st.integers(0, 1),
            keys=st.none() | st.lists(st.sampled_from(_KEYS), min_size=1, max_size=3, unique=True),
        )
        def clear(self, part: int, keys: list[str] | None) -> None:
            pid = self.parts[part]
            self.client.kv_clear(keys, partition_id=pid)
            for k in list(self.model[pid]) if keys is None else keys:
                self.model[pid].pop(k, None)
                self.tags[pid].pop(k, None)
                for taken in (self.claimed or {}).get(pid, {}).values():
                    taken.discard(k)

        @rule(
            part=st.integers(0, 1),
            task=st.sampled_from(["t1", "t2"]),
            fields=st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=2, unique=True),
            n=st.integers(1, 4),
        )
        def claim(self, part: int, task: str, fields: list[str], n: int) -> None:
            """A claim hands out up to ``n`` rows holding ``fields`` that the task has not claimed,
            in first-put order (which of them a backend picks first may vary: TransferQueue's
            controller picks by its row index), and the task's counts follow."""
            if self.claimed is None:
                return
            pid = self.parts[part]
            try:
                meta = self.client.claim_meta(task, partition_id=pid, required_fields=fields, batch_size=n)
            except NotImplementedError:
                self.claimed = None
                return
            taken = self.claimed[pid].setdefault(task, set())
            order = list(self.tags[pid])  # first-put order
            ready = [k for k in order if k not in taken and all(f in self.model[pid][k] for f in fields)]
            got = list(meta.keys)
            assert len(got) == min(n, len(ready)) and set(got) <= set(ready), (pid, task, fields, got, ready)
            assert got == sorted(got, key=order.index), ("first-put order", got)
            assert meta.tags == tuple(self.tags[pid][k] for k in got)
            taken.update(got)
            status = self.client.consumption_status(task, partition_id=pid, required_fields=fields)
            left = [k for k in order if k not in taken]
            expect = (len(taken), sum(all(f in self.model[pid][k] for f in fields) for k in left), len(order))
            assert (status.claimed, status.ready, status.total) == expect, (pid, task, status, expect)

        @invariant()
        def listing_matches(self) -> None:
            for pid in self.parts:
                listed = self.client.kv_list(pid).get(pid, {})
                assert listed == self.tags[pid], (pid, listed, self.tags[pid])
                assert list(listed) == list(self.tags[pid]), ("first-put order", pid, list(listed))

        @invariant()
        def describe_matches(self) -> None:
            for pid in self.parts:
                info = self.client.kv_describe(_KEYS, partition_id=pid)
                assert list(info) == [k for k in _KEYS if k in self.model[pid]], (pid, list(info))
                for k, row in info.items():
                    assert row.fields == set(self.model[pid][k]) and row.tags == self.tags[pid][k], (pid, k, row)

        def teardown(self) -> None:
            for pid in self.parts:
                self.client.kv_clear(partition_id=pid)

    return ClientMachine
