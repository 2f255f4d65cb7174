"""Checking and shaping what a worker writes back for its shard.

Rules (validated before the client is called, so a bad write-back writes nothing):

* every field has exactly one row per key of the meta;
* a nested (jagged) tensor's row lengths must equal ``meta.sequence_lengths`` when the meta has them
  (``check_lengths=False`` turns this off for fields of another length);
* padded per-token tensors ``[B, W, *inner]`` are packed to jagged with ``meta.sequence_lengths``, so
  the store keeps no padding and later reads pad them like any jagged field. Which fields are
  per-token: the names in ``token_fields``; with ``"auto"``, every non-nested tensor of two or more
  dims whose width (dim 1) is a padded width this meta was fetched at -- ``extra_info["pad_to_length"]``
  or the width of the worker's last padded fetch of these keys. Pass the names explicitly for tensors
  padded to any other width (a ``[B, k]`` per-row field that is not per-token is then never touched);
* tensors move to the CPU unless the client's ``capabilities.device_tensors`` says it takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from dataplane.codec.jagged import offsets_from_lengths, pack_nested, to_nested
from dataplane.codec.objects import object_array_of
from dataplane.errors import InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta

__all__ = ["TokenFields", "prepare_writeback", "to_host"]

TokenFields = Collection[str] | Literal["auto"]


def _rows_of(name: str, value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise SchemaError(f"field {name!r} is a 0-d tensor; write-back fields need one row per key (dim 0)")
        return int(value.size(0))
    if isinstance(value, NonTensorData):
        raise SchemaError(f"field {name!r} holds one value for the whole batch; put batch-level values in extra_info")
    if isinstance(value, (NonTensorStack, list, tuple, np.ndarray)):
        return len(value)
    raise SchemaError(
        f"field {name!r} has unsupported type {type(value).__name__}; write tensors, nested tensors, "
        "or lists of Python objects"
    )


def _pack_padded(name: str, value: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Padded ``[B, W, *inner]`` -> jagged nested tensor of the valid prefix of each row (on its device)."""
    if value.dim() < 2:
        raise SchemaError(f"token field {name!r} must be padded [B, W, ...], got shape {tuple(value.shape)}")
    width = int(value.size(1))
    longest = max(lengths, default=0)
    if longest > width:
        raise InvalidArgument(
            f"token field {name!r} is {width} wide but meta.sequence_lengths has a row of {longest} tokens; "
            "write the full padded tensor the fetch returned"
        )
    lens = torch.as_tensor(lengths, dtype=torch.int64, device=value.device)
    mask = torch.arange(width, device=value.device).unsqueeze(0) < lens.unsqueeze(1)
    values = value[mask]
    return to_nested(values, offsets_from_lengths(lengths).to(value.device))


def _check_lengths(name: str, value: torch.Tensor, lengths: tuple[int, ...]) -> None:
    _, offsets = pack_nested(value)
    got = (offsets[1:] - offsets[:-1]).tolist()
    if got != list(lengths):
        bad = next(i for i, (a, b) in enumerate(zip(got, lengths, strict=True)) if a != b)
        raise InvalidArgument(
            f"jagged field {name!r} row {bad} has {got[bad]} tokens but meta.sequence_lengths says {lengths[bad]}; "
            "write one value per token of each row, or pass check_lengths=False for fields of another length"
        )


def prepare_writeback(
    meta: KVBatchMeta,
    fields: TensorDictBase | Mapping[str, Any],
    *,
    token_fields: TokenFields = "auto",
    pad_widths: Collection[int] = (),
    check_lengths: bool = True,
    to_cpu: bool = True,
) -> dict[str, Any]:
    """Validate ``fields`` against ``meta`` and return what to put (see the module docstring).

    Args:
        meta: the shard the fields belong to.
        fields: field name -> tensor / nested tensor / list of objects, one row per key.
        token_fields: per-token fields given padded, or ``"auto"``.
        pad_widths: padded widths that ``"auto"`` recognises besides ``extra_info["pad_to_length"]``.
        check_lengths: compare jagged row lengths with ``meta.sequence_lengths``.
        to_cpu: move tensors to the CPU (for clients without ``device_tensors``).

    >>> m = KVBatchMeta(partition_id="p", keys=["a", "b"], sequence_lengths=[1, 3])
    >>> out = prepare_writeback(m, {"lp": torch.ones(2, 3)}, token_fields=["lp"])
    >>> out["lp"].offsets().tolist()
    [0, 1, 4]
    """
    items = list(fields.items()) if isinstance(fields, (TensorDictBase, Mapping)) else None
    if items is None:
        raise SchemaError(f"fields must be a TensorDict or a dict, got {type(fields).__name__}")
    if not items:
        raise InvalidArgument("fields is empty; give at least one field to write back")
    lengths = meta.sequence_lengths
    names = {str(k) for k, _ in items}
    if token_fields == "auto":
        widths = set(pad_widths)
        pad = meta.extra_info.get("pad_to_length")
        if isinstance(pad, int) and not isinstance(pad, bool):
            widths.add(pad)
        tokens: set[str] = set()
        if lengths is not None:
            for k, v in items:
                if (
                    isinstance(v, torch.Tensor)
                    and not v.is_nested
                    and v.dim() >= 2
                    and int(v.size(1)) in widths
                    and int(v.size(1)) >= max(lengths, default=0)
                ):
                    tokens.add(str(k))
    else:
        tokens = set(token_fields)
        unknown = tokens - names
        if unknown:
            raise InvalidArgument(f"token_fields names fields not being written: {sorted(unknown)}")
        if tokens and lengths is None:
            raise InvalidArgument(
                f"packing token fields {sorted(tokens)} needs meta.sequence_lengths; pass nested tensors instead"
            )
    out: dict[str, Any] = {}
    for key, value in items:
        name = str(key)
        if (objects := object_array_of(value)) is not None:
            value = objects  # a per-row object array, which a TensorDict wraps as one NonTensorData
        rows = _rows_of(name, value)
        if rows != meta.size:
            raise InvalidArgument(
                f"field {name!r} has {rows} rows but the meta has {meta.size} keys; write one row per key of the "
                "shard you fetched, in its order"
            )
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if name in tokens:
                assert lengths is not None
                value = _pack_padded(name, value, lengths)
            elif value.is_nested and check_lengths and lengths is not None:
                _check_lengths(name, value, lengths)
            if to_cpu and value.device.type != "cpu":
                value = value.cpu()
        out[name] = value
    return out


def to_host(
    fields: TensorDictBase | Mapping[str, Any],
    *,
    always: bool = False,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    made: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """``fields`` with every CUDA tensor (dense, or jagged nested) copied to host memory through the
    process's pinned pool (:mod:`dataplane.worker.pinned`); everything else as it is (``always``:
    host tensors too, copied through the pool: what the CPU tests run).

    Args:
        fields: what a write-back puts.
        always: copy host tensors through the pool too.
        empty: makes each host copy (``shape, dtype -> tensor``): the client's ``empty``, whose
            memory its put sends without staging it (``mooncake://``) or keeps (``memory://``,
            adopting); pageable ``torch.empty`` by default.
        made: when given, the host copies made here are appended to it (what the caller may hand
            over to the store: nothing else holds them).

    >>> to_host({"x": torch.ones(2)})["x"].tolist()
    [1.0, 1.0]
    """
    from dataplane.worker.pinned import process_pool

    items = dict(fields.items()) if isinstance(fields, (TensorDictBase, Mapping)) else None
    if items is None:
        raise SchemaError(f"fields must be a TensorDict or a dict, got {type(fields).__name__}")
    names, tensors = [], []
    for name, value in items.items():
        if not isinstance(value, torch.Tensor) or (value.device.type != "cuda" and not always):
            continue
        if value.is_nested:
            if value.layout != torch.jagged:
                continue  # a strided nested tensor moves as it is, in prepare_writeback
            names.append(name)
            tensors += [value.values(), value.offsets()]  # type: ignore[attr-defined]
        else:
            names.append(name)
            tensors.append(value)
    if not tensors:
        return items
    copies = process_pool().to_host(tensors, empty)
    if made is not None:
        made += copies
    moved = iter(copies)
    for name in names:
        if items[name].is_nested:
            values, offsets = next(moved), next(moved)
            items[name] = torch.nested.nested_tensor_from_jagged(values, offsets)
        else:
            items[name] = next(moved)
    return items
