"""``memory://``'s read-into and adopting surfaces (:mod:`dataplane.adapters.read_into`): any byte
window of a planned get equals the same bytes of a plain get, whichever puts the rows come from; a
put keeps exactly the tensors handed over, and only inside the scope."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dataplane
from dataplane.adapters.read_into import AdoptsPuts, ReadsInto
from dataplane.meta import KVBatchMeta

DTYPES = [torch.int64, torch.int32, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8]


def _rows(keys: list[str], seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(0, 9, (len(keys),), generator=g)]
    lengths[0] = 0  # an empty row in every put
    fields: dict[str, Any] = {}
    for dtype in DTYPES:
        rows = [(torch.randn(n, generator=g) * 50).to(dtype) for n in lengths]
        fields[f"j_{str(dtype)[6:]}"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    fields["emb"] = torch.randn(len(keys), 3, generator=g)  # dense with an inner shape
    fields["r"] = torch.arange(len(keys), dtype=torch.float64) + seed
    fields["msgs"] = [{"k": k, "n": i} for i, k in enumerate(keys)]
    return fields


def _store_from_puts(client: Any) -> tuple[Any, KVBatchMeta, list[str]]:
    """Rows of three puts, a rewrite of some of them, read in an order that alternates between puts."""
    keys = [f"k{i}" for i in range(30)]
    for part, seed in ((keys[:10], 1), (keys[10:20], 2), (keys[20:], 3), (keys[5:15], 4)):
        meta = client.kv_batch_put(part, _rows(part, seed), partition_id="p")
    fields = list(meta.fields)
    order = [keys[i] for i in np.random.default_rng(0).permutation(len(keys))]
    return client.store, KVBatchMeta(partition_id="p", keys=order), fields


def _windows(read: Any, field: str, nbytes: int, step: int) -> torch.Tensor:
    out = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    for start in range(0, nbytes, step):
        read.read_into(field, start, out[start : start + step])
    return out


@pytest.mark.parametrize("url", ["memory://", "memory://shared-read-into"])
@pytest.mark.parametrize("step", [1, 3, 8, 64, 1 << 20])
def test_windows_equal_the_plain_get(url: str, step: int) -> None:
    with dataplane.connect(url) as client:
        store, meta, fields = _store_from_puts(client)
        assert isinstance(store, ReadsInto) and isinstance(store, AdoptsPuts)
        want = store.get("p", list(meta.keys), fields, meta=None, timeout_s=5.0)
        read = store.begin_read_into("p", list(meta.keys), fields, meta=None, timeout_s=5.0)
        assert read.device_direct is False
        for f in fields:
            col, ref = read.columns[f], want[f]
            assert col.values.device.type == "meta" and col.schema == ref.schema
            assert col.values.shape == ref.values.shape and col.values.dtype == ref.values.dtype
            assert (col.offsets is None) == (ref.offsets is None)
            if ref.offsets is not None:
                assert torch.equal(col.offsets, ref.offsets)
            raw = ref.values.reshape(-1).view(torch.uint8)
            assert torch.equal(_windows(read, f, raw.numel(), step), raw), f
        # jagged fields of equal row lengths share one offsets tensor, as a plain get's do
        jagged = [read.columns[f].offsets for f in fields if read.columns[f].schema.kind == "jagged"]
        assert all(o is jagged[0] for o in jagged)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_window_is_the_same_bytes(data: st.DataObject) -> None:
    with dataplane.connect("memory://") as client:
        store, meta, fields = _store_from_puts(client)
        field = data.draw(st.sampled_from([f for f in fields if f != "msgs"]))
        want = store.get("p", list(meta.keys), [field], meta=None, timeout_s=5.0)[field]
        raw = want.values.reshape(-1).view(torch.uint8)
        start = data.draw(st.integers(0, raw.numel()))
        end = data.draw(st.integers(start, raw.numel()))
        read = store.begin_read_into("p", list(meta.keys), [field], meta=None, timeout_s=5.0)
        out = torch.empty(end - start, dtype=torch.uint8)
        read.read_into(field, start, out)
        assert torch.equal(out, raw[start:end])


def test_bad_reads_raise_typed_errors() -> None:
    with dataplane.connect("memory://") as client:
        store, meta, fields = _store_from_puts(client)
        with pytest.raises(dataplane.KeyNotFound, match="nope"):
            store.begin_read_into("p", [*meta.keys, "nope"], fields, meta=None, timeout_s=5.0)
        read = store.begin_read_into("p", list(meta.keys), ["r"], meta=None, timeout_s=5.0)
        with pytest.raises(dataplane.InvalidArgument, match="outside"):
            read.read_into("r", 8, torch.empty(30 * 8, dtype=torch.uint8))
        with pytest.raises(dataplane.InvalidArgument, match="uint8"):
            read.read_into("r", 0, torch.empty(4, dtype=torch.float32))
        with pytest.raises(dataplane.InvalidArgument, match="not part of this read"):
            read.read_into("emb", 0, torch.empty(4, dtype=torch.uint8))


def test_a_read_outlives_a_clear_of_its_rows() -> None:
    with dataplane.connect("memory://") as client:
        store, meta, _ = _store_from_puts(client)
        want = store.get("p", list(meta.keys), ["j_int64"], meta=None, timeout_s=5.0)["j_int64"]
        read = store.begin_read_into("p", list(meta.keys), ["j_int64"], meta=None, timeout_s=5.0)
        client.kv_clear(partition_id="p")
        raw = want.values.reshape(-1).view(torch.uint8)
        assert torch.equal(_windows(read, "j_int64", raw.numel(), 16), raw)


def test_a_put_keeps_what_is_handed_over_and_copies_the_rest() -> None:
    with dataplane.connect("memory://") as client:
        store = client.store
        handed = client.empty((4,), torch.float32)
        handed.copy_(torch.arange(4.0))
        mine = torch.arange(4.0) + 10
        with store.adopting([handed]):
            meta = client.kv_batch_put(list("abcd"), {"h": handed, "m": mine}, partition_id="p")
        outside = torch.arange(4.0) + 20
        client.kv_batch_put(list("abcd"), {"o": outside}, partition_id="p")
        handed.fill_(-1)  # the contract forbids this; here it shows which tensor the store kept
        mine.fill_(-1)
        outside.fill_(-1)
        got = client.kv_batch_get(meta, select_fields=["h", "m", "o"])
        assert got["h"].tolist() == [-1.0] * 4, "kept as it was handed over"
        assert got["m"].tolist() == [10.0, 11.0, 12.0, 13.0], "not handed over: copied"
        assert got["o"].tolist() == [20.0, 21.0, 22.0, 23.0], "outside the scope: copied"
        assert store.used_bytes == 3 * 16


def test_a_read_keeps_its_rows_while_the_keys_are_cleared_and_written_again() -> None:
    """Rows of 2 MiB (the store's pooled memory): after the plan, the same keys are cleared and put
    again with other values of the same size, several times, so freed memory is reused; the planned
    read still copies the rows it planned, and a new read sees the new ones."""
    rows, width = 4, 1 << 18  # int64: 2 MiB a row
    keys = [f"k{i}" for i in range(rows)]
    with dataplane.connect("memory://") as client:
        store = client.store
        old = torch.arange(rows * width, dtype=torch.int64).reshape(rows, width)
        client.kv_batch_put(keys, {"x": old}, partition_id="p")
        read = store.begin_read_into("p", keys, ["x"], meta=None, timeout_s=5.0)
        for round_ in range(1, 4):
            client.kv_clear(keys, partition_id="p")
            client.kv_batch_put(keys, {"x": torch.full((rows, width), -round_, dtype=torch.int64)}, partition_id="p")
        raw = old.reshape(-1).view(torch.uint8)
        assert torch.equal(_windows(read, "x", raw.numel(), 3 << 20), raw)
        fresh = store.begin_read_into("p", keys, ["x"], meta=None, timeout_s=5.0)
        now = torch.full((rows, width), -3, dtype=torch.int64).reshape(-1).view(torch.uint8)
        assert torch.equal(_windows(fresh, "x", now.numel(), 3 << 20), now)
