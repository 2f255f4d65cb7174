"""Argument checks for scalars: an int in a range, a number in a range, a size in bytes.

Each raises :class:`~dataplane.errors.InvalidArgument` with one message style that names the
parameter, the range and the value given (``"dp must be an int >= 1, got 0"``), and each refuses
``bool``: ``True`` is never a count nor a number here. Public, so the layers above the core
(``integrations``, third-party adapters) use the same checks::

    from dataplane.checks import check_bytes, check_int, check_number, parse_bytes

:func:`check_bytes` is the one size syntax of every byte-count option of every backend
(``capacity_bytes``, ``segment_bytes``, ...): ``67108864``, ``"64MiB"``, ``"64MB"``, ``"1GiB"``,
``"1.5G"``, ``"1e9"``, the same in a URL, a keyword or a config object.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Literal, overload

import numpy as np

from dataplane.errors import InvalidArgument

__all__ = ["SIZE_EXAMPLES", "check_bytes", "check_int", "check_number", "parse_bytes"]


def _range(low: object, high: object, low_open: bool, high_open: bool) -> str:
    """`` >= 1``, `` < 3600``, `` in [0, 1]``, ... (empty without bounds)."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


@overload
def check_int(
    name: str,
    value: object,
    *,
    low: int | None = ...,
    high: int | None = ...,
    allow_none: Literal[False] = ...,
    allow_numpy: bool = ...,
) -> int: ...
@overload
def check_int(
    name: str,
    value: object,
    *,
    low: int | None = ...,
    high: int | None = ...,
    allow_none: bool,
    allow_numpy: bool = ...,
) -> int | None: ...
def check_int(
    name: str,
    value: object,
    *,
    low: int | None = 0,
    high: int | None = None,
    allow_none: bool = False,
    allow_numpy: bool = False,
) -> int | None:
    """``value`` as an ``int`` if it is one in ``[low, high]`` (both inclusive), else ``InvalidArgument``.

    Args:
        name: the parameter, as the message names it (``"dp"``, ``"TinyConfig.dim"``, ``"--steps"``).
        value: what the caller gave.
        low: the smallest value allowed (None: no lower bound).
        high: the largest value allowed (None: no upper bound).
        allow_none: let ``None`` through (returned as is).
        allow_numpy: accept numpy integers too (returned as ``int``).

    Returns:
        ``int(value)``, or None when ``value`` is None and ``allow_none`` is set.

    Raises:
        InvalidArgument: ``value`` is a bool, not an int (a float such as ``3.0`` included), or out of
            range.

    >>> check_int("dp", 2, low=1)
    2
    >>> check_int("dp", 3.0, low=1)
    Traceback (most recent call last):
    ...
    dataplane.errors.InvalidArgument: dp must be an int >= 1, got 3.0
    >>> check_int("rank", 4, low=0, high=3)
    Traceback (most recent call last):
    ...
    dataplane.errors.InvalidArgument: rank must be an int in [0, 3], got 4
    >>> check_int("pad_to_length", None, allow_none=True) is None
    True
    """
    if value is None and allow_none:
        return None
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif allow_numpy and isinstance(value, np.integer):
        number = int(value)
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        bounds = _range(low, high, False, False)
        raise InvalidArgument(f"{name} must be an int{bounds}{' or None' if allow_none else ''}, got {value!r}")
    return int(number)


@overload
def check_number(
    name: str,
    value: object,
    *,
    low: float | None = ...,
    high: float | None = ...,
    low_open: bool = ...,
    high_open: bool = ...,
    allow_none: Literal[False] = ...,
) -> float: ...
@overload
def check_number(
    name: str,
    value: object,
    *,
    low: float | None = ...,
    high: float | None = ...,
    low_open: bool = ...,
    high_open: bool = ...,
    allow_none: bool,
) -> float | None: ...
def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> float | None:
    """``value`` as a ``float`` if it is a real number within the bounds, else ``InvalidArgument``.

    A number is any real (``int``, ``float``, numpy scalars, ...) but a bool. NaN fails every bound.

    Args:
        name: the parameter, as the message names it.
        value: what the caller gave.
        low: the lower bound (None: none); inclusive unless ``low_open``.
        high: the upper bound (None: none); inclusive unless ``high_open``.
        low_open: ``value`` must be greater than ``low`` (``> 0``), not merely equal.
        high_open: ``value`` must be below ``high`` (``< 3600``).
        allow_none: let ``None`` through (returned as is).

    Returns:
        ``float(value)``, or None when ``value`` is None and ``allow_none`` is set.

    Raises:
        InvalidArgument: ``value`` is a bool, not a real number, or out of range.

    >>> check_number("timeout_s", 5, low=0, low_open=True)
    5.0
    >>> check_number("latency_s", 3600, low=0, high=3600, high_open=True)
    Traceback (most recent call last):
    ...
    dataplane.errors.InvalidArgument: latency_s must be a number in [0, 3600), got 3600
    >>> check_number("clip", None, low=0, allow_none=True) is None
    True
    """
    if value is None and allow_none:
        return None
    number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    if (
        number is None
        or (low is not None and not (number > low if low_open else number >= low))
        or (high is not None and not (number < high if high_open else number <= high))
    ):
        bounds = _range(low, high, low_open, high_open)
        raise InvalidArgument(f"{name} must be a number{bounds}{' or None' if allow_none else ''}, got {value!r}")
    return number


SIZE_EXAMPLES = "67108864, 64MiB, 1GiB or 1.5GB"
"""What a message suggests where a size is expected."""

# a number (decimal or exponent form), then an optional unit: K, M, G or T, each with an optional
# "i" and an optional "B" (KiB, KB, K, Ki), or B alone
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(e[+-]?[0-9]+)?\s*(?:([kmgt])(i?)b?|b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: object) -> int:
    """A size in bytes from an int or a str (:func:`check_bytes` names the option and bounds it).

    Units are binary whether or not they say so, as Mooncake reads them (``"1GB"`` and ``"1GiB"``
    are both 2**30 bytes); case and a space before the unit do not matter; a fraction of a byte is
    dropped.

    Raises:
        InvalidArgument: ``value`` is not a size (a bool, a negative number and NaN included).

    >>> parse_bytes("64MiB"), parse_bytes("1GB"), parse_bytes("1.5 g"), parse_bytes("1e9"), parse_bytes(4096)
    (67108864, 1073741824, 1610612736, 1000000000, 4096)
    """
    number = _size(value)
    if number is None or number < 0:
        raise InvalidArgument(f"not a size: {value!r}; give bytes as {SIZE_EXAMPLES}")
    return number


def _size(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return int(number) if math.isfinite(number) else None
    if not isinstance(value, str):
        return None
    m = _SIZE_RE.fullmatch(value.strip())
    if m is None:
        return None
    digits, exponent, unit, _ = m.groups()
    scale = _UNITS[(unit or "").lower()]
    if exponent is None and "." not in digits:
        return int(digits) * scale  # exact, however large
    number = float(digits + (exponent or "")) * scale
    return int(number) if math.isfinite(number) else None


@overload
def check_bytes(name: str, value: object, *, low: int = ..., allow_none: Literal[False] = ...) -> int: ...
@overload
def check_bytes(name: str, value: object, *, low: int = ..., allow_none: bool) -> int | None: ...
def check_bytes(name: str, value: object, *, low: int = 0, allow_none: bool = False) -> int | None:
    """``value`` as a byte count ``>= low``: an int, or a size such as ``"64MiB"`` (as :func:`parse_bytes`).

    The one parser of every byte-count option of every backend, whether the option comes from a
    URL query, a keyword or a config object.

    Args:
        name: the option, as the message names it (``"capacity_bytes"``).
        value: what the caller gave.
        low: the smallest count allowed.
        allow_none: let ``None`` through (returned as is: "unbounded").

    Raises:
        InvalidArgument: ``value`` is not a size (a bool included), or is below ``low``.

    >>> check_bytes("capacity_bytes", "64MiB")
    67108864
    >>> check_bytes("segment_bytes", "lots")
    Traceback (most recent call last):
    ...
    dataplane.errors.InvalidArgument: segment_bytes must be a size in bytes >= 0 (67108864, 64MiB, 1GiB or 1.5GB), got 'lots'
    """
    if value is None and allow_none:
        return None
    number = _size(value)
    if number is None or number < low:
        also = " or None" if allow_none else ""
        raise InvalidArgument(f"{name} must be a size in bytes >= {low}{also} ({SIZE_EXAMPLES}), got {value!r}")
    return number
