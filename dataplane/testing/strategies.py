"""Hypothesis strategies for ragged RL batches, shared by the conformance suite and adapters' tests."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["ALL_DTYPES", "bit_exact", "key_lists", "lengths", "object_values", "random_tensor", "ragged_batches"]

ALL_DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "uint16", None),
        getattr(torch, "uint32", None),
        getattr(torch, "uint64", None),
    )
    if isinstance(d, torch.dtype)
)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads included); bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bit_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN == NaN when the bits agree)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def lengths(max_rows: int = 16, max_len: int = 64) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, max_len), min_size=1, max_size=max_rows)


def key_lists(min_size: int = 1, max_size: int = 16) -> st.SearchStrategy[list[str]]:
    return st.lists(
        st.from_regex(r"[a-z0-9]{1,8}_g[0-9]", fullmatch=True), min_size=min_size, max_size=max_size, unique=True
    )


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
object_values: st.SearchStrategy[Any] = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def ragged_batches(draw: st.DrawFn, max_rows: int = 12, max_len: int = 48) -> tuple[list[str], dict[str, Any]]:
    """``(keys, fields)``: a jagged token field, a dense field, a ``[B]`` scalar and an object column."""
    keys = draw(key_lists(1, max_rows))
    b = len(keys)
    lens = draw(st.lists(st.integers(0, max_len), min_size=b, max_size=b))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    inner = draw(st.sampled_from([(), (3,)]))
    rows = [random_tensor((n, *inner), dtype, seed + i) for i, n in enumerate(lens)]
    fields: dict[str, Any] = {
        "tokens": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
        "dense": random_tensor((b, 2, 3), dtype, seed),
        "scalar": random_tensor((b,), torch.float32, seed + 1),
        "obj": draw(st.lists(object_values, min_size=b, max_size=b)),
    }
    return keys, fields
