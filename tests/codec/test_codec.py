"""Codec properties: pack then materialize is the identity on valid data."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dataplane.codec import (
    RaggedCache,
    encode_fields,
    jagged,
    materialize,
    offsets_from_lengths,
    pack,
    pack_nested,
    padded_width,
    to_nested,
)
from dataplane.codec.jagged import Ragged
from dataplane.codec.objects import decode_objects, encode_objects
from dataplane.errors import InvalidArgument, SchemaError
from dataplane.testing.strategies import ALL_DTYPES, bit_exact, object_values, random_tensor


@st.composite
def padded_batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[int], int]:
    lens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=20))
    extra = draw(st.integers(0, 5))  # sequence-parallel padding: wider than the longest row
    inner = draw(st.sampled_from([(), (2,), (2, 3)]))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    padded = random_tensor((len(lens), max(lens) + extra, *inner), dtype, draw(st.integers(0, 1000)))
    return padded, lens, extra


@given(padded_batches())
def test_pack_then_materialize_is_identity(batch: tuple[torch.Tensor, list[int], int]) -> None:
    padded, lens, extra = batch
    values, offsets = pack(padded, lens)
    assert values.shape[0] == sum(lens) and offsets.tolist()[-1] == sum(lens)
    out = materialize(values, offsets, pad_to_length=padded.shape[1])
    for i, n in enumerate(lens):
        assert bit_exact(out[i, :n], padded[i, :n])
    if extra == 0:
        dense = materialize(values, offsets, pad_value=0)
        assert dense.shape[1] == max(lens)


@given(padded_batches())
def test_pack_gathers_into_the_given_buffer(batch: tuple[torch.Tensor, list[int], int]) -> None:
    padded, lens, _ = batch
    made: list[torch.Tensor] = []

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(torch.full(shape, 1, dtype=dtype))  # not torch.empty: stale bytes must be overwritten
        return made[-1]

    values, offsets = pack(padded, lens, empty=empty)
    want, want_offsets = pack(padded, lens)
    assert bit_exact(values, want) and torch.equal(offsets, want_offsets)
    if all(n == padded.shape[1] for n in lens):
        assert not made  # a view of the padded tensor, no gather
    else:
        assert len(made) == 1 and values.data_ptr() == made[0].data_ptr()


@given(padded_batches(), st.integers(1, 8), st.sampled_from([0, -1, 3]))
def test_materialize_padding_rules(batch: tuple[torch.Tensor, list[int], int], multiple: int, pad: int) -> None:
    padded, lens, _ = batch
    if padded.dtype in (torch.bool,) or padded.dtype.is_complex or (padded.dtype.itemsize == 1 and pad < 0):
        pad = 0
    values, offsets = pack(padded, lens)
    out = materialize(values, offsets, pad_value=pad, pad_to_multiple=multiple)
    assert out.shape[1] % multiple == 0 and out.shape[1] >= max(lens)
    expect_pad = torch.full((), pad, dtype=padded.dtype)
    for i, n in enumerate(lens):
        assert bool((out[i, n:] == expect_pad).all())


@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.sampled_from(ALL_DTYPES))
def test_nested_round_trip(lens: list[int], dtype: torch.dtype) -> None:
    rows = [random_tensor((n, 3), dtype, n) for n in lens]
    nt = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    values, offsets = pack_nested(nt)
    back = to_nested(values, offsets)
    assert all(bit_exact(a, b) for a, b in zip(back.unbind(), rows, strict=True))
    if dtype in (torch.float32, torch.int64):
        with warnings.catch_warnings():  # torch warns (once) that the strided layout is a prototype
            warnings.simplefilter("ignore", UserWarning)
            strided = torch.nested.nested_tensor(rows)
        v2, o2 = pack_nested(strided)
        assert bit_exact(v2, values) and torch.equal(o2, offsets)


@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.sampled_from(ALL_DTYPES))
def test_to_nested_matches_torch_constructor(lens: list[int], dtype: torch.dtype) -> None:
    values = random_tensor((sum(lens), 2), dtype, 7)
    offsets = offsets_from_lengths(lens)
    ours = to_nested(values, offsets)
    ref = torch.nested.nested_tensor_from_jagged(values, offsets)
    assert ours.is_nested and ours.layout == torch.jagged and ours.dtype == dtype
    assert ours.shape[0] == ref.shape[0] and ours.shape[2:] == ref.shape[2:]
    assert ours.values().data_ptr() == values.data_ptr()  # a view: no copy
    assert all(bit_exact(a, b) for a, b in zip(ours.unbind(), ref.unbind(), strict=True))
    if lens and max(lens) > 0:
        assert ours._max_seqlen == max(lens) and ours._min_seqlen == min(lens)  # type: ignore[attr-defined]


def test_fast_nested_constructor_matches_torch_or_steps_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct NestedTensor build is used only after its self-check; it then builds what torch builds."""
    offsets = offsets_from_lengths([3, 0, 4])
    r = Ragged.of(offsets)
    for values in (torch.randn(7, 2, 3), torch.arange(7), torch.rand(7) > 0.5):
        ours = to_nested(values, offsets, ragged=r)
        ref = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=0, max_seqlen=4)
        assert str(ours.shape) == str(ref.shape) and str(ours.stride()) == str(ref.stride())
        assert torch.equal(
            torch.nested.to_padded_tensor(ours.float(), -1), torch.nested.to_padded_tensor(ref.float(), -1)
        )
    assert (to_nested(torch.ones(7), offsets, ragged=r) * to_nested(torch.arange(7.0), offsets, ragged=r)).shape[0] == 3
    jagged._fast_njt_ok.cache_clear()
    try:
        monkeypatch.setattr(jagged, "_fast_njt", lambda *a: torch.zeros(1))  # a torch it does not fit
        assert not jagged._fast_njt_ok()
        back = to_nested(torch.arange(7), offsets, ragged=Ragged.of(offsets))  # torch's constructor instead
        assert [x.tolist() for x in back.unbind()] == [[0, 1, 2], [], [3, 4, 5, 6]]
    finally:
        monkeypatch.undo()
        jagged._fast_njt_ok.cache_clear()
    if torch.__version__.startswith("2.13"):  # the torch CI pins: the fast path must be live there
        assert jagged._fast_njt_ok()


def test_ragged_cache_shares_offsets_of_equal_lengths() -> None:
    cache = RaggedCache()
    a = cache(offsets_from_lengths([2, 3]))
    assert cache(offsets_from_lengths([2, 3])) is a  # equal values, another tensor
    assert cache(offsets_from_lengths([3, 2])) is not a
    x = to_nested(torch.arange(5.0), a.offsets, ragged=a)
    y = to_nested(torch.ones(5), a.offsets, ragged=a)
    assert (x + y).values().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_pack_nested_of_views_and_holes() -> None:
    values = torch.arange(10)
    nt = torch.nested.nested_tensor_from_jagged(values, torch.tensor([2, 4, 7]))  # starts at 2, ends before 10
    v, o = pack_nested(nt)
    assert v.tolist() == [2, 3, 4, 5, 6] and o.tolist() == [0, 2, 5]
    holes = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 4, 8]), lengths=torch.tensor([1, 3]))
    v, o = pack_nested(holes)
    assert v.tolist() == [0, 4, 5, 6] and o.tolist() == [0, 1, 4]


def test_equal_lengths_are_zero_copy() -> None:
    values = torch.arange(12)
    offsets = offsets_from_lengths([4, 4, 4])
    out = materialize(values, offsets)
    assert out.data_ptr() == values.data_ptr() and out.shape == (3, 4)
    padded = torch.arange(12).view(3, 4)
    v, _ = pack(padded, [4, 4, 4])
    assert v.data_ptr() == padded.data_ptr()


def test_pack_validates() -> None:
    with pytest.raises(InvalidArgument):
        pack(torch.zeros(2, 3), [1, 4])
    with pytest.raises(InvalidArgument):
        pack(torch.zeros(2, 3), [1])
    with pytest.raises(InvalidArgument):
        padded_width(5, pad_to_length=3)
    with pytest.raises(InvalidArgument):
        padded_width(5, pad_to_multiple=0)


@given(st.lists(object_values, min_size=1, max_size=10))
def test_objects_round_trip_msgpack(rows: list[object]) -> None:
    values, offsets = encode_objects("f", rows, "msgpack")
    assert values.dtype == torch.uint8
    assert decode_objects("f", values, offsets, "msgpack", allow_pickle=False) == rows


class Custom:
    """Not msgpack-encodable; picklable because it is defined at module level."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom)

    __hash__ = object.__hash__


def test_pickle_needs_opt_in_by_name() -> None:
    with pytest.raises(SchemaError, match="pickle_fields"):
        encode_fields({"o": [Custom()]}, 1)
    cols = encode_fields({"o": [Custom()]}, 1, pickle_fields={"o"})
    col = cols["o"]
    assert col.schema.codec == "pickle"
    assert col.offsets is not None
    with pytest.raises(SchemaError, match="pickle"):
        decode_objects("o", col.values, col.offsets, "pickle", allow_pickle=False)
    assert decode_objects("o", col.values, col.offsets, "pickle", allow_pickle=True) == [Custom()]


def test_encode_fields_kinds() -> None:
    import numpy as np

    cols = encode_fields(
        {
            "dense": torch.zeros(2, 3),
            "scalar": np.arange(2),
            "rows": [torch.zeros(1, 4), torch.zeros(3, 4)],
            "objs": np.array(["a", None], dtype=object),
        },
        2,
    )
    assert [c.schema.kind for c in cols.values()] == ["dense", "dense", "jagged", "object"]
    assert cols["rows"].schema.inner_shape == (4,)
    with pytest.raises(SchemaError):
        encode_fields({"x": [torch.zeros(1, 2), torch.zeros(1, 3)]}, 2)
