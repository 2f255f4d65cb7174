"""Rows as columns: helpers shared by the stores that keep a partition's rows as slots (one per live
key) and per field arrays over slots, instead of one Python object per row."""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["NONE", "add_keys", "described", "grown", "lookup", "merged_tags"]

NONE = -1  # no put holds this field for this slot (or: a dead slot)


def lookup(rows: Mapping[str, int], keys: Sequence[str]) -> np.ndarray:
    """The slot of each of ``keys`` in ``rows`` (key -> slot), ``NONE`` where absent. When every key
    is there (a get, a write-back) one C-level pass finds them, a third faster than a Python one at
    64K keys."""
    n = len(keys)
    if n and rows:
        try:
            found = operator.itemgetter(*keys)(rows)
        except KeyError:
            pass
        else:
            return np.array(found if n > 1 else (found,), dtype=np.int64)
    if not rows:
        return np.full(n, NONE, dtype=np.int64)
    get = rows.get
    return np.array([get(k, NONE) for k in keys], dtype=np.int64)


def add_keys(rows: dict[str, int], keys: Sequence[str], slots: np.ndarray, fresh: np.ndarray, new: np.ndarray) -> None:
    """Give the keys at positions ``fresh`` of ``keys`` (those :func:`lookup` found absent) the slots
    ``new``: in ``slots`` (their lookup) and in ``rows``."""
    slots[fresh] = new
    new_keys = keys if len(fresh) == len(keys) else [keys[i] for i in fresh.tolist()]
    rows.update(zip(new_keys, new.tolist(), strict=True))


def grown(a: np.ndarray, size: int) -> np.ndarray:
    """``a`` extended to ``size`` entries, the new ones ``NONE``."""
    out = np.full(size, NONE, dtype=a.dtype)
    out[: len(a)] = a
    return out


def merged_tags(
    tagged: Iterable[tuple[np.ndarray, Sequence[Mapping[str, Any]]]], rows: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """Every key of ``rows`` (key -> slot) with its tags: the tags of each put (slot of each of its
    rows, their tags), merged in put order; slots ``NONE`` are skipped."""
    tags: dict[int, dict[str, Any]] = {}
    for slots, put_tags in tagged:
        for s, t in zip(slots.tolist(), put_tags, strict=True):
            if t and s != NONE:
                mine = tags.get(s)
                if mine is None:
                    tags[s] = dict(t)
                else:
                    mine.update(t)
    if not tags:
        return {k: {} for k in rows}
    return {k: tags.get(s) or {} for k, s in rows.items()}


# tag values a caller cannot change in place: a merged tag dict holding only these needs no deep copy
_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def described(
    slots: np.ndarray,
    held: Mapping[str, np.ndarray],
    tagged: Iterable[tuple[np.ndarray, Sequence[Mapping[str, Any]] | None]],
) -> list[tuple[frozenset[str], dict[str, Any]] | None]:
    """Per slot of ``slots`` (distinct, but for ``NONE``: an absent key): the fields it holds and its
    merged tags, or None. ``held``: field -> array over slots, ``NONE`` where no put holds the field
    for the slot; ``tagged``: (slot of each row, ``NONE`` for a dead one; tags) per put, in put
    order. Costs one pass over the puts' tags, no listing: the rows of a put none of whose slots is
    asked for are skipped in C."""
    n = len(slots)
    live = slots != NONE
    names = list(held)
    # one bit per field; rows with the same bits share one frozenset
    bits = np.zeros(n, dtype=object if len(names) > 62 else np.int64)
    for i, name in enumerate(names):
        col = held[name]
        inside = live & (slots < len(col))
        has = np.zeros(n, dtype=bool)
        has[inside] = col[slots[inside]] != NONE
        bits[has] += 1 << i
    asked = slots[live]
    top = int(asked.max()) + 1 if len(asked) else 0
    want = np.zeros(top + 1, dtype=bool)  # per slot, and False at [top] for every slot outside
    want[asked] = True
    merged: dict[int, dict[str, Any]] = {}  # slot -> its merged tags (a copy)
    for put_slots, put_tags in tagged:
        if not put_tags or not top:
            continue
        pick = want[np.where((put_slots >= 0) & (put_slots < top), put_slots, top)]
        rows = put_slots.tolist()
        if pick.all():
            pairs: Iterable[tuple[int, Mapping[str, Any]]] = zip(rows, put_tags, strict=True)
        else:
            pairs = ((rows[j], put_tags[j]) for j in np.flatnonzero(pick).tolist())
        for s, t in pairs:
            if t:
                mine = merged.get(s)
                if mine is None:
                    merged[s] = dict(t)
                else:
                    mine.update(t)
    # whether any merged tags hold a value the caller could change in place (one pass in C)
    nested = not _SCALARS.issuperset(map(type, itertools.chain.from_iterable(map(dict.values, merged.values()))))
    sets: dict[int, frozenset[str]] = {}
    out: list[tuple[frozenset[str], dict[str, Any]] | None] = []
    for s, b in zip(slots.tolist(), bits.tolist(), strict=True):
        if s == NONE:
            out.append(None)
            continue
        fields = sets.get(b)
        if fields is None:
            fields = sets[b] = frozenset(name for i, name in enumerate(names) if b >> i & 1)
        tags = merged.get(s)
        if tags is None:
            tags = {}
        elif nested and not _SCALARS.issuperset(map(type, tags.values())):
            tags = copy.deepcopy(tags)  # the caller's to change
        out.append((fields, tags))
    return out
