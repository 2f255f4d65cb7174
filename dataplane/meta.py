"""KVBatchMeta: the small handle to a batch of rows in the store.

The driver passes metas around instead of tensors. Every transform is pure (no I/O) and returns a
new meta whose keys, sequence lengths and tags stay aligned row by row.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from dataplane.errors import InvalidArgument, SchemaError

__all__ = ["MAX_KEY_LEN", "KVBatchMeta", "RowInfo", "check_keys", "trusted_meta"]

MAX_KEY_LEN = 512
"""The most characters a key holds (a uid longer than this: store a hash of it, e.g. its sha256 hex)."""

# what no key may hold: NUL (C strings and SQLite end there) and lone surrogates (not Unicode text:
# they cannot be encoded as UTF-8, which every backend's wire format and msgpack need)
_BAD_KEY_CHAR = re.compile("[\x00\ud800-\udfff]")


def _key_problem(k: object) -> str | None:
    """Why ``k`` is not a key (the rule of :func:`check_keys`), or None."""
    if not isinstance(k, str):
        return f"every key must be a str, got {type(k).__name__} ({k!r}); mint keys like f'{{uid}}_g{{i}}'"
    if not k:
        return "keys must be non-empty strings, got ''"
    if len(k) > MAX_KEY_LEN:
        return (
            f"key {k[:40]!r}... has {len(k)} characters, over the {MAX_KEY_LEN} a key holds; use a digest of "
            "longer ids (hashlib.sha256(uid.encode()).hexdigest())"
        )
    bad = _BAD_KEY_CHAR.search(k)
    if bad is not None:
        what = "NUL ('\\x00')" if bad.group() == "\x00" else f"a lone surrogate ({bad.group()!r}: not Unicode text)"
        return f"key {k[:40]!r} holds {what} at index {bad.start()}; drop or replace it (every other character is fine)"
    return None


def check_keys(keys: object, *, what: str = "keys", allow_empty: bool = False) -> list[str]:
    """``keys`` as a list, or raises: the one key rule of every backend, checked before any adapter
    sees a key.

    A key is any ``str`` of 1 to :data:`MAX_KEY_LEN` (512) characters without NUL (``"\\x00"``) and
    without lone surrogates: non-ASCII, whitespace, control characters, ``/``, ``:``, ``@``, ``..`` are
    all fine. Keys are compared as they are, code point by code point: two spellings of one text in
    different Unicode normal forms are two keys (normalise uids yourself, ``unicodedata.normalize``,
    where a dataset mixes forms). A batch's keys are unique.

    Raises:
        SchemaError: ``keys`` is not a list (or tuple) of ``str``.
        InvalidArgument: a key breaks the rule, or is repeated.

    >>> check_keys(["ключ", "鍵", "a b", "k:1@f"])
    ['ключ', '鍵', 'a b', 'k:1@f']
    >>> check_keys(["a\\x00b"])
    Traceback (most recent call last):
    ...
    dataplane.errors.InvalidArgument: key 'a\\x00b' holds NUL ('\\x00') at index 1; drop or replace it (every other character is fine)
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise SchemaError(f"{what} must be a list of str, got {type(keys).__name__}")
    out = list(keys)
    if not out:
        if allow_empty:
            return out
        raise InvalidArgument(f"{what} is empty; give at least one key")
    # C-level passes first (a batch has hundreds of keys); the loop names the bad key
    lengths = set(map(len, out)) if set(map(type, out)) == {str} else None
    if lengths is not None and min(lengths) > 0 and max(lengths) <= MAX_KEY_LEN:
        # printable text holds neither NUL nor surrogates: the usual batch needs no regex
        ok = "".join(out).isprintable() or _BAD_KEY_CHAR.search("".join(out)) is None
    else:
        ok = False
    if not ok:
        for k in out:
            problem = _key_problem(k)
            if problem is not None:
                raise (InvalidArgument if isinstance(k, str) else SchemaError)(problem)
    if len(set(out)) != len(out):
        seen: set[str] = set()
        dups = [k for k in out if k in seen or seen.add(k)]  # type: ignore[func-returns-value]
        raise InvalidArgument(f"{what} must be unique; duplicated: {dups[:8]}")
    return out


def _rows(name: str, value: Iterable[Any] | None, n: int) -> tuple[Any, ...] | None:
    if value is None:
        return None
    out = tuple(value)
    if len(out) != n:
        raise InvalidArgument(f"{name} has {len(out)} entries but there are {n} keys; give one per key")
    return out


_REPR_KEYS = 3  # keys a repr shows


@dataclass(frozen=True, slots=True)
class RowInfo:
    """What one stored row holds, as :meth:`~dataplane.DataPlaneClient.kv_describe` reports it.

    Attributes:
        fields: the fields the row holds (empty for a tag-only row).
        tags: its tags, merged over every put that wrote it (a copy: changing it changes nothing).

    >>> RowInfo(frozenset({"reward"}), {"step": 3}).fields
    frozenset({'reward'})
    """

    fields: frozenset[str]
    tags: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class KVBatchMeta:
    """Keys of a batch of rows in one partition, plus what the driver knows about them.

    Args:
        partition_id: address space of the keys ("train", "val", ...).
        keys: one id per row, minted once and reused for every read and write of that row.
        fields: fields known to be present on every row.
        sequence_lengths: valid (unpadded) token count per row, used for balancing.
        tags: per-row dict of primitives (reward, weight version, ...), for filtering without I/O.
        extra_info: batch-level values (pad length, microbatch plan, ...).
        task_name: optional label.
        deployment: the ``deployment_id`` of the store a put wrote these rows to, stamped by the put
            ("" for a meta built by hand: never checked). A get through a client of another
            deployment raises ``DeploymentMismatch`` before any I/O.
        deployment_url: that store's ``client.url`` when the put stamped it, to name it in errors.

    >>> m = KVBatchMeta(partition_id="train", keys=["a", "b"], fields=["ids"], sequence_lengths=[3, 5])
    >>> m.subset([1]).keys
    ('b',)
    """

    partition_id: str
    keys: tuple[str, ...]
    fields: tuple[str, ...] = ()
    sequence_lengths: tuple[int, ...] | None = None
    tags: tuple[dict[str, Any], ...] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    task_name: str | None = None
    deployment: str = ""
    deployment_url: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.partition_id, str) or not self.partition_id:
            raise InvalidArgument(f"partition_id must be a non-empty str, got {self.partition_id!r}")
        if isinstance(self.keys, (str, bytes)):
            raise SchemaError("keys must be a sequence of str, not a single str")
        keys = tuple(check_keys(tuple(self.keys), allow_empty=True))
        fields = tuple(self.fields)
        if len(set(fields)) != len(fields):
            raise InvalidArgument(f"fields must be unique, got {list(fields)}")
        n = len(keys)
        lengths = _rows("sequence_lengths", self.sequence_lengths, n)
        if lengths is not None:
            lengths = tuple(map(int, lengths))
            if lengths and min(lengths) < 0:
                raise InvalidArgument("sequence_lengths must be >= 0")
        tags = _rows("tags", self.tags, n)
        if tags is not None:
            if not all(isinstance(t, Mapping) for t in tags):
                raise SchemaError("tags must be one dict per key")
            tags = tuple(dict(t) for t in tags)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "sequence_lengths", lengths)
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "extra_info", dict(self.extra_info))
        for name in ("deployment", "deployment_url"):
            if not isinstance(getattr(self, name), str):
                raise SchemaError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")

    # -- size -----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        """Short whatever the batch: counts, the partition, the first keys, the fields, and the names
        (not the values) of ``extra_info``, where adapters keep read hints and binary indexes."""
        keys = ", ".join(repr(k if len(k) <= 40 else k[:37] + "...") for k in self.keys[:_REPR_KEYS])
        if len(self.keys) > _REPR_KEYS:
            keys += f", ... ({len(self.keys)} in all)"
        parts = [f"partition_id={self.partition_id!r}", f"rows={len(self.keys)}", f"keys=[{keys}]"]
        parts.append(f"fields={list(self.fields)!r}")
        if self.sequence_lengths is not None:
            parts.append(f"tokens={self.total_tokens}")
        if self.tags is not None:
            parts.append("tags=...")
        if self.extra_info:
            parts.append(f"extra_info=<{', '.join(sorted(map(str, self.extra_info)))}>")
        if self.task_name is not None:
            parts.append(f"task_name={self.task_name!r}")
        return f"KVBatchMeta({', '.join(parts)})"

    @property
    def total_tokens(self) -> int | None:
        return None if self.sequence_lengths is None else sum(self.sequence_lengths)

    # -- pure transforms --------------------------------------------------------------------------
    def _take(self, idx: Sequence[int]) -> KVBatchMeta:
        n = len(self.keys)
        for i in idx:
            if not -n <= i < n:
                raise InvalidArgument(f"row index {i} out of range for a batch of {n}")
        lens, tags = self.sequence_lengths, self.tags
        return replace(
            self,
            keys=tuple(self.keys[i] for i in idx),
            sequence_lengths=None if lens is None else tuple(lens[i] for i in idx),
            tags=None if tags is None else tuple(copy.deepcopy(tags[i]) for i in idx),
            extra_info=copy.deepcopy(self.extra_info),
        )

    def subset(self, indices: Sequence[int]) -> KVBatchMeta:
        """Rows at ``indices``, in that order (a key may not repeat)."""
        return self._take([int(i) for i in indices])

    def reorder(self, indices: Sequence[int]) -> KVBatchMeta:
        """A permutation of all rows: row ``j`` of the result is row ``indices[j]`` of this meta."""
        idx = [int(i) for i in indices]
        if sorted(idx) != list(range(len(self.keys))):
            raise InvalidArgument(f"reorder needs a permutation of range({len(self.keys)})")
        return self._take(idx)

    def slice(self, start: int, stop: int | None = None) -> KVBatchMeta:
        return self._take(list(range(len(self.keys)))[start:stop])

    def drop(self, keys: Iterable[str]) -> KVBatchMeta:
        """All rows except those whose key is in ``keys`` (unknown keys raise)."""
        gone = set(keys)
        unknown = gone.difference(self.keys)
        if unknown:
            raise InvalidArgument(f"cannot drop keys not in this meta: {sorted(unknown)[:8]}")
        return self._take([i for i, k in enumerate(self.keys) if k not in gone])

    def with_fields(self, fields: Iterable[str], *, replace_all: bool = False) -> KVBatchMeta:
        """Add ``fields`` to the known fields (or replace them with ``replace_all=True``)."""
        new = tuple(fields)
        merged = new if replace_all else self.fields + tuple(f for f in new if f not in self.fields)
        return replace(self, fields=tuple(dict.fromkeys(merged)))

    def stamp_tags(self, tags: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> KVBatchMeta:
        """Merge one dict into every row's tags, or one dict per row."""
        per_row = [dict(tags)] * len(self.keys) if isinstance(tags, Mapping) else list(tags)
        if len(per_row) != len(self.keys):
            raise InvalidArgument(f"{len(per_row)} tag dicts for {len(self.keys)} keys")
        old = self.tags or tuple({} for _ in self.keys)
        return replace(self, tags=tuple({**o, **dict(t)} for o, t in zip(old, per_row, strict=True)))

    def with_extra_info(self, **values: Any) -> KVBatchMeta:
        return replace(self, extra_info={**self.extra_info, **values})

    def chunk(self, n: int) -> list[KVBatchMeta]:
        """Split into ``n`` consecutive chunks whose sizes differ by at most one (some may be empty)."""
        if n < 1:
            raise InvalidArgument(f"chunk count must be >= 1, got {n}")
        size, rest = divmod(len(self.keys), n)
        out, start = [], 0
        for i in range(n):
            stop = start + size + (1 if i < rest else 0)
            out.append(self.slice(start, stop))
            start = stop
        return out

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """Rows of this meta followed by the rows of ``others`` (same partition and deployment; fields
        intersect). A meta built by hand (no ``deployment``) takes the others' deployment."""
        metas = (self, *others)
        if len({m.partition_id for m in metas}) != 1:
            raise InvalidArgument("concat needs metas of one partition_id")
        stamped = {m.deployment: m for m in metas if m.deployment}
        if len(stamped) > 1:
            urls = sorted(m.deployment_url or m.deployment for m in stamped.values())
            raise InvalidArgument(
                f"concat needs metas of one deployment, got rows written to {len(stamped)}: {', '.join(urls)}; "
                "read each through a client of its own deployment"
            )
        origin = next(iter(stamped.values()), self)
        fields = [f for f in self.fields if all(f in m.fields for m in others)]
        lens = None
        if all(m.sequence_lengths is not None for m in metas):
            lens = tuple(x for m in metas for x in (m.sequence_lengths or ()))
        tags = None
        if any(m.tags is not None for m in metas):
            tags = tuple(t for m in metas for t in (m.tags or tuple({} for _ in m.keys)))
        return replace(
            self,
            keys=tuple(k for m in metas for k in m.keys),
            fields=tuple(fields),
            sequence_lengths=lens,
            tags=tags,
            extra_info=copy.deepcopy(self.extra_info),
            deployment=origin.deployment,
            deployment_url=origin.deployment_url,
        )

    def select_tags(self, predicate: Any) -> KVBatchMeta:
        """Rows whose tags satisfy ``predicate(tags_dict) -> bool``."""
        tags = self.tags or tuple({} for _ in self.keys)
        return self._take([i for i, t in enumerate(tags) if predicate(t)])

    # -- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "partition_id": self.partition_id,
            "keys": list(self.keys),
            "fields": list(self.fields),
            "sequence_lengths": None if self.sequence_lengths is None else list(self.sequence_lengths),
            "tags": None if self.tags is None else [dict(t) for t in self.tags],
            "extra_info": dict(self.extra_info),
            "task_name": self.task_name,
            "deployment": self.deployment,
            "deployment_url": self.deployment_url,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVBatchMeta:
        return cls(
            partition_id=d["partition_id"],
            keys=d["keys"],
            fields=d.get("fields") or (),
            sequence_lengths=d.get("sequence_lengths"),
            tags=d.get("tags"),
            extra_info=d.get("extra_info") or {},
            task_name=d.get("task_name"),
            deployment=d.get("deployment") or "",
            deployment_url=d.get("deployment_url") or "",
        )

    def to_msgpack(self) -> bytes:
        out = msgpack.packb(self.to_dict(), use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    @classmethod
    def from_msgpack(cls, data: bytes) -> KVBatchMeta:
        return cls.from_dict(msgpack.unpackb(data, raw=False, strict_map_key=False))


def trusted_meta(
    *,
    partition_id: str,
    keys: tuple[str, ...],
    fields: tuple[str, ...],
    sequence_lengths: tuple[int, ...] | None,
    tags: tuple[dict[str, Any], ...] | None,
    deployment: str = "",
    deployment_url: str = "",
) -> KVBatchMeta:
    """A meta of parts the caller has already checked and normalized, as ``KVBatchMeta(...)`` would
    (the client's put, which checks every part of its call first: checking again costs every put)."""
    meta = object.__new__(KVBatchMeta)
    for name, value in (
        ("partition_id", partition_id),
        ("keys", keys),
        ("fields", fields),
        ("sequence_lengths", sequence_lengths),
        ("tags", tags),
        ("extra_info", {}),
        ("task_name", None),
        ("deployment", deployment),
        ("deployment_url", deployment_url),
    ):
        object.__setattr__(meta, name, value)
    return meta
