"""The shipped conformance suite on the memory adapter."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.testing import ClientConformance, make_state_machine


class TestMemoryConformance(ClientConformance):
    def make_client(self, **options: Any) -> DataPlaneClient:
        return dataplane.connect("memory://", **options)

    def make_limited_client(
        self, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> DataPlaneClient:
        return dataplane.connect("memory://", capacity_bytes=capacity_bytes, capacity_rows=capacity_rows)


_shared = dataplane.connect("memory://state-machine")
TestMemoryStateMachine = make_state_machine(lambda: _shared).TestCase
TestMemoryStateMachine.settings = settings(
    max_examples=40, stateful_step_count=20, suppress_health_check=list(HealthCheck)
)


_mem_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.lists(st.sampled_from("abcdef"), min_size=1, max_size=5, unique=True),
            st.lists(st.sampled_from(["x", "j"]), min_size=1, max_size=2, unique=True),
        ),
        st.tuples(
            st.just("clear"), st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=4, unique=True), st.just([])
        ),
        st.tuples(st.just("clear_all"), st.just([]), st.just([])),
    ),
    max_size=30,
)


@given(ops=_mem_ops)
@settings(max_examples=200, suppress_health_check=list(HealthCheck))
def test_memory_store_counts_exactly_the_rows_and_bytes_still_read(ops: list[tuple[str, list[str], list[str]]]) -> None:
    """After any puts (rewriting some fields of some rows) and clears, the store counts the live
    keys and the bytes of exactly those stored columns some live row still reads, and reads and
    lists what a plain model says (a chunk is freed with its last reader, never before)."""
    client = dataplane.connect("memory://")
    store = client.store  # type: ignore[attr-defined]
    model: dict[str, dict[str, tuple[int, int]]] = {}  # key -> field -> (put number, value)
    sizes: dict[tuple[int, str], int] = {}  # (put number, field) -> bytes stored
    tags: dict[str, dict[str, int]] = {}  # key -> its tags, merged over its puts
    try:
        for n, (op, keys, fields) in enumerate(ops):
            if op == "put":
                cols: dict[str, Any] = {}
                for f in fields:
                    if f == "x":
                        cols[f] = torch.tensor([[n, i] for i in range(len(keys))], dtype=torch.int32)
                    else:
                        rows = [torch.full((i % 3 + 1,), n, dtype=torch.int16) for i in range(len(keys))]
                        cols[f] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
                    sizes[(n, f)] = 8 * len(keys) if f == "x" else 2 * sum(i % 3 + 1 for i in range(len(keys)))
                client.kv_batch_put(keys, cols, partition_id="p", tags=[{"n": n, k: i} for i, k in enumerate(keys)])
                for i, k in enumerate(keys):
                    model.setdefault(k, {}).update({f: (n, 0) for f in fields})
                    tags.setdefault(k, {}).update({"n": n, k: i})
            elif op == "clear":
                client.kv_clear(keys, partition_id="p")
                for k in keys:
                    model.pop(k, None)
                    tags.pop(k, None)
            else:
                client.kv_clear(partition_id="p")
                model.clear()
                tags.clear()
            live = {(p, f) for row in model.values() for f, (p, _) in row.items()}
            assert store.used_rows == len(model)
            assert store.used_bytes == sum(sizes[c] for c in live)
            assert client.kv_list("p").get("p", {}) == tags
            for f in ("x", "j"):
                held = sorted(k for k in model if f in model[k])
                if held:
                    got = client.kv_batch_get(held, partition_id="p", select_fields=f)[f]
                    firsts = [int(t.reshape(-1)[0]) for t in (got.unbind() if got.is_nested else got)]
                    assert firsts == [model[k][f][0] for k in held]
    finally:
        client.close()
