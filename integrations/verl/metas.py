"""The two metadata classes verl handles, with TransferQueue 0.1.11's behaviour where verl relies on it.

verl mutates its batch metas in place (``batch.reorder(idx)``, ``batch.extra_info.update(...)``) and
concatenates their key lists (``batch.keys + pad_keys``), so these are plain mutable objects with
list attributes, unlike :class:`dataplane.KVBatchMeta` (frozen, tuples). Both pickle by value: verl
sends them to its workers through Ray.

:class:`BatchMeta` is the worker-side handle (``tq.get_client().async_get_data(meta)``). In
TransferQueue its rows are integer ``global_indexes`` the controller maps to keys; here the
``global_indexes`` are the keys themselves (verl only hands them back to
``async_kv_retrieve_keys``), so no integer index has to be kept consistent across processes.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["BatchMeta", "KVBatchMeta"]

log = logging.getLogger(__name__)


def _split(n: int, chunks: int) -> list[range]:
    """``chunks`` contiguous ranges over ``n`` rows whose sizes differ by at most one (the first
    ``n % chunks`` one longer), as TransferQueue chunks."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if n < chunks:
        log.warning("chunking %d rows into %d chunks: some chunks are empty", n, chunks)
    base, extra = divmod(n, chunks)
    out, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def _check_permutation(indexes: Sequence[int], n: int) -> list[int]:
    idx = [int(i) for i in indexes]
    if len(idx) != n:
        raise ValueError(f"reorder got {len(idx)} indexes for a batch of {n}; give one per row")
    if len(set(idx)) != n:
        raise ValueError("reorder indexes contain duplicates")
    return idx


def _merged_extra_info(infos: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """The union of the ``extra_info`` of metas concatenated; one name's values must be equal."""
    merged: dict[str, Any] = {}
    for info in infos:
        for k, v in (info or {}).items():
            if k in merged and not _same(merged[k], v):
                raise ValueError(f"extra_info {k!r} differs between the metas concatenated")
            merged.setdefault(k, v)
    return merged


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors and arrays compare elementwise
        return a is b


class KVBatchMeta:
    """A batch of rows by key: ``keys``, one tag dict per key, the partition, the fields its rows
    share (or None) and batch-level ``extra_info``. Mutable, as verl uses it.

    >>> m = KVBatchMeta(keys=["a", "b"], tags=[{"i": 0}, {"i": 1}], partition_id="train")
    >>> m.reorder([1, 0]); m.keys, len(m)
    (['b', 'a'], 2)
    """

    def __init__(
        self,
        keys: Iterable[str] | None = None,
        tags: Iterable[dict[str, Any]] | None = None,
        partition_id: str | None = None,
        fields: Iterable[str] | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> None:
        self.keys: list[str] = list(keys or [])
        self.tags: list[dict[str, Any]] = copy.deepcopy(list(tags or []))
        self.partition_id = partition_id
        self.fields: list[str] | None = None if fields is None else list(fields)
        self.extra_info: dict[str, Any] = copy.deepcopy(extra_info) if extra_info is not None else {}
        if len(self.keys) != len(self.tags):
            raise ValueError(f"{len(self.keys)} keys but {len(self.tags)} tag dicts; give one dict per key")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("keys must be unique")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ValueError("fields must be unique")

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, partition_id={self.partition_id!r}, fields={self.fields}, "
            f"extra_info={self.extra_info})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVBatchMeta):
            return NotImplemented
        return (self.keys, self.tags, self.partition_id, self.fields, self.extra_info) == (
            other.keys,
            other.tags,
            other.partition_id,
            other.fields,
            other.extra_info,
        )

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """A new meta of these keys (each in this batch), in the order given."""
        wanted = list(keys_to_select)
        if len(set(wanted)) != len(wanted):
            raise ValueError("keys_to_select contains duplicates")
        where = {k: i for i, k in enumerate(self.keys)}
        absent = [k for k in wanted if k not in where]
        if absent:
            raise RuntimeError(f"keys {absent[:8]} are not in this batch")
        return KVBatchMeta(
            keys=wanted,
            tags=[self.tags[where[k]] for k in wanted],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the rows in the order ``indexes`` (a permutation), in place."""
        idx = _check_permutation(indexes, self.size)
        self.keys = [self.keys[i] for i in idx]
        self.tags = [self.tags[i] for i in idx]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """``chunks`` contiguous metas, sizes differing by at most one."""
        return [
            KVBatchMeta(
                keys=self.keys[r.start : r.stop],
                tags=self.tags[r.start : r.stop],
                partition_id=self.partition_id,
                fields=self.fields,
                extra_info=self.extra_info,
            )
            for r in _split(self.size, chunks)
        ]

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """One meta of the non-empty ``data`` in order; their fields and partition must agree, and
        ``extra_info`` values under the same name must be equal."""
        parts = [m for m in data if m is not None and m.size > 0]
        if not parts:
            return cls()
        first = parts[0]
        for m in parts:
            if m.fields is not None and set(m.fields) != set(first.fields or ()):
                raise ValueError(f"cannot concat metas with fields {first.fields} and {m.fields}")
            if m.partition_id != first.partition_id:
                raise ValueError(f"cannot concat metas of partitions {first.partition_id!r} and {m.partition_id!r}")
        merged = _merged_extra_info(m.extra_info for m in parts)
        return cls(
            keys=[k for m in parts for k in m.keys],
            tags=[t for m in parts for t in m.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=merged,
        )


class BatchMeta:
    """The worker-side handle of a batch: its rows (``global_indexes``: here the keys), their
    partition, the fields a get reads (``field_names``, sorted), per-row ``custom_meta`` (the
    stored tags) and ``extra_info``. ``BatchMeta()`` is the empty batch verl's non-collecting ranks
    return."""

    def __init__(
        self,
        global_indexes: Iterable[str] | None = None,
        partition_ids: Iterable[str] | None = None,
        field_names: Iterable[str] | None = None,
        custom_meta: Iterable[dict[str, Any]] | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> None:
        self.global_indexes: list[str] = list(global_indexes or [])
        self.partition_ids: list[str] = list(partition_ids or [])
        if len(self.partition_ids) != len(self.global_indexes):
            raise ValueError(
                f"{len(self.global_indexes)} rows but {len(self.partition_ids)} partition ids; give one per row"
            )
        self._fields: list[str] = sorted(set(field_names or ()))
        self.custom_meta: list[dict[str, Any]] = (
            [dict(t) for t in custom_meta] if custom_meta is not None else [{} for _ in self.global_indexes]
        )
        if len(self.custom_meta) != len(self.global_indexes):
            raise ValueError("custom_meta must hold one dict per row")
        self.extra_info: dict[str, Any] = dict(extra_info or {})

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls(extra_info=extra_info)

    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        return list(self._fields)

    @property
    def is_ready(self) -> bool:
        """Every field of every row is stored (a meta is only ever built from stored rows)."""
        return True

    @property
    def partition_id(self) -> str | None:
        return self.partition_ids[0] if self.partition_ids else None

    def __repr__(self) -> str:
        return f"BatchMeta(size={self.size}, partition={self.partition_id!r}, field_names={self._fields})"

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[dict[str, Any]]) -> None:
        if len(custom_meta) != self.size:
            raise ValueError(f"{len(custom_meta)} dicts for {self.size} rows")
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def update_extra_info(self, info: dict[str, Any]) -> None:
        self.extra_info.update(info)

    def add_fields(self, tensor_dict: Any) -> BatchMeta:
        """Record the fields of ``tensor_dict`` as written (in place; returns this meta)."""
        self._fields = sorted(set(self._fields) | {str(k) for k in tensor_dict.keys()})
        return self

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """A new meta reading only those of ``field_names`` this one has (others are left out)."""
        wanted = [field_names] if isinstance(field_names, str) else list(field_names)
        return self._with(range(self.size), [f for f in self._fields if f in set(wanted)])

    def select_samples(self, indexes: Sequence[int]) -> BatchMeta:
        return self._with([int(i) for i in indexes], self._fields)

    def __getitem__(self, item: int | slice) -> BatchMeta:
        rows = range(self.size)[item]
        return self._with([rows] if isinstance(rows, int) else rows, self._fields)

    def _with(self, rows: Iterable[int], fields: Sequence[str]) -> BatchMeta:
        rows = list(rows)
        return BatchMeta(
            global_indexes=[self.global_indexes[i] for i in rows],
            partition_ids=[self.partition_ids[i] for i in rows],
            field_names=fields,
            custom_meta=[copy.deepcopy(self.custom_meta[i]) for i in rows],
            extra_info=copy.deepcopy(self.extra_info),
        )

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` contiguous metas, sizes differing by at most one."""
        return [self._with(r, self._fields) for r in _split(self.size, chunks)]

    def reorder(self, indexes: Sequence[int]) -> None:
        idx = _check_permutation(indexes, self.size)
        self.global_indexes = [self.global_indexes[i] for i in idx]
        self.partition_ids = [self.partition_ids[i] for i in idx]
        self.custom_meta = [self.custom_meta[i] for i in idx]

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """One meta of the non-empty ``data`` in order (their field names must agree when
        ``validate``); ``extra_info`` values under the same name must be equal."""
        parts = [m for m in data if m is not None and m.size > 0]
        if not parts:
            return cls()
        if validate:
            for i, m in enumerate(parts):
                if m.field_names != parts[0].field_names:
                    raise ValueError(
                        f"BatchMeta.concat: chunk {i} has fields {m.field_names}, chunk 0 {parts[0].field_names}"
                    )
        merged = _merged_extra_info(m.extra_info for m in parts)
        return cls(
            global_indexes=[g for m in parts for g in m.global_indexes],
            partition_ids=[p for m in parts for p in m.partition_ids],
            field_names=parts[0].field_names,
            custom_meta=[t for m in parts for t in m.custom_meta],
            extra_info=merged,
        )
