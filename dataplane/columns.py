"""Column helpers over any client: the first write of a rollout, then reads and writes by meta.

``first_write`` mints one key per sample (``f"{uid}_g{i}"``), stores token-aligned fields jagged
(padding never reaches the store) and returns a meta that knows every row's length, uid and sample
index. ``read_columns`` reads fields back, padded to the global length a preshard stamped;
``write_columns`` writes per-row results for the rows of a meta, checking sizes first.

Token-aligned fields are right-padded: a row's valid tokens come first, then padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from dataplane.checks import check_int
from dataplane.client import DataPlaneClient, PadValues
from dataplane.codec.jagged import lengths_of, pack, pack_nested, to_nested
from dataplane.codec.objects import object_array_of
from dataplane.codec.wire import Layout
from dataplane.errors import InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta

__all__ = ["LengthsSpec", "first_write", "read_columns", "write_columns"]

LengthsSpec = str | torch.Tensor | Sequence[int] | None
"""Row lengths: a field name (a right-padded ``[B, W]`` mask or ``[B]`` lengths), explicit lengths,
or None (use ``attention_mask`` when present)."""


def _as_dict(fields: TensorDictBase | Mapping[str, Any], what: str) -> dict[str, Any]:
    if isinstance(fields, TensorDictBase):
        return {k: _unwrapped(fields.get(k)) for k in fields.keys()}
    if isinstance(fields, Mapping):
        return {k: _unwrapped(v) for k, v in fields.items()}
    raise SchemaError(f"{what} must be a TensorDict or a dict of fields, got {type(fields).__name__}")


def _unwrapped(value: Any) -> Any:
    """A per-row numpy object array for the one ``NonTensorData`` a TensorDict wraps it in."""
    objects = object_array_of(value)
    return value if objects is None else objects


def _num_rows(field: str, value: Any) -> int:
    if isinstance(value, TensorDictBase):
        raise SchemaError(f"field {field!r} is a nested TensorDict; flatten it first (td.flatten_keys('.'))")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise SchemaError(f"field {field!r} is 0-d; per-row fields need a leading batch dim")
        return int(value.shape[0])
    if isinstance(value, (list, tuple, NonTensorStack)):
        return len(value)
    raise SchemaError(
        f"field {field!r} has unsupported type {type(value).__name__}; use a tensor, a nested tensor, "
        "a list of row tensors, or a list or numpy object array of Python objects"
    )


def _lengths_from_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    valid = mask != 0
    lens = valid.sum(dim=1, dtype=torch.int64)
    expected = torch.arange(mask.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
    if not torch.equal(valid, expected):
        row = int((valid != expected).any(dim=1).nonzero()[0])
        raise InvalidArgument(
            f"{name!r} row {row} is not right-padded (ones, then zeros); token fields must hold their valid "
            "tokens first -- shift left-padded rows, or pass lengths=... explicitly"
        )
    return lens


def _resolve_lengths(spec: LengthsSpec, items: Mapping[str, Any], num_rows: int, need: bool) -> torch.Tensor | None:
    if spec is None:
        if "attention_mask" not in items:
            if need:
                raise InvalidArgument(
                    "token_fields need row lengths: pass lengths= a mask or lengths field name, or explicit "
                    "lengths, or include a right-padded 'attention_mask' field"
                )
            return None
        spec = "attention_mask"
    if isinstance(spec, str):
        if spec not in items:
            raise InvalidArgument(f"lengths={spec!r} names no field of the rollout; fields: {sorted(items)}")
        value = items[spec]
        if not isinstance(value, torch.Tensor) or value.is_nested or value.dim() not in (1, 2):
            raise SchemaError(f"lengths field {spec!r} must be a [B, W] mask or [B] lengths tensor")
        lens = _lengths_from_mask(spec, value) if value.dim() == 2 else value.to(torch.int64)
    else:
        lens = torch.as_tensor(spec, dtype=torch.int64).reshape(-1)
    if lens.numel() != num_rows:
        raise InvalidArgument(f"{lens.numel()} lengths for {num_rows} rows; give one length per row")
    if num_rows and int(lens.min()) < 0:
        raise InvalidArgument("lengths must be >= 0")
    return lens


def _token_column(
    field: str, value: Any, lens: torch.Tensor, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
) -> torch.Tensor:
    """A token-aligned field as a jagged nested tensor whose row lengths are ``lens``; a padded one is
    gathered into ``empty`` memory (the writing client's, which its put sends without a copy)."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        value = torch.nested.as_nested_tensor(list(value), layout=torch.jagged)
    if not isinstance(value, torch.Tensor):
        raise SchemaError(f"token field {field!r} must be a padded [B, W, ...] tensor or a nested tensor")
    if value.is_nested:
        values, offsets = pack_nested(value)
        got = lengths_of(offsets)
        if not torch.equal(got, lens):
            row = int((got != lens).nonzero()[0])
            raise InvalidArgument(
                f"token field {field!r} row {row} has {int(got[row])} tokens but the row length is {int(lens[row])}; "
                "give it one entry per valid token"
            )
        return to_nested(values, offsets)
    if value.dim() < 2:
        raise SchemaError(f"token field {field!r} has shape {tuple(value.shape)}; it must be padded [B, W, ...]")
    if value.shape[0] != lens.numel():
        raise InvalidArgument(f"token field {field!r} has {value.shape[0]} rows but there are {lens.numel()}")
    longest = int(lens.max()) if lens.numel() else 0
    if value.shape[1] < longest:
        raise InvalidArgument(
            f"token field {field!r} is {value.shape[1]} wide but a row has {longest} tokens; pad it to at least the longest row"
        )
    return to_nested(*pack(value.detach().cpu(), lens, empty=empty))


def first_write(
    client: DataPlaneClient,
    rollout: TensorDictBase | Mapping[str, Any],
    *,
    uids: Sequence[str | int],
    group_size: int,
    partition_id: str,
    token_fields: Collection[str],
    pad_to_multiple: int = 1,
    lengths: LengthsSpec = None,
    tags: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
) -> KVBatchMeta:
    """Write a rollout batch for the first time and return its meta.

    Rows are uid-major: row ``j`` is sample ``j % group_size`` of prompt ``uids[j // group_size]``
    and gets key ``f"{uid}_g{sample}"``. Fields in ``token_fields`` are right-padded ``[B, W, ...]``
    tensors (or nested tensors) stored jagged with the row lengths; every other field is written
    as given. The meta carries ``sequence_lengths``, per-row tags ``uid`` and ``sample_idx`` (over
    any given ``tags``) and ``extra_info`` ``pad_to_multiple`` and ``group_size``.

    Args:
        client: where to write.
        rollout: the batch, ``len(uids) * group_size`` rows.
        uids: one id per prompt (unique).
        group_size: samples per prompt.
        partition_id: partition to write into.
        token_fields: names of the token-aligned fields.
        pad_to_multiple: width multiple later padded reads use (recorded in ``extra_info``).
        lengths: see :data:`LengthsSpec`.
        tags: one dict for every row, or one per row.

    Returns:
        The meta of the written rows.

    >>> import dataplane
    >>> ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    >>> with dataplane.connect() as c:
    ...     meta = first_write(c, {"input_ids": ids, "reward": torch.tensor([1.0, 0.0])}, uids=["p0"],
    ...                        group_size=2, partition_id="train", token_fields=["input_ids"], lengths=[2, 1])
    ...     meta.keys, meta.sequence_lengths, read_columns(c, meta, ["input_ids"])["input_ids"].tolist()
    (('p0_g0', 'p0_g1'), (2, 1), [[5, 6], [7, 0]])
    """
    items = _as_dict(rollout, "rollout")
    check_int("group_size", group_size, low=1)
    if isinstance(uids, (str, bytes)):
        raise SchemaError("uids must be a list of ids, not a single str")
    uid_list = list(uids)
    if len(set(uid_list)) != len(uid_list):
        raise InvalidArgument("uids must be unique; one uid per prompt, its samples are told apart by _g{i}")
    check_int("pad_to_multiple", pad_to_multiple, low=1)
    num_rows = len(uid_list) * group_size
    if isinstance(token_fields, str):
        token_fields = [token_fields]
    missing = [f for f in token_fields if f not in items]
    if missing:
        raise InvalidArgument(f"token_fields {missing} are not in the rollout; fields: {sorted(items)}")
    for field, value in items.items():
        if (rows := _num_rows(field, value)) != num_rows:
            raise InvalidArgument(
                f"field {field!r} has {rows} rows but {len(uid_list)} uids x group_size {group_size} = {num_rows}; "
                "rows must be uid-major, group_size samples per uid"
            )
    lens = _resolve_lengths(lengths, items, num_rows, need=bool(token_fields))
    if lens is not None:
        for field in token_fields:
            items[field] = _token_column(field, items[field], lens, client.empty)
    per_row = (
        [dict(tags)] * num_rows
        if isinstance(tags, Mapping)
        else [dict(t) for t in (tags if tags is not None else [{}] * num_rows)]
    )
    if len(per_row) != num_rows:
        raise InvalidArgument(f"{len(per_row)} tag dicts for {num_rows} rows; give one dict, or one per row")
    keys, row_tags = [], []
    for j, extra in enumerate(per_row):
        uid, sample = uid_list[j // group_size], j % group_size
        keys.append(f"{uid}_g{sample}")
        row_tags.append({**extra, "uid": uid, "sample_idx": sample})
    meta = client.kv_batch_put(keys, items, partition_id=partition_id, tags=row_tags)
    return dataclasses.replace(
        meta,
        sequence_lengths=meta.sequence_lengths if lens is None else tuple(lens.tolist()),
        tags=tuple(row_tags),
        extra_info={**meta.extra_info, "pad_to_multiple": pad_to_multiple, "group_size": group_size},
    )


def read_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    fields: Sequence[str] | str,
    layout: Layout = "padded",
    pad_values: PadValues = None,
    *,
    pad_to_length: int | None = None,
    pad_to_multiple: int | None = None,
) -> TensorDict:
    """Read ``fields`` of the rows of ``meta``, in meta order.

    Padded reads use ``meta.extra_info["pad_to_length"]`` (the global length a preshard stamps, so
    every DP rank gets one width) and ``["pad_to_multiple"]`` unless given here.

    >>> import dataplane
    >>> with dataplane.connect() as c:
    ...     m = c.kv_batch_put(["a", "b"], {"ids": [torch.tensor([1, 2]), torch.tensor([3])]}, partition_id="p")
    ...     read_columns(c, m.with_extra_info(pad_to_length=4), "ids", pad_values=-1)["ids"].tolist()
    [[1, 2, -1, -1], [3, -1, -1, -1]]
    """
    if not isinstance(meta, KVBatchMeta):
        raise SchemaError(f"read_columns needs a KVBatchMeta, got {type(meta).__name__}")
    length = pad_to_length if pad_to_length is not None else meta.extra_info.get("pad_to_length")
    multiple = pad_to_multiple if pad_to_multiple is not None else meta.extra_info.get("pad_to_multiple", 1)
    return client.kv_batch_get(
        meta,
        select_fields=fields,
        layout=layout,
        pad_values=pad_values,
        pad_to_multiple=int(multiple),
        pad_to_length=None if length is None else int(length),
    )


def write_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    columns: TensorDictBase | Mapping[str, Any],
    *,
    token_fields: Collection[str] | None = None,
) -> KVBatchMeta:
    """Write one value per row of ``meta`` (in meta order) for each field; return the meta with them.

    Sizes are checked against the meta before anything is written: every field must have
    ``len(meta)`` rows, and token fields (``token_fields``, by default every nested-tensor field)
    must have exactly ``meta.sequence_lengths`` tokens per row if jagged, or be at least the longest
    row wide if padded (padded token fields are stored jagged; plain tensors not named in
    ``token_fields`` are written as dense per-row values).

    >>> import dataplane
    >>> with dataplane.connect() as c:
    ...     m = c.kv_batch_put(["a", "b"], {"r": torch.tensor([1.0, 2.0])}, partition_id="p")
    ...     write_columns(c, m, {"adv": torch.tensor([0.5, -0.5])}).fields
    ('r', 'adv')
    """
    if not isinstance(meta, KVBatchMeta):
        raise SchemaError(f"write_columns needs a KVBatchMeta, got {type(meta).__name__}")
    items = _as_dict(columns, "columns")
    if not items:
        raise InvalidArgument("columns is empty; give at least one field to write")
    for field, value in items.items():
        if (rows := _num_rows(field, value)) != meta.size:
            raise InvalidArgument(
                f"field {field!r} has {rows} rows but the meta has {meta.size}; give one row per key of the meta, in meta order"
            )
    if isinstance(token_fields, str):
        token_fields = [token_fields]
    tokens = (
        [f for f, v in items.items() if isinstance(v, torch.Tensor) and v.is_nested]
        if token_fields is None
        else list(token_fields)
    )
    unknown = [f for f in tokens if f not in items]
    if unknown:
        raise InvalidArgument(f"token_fields {unknown} are not among the columns {sorted(items)}")
    if tokens:
        if meta.sequence_lengths is None:
            raise InvalidArgument(
                f"token fields {tokens} need the meta's sequence_lengths to be checked; use a meta from "
                "first_write or a preshard of it, or pass token_fields=() to write them unchecked"
            )
        lens = torch.tensor(meta.sequence_lengths, dtype=torch.int64)
        for field in tokens:
            items[field] = _token_column(field, items[field], lens, client.empty)
    if meta.size == 0:
        return meta.with_fields(items)
    client.kv_batch_put(list(meta.keys), items, partition_id=meta.partition_id)
    return meta.with_fields(items)
