"""KVBatchMeta: invariants, transforms keep rows aligned, serialisation round-trips."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataplane.errors import InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta, trusted_meta


@st.composite
def metas(draw: st.DrawFn) -> KVBatchMeta:
    n = draw(st.integers(0, 30))
    keys = [f"k{i}" for i in draw(st.permutations(range(n)))]
    lens = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    stamped = draw(st.booleans())  # a put's meta names its deployment; one built by hand does not
    return KVBatchMeta(
        partition_id="p",
        keys=keys,
        fields=["ids", "mask"],
        sequence_lengths=lens,
        tags=[{"len": x, "key": k} for k, x in zip(keys, lens, strict=True)],
        extra_info={"pad": 8},
        deployment="mooncake:0123abcd/dataplane" if stamped else "",
        deployment_url="mooncake://127.0.0.1:5001?metrics_port=5002&ns=dataplane" if stamped else "",
    )


def _aligned(m: KVBatchMeta) -> None:
    assert m.tags is not None and m.sequence_lengths is not None
    for k, n, t in zip(m.keys, m.sequence_lengths, m.tags, strict=True):
        assert t["key"] == k and t["len"] == n


@given(metas(), st.data())
def test_transforms_keep_rows_aligned(m: KVBatchMeta, data: st.DataObject) -> None:
    n = len(m)
    idx = data.draw(st.lists(st.integers(0, max(n - 1, 0)), unique=True, max_size=n)) if n else []
    perm = data.draw(st.permutations(range(n)))
    chunks = data.draw(st.integers(1, 6))
    for out in (m.subset(idx), m.reorder(perm), m.slice(1, n - 1), m.drop(m.keys[: n // 2]), *m.chunk(chunks)):
        _aligned(out)
    assert sum(len(c) for c in m.chunk(chunks)) == n
    assert m.chunk(chunks)[0].concat(*m.chunk(chunks)[1:]).keys == m.keys
    assert m.reorder(perm).keys == tuple(m.keys[i] for i in perm)
    _aligned(m.stamp_tags({"w": 1}))
    assert all(t["w"] == 1 for t in m.stamp_tags({"w": 1}).tags or ())


@given(metas())
def test_serialisation_round_trips(m: KVBatchMeta) -> None:
    assert KVBatchMeta.from_dict(m.to_dict()) == m
    assert pickle.loads(pickle.dumps(m)) == m
    assert KVBatchMeta.from_msgpack(m.to_msgpack()) == m
    assert KVBatchMeta.from_dict(msgpack.unpackb(msgpack.packb(m.to_dict()))) == m


def test_invariants() -> None:
    with pytest.raises(InvalidArgument, match="unique"):
        KVBatchMeta(partition_id="p", keys=["a", "a"])
    with pytest.raises(InvalidArgument, match="sequence_lengths"):
        KVBatchMeta(partition_id="p", keys=["a"], sequence_lengths=[1, 2])
    with pytest.raises(InvalidArgument, match="tags"):
        KVBatchMeta(partition_id="p", keys=["a"], tags=[])
    with pytest.raises(SchemaError):
        KVBatchMeta(partition_id="p", keys=[1])  # type: ignore[list-item]
    with pytest.raises(SchemaError):
        KVBatchMeta(partition_id="p", keys="ab")
    with pytest.raises(InvalidArgument):
        KVBatchMeta(partition_id="", keys=["a"])
    for bad, why in (("", "non-empty"), ("a\x00b", "NUL"), ("k" * 513, "513 characters"), ("\udc80", "surrogate")):
        with pytest.raises(InvalidArgument, match=why):  # the client trusts a meta's keys: a meta holds only valid ones
            KVBatchMeta(partition_id="p", keys=["a", bad])
    assert KVBatchMeta(partition_id="p", keys=["a\nb", "ключ", " "]).keys == ("a\nb", "ключ", " ")
    assert KVBatchMeta(partition_id="p", keys=[]).keys == ()
    m = KVBatchMeta(partition_id="p", keys=["a", "b"])
    with pytest.raises(InvalidArgument):
        m.reorder([0, 0])
    with pytest.raises(InvalidArgument):
        m.drop(["zz"])
    with pytest.raises(InvalidArgument):
        m.concat(KVBatchMeta(partition_id="q", keys=["c"]))
    with pytest.raises(InvalidArgument):
        m.concat(KVBatchMeta(partition_id="p", keys=["a"]))


def test_meta_is_frozen_and_copies_inputs() -> None:
    tags = [{"r": 1}]
    m = KVBatchMeta(partition_id="p", keys=["a"], tags=tags)
    tags[0]["r"] = 2
    assert m.tags == ({"r": 1},)
    with pytest.raises(AttributeError):
        m.keys = ("b",)  # type: ignore[misc]
    assert m.with_fields(["x"]).with_fields(["y", "x"]).fields == ("x", "y")
    assert m.select_tags(lambda t: t["r"] > 1).keys == ()


@given(metas())
def test_trusted_meta_is_the_meta_its_checked_parts_make(m: KVBatchMeta) -> None:
    parts = {f.name: getattr(m, f.name) for f in dataclasses.fields(KVBatchMeta)}
    assert parts.pop("extra_info") == {"pad": 8} and parts.pop("task_name") is None  # set by no put
    made = trusted_meta(**parts)
    assert made == KVBatchMeta(**parts) == replace(m, extra_info={})
    assert type(made) is KVBatchMeta and made.extra_info is not trusted_meta(**parts).extra_info  # its own dict
    assert pickle.loads(pickle.dumps(made)) == made


def test_repr_stays_short_whatever_the_batch_carries() -> None:
    """Adapters keep read hints and binary indexes in ``extra_info``: the repr names them, never
    prints them, and shows a few keys however many rows there are."""
    keys = [f"{'u' * 100}{i}_g0" for i in range(4096)]
    meta = KVBatchMeta(
        partition_id="train",
        keys=keys,
        fields=["input_ids", "reward"],
        sequence_lengths=[7] * len(keys),
        tags=[{"uid": k} for k in keys],
        extra_info={"mooncake_index": b"\x00" * 4000, "mooncake_read": list(range(1000)), "pad_to": 8},
        task_name="gsm8k",
    )
    text = repr(meta)
    assert len(text) < 400, text
    assert "rows=4096" in text and "tokens=28672" in text and "'train'" in text and "'gsm8k'" in text
    assert "extra_info=<mooncake_index, mooncake_read, pad_to>" in text and "\\x00" not in text
    assert "(4096 in all)" in text and text.count("_g0") == 0  # long keys are cut, only the first 3 shown
    assert (
        repr(KVBatchMeta(partition_id="p", keys=["a"]))
        == "KVBatchMeta(partition_id='p', rows=1, keys=['a'], fields=[])"
    )


@given(metas(), st.data())
def test_every_transform_keeps_the_deployment(m: KVBatchMeta, data: st.DataObject) -> None:
    n = len(m.keys)
    idx = data.draw(st.permutations(range(n)))
    made = [
        m.subset(idx[: n // 2]),
        m.reorder(idx),
        m.slice(1),
        m.drop(m.keys[:1]),
        m.with_fields(["x"]),
        m.stamp_tags({"w": 1}),
        m.with_extra_info(a=1),
        *m.chunk(3),
        m.concat(m.slice(0, 0)),
        m.select_tags(lambda t: True),
        KVBatchMeta.from_dict(m.to_dict()),
        KVBatchMeta.from_msgpack(m.to_msgpack()),
        pickle.loads(pickle.dumps(m)),
    ]
    assert {(x.deployment, x.deployment_url) for x in made} == {(m.deployment, m.deployment_url)}


def test_concat_of_metas_from_two_deployments_is_an_error() -> None:
    a = KVBatchMeta(partition_id="p", keys=["a"], deployment="tq:1", deployment_url="tq://?ray_address=h:1")
    b = KVBatchMeta(partition_id="p", keys=["b"], deployment="tq:2", deployment_url="tq://?ray_address=h:2")
    by_hand = KVBatchMeta(partition_id="p", keys=["c"])
    with pytest.raises(InvalidArgument, match=r"one deployment.*tq://\?ray_address=h:1, tq://\?ray_address=h:2"):
        a.concat(by_hand, b)
    joined = by_hand.concat(a)  # a meta built by hand takes the deployment of the rows it joins
    assert (joined.keys, joined.deployment, joined.deployment_url) == (("c", "a"), "tq:1", "tq://?ray_address=h:1")
    assert by_hand.concat(by_hand.slice(0, 0)).deployment == ""
    with pytest.raises(SchemaError, match="deployment must be a str"):
        KVBatchMeta(partition_id="p", keys=["a"], deployment=None)  # type: ignore[arg-type]
    assert "tq:" not in repr(a)  # the repr stays short
    assert KVBatchMeta.from_dict({"partition_id": "p", "keys": ["a"]}).deployment == ""  # older dicts
