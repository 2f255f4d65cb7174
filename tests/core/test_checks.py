"""``dataplane.checks``: the int, number and size argument checks every layer uses, and their messages."""

from __future__ import annotations

import doctest
import math
from fractions import Fraction

import numpy as np
import pytest

import dataplane.checks
from dataplane.checks import SIZE_EXAMPLES, check_bytes, check_int, check_number, parse_bytes
from dataplane.errors import InvalidArgument


def test_doctests() -> None:
    result = doctest.testmod(dataplane.checks)
    assert result.failed == 0 and result.attempted > 0


# -- check_int ---------------------------------------------------------------------------------------
def test_check_int_returns_the_int() -> None:
    assert check_int("n", 0) == 0  # low defaults to 0, inclusive
    assert check_int("n", 7, low=1, high=7) == 7  # high inclusive
    assert check_int("n", -3, low=None) == -3
    assert type(check_int("n", np.int64(4), allow_numpy=True)) is int


@pytest.mark.parametrize("bad", [True, False, 3.0, 1.5, "3", None, np.int64(3), np.float64(3.0)])
def test_check_int_refuses_what_is_not_an_int(bad: object) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_int("steps", bad, low=1)
    assert str(info.value) == f"steps must be an int >= 1, got {bad!r}"


def test_check_int_numpy_only_when_asked() -> None:
    assert check_int("dp", np.int32(2), low=1, allow_numpy=True) == 2
    with pytest.raises(InvalidArgument) as info:
        check_int("dp", np.int64(0), low=1, allow_numpy=True)
    assert str(info.value) == f"dp must be an int >= 1, got {np.int64(0)!r}"
    with pytest.raises(InvalidArgument):
        check_int("dp", np.bool_(True), low=0, allow_numpy=True)  # numpy's bool is no integer either


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"low": 1}, 0, "x must be an int >= 1, got 0"),
        ({}, -1, "x must be an int >= 0, got -1"),
        ({"low": 0, "high": 3}, 4, "x must be an int in [0, 3], got 4"),
        ({"low": None, "high": 3}, 4, "x must be an int <= 3, got 4"),
        ({"low": None}, 2.5, "x must be an int, got 2.5"),
        ({"low": 1, "allow_none": True}, 0, "x must be an int >= 1 or None, got 0"),
    ],
)
def test_check_int_bounds_and_messages(kwargs: dict[str, object], value: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_int("x", value, **kwargs)  # type: ignore[call-overload]
    assert str(info.value) == message


def test_check_int_none_only_with_allow_none() -> None:
    assert check_int("micro_batch_size", None, low=1, allow_none=True) is None
    with pytest.raises(InvalidArgument, match="micro_batch_size must be an int >= 1, got None"):
        check_int("micro_batch_size", None, low=1)


# -- check_number ------------------------------------------------------------------------------------
def test_check_number_returns_a_float() -> None:
    assert check_number("x", 2) == 2.0 and type(check_number("x", 2)) is float
    assert check_number("x", np.float32(0.5), low=0, high=1) == 0.5
    assert check_number("x", Fraction(1, 4), low=0) == 0.25
    assert check_number("x", -math.inf) == -math.inf  # no bounds: any real


@pytest.mark.parametrize("bad", [True, False, "1", None, [1.0], complex(1, 0)])
def test_check_number_refuses_what_is_not_a_number(bad: object) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_number("kl_coef", bad, low=0)
    assert str(info.value) == f"kl_coef must be a number >= 0, got {bad!r}"


@pytest.mark.parametrize(
    ("kwargs", "ok", "bad", "message"),
    [
        ({"low": 0}, 0, -0.1, "x must be a number >= 0, got -0.1"),
        ({"low": 0, "low_open": True}, 1e-9, 0, "x must be a number > 0, got 0"),
        ({"high": 1}, 1, 1.5, "x must be a number <= 1, got 1.5"),
        ({"high": 1, "high_open": True}, 0.99, 1, "x must be a number < 1, got 1"),
        ({"low": 0, "high": 1}, 1.0, 1.01, "x must be a number in [0, 1], got 1.01"),
        ({"low": 0, "high": 3600, "high_open": True}, 0, 3600, "x must be a number in [0, 3600), got 3600"),
        ({"low": 0, "high": 1, "low_open": True}, 0.5, 0, "x must be a number in (0, 1], got 0"),
        ({"low": 0, "high": math.inf, "high_open": True}, 1e300, math.inf, "x must be a number in [0, inf), got inf"),
        ({"low": 0, "allow_none": True}, None, -1, "x must be a number >= 0 or None, got -1"),
    ],
)
def test_check_number_bounds_and_messages(kwargs: dict[str, object], ok: object, bad: object, message: str) -> None:
    check_number("x", ok, **kwargs)  # type: ignore[call-overload]
    with pytest.raises(InvalidArgument) as info:
        check_number("x", bad, **kwargs)  # type: ignore[call-overload]
    assert str(info.value) == message


def test_check_number_nan_fails_every_bound() -> None:
    for kwargs in ({"low": 0}, {"high": 1}, {"low": 0, "high": 1, "high_open": True}):
        with pytest.raises(InvalidArgument, match="nan"):
            check_number("eps", math.nan, **kwargs)  # type: ignore[call-overload]


def test_check_number_none_only_with_allow_none() -> None:
    assert check_number("clip", None, low=0, allow_none=True) is None
    with pytest.raises(InvalidArgument, match="clip must be a number >= 0, got None"):
        check_number("clip", None, low=0)


def test_errors_are_value_errors() -> None:
    """InvalidArgument is a ValueError: callers catching ValueError keep working."""
    with pytest.raises(ValueError):
        check_int("n", -1)
    with pytest.raises(ValueError):
        check_number("n", -1, low=0)


# -- check_bytes / parse_bytes ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "want"),
    [
        (0, 0),
        (67108864, 64 << 20),
        (np.int64(4096), 4096),
        (1e9, 10**9),
        ("67108864", 64 << 20),
        (" 64MiB ", 64 << 20),
        ("64MB", 64 << 20),  # binary either way, as Mooncake reads sizes
        ("64 mb", 64 << 20),
        ("64M", 64 << 20),
        ("64Mi", 64 << 20),
        ("1GiB", 1 << 30),
        ("1gb", 1 << 30),
        ("1.5GiB", 3 << 29),
        (".5K", 512),
        ("2TiB", 2 << 40),
        ("512B", 512),
        ("1e9", 10**9),
        ("1E+3K", 1000 << 10),
        ("99999999999999999999999", 99999999999999999999999),  # exact, however large
    ],
)
def test_sizes_parse_alike_everywhere(given: object, want: int) -> None:
    assert parse_bytes(given) == check_bytes("x_bytes", given) == want
    assert type(check_bytes("x_bytes", given)) is int


@pytest.mark.parametrize("bad", ["", "lots", "64 parsecs", "MiB", "64iB", "-1", "1.2.3", "0x10", "1e400", "nan", "64 M B",
                                 True, -1, math.inf, math.nan, None, [1]])  # fmt: skip
def test_a_non_size_is_refused_with_examples(bad: object) -> None:
    with pytest.raises(InvalidArgument, match=f"^not a size: .*; give bytes as {SIZE_EXAMPLES}$"):
        parse_bytes(bad)
    with pytest.raises(InvalidArgument) as err:
        check_bytes("segment_bytes", bad)
    assert str(err.value) == f"segment_bytes must be a size in bytes >= 0 ({SIZE_EXAMPLES}), got {bad!r}"


def test_check_bytes_bounds_and_none() -> None:
    assert check_bytes("capacity_bytes", None, allow_none=True) is None
    assert check_bytes("segment_bytes", "1KiB", low=1024) == 1024
    with pytest.raises(InvalidArgument, match=r"^segment_bytes must be a size in bytes >= 1 \("):
        check_bytes("segment_bytes", 0, low=1)
    with pytest.raises(InvalidArgument, match=r">= 0 or None"):
        check_bytes("capacity_bytes", "x", allow_none=True)
