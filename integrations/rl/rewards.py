"""Rewards on text: the final answer of a math completion, checked against a reference.

:func:`math_reward` scores a completion 1.0 when its final answer equals the reference and 0.0
otherwise (no answer found counts as wrong). The final answer is what follows the last ``####``,
else the last ``\\boxed{...}``, else the last number in the text (:func:`extract_answer`); numbers
compare exactly after :func:`normalize_number` (commas, ``$`` and a trailing period dropped,
``72.0 == 72``, ``1/2 == 0.5``). Where ``math-verify`` is installed (``pip install math-verify``) and
``use_math_verify=True``, answers that are not plain numbers (``\\frac{144}{2}``, expressions) go
through it; it is called with its timeouts off, so it works in a Ray actor's threads.

>>> math_reward("so 12 + 7 = 19\\n#### 19", "19"), math_reward("#### 1,000", "1000"), math_reward("no idea", "3")
(1.0, 1.0, 0.0)
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = ["extract_answer", "math_reward", "normalize_number"]

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"[-+]?\$?\s*(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:\s*/\s*\d+)?")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: after the last ``####``, else in the last ``\\boxed{}``,
    else the last number; None when there is none.

    >>> extract_answer("48/2 = 24 <<48/2=24>>\\n#### 72"), extract_answer("\\\\boxed{\\\\frac{1}{2}}"), extract_answer("3 then 4.")
    ('72', '\\\\frac{1}{2}', '4.')
    """
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return str(hashes[-1]).strip()
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def normalize_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or None: thousands commas, ``$``, spaces and a trailing period
    are dropped; integers, decimals and ``a/b`` are read exactly.

    >>> normalize_number("$1,234.50"), normalize_number("-7"), normalize_number("3/4"), normalize_number("x")
    (Fraction(2469, 2), Fraction(-7, 1), Fraction(3, 4), None)
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def math_reward(completion: str, answer: str, *, use_math_verify: bool = True) -> float:
    """1.0 when ``completion``'s final answer equals ``answer`` (a reference such as GSM8K's text after
    ``####``), else 0.0; see the module docstring."""
    got = extract_answer(completion)
    if got is None:
        return 0.0
    want_n, got_n = normalize_number(answer), normalize_number(got)
    if want_n is not None and got_n is not None:
        return float(want_n == got_n)
    mv = _math_verify() if use_math_verify else None
    if mv is None:
        return float(got.strip() == answer.strip())
    gold = mv.parse(answer, parsing_timeout=None)
    pred = mv.parse(got if "\\" not in got else f"${got}$", parsing_timeout=None)
    return float(bool(gold) and bool(pred) and mv.verify(gold, pred, timeout_seconds=None))
