"""Jagged wire form: a ragged field is ``values [sum(L), *inner]`` plus ``offsets [B+1]``.

``pack`` builds that form from a padded tensor and lengths (the padded width may exceed the longest
row, as sequence-parallel padding produces) or from a nested tensor; ``materialize`` turns it back
into a padded tensor, or ``to_nested`` into a jagged nested tensor, without copying when it can.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dataplane.errors import InvalidArgument, SchemaError

__all__ = [
    "Ragged",
    "RaggedCache",
    "lengths_of",
    "materialize",
    "offsets_from_lengths",
    "pack",
    "pack_nested",
    "padded_width",
    "round_up",
    "to_nested",
]

PadValue = bool | int | float

# torch's jagged nested tensor class. Reading its attributes directly, and building it directly,
# skips a __torch_function__ round per property (~8 us each) and a dispatcher round per tensor
# (~50 us): per field, that is most of the cost of a small get. Public APIs are the fallback.
try:
    from torch.nested._internal import nested_tensor as _njt_module
except ImportError:  # pragma: no cover - other torch versions take the public path
    _njt_module = None  # type: ignore[assignment]
_NJT: Any = getattr(_njt_module, "NestedTensor", None)
_store_val_in_tensor: Any = getattr(_njt_module, "_store_val_in_tensor", None)
if _store_val_in_tensor is None:  # pragma: no cover
    _NJT = None


def is_jagged_nested(t: object) -> bool:
    """True for a jagged-layout nested tensor (without a __torch_function__ round when possible)."""
    if _NJT is not None and type(t) is _NJT:
        return True
    return isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def offsets_from_lengths(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``[3, 0, 2]`` -> ``tensor([0, 3, 3, 5])`` (int64)."""
    lens = torch.as_tensor(lengths, dtype=torch.int64)
    if lens.dim() != 1:
        raise InvalidArgument(f"lengths must be 1-D, got shape {tuple(lens.shape)}")
    if lens.numel() and int(lens.min()) < 0:
        raise InvalidArgument("lengths must be >= 0")
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    return offsets


def lengths_of(offsets: torch.Tensor) -> torch.Tensor:
    return torch.diff(offsets)  # one op where offsets[1:] - offsets[:-1] is three


def pack(
    padded: torch.Tensor,
    lengths: torch.Tensor | Sequence[int],
    *,
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ``[B, W, *inner]`` plus valid lengths -> ``(values, offsets)``.

    ``empty(shape, dtype)`` makes the buffer the valid tokens are gathered into (e.g. a client's
    :meth:`~dataplane.client.DataPlaneClient.empty`, so a put sends it without another copy); rows
    that all fill the width need no gather and stay a view of ``padded``.

    >>> v, o = pack(torch.tensor([[1, 2, 0], [3, 0, 0]]), [2, 1])
    >>> v.tolist(), o.tolist()
    ([1, 2, 3], [0, 2, 3])
    """
    if padded.dim() < 2:
        raise SchemaError(f"pack needs a padded tensor [B, W, ...], got shape {tuple(padded.shape)}")
    lens = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
    b, w = padded.shape[0], padded.shape[1]
    if lens.numel() != b:
        raise InvalidArgument(f"{lens.numel()} lengths for a batch of {b} rows")
    if b and (int(lens.max()) > w or int(lens.min()) < 0):
        raise InvalidArgument(f"lengths must lie in [0, {w}] (the padded width), got {lens.min()}..{lens.max()}")
    offsets = offsets_from_lengths(lens)
    if b and bool((lens == w).all()):
        return padded.reshape(b * w, *padded.shape[2:]), offsets
    mask = torch.arange(w).unsqueeze(0) < lens.unsqueeze(1)
    if empty is None:
        return padded[mask], offsets
    n = int(offsets[-1])
    values = empty((n, *padded.shape[2:]), padded.dtype)
    if values.numel():  # gather whole tokens as bytes: every dtype, straight into ``values``
        src = padded.reshape(b * w, -1)
        src = (src if src.stride(-1) == 1 else src.contiguous()).view(torch.uint8)
        torch.index_select(src, 0, mask.reshape(-1).nonzero().squeeze(1), out=values.view(n, -1).view(torch.uint8))
    return values, offsets


def pack_nested(
    nt: torch.Tensor, *, seen: dict[int, tuple[int, int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A nested tensor (jagged or strided layout, ragged in its first row dim) -> ``(values, offsets)``.

    ``seen`` remembers the first and last offset of offsets tensors already read (fields of one
    batch often share one), keyed by ``id``: pass one dict per batch, while its tensors are alive.
    """
    if _NJT is not None and type(nt) is _NJT:
        njt: Any = nt
        return _pack_jagged(njt._ragged_idx, njt._values, njt._offsets, njt._lengths, seen)
    if not nt.is_nested:
        raise SchemaError("pack_nested needs a nested tensor")
    if nt.layout == torch.jagged:
        values, offsets = nt.values(), nt.offsets()  # type: ignore[attr-defined]
        return _pack_jagged(getattr(nt, "_ragged_idx", 1), values, offsets, getattr(nt, "_lengths", None), seen)
    rows = list(nt.unbind())
    if rows and any(r.dim() == 0 for r in rows):
        raise SchemaError("nested rows must have at least one dimension")
    inner = {tuple(r.shape[1:]) for r in rows}
    if len(inner) > 1:
        raise SchemaError(f"nested rows may differ only in their first dim, got trailing shapes {sorted(inner)}")
    offsets = offsets_from_lengths([r.shape[0] for r in rows])
    return (torch.cat(rows) if rows else torch.empty(0)), offsets


@dataclass(frozen=True, slots=True)
class Ragged:
    """Row structure of a jagged field: offsets plus the row-length range, computed once.

    Fields of one batch that have the same row lengths share one :class:`Ragged`, so their nested
    tensors share one offsets tensor and therefore one ragged dim: ``out["logprobs"] * out["mask"]``
    works on the nested tensors a get returns.
    """

    offsets: torch.Tensor
    lengths: torch.Tensor
    min_len: int
    max_len: int
    seqlen_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's holders of min/max, shared
    outer: dict[int, Any] = field(default_factory=dict)  # values' row stride -> (ragged size, outer stride)

    @classmethod
    def of(cls, offsets: torch.Tensor) -> Ragged:
        lens = lengths_of(offsets)
        if lens.numel() == 0:
            return cls(offsets, lens, 0, 0)
        lo, hi = (int(x) for x in torch.aminmax(lens))
        held = None
        if _NJT is not None:
            held = (_store_val_in_tensor(lo), _store_val_in_tensor(hi))
            for t in held:  # what NestedTensor.__init__ does with them, once instead of per tensor
                torch._dynamo.mark_dynamic(t, 0)
        return cls(offsets, lens, lo, hi, held)


class RaggedCache:
    """Finds the :class:`Ragged` of offsets already seen (same object, or equal values)."""

    def __init__(self) -> None:
        self._seen: list[Ragged] = []

    def __call__(self, offsets: torch.Tensor) -> Ragged:
        for r in self._seen:
            if r.offsets is offsets:
                return r
        for r in self._seen:
            o = r.offsets
            if o.shape == offsets.shape and o.device == offsets.device and torch.equal(o, offsets):
                return r
        r = Ragged.of(offsets)
        self._seen.append(r)
        return r


def _pack_jagged(
    ragged_idx: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    holes: torch.Tensor | None,
    seen: dict[int, tuple[int, int]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if ragged_idx != 1:
        raise SchemaError("jagged nested tensors must be ragged in dim 1 (rows of [L_i, *inner])")
    key = id(offsets)  # of the caller's tensor, alive as long as its nested tensor
    if offsets.dtype is not torch.int64:
        offsets = offsets.to(torch.int64)
    if holes is not None:  # non-contiguous jagged (with holes): gather rows
        cuts, lens = offsets.tolist(), holes.tolist()
        rows = [values[cuts[i] : cuts[i] + lens[i]] for i in range(len(lens))]
        return (torch.cat(rows) if rows else values[:0]), offsets_from_lengths(holes)
    bounds = None if seen is None else seen.get(key)
    if bounds is None:
        bounds = (int(offsets[0]), int(offsets[-1]))
        if seen is not None:
            seen[key] = bounds
    lo, hi = bounds
    if lo != 0 or hi != values.shape[0]:
        return values[lo:hi], offsets - lo
    return values, offsets


def to_nested(values: torch.Tensor, offsets: torch.Tensor, *, ragged: Ragged | None = None) -> torch.Tensor:
    """``(values, offsets)`` -> a jagged-layout nested tensor that views ``values`` (no copy).

    ``ragged`` (from :class:`RaggedCache`) reuses another field's offsets and length range.
    """
    r = ragged if ragged is not None else Ragged.of(offsets)
    if r.lengths.numel() == 0:
        return torch.nested.nested_tensor_from_jagged(values, r.offsets)
    if r.seqlen_cache is not None and not values.requires_grad and values.device == r.offsets.device:
        cache = {"min_seqlen": r.seqlen_cache[0], "max_seqlen": r.seqlen_cache[1]}
        if _fast_njt_ok():
            return _fast_njt(values, r, cache)
        return _NJT(values, r.offsets, _metadata_cache=cache)  # type: ignore[no-any-return]
    return torch.nested.nested_tensor_from_jagged(values, r.offsets, min_seqlen=r.min_len, max_seqlen=r.max_len)


# NestedTensor.__new__/__init__ for the case above, with the ragged size times the row stride
# computed once per Ragged (torch builds a new symbolic int per tensor) and the min/max holders
# marked dynamic once: about half the cost of a nested tensor, which is per field of every get.
# Used only after a self-check against torch's own constructor passes on this torch.
_NJT_KEYS: Any = None


def _fast_njt(values: torch.Tensor, r: Ragged, cache: dict[str, Any]) -> torch.Tensor:
    stride = values.stride()
    sym = r.outer.get(stride[0])
    if sym is None:
        ragged_size = _njt_module.get_tensor_symint(r.offsets, coeff=1)  # type: ignore[no-untyped-call]
        sym = r.outer[stride[0]] = (ragged_size, ragged_size * stride[0])
    size = (r.offsets.shape[0] - 1, sym[0], *values.shape[1:])
    strides = (sym[1], *stride)
    t: Any = torch.Tensor._make_wrapper_subclass(
        _NJT,
        size,
        strides,
        0,
        torch.contiguous_format,
        values.dtype,
        torch.jagged,
        values.device,
        False,
        False,
        "sizes",
        False,
        True,
        _NJT_KEYS,
        storage_size=values.untyped_storage().size(),
    )
    t._ragged_idx = 1
    t._size = size
    t._strides = strides
    t._values = values
    t._offsets = r.offsets
    t._lengths = None
    t._metadata_cache = cache
    t._dynamo_propagated_dynamic_indices = {1}
    values._dynamo_propagated_dynamic_indices = {0}  # type: ignore[attr-defined]
    return t  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def _fast_njt_ok() -> bool:
    """Whether :func:`_fast_njt` builds what torch's constructor builds, on this torch."""
    global _NJT_KEYS
    try:
        from torch._C import DispatchKey, DispatchKeySet

        _NJT_KEYS = DispatchKeySet(DispatchKey.NestedTensor).add(DispatchKey.AutogradNestedTensor)
        offsets = torch.tensor([0, 2, 2, 5])
        r = Ragged.of(offsets)
        a_vals, b_vals = torch.arange(10.0).view(5, 2), torch.arange(5)
        cache = {"min_seqlen": r.seqlen_cache[0], "max_seqlen": r.seqlen_cache[1]}  # type: ignore[index]
        fast: list[Any] = [_fast_njt(v, r, dict(cache)) for v in (a_vals, b_vals)]
        ref: list[Any] = [_NJT(v, offsets, _metadata_cache=dict(cache)) for v in (a_vals, b_vals)]
        for f, g in zip(fast, ref, strict=True):
            same = (
                type(f) is type(g)
                and str(f.shape) == str(g.shape)
                and str(f.stride()) == str(g.stride())
                and f.dtype == g.dtype
                and f.layout == g.layout
                and f._ragged_idx == g._ragged_idx
                and torch.equal(f.values(), g.values())
                and f.offsets() is g.offsets()
                and [x.tolist() for x in f.unbind()] == [x.tolist() for x in g.unbind()]
                and torch.equal((f * 2).values(), (g * 2).values())
            )
            if not same:
                return False
        summed = fast[0] + fast[0]
        return bool(torch.equal(summed.values(), a_vals * 2) and fast[0].shape[1] == fast[1].shape[1])
    except Exception:  # another torch: keep its public constructor
        return False


def padded_width(max_length: int, pad_to_multiple: int = 1, pad_to_length: int | None = None) -> int:
    """Width of the padded batch: longest row rounded up to ``pad_to_multiple``, or ``pad_to_length``."""
    if pad_to_multiple < 1:
        raise InvalidArgument(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    width = round_up(max_length, pad_to_multiple)
    if pad_to_length is not None:
        if pad_to_length < max_length:
            raise InvalidArgument(
                f"pad_to_length={pad_to_length} is shorter than the longest row ({max_length}); "
                "raise it (the preshard step stamps a global one) or leave it None"
            )
        width = round_up(pad_to_length, pad_to_multiple)
    return width


def materialize(
    values: torch.Tensor,
    offsets: torch.Tensor,
    *,
    pad_value: PadValue = 0,
    pad_to_multiple: int = 1,
    pad_to_length: int | None = None,
    ragged: Ragged | None = None,
) -> torch.Tensor:
    """``(values, offsets)`` -> padded ``[B, W, *inner]``; a view of ``values`` when no padding is needed.

    ``ragged`` (from :class:`RaggedCache`) reuses the row lengths another field already computed.

    >>> materialize(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]), pad_value=-1).tolist()
    [[1, 2], [3, -1]]
    """
    b = offsets.numel() - 1
    r = ragged if ragged is not None else Ragged.of(offsets)
    lens, max_len = r.lengths, r.max_len
    width = padded_width(max_len, pad_to_multiple, pad_to_length)
    inner = tuple(values.shape[1:])
    if b and width == r.min_len and values.is_contiguous():
        return values.view(b, width, *inner)
    out = torch.full((b, width, *inner), pad_value, dtype=values.dtype, device=values.device)
    if b == 0 or values.shape[0] == 0:
        return out
    if b <= 64:  # few rows: slice copies beat building an index
        cuts = offsets.tolist()
        for i in range(b):
            n = cuts[i + 1] - cuts[i]
            if n:
                out[i, :n] = values[cuts[i] : cuts[i + 1]]
        return out
    mask = torch.arange(width, device=values.device).unsqueeze(0) < lens.to(values.device).unsqueeze(1)
    out[mask] = values
    return out
