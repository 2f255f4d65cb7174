"""TransferQueue's module-level KV API (``import transfer_queue as tq``), answered by a dataplane client.

After :func:`integrations.verl.install`, ``import transfer_queue`` in any process of the job gives the
shim package whose names are these. Each process connects once, lazily, to the deployment
``install`` named (``$DATAPLANE_VERL_URL``, or Ray's internal KV inside Ray workers).

Where TransferQueue's answers differ from dataplane's and verl depends on them, these reproduce
TransferQueue's (the default, ``compat``):

* a get drops keys and fields that are not there (with a warning) and returns the fields every
  found row holds, intersected with ``select_fields``; it raises ``ValueError`` only when no key is
  found or the rows share no field, and returns ``TensorDict({}, batch_size=0)`` when every selected
  field was dropped;
* a get without ``select_fields`` returns every field the rows share;
* a put returns the rows' merged stored tags and the fields they all hold now (sorted);
* tag-only puts make rows without fields; ``kv_put`` merges one row's tags;
* per-row tensors come back as jagged nested tensors (dense ``[B, L, ...]`` puts are stored jagged,
  so one-row rollout puts of different lengths share a field), per-row scalars as ``[B]``, objects
  as a ``NonTensorStack``, fields in sorted order.

In ``strict`` mode (``install(..., strict=True)``) a get raises :class:`MissingRows` (a
``KeyNotFound`` that is also a ``ValueError``) naming what TransferQueue would have dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

import dataplane
from dataplane import DataPlaneClient, KeyNotFound, RowInfo
from integrations.verl import checkpoint
from integrations.verl.metas import BatchMeta, KVBatchMeta

__all__ = [
    "PICKLE_ENV",
    "STRICT_ENV",
    "URL_ENV",
    "BatchMeta",
    "FacadeClient",
    "KVBatchMeta",
    "MissingRows",
    "async_kv_batch_get",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

URL_ENV = "DATAPLANE_VERL_URL"  # the deployment every process of the job joins
STRICT_ENV = "DATAPLANE_VERL_STRICT"  # "1": raise where TransferQueue drops
PICKLE_ENV = "DATAPLANE_VERL_PICKLE_FIELDS"  # object fields every process reads and writes with pickle
KV_NAMESPACE = "dataplane_verl"  # Ray internal KV: where workers find the URL when their env lacks it


class MissingRows(KeyNotFound, ValueError):
    """Strict mode: keys or fields a get asked for are not stored (TransferQueue would drop them).
    A ``ValueError`` too, so code written against TransferQueue's errors still catches it."""


_lock = threading.Lock()
_client: DataPlaneClient | None = None
_owned_elsewhere: DataPlaneClient | None = None  # install()'s client in the installing process


def _adopt(client: DataPlaneClient) -> None:
    """Use ``client`` (the installer's owner client) as this process's; :func:`close` leaves it open."""
    global _client, _owned_elsewhere
    with _lock:
        _client = _owned_elsewhere = client


def _forget() -> None:
    global _client, _owned_elsewhere
    with _lock:
        _client = _owned_elsewhere = None


def _url() -> str:
    url = os.environ.get(URL_ENV)
    if url:
        return url
    try:
        import ray

        if ray.is_initialized():
            from ray.experimental import internal_kv

            found = internal_kv._internal_kv_get(URL_ENV, namespace=KV_NAMESPACE)
            if found:
                return str(found.decode())
    except ImportError:
        pass
    raise RuntimeError(
        "transfer_queue is dataplane's verl facade here, but no deployment was named: call "
        "integrations.verl.install(url) in the driver before verl starts its processes "
        f"(or set ${URL_ENV} to a deployment's URL in this process's environment)"
    )


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "0") == "1"


def _pickle_fields() -> frozenset[str]:
    return frozenset(f for f in os.environ.get(PICKLE_ENV, "").split(",") if f)


def _dp() -> DataPlaneClient:
    """This process's client (connected on first use)."""
    global _client
    with _lock:
        if _client is None or getattr(_client, "closed", False):
            _client = dataplane.connect(_url(), pickle_fields=_pickle_fields())
        return _client


# -- lifecycle --------------------------------------------------------------------------------------
def init(conf: Any = None) -> Any:
    """Join the installed deployment (idempotent). A TransferQueue config is accepted and ignored:
    the deployment is the one ``install`` named. Returns ``conf``, as TransferQueue does."""
    if conf is not None:
        log.debug("transfer_queue facade: init(conf) ignores the TransferQueue config; the backend is %s", _url())
    _dp()
    return conf


def close() -> None:
    """Close this process's client. The deployment stays up: it belongs to the process that called
    ``install`` (``integrations.verl.uninstall`` or that process's exit ends it)."""
    global _client
    with _lock:
        client, _client = _client, None
    if client is not None and client is not _owned_elsewhere:
        client.close()
    elif client is not None:
        with _lock:
            _client = client  # the installer's client stays this process's


def get_metrics_endpoint() -> str | None:
    """None: the facade serves no TransferQueue metrics endpoint."""
    return None


# -- conversions ------------------------------------------------------------------------------------
def _plain(v: Any) -> Any:
    """A value as the primitives msgpack holds: numpy arrays become lists, numpy and 0-d torch
    scalars Python numbers, tuples lists (what verl's dataloader columns hold: ``raw_prompt`` is a
    numpy array of message dicts). Anything else is left for the codec to accept or refuse."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {(k if isinstance(k, str) else str(k)): _plain(x) for k, x in v.items()}
    return v


def _objects(name: str, values: list[Any]) -> list[Any]:
    """An object column's rows as plain values, except in fields this job pickles."""
    return values if name in _pickle_fields() else [_plain(x) for x in values]


def _tags(tags: Sequence[Mapping[str, Any]] | None, n: int) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    out = [{str(k): _plain(v) for k, v in t.items()} for t in tags]
    if len(out) != n:
        raise ValueError(f"{len(out)} tag dicts for {n} keys; give one per key")
    return out


def _as_jagged(t: torch.Tensor) -> torch.Tensor:
    """A dense ``[B, L, ...]`` tensor as a jagged nested tensor of ``B`` rows of ``[L, ...]`` (a
    view of the same values)."""
    b, length = t.shape[0], t.shape[1]
    values = t.contiguous().reshape(b * length, *t.shape[2:])
    return torch.nested.nested_tensor_from_jagged(values, torch.arange(b + 1, dtype=torch.int64) * length)


def _column(name: str, v: Any, n: int) -> Any:
    if isinstance(v, NonTensorStack):
        return _objects(name, list(v.tolist()))
    if isinstance(v, NonTensorData):  # one batch-level value: every row gets it
        return _objects(name, [v.data] * n)
    if isinstance(v, torch.Tensor):
        if v.is_nested:
            if v.layout == torch.jagged:
                return v
            return torch.nested.as_nested_tensor(list(v.unbind()), layout=torch.jagged)
        if v.dim() >= 2:
            return _as_jagged(v)
        if v.dim() == 0:
            raise ValueError(f"field {name!r} is a 0-d tensor; give one value per row ([B])")
        return v
    if isinstance(v, (list, tuple)):
        return _objects(name, list(v))
    if isinstance(v, np.ndarray):
        return _objects(name, list(v)) if v.dtype == object else torch.from_numpy(v)
    raise ValueError(f"field {name!r}: unsupported type {type(v).__name__}")


def _columns(fields: TensorDictBase | Mapping[str, Any], n: int) -> dict[str, Any]:
    """verl's fields as dataplane columns: rank >= 2 tensors jagged, objects as lists."""
    if isinstance(fields, TensorDictBase):
        if fields.batch_dims < 1 or fields.batch_size[0] != n:
            raise ValueError(f"fields has batch size {list(fields.batch_size)} for {n} keys")
        items = [(str(k), fields.get(k)) for k in fields.keys()]
    elif isinstance(fields, Mapping):
        items = [(str(k), v) for k, v in fields.items()]
    else:
        raise TypeError(f"fields must be a TensorDict or a dict, got {type(fields).__name__}")
    return {k: _column(k, v, n) for k, v in items}


def _tq_form(got: TensorDict, fields: Sequence[str], n: int) -> TensorDict:
    """A get's columns as TransferQueue (SimpleStorage) returns them: per-row tensors of rank >= 1
    jagged, per-row scalars ``[B]``, objects as a ``NonTensorStack``; fields sorted."""
    out = TensorDict({}, batch_size=[n])
    for f in sorted(fields):
        v = got.get(f)
        if isinstance(v, torch.Tensor) and not v.is_nested and v.dim() >= 2:
            v = _as_jagged(v)
        out.set(f, v)
    return out


def _shared(infos: Mapping[str, RowInfo]) -> set[str]:
    rows = list(infos.values())
    return set.intersection(*(set(r.fields) for r in rows)) if rows else set()


# -- puts ------------------------------------------------------------------------------------------
def kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> KVBatchMeta:
    """Write ``fields`` and/or merge ``tags`` for ``keys``; returns the rows' meta with their merged
    stored tags and the fields every row now holds (sorted)."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    if fields is None and tags is None:
        raise ValueError("kv_batch_put needs fields, tags or both")
    client = _dp()
    columns = None if fields is None else _columns(fields, len(keys))
    client.kv_batch_put(keys, columns or None, partition_id=partition_id, tags=_tags(tags, len(keys)))
    return _StoredMeta(keys, partition_id)


class _StoredMeta(KVBatchMeta):
    """What a put returns: its ``tags`` (the rows' merged stored tags) and ``fields`` (those every
    row holds, sorted) are read from the store when first used. verl uses them after two of its
    puts a step and never after the agent loop's one-row puts and status flips, which so cost no
    second round trip. Pickled or copied, it is a plain :class:`KVBatchMeta`."""

    def __init__(
        self, keys: list[str], partition_id: str
    ) -> None:  # no super().__init__: tags and fields stay unset until used
        self.keys = keys
        self.partition_id = partition_id
        self.extra_info = {}

    def __getattr__(self, name: str) -> Any:
        if name not in ("tags", "fields"):
            raise AttributeError(name)
        assert self.partition_id is not None
        infos = _dp().kv_describe(self.keys, partition_id=self.partition_id)
        self.tags = [infos[k].tags if k in infos else {} for k in self.keys]
        self.fields = sorted(_shared(infos))
        return getattr(self, name)

    def __reduce__(self) -> Any:
        return (KVBatchMeta, (self.keys, self.tags, self.partition_id, self.fields, self.extra_info))

    def __deepcopy__(self, memo: dict[int, Any]) -> KVBatchMeta:
        return KVBatchMeta(self.keys, self.tags, self.partition_id, self.fields, self.extra_info)


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tag: Mapping[str, Any] | None = None,
) -> KVBatchMeta:
    """One row: a dict's tensors get a batch dim of 1 and its other values become one-row objects."""
    if isinstance(fields, Mapping) and not isinstance(fields, TensorDictBase):
        one: dict[str, Any] = {}
        for k, v in fields.items():
            if isinstance(v, torch.Tensor):
                if v.is_nested:
                    raise ValueError(f"kv_put field {k!r}: give one row's plain tensor, not a nested tensor")
                one[k] = v.unsqueeze(0)
            else:
                one[k] = [v]
        fields = one
    return kv_batch_put([key], partition_id, fields, None if tag is None else [tag])


# -- gets ------------------------------------------------------------------------------------------
def _missing(pid: str, keys: Sequence[str], fields: Mapping[str, Sequence[str]]) -> MissingRows:
    parts = []
    if keys:
        parts.append(f"keys {list(keys)[:8]} are not in partition {pid!r}")
    for f, rows in fields.items():
        parts.append(f"field {f!r} is missing on {len(rows)} row(s) ({list(rows)[:4]})")
    return MissingRows(
        "; ".join(parts) + " (strict mode: TransferQueue would have dropped them silently; "
        "install(..., strict=False) drops them the same way)"
    )


def kv_batch_get(
    keys: Sequence[str] | str,
    partition_id: str,
    select_fields: Sequence[str] | str | None = None,
) -> TensorDict:
    """The rows ``keys`` (those found, in the order asked) with the fields they all hold, limited to
    ``select_fields`` when given; see the module docstring for what is dropped and when it raises."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    wanted = [select_fields] if isinstance(select_fields, str) else select_fields
    client = _dp()
    if wanted:  # the common case: everything there, one round trip
        try:
            got = client.kv_batch_get(keys, select_fields=list(wanted), partition_id=partition_id)
            return _tq_form(got, wanted, len(keys))
        except KeyNotFound:
            pass
    infos = client.kv_describe(keys, partition_id=partition_id)
    found = [k for k in keys if k in infos]
    shared = _shared(infos)
    if _strict():
        absent = [k for k in keys if k not in infos]
        lacking = {f: [k for k in found if f not in infos[k].fields] for f in (wanted or [])}
        lacking = {f: ks for f, ks in lacking.items() if ks}
        if absent or lacking or not found:
            raise _missing(partition_id, absent or ([] if found else keys), lacking)
    if not found:
        raise ValueError(f"keys or partition were not found! (partition {partition_id!r}, keys {keys[:8]})")
    if len(found) < len(keys):
        log.warning("transfer_queue facade: %d of %d keys not found; dropped", len(keys) - len(found), len(keys))
    if not shared:
        raise ValueError("Some fields are not ready in all the requested keys!")
    fields = sorted(shared if wanted is None else shared & set(wanted))
    if wanted is not None and set(wanted) - shared:
        log.warning("transfer_queue facade: fields %s not held by every row; dropped", sorted(set(wanted) - shared))
    if not fields:
        return TensorDict({}, batch_size=0)
    got = client.kv_batch_get(found, select_fields=fields, partition_id=partition_id)
    return _tq_form(got, fields, len(found))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: Sequence[str] | str | None = None) -> TensorDict:
    wanted = [select_fields] if isinstance(select_fields, str) else select_fields
    if wanted is not None and meta.fields is not None and set(wanted) - set(meta.fields):
        raise ValueError(f"select_fields {sorted(set(wanted) - set(meta.fields))} are not in meta.fields")
    assert meta.partition_id is not None
    return kv_batch_get(meta.keys, meta.partition_id, wanted if wanted is not None else meta.fields)


# -- listing and clearing --------------------------------------------------------------------------
def kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """``{partition: {key: tags}}``, keys in first-put order; ``{}`` for an unknown partition."""
    return _dp().kv_list(partition_id)


def kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    """Remove rows (unknown ones ignored); a key list is required, as in TransferQueue."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    if not keys:
        raise ValueError("kv_clear needs at least one key")
    _dp().kv_clear(keys, partition_id=partition_id)


# -- checkpoints ----------------------------------------------------------------------------------
def save_checkpoint(checkpoint_dir: str, *, include_storage: bool = True, metadata: Any = None) -> None:
    """Write every partition (keys in listing order, tags, fields) to ``checkpoint_dir`` as plain
    files (:mod:`integrations.verl.checkpoint`), swapped in atomically. ``include_storage=False`` is
    accepted and ignored: without the rows a Mooncake checkpoint would restore nothing."""
    checkpoint.save(_dp(), checkpoint_dir, metadata=metadata)


def load_checkpoint(checkpoint_dir: str) -> Any:
    """Replace everything the deployment holds with the checkpoint (as TransferQueue's load does);
    works on a deployment started after the one that was saved. Returns the saved metadata."""
    return checkpoint.load(_dp(), checkpoint_dir)


# -- async twins ----------------------------------------------------------------------------------
async def async_kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, keys, partition_id, fields, tags)


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tag: Mapping[str, Any] | None = None,
) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, key, partition_id, fields, tag)


async def async_kv_batch_get(
    keys: Sequence[str] | str, partition_id: str, select_fields: Sequence[str] | str | None = None
) -> TensorDict:
    return await asyncio.to_thread(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: Sequence[str] | str | None = None) -> TensorDict:
    return await asyncio.to_thread(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    return await asyncio.to_thread(kv_list, partition_id)


async def async_kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    await asyncio.to_thread(kv_clear, keys, partition_id)


# -- the worker-side client ----------------------------------------------------------------------
class FacadeClient:
    """What ``tq.get_client()`` returns: the four calls verl's worker bridge makes
    (``verl/utils/transferqueue_utils.py``), over this process's dataplane client."""

    async def async_kv_retrieve_meta(self, keys: Sequence[str], partition_id: str, create: bool = False) -> BatchMeta:
        """A :class:`BatchMeta` of the keys found (missing ones dropped) with the fields they share
        and their stored tags. ``create=True`` makes the missing keys tag-only rows first."""
        return await asyncio.to_thread(self._retrieve, list(keys), partition_id, create)

    def _retrieve(self, keys: list[str], partition_id: str, create: bool) -> BatchMeta:
        if not keys:
            raise ValueError("keys is empty")
        client = _dp()
        infos = client.kv_describe(keys, partition_id=partition_id)
        if create and len(infos) < len(keys):
            absent = [k for k in keys if k not in infos]
            client.kv_batch_put(absent, None, partition_id=partition_id, tags=[{} for _ in absent])
            infos = client.kv_describe(keys, partition_id=partition_id)
        found = [k for k in keys if k in infos]
        if _strict() and len(found) < len(keys):
            raise _missing(partition_id, [k for k in keys if k not in infos], {})
        return BatchMeta(
            global_indexes=found,
            partition_ids=[partition_id] * len(found),
            field_names=_shared(infos),
            custom_meta=[infos[k].tags for k in found],
        )

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        """The fields ``metadata.field_names`` of its rows, in TransferQueue's form."""
        if metadata.size == 0 or not metadata.field_names:
            return TensorDict({}, batch_size=0)
        pid = metadata.partition_id
        assert pid is not None

        def read() -> TensorDict:
            got = _dp().kv_batch_get(metadata.global_indexes, select_fields=metadata.field_names, partition_id=pid)
            return _tq_form(got, metadata.field_names, metadata.size)

        return await asyncio.to_thread(read)

    async def async_put(self, data: TensorDictBase, metadata: BatchMeta | None = None, **_: Any) -> BatchMeta:
        """Write ``data``'s fields for ``metadata``'s rows (tags are not re-sent); returns the meta
        with those fields added."""
        if metadata is None or metadata.partition_id is None:
            raise ValueError("async_put needs the BatchMeta of the rows it writes")
        pid = metadata.partition_id

        def write() -> None:
            _dp().kv_batch_put(metadata.global_indexes, _columns(data, metadata.size), partition_id=pid)

        await asyncio.to_thread(write)
        return metadata.add_fields(data)

    async def async_kv_retrieve_keys(self, global_indexes: Sequence[str], partition_id: str) -> list[str]:
        """The keys of ``global_indexes`` (which, here, are the keys)."""
        return list(global_indexes)


_FACADE_CLIENT = FacadeClient()


def get_client() -> FacadeClient:
    """The worker-side client (joins the deployment on first use)."""
    _dp()
    return _FACADE_CLIENT
