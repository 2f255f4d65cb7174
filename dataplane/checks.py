"""Argument checks for scalars: an int in a range, a number in a range.

Both raise :class:`~dataplane.errors.InvalidArgument` with one message style that names the
parameter, the range and the value given (``"dp must be an int >= 1, got 0"``), and both refuse
``bool``: ``True`` is never a count nor a number here. Public, so the layers above the core
(``integrations``) use the same checks::

    from dataplane.checks import check_int, check_number
"""

from __future__ import annotations

import numbers
from typing import Literal, overload

import numpy as np

from dataplane.errors import InvalidArgument

__all__ = ["check_int", "check_number"]


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
