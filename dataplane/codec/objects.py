"""Object columns: one Python object per row, encoded to bytes.

msgpack is the only codec used unless the caller names a field in ``pickle_fields``: unpickling
bytes read from a shared store runs whatever code the writer put there.

A column of objects may be given as a list or tuple, a ``NonTensorStack``, or a numpy object array
of shape ``(B,)`` (common in RL code: one prompt, message log or ground truth per row), also inside a
TensorDict, which wraps such an array as one ``NonTensorData``. Its elements follow the rules of
a list's: msgpack's types (tuples come back as lists), or pickle for fields named in
``pickle_fields``.

Whatever it was given as, a get returns it as a plain ``list`` of the decoded objects:
``batch[field]`` is a ``list`` the caller owns (tensordict's own stacks give a ``LinkedList`` that
writes item assignments back into the batch). The batch holds it as an :class:`ObjectStack`, a
``NonTensorStack``, so indexing, ``torch.cat`` and the rest of tensordict work on it as on any
stack; slices tensordict makes of it are its own ``NonTensorStack``.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack

from dataplane.codec.jagged import offsets_from_lengths
from dataplane.errors import SchemaError
from dataplane.schema import ObjectCodecName

__all__ = ["ObjectStack", "decode_objects", "encode_objects", "object_array_of", "object_stack"]


class ObjectStack(NonTensorStack):
    """The ``NonTensorStack`` an object column of a get is held as: ``td[field]`` on it is a plain
    ``list`` (a copy of the objects, not linked back to the batch).

    ``torch.save`` writes it as itself, so ``torch.load`` gives the same batch back; importing
    ``dataplane`` allowlists it for ``torch.load(weights_only=True)``. (Where dataplane is not
    installed, ``batch.to_dict()`` before saving leaves plain lists and tensors.)
    """

    def tolist(self, *args: Any, as_linked_list: bool = False, **kwargs: Any) -> Any:
        return super().tolist(*args, **kwargs)  # never the linked list tensordict's td[field] asks for


# A saved batch loads back with its object columns as they were; torch.load(weights_only=True), its
# default, rebuilds only allowlisted classes (tensordict allowlists its own the same way).
torch.serialization.add_safe_globals([ObjectStack])


def object_stack(objects: list[Any], num_rows: int) -> ObjectStack:
    """The column a get returns for ``objects`` (one per row)."""
    return ObjectStack(*(NonTensorData(o) for o in objects), batch_size=[num_rows])


def object_array_of(value: Any) -> np.ndarray | None:
    """The numpy object array of per-row objects that ``value`` is or wraps, else None.

    A TensorDict stores a numpy object array as one ``NonTensorData`` (tensordict's form of a
    batch-level value); an object array with a batch dim is one object per row all the same.
    """
    data = value.data if isinstance(value, NonTensorData) else value
    if isinstance(data, np.ndarray) and data.dtype == object and data.ndim >= 1:
        return data
    return None


def _encode_one(obj: Any, codec: ObjectCodecName) -> bytes:
    if codec == "pickle":
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def encode_objects(field: str, rows: Sequence[Any], codec: ObjectCodecName) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode each row; return ``(uint8 values, int64 offsets)`` in the jagged wire form."""
    blobs: list[bytes] = []
    for i, obj in enumerate(rows):
        try:
            blobs.append(_encode_one(obj, codec))
        except (TypeError, ValueError, OverflowError, pickle.PicklingError) as e:
            raise SchemaError(
                f"object field {field!r}, row {i}: {type(obj).__name__} cannot be encoded with {codec} ({e}); "
                "use str/int/float/bool/None/bytes and lists/dicts of them, or name the field in "
                "pickle_fields=... to opt in to pickle"
            ) from e
    buf = b"".join(blobs)
    values = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return values, offsets_from_lengths([len(b) for b in blobs])


def decode_objects(
    field: str, values: torch.Tensor, offsets: torch.Tensor, codec: ObjectCodecName, *, allow_pickle: bool
) -> list[Any]:
    if codec == "pickle" and not allow_pickle:
        raise SchemaError(
            f"field {field!r} was stored with pickle; reading it runs code from the store. "
            f"Pass pickle_fields=[{field!r}] to connect() if you trust every writer"
        )
    raw = np.ascontiguousarray(values.numpy()).tobytes()
    cuts = offsets.tolist()
    out: list[Any] = []
    for i in range(len(cuts) - 1):
        chunk = raw[cuts[i] : cuts[i + 1]]
        if codec == "pickle":
            out.append(pickle.loads(chunk))
        else:
            out.append(msgpack.unpackb(chunk, raw=False, strict_map_key=False))
    return out
