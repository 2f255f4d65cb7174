"""The SimpleStorage pack layout on its own: blobs round-trip every kind of column bit-exact, row
markers resolve each field to the last pack written, and bad blobs raise instead of decoding."""

from __future__ import annotations

import pytest
import torch

from dataplane.adapters.transfer_queue._layout import RowsChanged
from dataplane.adapters.transfer_queue._pack import (
    StaleSchema,
    column_of,
    marker_after_put,
    pack_columns,
    pack_field,
    packs_of_marker,
    parse_pack,
)
from dataplane.codec.jagged import offsets_from_lengths
from dataplane.codec.wire import Column
from dataplane.errors import DataPlaneError, SchemaError
from dataplane.schema import FieldSchema


def _columns(n: int) -> dict[str, Column]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 7, (n,), generator=g)
    offsets = offsets_from_lengths(lengths)
    total = int(offsets[-1])
    obj_lengths = torch.randint(1, 5, (n,), generator=g)
    return {
        "ids": Column(
            FieldSchema(kind="jagged", dtype=torch.int64), torch.randint(0, 9, (total,), generator=g), offsets
        ),
        "lp": Column(
            FieldSchema(kind="jagged", dtype=torch.bfloat16, inner_shape=(2,)),
            torch.randn(total, 2, generator=g).bfloat16(),
            offsets,
        ),
        "mask": Column(FieldSchema(kind="jagged", dtype=torch.bool), torch.rand(total, generator=g) > 0.5, offsets),
        "reward": Column(FieldSchema(kind="dense", dtype=torch.float32), torch.randn(n, generator=g)),
        "img": Column(
            FieldSchema(kind="dense", dtype=torch.complex64, inner_shape=(2, 3)),
            torch.randn(n, 2, 3, dtype=torch.complex64),
        ),
        "wide0": Column(
            FieldSchema(kind="jagged", dtype=torch.float16, inner_shape=(0,)), torch.empty(total, 0).half(), offsets
        ),
        "empty": Column(
            FieldSchema(kind="dense", dtype=torch.int32, inner_shape=(0,)), torch.empty(n, 0, dtype=torch.int32)
        ),
        "msg": Column(
            FieldSchema(kind="object", dtype=torch.uint8, codec="msgpack"),
            torch.randint(0, 255, (int(obj_lengths.sum()),), dtype=torch.uint8, generator=g),
            offsets_from_lengths(obj_lengths),
        ),
    }


def _same(a: Column, b: Column) -> None:
    assert a.schema == b.schema
    assert torch.equal(a.values.view(torch.uint8), b.values.contiguous().view(torch.uint8))
    assert (a.offsets is None) == (b.offsets is None)
    if a.offsets is not None and b.offsets is not None:
        assert torch.equal(a.offsets, b.offsets)


K = [f"key{i}" for i in range(8)]


def test_every_kind_of_column_round_trips_bit_exact() -> None:
    cols = _columns(5)
    packed = pack_columns(cols, 5, keys=K[:5])
    assert packed.pack == "empty,ids,img,lp,mask,msg,reward,wide0"
    blobs = list(packed.rows.unbind())
    parsed = parse_pack(packed.pack, [b.clone() for b in blobs], list(range(5)), keys=K[:5])
    for f, col in cols.items():
        _same(column_of(f, col.schema, 5, [parsed]), col)


def test_rows_from_several_packs_come_back_in_request_order() -> None:
    a, b = _columns(4), _columns(4)
    pb_packed = pack_columns({"ids": b["ids"], "lp": b["lp"]}, 4, keys=K[:4])
    blobs_a = list(pack_columns(a, 4, keys=K[:4]).rows.unbind())
    blobs_b = list(pb_packed.rows.unbind())
    # request order: rows 0, 2 from pack a; rows 1, 3 from pack b (as two put groups would be)
    pa = parse_pack("empty,ids,img,lp,mask,msg,reward,wide0", [blobs_a[0], blobs_a[2]], [0, 2], keys=K[:4])
    pb = parse_pack(pb_packed.pack, [blobs_b[1], blobs_b[3]], [1, 3], keys=K[:4])
    got = column_of("ids", a["ids"].schema, 4, [pa, pb])
    rows = [a["ids"].rows()[0], b["ids"].rows()[1], a["ids"].rows()[2], b["ids"].rows()[3]]
    assert got.offsets is not None
    assert [got.values[got.offsets[i] : got.offsets[i + 1]].tolist() for i in range(4)] == [r.tolist() for r in rows]


def test_a_reader_with_another_schema_is_told() -> None:
    cols = _columns(3)
    packed = pack_columns(cols, 3, keys=K[:3])
    parsed = parse_pack(packed.pack, list(packed.rows.unbind()), [0, 1, 2], keys=K[:3])
    with pytest.raises(StaleSchema):
        column_of("reward", FieldSchema(kind="dense", dtype=torch.int32), 3, [parsed])


def test_blobs_that_are_not_dataplane_blobs_raise() -> None:
    cols = _columns(3)
    packed = pack_columns(cols, 3, keys=K[:3])
    blobs = [b.clone() for b in packed.rows.unbind()]
    with pytest.raises(DataPlaneError, match="does not add up"):
        parse_pack(packed.pack, [blobs[0][:-1], blobs[1], blobs[2]], [0, 1, 2], keys=K[:3])
    with pytest.raises(DataPlaneError, match="not a dataplane blob"):
        parse_pack(packed.pack, [torch.zeros(3), blobs[1], blobs[2]], [0, 1, 2], keys=K[:3])
    # a header whose count disagrees with its byte size (same token) is caught per field
    bad = blobs[0].clone()
    nf = len(cols)
    counts = bad[8 * nf : 12 * nf].view(torch.int32)
    counts[list(sorted(cols)).index("ids")] += 1
    parsed = parse_pack(packed.pack, [bad, blobs[1], blobs[2]], [0, 1, 2], keys=K[:3])
    with pytest.raises(SchemaError, match="size"):
        column_of("ids", cols["ids"].schema, 3, [parsed])


def test_markers_resolve_each_field_to_its_last_pack() -> None:
    m = marker_after_put(None, "a,b,c")
    assert m == "a,b,c"
    m = marker_after_put(m, "b")
    assert m == "a,b,c;b"
    assert packs_of_marker(m) == {"a": "a,b,c", "b": "b", "c": "a,b,c"}
    m = marker_after_put(m, "a,c,d")  # "a,b,c" has nothing of its own left: dropped
    assert m == "b;a,c,d"
    assert marker_after_put(m, "a,c,d") == m  # a re-write of the same pack changes nothing
    assert marker_after_put("x;y", "x") == "y;x"
    assert pack_field("a,b") != pack_field("a,b,c") and pack_field("a,b").startswith("__dataplane__/pack/")


def test_a_blob_read_under_another_key_is_read_again() -> None:
    """TransferQueue hands a cleared row's index to the next new key: a reader that took the index
    before the clear and reads the blob after that put finds another key's blob, and must not
    return it as its own."""
    cols = _columns(3)
    packed = pack_columns(cols, 3, keys=K[:3])
    blobs = list(packed.rows.unbind())
    with pytest.raises(RowsChanged):
        parse_pack(packed.pack, [blobs[0], blobs[2], blobs[1]], [0, 1, 2], keys=K[:3])
    parse_pack(packed.pack, [blobs[2], blobs[0]], [0, 1], keys=[K[2], K[0]])  # its own key: fine


def test_keys_that_look_reserved_are_stored_apart_and_listed_as_given() -> None:
    """Every key the core accepts is a key on tq://: one beginning like dataplane's reserved keys
    gets a NUL in front (no user key holds one); every other key, as every key before, as it is."""
    from dataplane.adapters.transfer_queue._layout import is_reserved, schema_key, stored_keys, user_key, user_listing

    plain = ["a", "ключ", "a\nb", "__dataplan"]
    assert stored_keys(plain) is plain  # the usual batch: no copy
    assert stored_keys(["x__dataplane__"]) == ["x__dataplane__"]  # only a key that begins like one
    keys = ["__dataplane__", schema_key("x"), "a"]
    stored = stored_keys(keys)
    assert stored == ["\x00__dataplane__", "\x00" + schema_key("x"), "a"] and not any(map(is_reserved, stored))
    assert [user_key(k) for k in stored] == keys
    listing = {"p": {s: {"i": i} for i, s in enumerate(stored)}, "q": {"b": {}}}
    assert user_listing(listing) == {"p": {k: {"i": i} for i, k in enumerate(keys)}, "q": {"b": {}}}
    assert list(listing["p"]) == keys  # first-put order kept
