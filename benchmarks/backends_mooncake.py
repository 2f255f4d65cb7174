"""``mooncake`` in ``benchmarks.put_get``, beside raw Mooncake in the same layout.

The raw ceiling moves the same bytes in the layout the adapter uses (one object per field, rows back
to back) with ``batch_put_from`` / ``batch_get_into`` between registered buffers, from a client that
lends no segment, into the same master and store server as the benchmark's client, over the same
path (shared memory with the real client, or TCP), so ours/raw isolates our layer. Puts compare like
with like: ours from ordinary tensors against raw with the same copy into registered memory first,
ours from ``client.empty()`` memory against raw from its registered buffer (no copy).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import torch

from benchmarks.backends import BenchBackend, RawTimes
from benchmarks.workload import Batch

__all__ = ["BACKENDS", "FieldSpec", "RawMooncake", "deployment_of", "field_buffers", "field_specs"]

SEGMENT_BYTES = 4 << 30
PAGE = 4096  # ours and the raw ceiling's objects share the one store server


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


FieldSpec = tuple[str, torch.dtype, tuple[int, ...], torch.Tensor | None]  # name, dtype, inner shape, offsets


def _tensor_fields(batch: Batch) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(field, values, offsets or None) of every tensor field: one object each in the adapter."""
    out = []
    for name, v in batch.fields.items():
        if isinstance(v, torch.Tensor):
            out.append((name, v.values(), v.offsets()) if v.is_nested else (name, v, None))
    return out


def field_specs(batch: Batch) -> list[FieldSpec]:
    """(field, dtype, inner shape, offsets or None) of every tensor field, in :func:`field_buffers` order."""
    return [(name, t.dtype, tuple(t.shape[1:]), offsets) for name, t, offsets in _tensor_fields(batch)]


def field_buffers(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    """(field, contiguous uint8 view) of every field the adapter would store as one object."""
    return [(name, t.contiguous().reshape(-1).view(torch.uint8)) for name, t, _ in _tensor_fields(batch)]


class RawMooncake:
    """One Mooncake client (no segment) with a registered source and destination arena.

    With ``real_client`` it attaches to that real client (``setup_dummy``) as the adapter does, and
    its arenas are shared memory from ``alloc_from_mem_pool``; otherwise it is a plain TCP client.

    ``page_aligned`` (default): every object starts on a page in its arena and is padded to whole
    pages, as the adapter pads its objects over shared memory. A store server that streams its copies
    (as ``mooncake://local`` starts it) copies 2-5x slower where an object's bytes lie 1-700 bytes
    past a page boundary relative to the other side, so back-to-back objects of odd sizes would slow
    raw down by chance; padded, raw is the ceiling.
    """

    def __init__(
        self, master_address: str, arena_bytes: int, real_client: str | None = None, *, page_aligned: bool = True
    ) -> None:
        from dataplane.adapters.mooncake import apply_client_env_defaults

        apply_client_env_defaults()  # the environment the adapter's own clients get
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        from dataplane.observability import filtered_stderr

        self.store: Any = MooncakeDistributedStore()
        with filtered_stderr():  # Mooncake's harmless glog lines, as for our own clients
            if real_client:
                rc = self.store.setup_dummy(arena_bytes, 16 << 20, real_client)
            else:
                rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address)
        if rc != 0:
            raise RuntimeError(f"raw Mooncake setup failed: {rc}")
        self.cfg = ReplicateConfig()
        self.cfg.with_hard_pin = True
        self.src, self.dst = (self._arena(arena_bytes, bool(real_client)) for _ in range(2))
        self._tail = 0  # where stage_tensors' values end in src (put_tensors stages offsets after them)
        for arr in (self.src, self.dst):
            arr[:] = 1  # pre-faulted
            if self.store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        self.sizes: list[int] = []  # bytes of each object's content (see stored)
        self.align = PAGE if page_aligned else 1
        self._slot = max(64, self.align)  # where put_tensors / get_tensors place each tensor

    def _arena(self, nbytes: int, shm: bool) -> np.ndarray:
        if not shm:
            return np.empty(nbytes, dtype=np.uint8)
        ptr = self.store.alloc_from_mem_pool(nbytes)
        if not ptr:
            raise RuntimeError("alloc_from_mem_pool failed")
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def load(self, buffers: list[tuple[str, torch.Tensor]]) -> None:
        """Copy the batch into the registered source arena (untimed)."""
        self.sizes = [b.numel() for _, b in buffers]
        for (_, b), ptr in zip(buffers, self._ptrs(self.src), strict=True):
            at = ptr - int(self.src.ctypes.data)
            self.src[at : at + b.numel()] = b.numpy()

    def _padded(self, nbytes: int) -> int:
        return round_up(nbytes, self.align)

    @property
    def stored(self) -> list[int]:
        """Bytes of each object in the store (its content, padded to :attr:`align`)."""
        return [self._padded(n) for n in self.sizes]

    def _ptrs(self, arr: np.ndarray, align: int | None = None, sizes: list[int] | None = None) -> list[int]:
        """Where each object of ``sizes`` (default ``self.sizes``) goes in ``arr``: back to back, each
        start ``align``-aligned (default :attr:`align`)."""
        step = self.align if align is None else align
        base, at, out = int(arr.ctypes.data), 0, []
        for n in self.sizes if sizes is None else sizes:
            out.append(base + at)
            at += round_up(n, step)
        return out

    def read_back(self, arr: np.ndarray | None = None) -> np.ndarray:
        """The content of every object in ``arr`` (default the destination arena), back to back."""
        arr = self.dst if arr is None else arr
        base = int(arr.ctypes.data)
        return np.concatenate([arr[p - base : p - base + n] for p, n in zip(self._ptrs(arr), self.sizes, strict=True)])

    def put(self, keys: list[str]) -> float:
        t0 = time.perf_counter()
        rc = self.store.batch_put_from(keys, self._ptrs(self.src), self.stored, self.cfg)
        dt = time.perf_counter() - t0
        if any(c != 0 for c in rc):
            raise RuntimeError(f"raw batch_put_from failed: {rc}")
        return dt

    def get(self, keys: list[str]) -> float:
        stored = self.stored
        t0 = time.perf_counter()
        rc = self.store.batch_get_into(keys, self._ptrs(self.dst), stored)
        dt = time.perf_counter() - t0
        if list(rc) != stored:
            raise RuntimeError(f"raw batch_get_into failed: {rc}")
        return dt

    def stage_tensors(self, specs: list[FieldSpec], buffers: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The batch as ``kv_batch_put`` takes it (a jagged field a nested tensor; fields that share
        offsets share them), its values in page-aligned slots of the registered source arena (where
        :meth:`load` puts the bytes-only contender's batch): untimed setup, like the ``client.empty()``
        batch ``ours_zc`` puts."""
        arena = torch.from_numpy(self.src)
        out: dict[str, torch.Tensor] = {}
        at = 0
        for (name, dtype, inner, offsets), (_, b) in zip(specs, buffers, strict=True):
            slot = arena[at : at + b.numel()]
            np.copyto(slot.numpy(), b.numpy())  # one thread, as load(): no OpenMP workers spin into the put
            values = slot.view(dtype).view(-1, *inner)
            out[name] = values if offsets is None else torch.nested.nested_tensor_from_jagged(values, offsets)
            at += round_up(b.numel(), self._slot)
        self._tail = at
        return out

    def put_tensors(self, prefix: str, fields: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
        """A raw put of what ``kv_batch_put`` takes, as a raw user must make it: each field's values
        (already in registered memory, from :meth:`stage_tensors`) as object ``{prefix}{field}``, and
        each distinct offsets tensor, copied into registered memory, as ``{prefix}{field}.offsets`` of
        the first field that has it. Seconds (from the tensors to the end of ``batch_put_from``) and
        the keys written."""
        t0 = time.perf_counter()
        arena = torch.from_numpy(self.src)
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        staged: set[int] = set()
        at = self._tail
        for name, t in fields.items():
            values = t
            if t.is_nested:
                values, offsets = t.values(), t.offsets()
                if id(offsets) not in staged:
                    staged.add(id(offsets))
                    nbytes = offsets.numel() * 8
                    slot = arena[at : at + nbytes]
                    slot.view(torch.int64).copy_(offsets)
                    keys.append(f"{prefix}{name}.offsets")
                    ptrs.append(slot.data_ptr())
                    sizes.append(self._padded(nbytes))
                    at += round_up(nbytes, self._slot)
            keys.append(prefix + name)
            ptrs.append(values.data_ptr())
            sizes.append(self._padded(values.numel() * values.element_size()))
        rc = self.store.batch_put_from(keys, ptrs, sizes, self.cfg)
        dt = time.perf_counter() - t0
        if any(c != 0 for c in rc):
            raise RuntimeError(f"raw batch_put_from failed: {rc}")
        return dt, keys

    def get_tensors(
        self, prefix: str, specs: list[FieldSpec], sizes: list[int], rows: int
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """A raw get as a user needs it, of what :meth:`put_tensors` wrote: every values object and
        offsets object read in one ``batch_get_into`` into page-aligned slots of the registered
        buffer, then each field viewed as its dtype and shape, a jagged one made a nested tensor with
        torch's own constructor over the offsets just read (the tensors ``kv_batch_get`` returns).
        The reader knows the schema (``specs``: which fields share offsets), the values' byte
        ``sizes`` and the row count, as a raw user's code would. Seconds and the tensors."""
        owner: dict[int, str] = {}  # id(offsets) -> the first field that has it (names its object)
        for name, _, _, offsets in specs:
            if offsets is not None:
                owner.setdefault(id(offsets), name)
        keys = [prefix + name for name, *_ in specs] + [f"{prefix}{n}.offsets" for n in owner.values()]
        want = [self._padded(n) for n in [*sizes, *[(rows + 1) * 8] * len(owner)]]
        base, ptrs = int(self.dst.ctypes.data), self._ptrs(self.dst, align=self._slot, sizes=want)
        t0 = time.perf_counter()
        rc = self.store.batch_get_into(keys, ptrs, want)
        dst = torch.from_numpy(self.dst)
        read = {
            n: dst[p - base : p - base + (rows + 1) * 8].view(torch.int64)
            for n, p in zip(owner.values(), ptrs[len(specs) :], strict=True)
        }
        out: dict[str, torch.Tensor] = {}
        for (name, dtype, inner, offsets), ptr, n in zip(specs, ptrs[: len(specs)], sizes, strict=True):
            values = dst[ptr - base : ptr - base + n].view(dtype).view(-1, *inner)
            out[name] = (
                values if offsets is None else torch.nested.nested_tensor_from_jagged(values, read[owner[id(offsets)]])
            )
        dt = time.perf_counter() - t0
        if list(rc) != want:
            raise RuntimeError(f"raw batch_get_into failed: {rc}")
        return dt, out

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)

    def close(self) -> None:
        from dataplane.observability import filtered_stderr

        for arr in (self.src, self.dst):
            self.store.unregister_buffer(arr.ctypes.data)
        with filtered_stderr():
            self.store.close()


_RAW: dict[str, RawMooncake] = {}  # master address -> the raw client, reused across cases


def _raw_client(master: str, nbytes: int, real_client: str | None) -> RawMooncake:
    nbytes += 1 << 20  # room for each object's padding to whole pages (up to 256 objects)
    raw = _RAW.get(master)
    if raw is not None and raw.src.nbytes >= nbytes:
        return raw
    if raw is not None:
        raw.close()
    raw = _RAW[master] = RawMooncake(master, max(nbytes, 64 << 20), real_client)
    return raw


def deployment_of(client: Any) -> Any:
    """The :class:`~dataplane.adapters.mooncake.MooncakeConfig` of the deployment a ``mooncake://``
    client is part of, from the URL other processes join it by (``client.store.join_url``): its
    ``master``, ``metrics_port`` and ``real_client`` (None: clients reach the store over TCP)."""
    from dataplane.adapters.mooncake import MooncakeConfig

    return MooncakeConfig.from_url(client.store.join_url)


def close_raw_clients() -> None:
    """Close the raw clients (before their deployment stops)."""
    while _RAW:
        _RAW.popitem()[1].close()


def raw_seconds(batch: Batch, repeat: int, client: Any, warmup: int = 1) -> RawTimes:
    """Raw Mooncake against the benchmark client's own master and store server, each repetition a
    copy of the batch's ordinary tensors into the registered source arena (what a raw user holding
    tensors must do first, as our put of ordinary tensors does), a ``batch_put_from`` from that
    arena and a ``batch_get_into``. Put from "tensors": the copy and the put; from "empty": the put
    alone (the batch already in registered memory, as ours from ``client.empty()`` memory)."""
    buffers = field_buffers(batch)
    total = sum(b.numel() for _, b in buffers)
    dep = deployment_of(client)
    raw = _raw_client(dep.master, total, dep.real_client)
    copied, puts, gets = [], [], []
    for i in range(warmup + repeat):
        keys = [f"raw/{i}/{name}" for name, _ in buffers]
        t0 = time.perf_counter()
        raw.load(buffers)
        tc = time.perf_counter() - t0
        tp = raw.put(keys)
        tg = raw.get(keys)
        if i < warmup and not np.array_equal(raw.read_back(raw.src), raw.read_back()):
            raise RuntimeError("raw Mooncake round trip is not bit-exact")
        raw.remove(keys)
        if i >= warmup:
            copied.append(tc + tp)
            puts.append(tp)
            gets.append(tg)
    return RawTimes(get=gets, put={"tensors": copied, "empty": puts})


def _reader_url(client: Any) -> tuple[str, dict[str, Any]]:
    return client.store.join_url, {}


BACKENDS: list[BenchBackend] = [
    BenchBackend(
        name="mooncake",
        url=f"mooncake://local?segment_bytes={SEGMENT_BYTES}",
        requires=("mooncake",),
        put_from=("tensors", "empty"),
        paths="a put of ordinary tensors copies them into the shared memory the store server reads, against "
        "raw Mooncake's copy of the same tensors into its registered buffer plus batch_put_from; a put from "
        "client.empty() memory sends with no copy, against raw batch_put_from of a batch already in registered "
        "memory; gets against raw batch_get_into into a registered buffer",
        raw=raw_seconds,
        reader_url=_reader_url,
        before_close=close_raw_clients,
    )
]
