"""What the controller records of the rows of a ``tq://?backend=mooncake`` partition, read into
what a get, a put or a clear needs: each row's Mooncake objects (the tokens recorded per row and
field; :mod:`dataplane.adapters.transfer_queue._mooncake_backend` says why objects are named by
token) and each row's length. A part of :class:`~dataplane.adapters.transfer_queue._ops.TQOps`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from dataplane.adapters.transfer_queue._layout import MARKER, RowsChanged, split_fields
from dataplane.adapters.transfer_queue._mooncake_backend import row_tokens
from dataplane.errors import DataPlaneError
from dataplane.schema import FieldSchema

__all__ = ["TokenLookups", "marker_fields"]

Held = list[tuple[int, dict[str, str]]]
"""``(global index, {field: token})`` per row: the objects named."""


@functools.lru_cache(maxsize=4096)
def marker_fields(marker: str) -> frozenset[str]:
    """The fields a committed row holds, from its marker (either layout; ``""``: a tag-only row)."""
    return frozenset(split_fields(marker))


class TokenLookups:
    """The token and length lookups of :class:`~dataplane.adapters.transfer_queue._ops.TQOps`, over
    its controller requests (``_retrieve``, ``client``, ``round_trips``)."""

    client: Any
    round_trips: int

    async def _retrieve(self, partition_id: str, keys: list[str], *, create: bool = False) -> Any:
        raise NotImplementedError

    async def _held_tokens(
        self,
        partition_id: str,
        keys: Sequence[str],
        gis: Sequence[int],
        tags: Sequence[Mapping[str, Any]],
        fields: frozenset[str],
    ) -> Held:
        """The tokens of ``fields`` that the rows of ``keys`` (at ``gis``, tagged ``tags``) hold now,
        as ``(global index, {field: token})`` for rows holding any: the objects a put of ``fields``
        replaces. Rows whose markers name none of ``fields`` cost nothing; the others are asked for in
        one request per set of fields (TQ answers only for fields every asked row holds), sent
        together."""
        groups: dict[frozenset[str], list[int]] = {}
        for i, t in enumerate(tags):
            held = marker_fields(m) & fields if isinstance(m := t.get(MARKER), str) else frozenset()
            if held:
                groups.setdefault(held, []).append(i)
        if not groups:
            return []
        answers = await asyncio.gather(
            *(self._retrieve(partition_id, [keys[i] for i in rows]) for rows in groups.values())
        )
        out = []
        for (held, rows), bm in zip(groups.items(), answers, strict=True):
            mine = {gis[i] for i in rows}
            for gi, meta in zip(bm.global_indexes, bm._custom_backend_meta, strict=True):
                held_now = {f: t for f, t in row_tokens(meta).items() if f in held}
                if gi in mine and held_now:  # a row cleared and its index reused meanwhile: not ours
                    out.append((gi, held_now))
        return out

    @staticmethod
    def _tokens_of(field: str, tokens: Sequence[Mapping[str, str]], prefixes: Sequence[str]) -> list[str]:
        """Each row's token of ``field`` (the controller records it with the row's shape). A token
        of another key is a late write of a cleared key whose index this row took: read again."""
        try:
            out = [t[field] for t in tokens]
        except KeyError:
            raise DataPlaneError(
                f"TransferQueue records no dataplane token of field {field!r} for some rows; the partition "
                "was probably written by something other than dataplane"
            ) from None
        if not all(t.startswith(p) for t, p in zip(out, prefixes, strict=True)):
            raise RowsChanged(f"field {field!r} of some rows was last written by a put of another key")
        return out

    async def _all_tokens(self, partition_id: str, asked: list[str], bm: Any) -> Held:
        """Every field's token of the rows ``bm`` found for ``asked``, as ``(global index, {field:
        token})``. ``bm`` has them for the fields all its rows hold; rows holding more fields cost
        one request per set of fields (and one more to name the rows, when some keys were absent)."""
        out = [(gi, row_tokens(m)) for gi, m in zip(bm.global_indexes, bm._custom_backend_meta, strict=True)]
        tags: list[dict[str, Any]] = bm.custom_meta
        short = [
            i
            for i, (t, (_, held)) in enumerate(zip(tags, out, strict=True))
            if isinstance(m := t.get(MARKER), str) and not marker_fields(m) <= held.keys()
        ]
        if not short:
            return out
        if bm.size == len(asked):
            names: list[str | None] = list(asked)  # every key found: in order
        else:
            self.round_trips += 1
            try:
                found = await self.client.async_kv_retrieve_keys(
                    global_indexes=[bm.global_indexes[i] for i in short], partition_id=partition_id
                )
            except RuntimeError:  # some cleared meanwhile, by a clear that removes their objects
                return out
            names = [None] * bm.size
            for i, name in zip(short, found, strict=True):
                names[i] = name
        named = [i for i in short if isinstance(names[i], str)]
        more = await self._held_tokens(
            partition_id,
            [str(names[i]) for i in named],
            [bm.global_indexes[i] for i in named],
            [tags[i] for i in named],
            frozenset().union(*(marker_fields(tags[i][MARKER]) for i in named)),
        )
        extra = dict(more)
        return [(gi, {**held, **extra.get(gi, {})}) for gi, held in out]

    @staticmethod
    def _lengths(field: str, schema: FieldSchema, tq: Mapping[str, Any], n: int) -> list[int] | None:
        if schema.kind == "dense":
            return None
        shapes = tq.get("per_sample_shapes")
        if not tq.get("is_nested") and tq.get("shape") is not None:
            # every row left has one shape (the others were cleared): TQ then records the field as a
            # plain [B, L, *inner] one and forgets the per-row shapes
            shapes = [tq["shape"]] * n
        if not shapes or len(shapes) != n or any(s is None or tuple(s[1:]) != schema.inner_shape for s in shapes):
            seen = None if not shapes else sorted({str(s) for s in shapes})[:4]
            raise DataPlaneError(
                f"TransferQueue's record of field {field!r} ({len(shapes or ())} row shapes for {n} rows, e.g. "
                f"{seen}) does not match {schema.describe()}; the partition was probably written by something "
                "other than dataplane"
            )
        return [int(s[0]) for s in shapes]
