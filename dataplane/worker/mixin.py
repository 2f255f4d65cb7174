"""``DataPlaneWorkerMixin``: shard fetch (independent or leader broadcast) and leader-only write-back.

Mix it into a training worker (one process per GPU rank)::

    class Worker(DataPlaneWorkerMixin, MyTrainerBase):
        def replica_group(self):  # ranks needing identical data: TP / CP / PP siblings
            return self.tp_cp_group

Policies of :meth:`DataPlaneWorkerMixin.fetch`:

* ``independent`` -- every rank reads its shard from the store.
* ``leader_broadcast`` -- rank 0 of :meth:`replica_group` reads the jagged wire form, sends a
  descriptor and one flat buffer per dtype over the group's backend (NCCL for CUDA, gloo for CPU),
  and every rank materializes locally (see :mod:`dataplane.worker.collective`).
* ``auto`` -- leader broadcast when the replica group has more than one rank.

Every rank of a replica group must call ``fetch`` with the same meta, fields and policy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from dataplane.adapters.read_into import AdoptsPuts, ReadsInto
from dataplane.checks import check_int
from dataplane.client import DataPlaneClient, PadValues
from dataplane.codec.wire import Column, Layout, decode_columns, validate_field_name
from dataplane.errors import DataPlaneError, InvalidArgument, SchemaError
from dataplane.meta import KVBatchMeta
from dataplane.worker.collective import (
    Agreement,
    agree,
    broadcast_buffers,
    comm_device,
    recv_descriptor,
    send_descriptor,
)
from dataplane.worker.descriptor import (
    Descriptor,
    ErrorInfo,
    allocate,
    batch_digest,
    columns_from_jagged,
    error_from_info,
    objects_column,
    plan_buffers,
    stage,
    unstage,
    wire_bytes,
)
from dataplane.worker.microbatch import iter_microbatches
from dataplane.worker.pinned import process_pool
from dataplane.worker.pipeline import PinnedMode, direct_store, move_columns, read_columns
from dataplane.worker.stats import FetchStats, WriteBackStats, notify_stats_observers
from dataplane.worker.writeback import TokenFields, prepare_writeback, to_host

__all__ = ["DataPlaneWorkerMixin", "FetchPolicy"]

FetchPolicy = Literal["auto", "independent", "leader_broadcast"]
_POLICIES = ("auto", "independent", "leader_broadcast")


def _check_fields(select_fields: Sequence[str] | str) -> list[str]:
    fields = [select_fields] if isinstance(select_fields, str) else list(select_fields or ())
    if not fields:
        raise InvalidArgument("select_fields is required and must name at least one field (there is no fetch-all)")
    out = [validate_field_name(f) for f in fields]
    if len(set(out)) != len(out):
        raise InvalidArgument(f"select_fields has duplicates: {out}")
    return out


def _meta_pad_length(meta: KVBatchMeta) -> int | None:
    value = meta.extra_info.get("pad_to_length")
    return None if value is None else check_int("meta.extra_info['pad_to_length']", value, low=None)


class DataPlaneWorkerMixin:
    """Turns a shard meta into local data and writes results back. See the module docstring.

    Override :meth:`replica_group` and :meth:`is_writeback_leader` for TP/CP/PP workers (or use
    :class:`~dataplane.worker.mesh.DeviceMeshReplicaMixin`); the defaults fit a DP-only worker.

    Attributes:
        data_plane_timeout_s: how long a sibling waits for its leader's descriptor (the leader's
            whole store read) and for each agreement, before raising ``DataPlaneTimeout``.
        data_plane_sync_timing: synchronize CUDA between phases so :class:`FetchStats` times are
            device times (benchmarks); off by default because it stalls the stream.
        data_plane_pinned: how host data reaches a GPU and GPU results reach the host: ``"auto"``
            (through the process's bounded pinned pool, chunked and overlapped on a side stream:
            :mod:`dataplane.worker.pinned`), ``"never"`` (plain pageable copies), ``"always"`` (the
            pool also for CPU targets: what the CPU tests run).
        data_plane_direct: with the pool, let the store's memory be the one the pool copies from
            and to, where the store allows it (:mod:`dataplane.adapters.read_into`): a fetch reads
            straight into the pinned chunks (``memory://``), a write-back's host copies land in
            the client's ``empty()`` memory, which its put sends as it is (``mooncake://``) or keeps
            (``memory://``). False: read first, then stage (the comparison the benchmark makes).
        last_fetch_stats: stats of this rank's last fetch.

    >>> import dataplane, torch
    >>> class Worker(DataPlaneWorkerMixin):
    ...     pass
    >>> w = Worker()
    >>> client = w.setup_data_plane("memory://")
    >>> meta = client.kv_batch_put(["a", "b"], {"ids": [torch.tensor([1, 2]), torch.tensor([3])]}, partition_id="p")
    >>> w.fetch(meta, select_fields=["ids"], pad_values={"ids": -1})["ids"].tolist()
    [[1, 2], [3, -1]]
    >>> w.write_back(meta, {"lp": torch.zeros(2, 2)}, token_fields=["lp"]).fields
    ('ids', 'lp')
    >>> w.close_data_plane()
    """

    data_plane_timeout_s: float = 300.0
    data_plane_sync_timing: bool = False
    data_plane_pinned: PinnedMode = "auto"
    data_plane_direct: bool = True
    last_fetch_stats: FetchStats | None = None
    _dp_client: DataPlaneClient | None = None
    _dp_owns_client: bool = False
    _dp_pad_widths: dict[str, int] | None = None

    # -- setup ------------------------------------------------------------------------------------
    def setup_data_plane(self, url_or_client: str | DataPlaneClient, **options: Any) -> DataPlaneClient:
        """Use ``url_or_client``: a URL goes to :func:`dataplane.connect` (and is closed by
        :meth:`close_data_plane`); a client is used as given (its owner closes it)."""
        if isinstance(url_or_client, str):
            from dataplane.registry import connect

            client, owned = connect(url_or_client, **options), True
        elif isinstance(url_or_client, DataPlaneClient):
            if options:
                raise InvalidArgument(f"options {sorted(options)} only apply to a URL; configure the client instead")
            client, owned = url_or_client, False
        else:
            raise SchemaError(f"setup_data_plane takes a URL or a DataPlaneClient, got {type(url_or_client).__name__}")
        self.close_data_plane()
        self._dp_client, self._dp_owns_client = client, owned
        return client

    @property
    def data_plane(self) -> DataPlaneClient:
        """The client set up by :meth:`setup_data_plane`."""
        if self._dp_client is None:
            raise DataPlaneError(
                f"{type(self).__name__} has no data plane yet; call setup_data_plane(url_or_client) on every rank first"
            )
        return self._dp_client

    def close_data_plane(self) -> None:
        """Close the client if this worker opened it from a URL (idempotent)."""
        client, owned = self._dp_client, self._dp_owns_client
        self._dp_client, self._dp_owns_client = None, False
        if client is not None and owned:
            client.close()
        process_pool().close()  # its pinned buffers are allocated again on the next copy

    # -- hooks ------------------------------------------------------------------------------------
    def replica_group(self) -> Any | None:
        """Process group of the ranks that need identical data (TP/CP/PP siblings), or None (DP only).

        Return the group whenever it has more than one rank, even where broadcasting is not worth it:
        choose ``policy="independent"`` for that instead, so write-back leadership stays correct.
        """
        return None

    def is_writeback_leader(self) -> bool:
        """Whether this rank writes its replica group's results: rank 0 of :meth:`replica_group`."""
        group = self.replica_group()
        if group is None:
            return True
        rank = dist.get_rank(group)
        if rank < 0:
            raise InvalidArgument("this rank is not a member of the group replica_group() returned; fix the hook")
        return bool(rank == 0)

    # -- fetch ------------------------------------------------------------------------------------
    def fetch(
        self,
        meta: KVBatchMeta,
        *,
        select_fields: Sequence[str] | str,
        layout: Layout = "padded",
        pad_values: PadValues = None,
        policy: FetchPolicy = "auto",
        device: torch.device | str | None = None,
        pad_to_multiple: int = 1,
        pad_to_length: int | None = None,
        timeout_s: float | None = None,
    ) -> TensorDict:
        """This rank's shard as a TensorDict.

        Args:
            meta: the shard (identical on every rank of the replica group).
            select_fields: fields to read (required; no fetch-all).
            layout: ``padded`` (right-padded per field) or ``jagged`` (nested tensors).
            pad_values: pad value, or field -> pad value (default 0).
            policy: ``independent``, ``leader_broadcast`` or ``auto`` (see the module docstring).
                Without a replica group (or one of one rank) every policy reads independently.
            device: where the result lives. None keeps it where the transfer leaves it: the CPU for
                independent reads and gloo groups, the current CUDA device for NCCL groups.
            pad_to_multiple: round the padded width up to a multiple of this.
            pad_to_length: padded width; defaults to ``meta.extra_info["pad_to_length"]`` (the global
                pad length the preshard step stamps), so every DP rank forwards one shape.
            timeout_s: bound on waiting for the leader (default :attr:`data_plane_timeout_s`).

        Raises:
            KeyNotFound, DataPlaneError, ...: on every rank of the group when the leader's read fails.
            DataPlaneTimeout: a rank of the group did not take part in time.
        """
        t_start = time.perf_counter()
        if not isinstance(meta, KVBatchMeta):
            raise SchemaError(f"fetch takes a KVBatchMeta, got {type(meta).__name__}")
        if layout not in ("jagged", "padded"):
            raise InvalidArgument(f"layout must be 'jagged' or 'padded', got {layout!r}")
        if policy not in _POLICIES:
            raise InvalidArgument(f"policy must be one of {list(_POLICIES)}, got {policy!r}")
        fields = _check_fields(select_fields)
        pad_len = pad_to_length if pad_to_length is not None else _meta_pad_length(meta)
        target = None if device is None else torch.device(device)
        if target is not None and target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        group = self.replica_group()
        size = 1 if group is None else dist.get_world_size(group)
        timings: dict[str, float] = {}
        role: Literal["reader", "leader", "sibling"]
        direct: ReadsInto | None = None  # the store a read into the pinned pool comes from
        if size > 1 and policy != "independent":
            cols, objects, role, store_bytes, bcast_bytes = self._fetch_broadcast(
                meta, fields, group, timeout_s, timings
            )
            used: Literal["independent", "leader_broadcast"] = "leader_broadcast"
        else:
            direct = self._direct(meta, target)
            cols, objects, store_bytes = self._fetch_independent(meta, fields, timings, target, direct)
            role, bcast_bytes, used = "reader", 0, "independent"
        t0 = time.perf_counter()
        out = self._materialize(
            cols,
            objects,
            fields,
            meta.size,
            layout,
            pad_values,
            pad_to_multiple,
            pad_len,
            target,
            "auto" if direct is not None else self.data_plane_pinned,  # read into place already
        )
        pad_width = None
        if layout == "padded":
            jagged = [f for f, c in cols.items() if c.schema.kind == "jagged"]
            if jagged:
                pad_width = int(out.get(jagged[0]).shape[1])
                self._remember_width(meta, pad_width)
        self._sync()
        now = time.perf_counter()
        self.last_fetch_stats = FetchStats(
            policy=used,
            role=role,
            group_size=size,
            rows=meta.size,
            fields=tuple(fields),
            store_bytes=store_bytes,
            broadcast_bytes=bcast_bytes,
            materialize_s=now - t0,
            total_s=now - t_start,
            pad_width=pad_width,
            **timings,
        )
        notify_stats_observers(self.last_fetch_stats)
        return out

    def _sync(self) -> None:
        if self.data_plane_sync_timing and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _direct(self, meta: KVBatchMeta, device: torch.device | None) -> ReadsInto | None:
        """The store a fetch to ``device`` reads into the pinned pool from, or None (see
        :func:`~dataplane.worker.pipeline.direct_store`)."""
        if not self.data_plane_direct:
            return None
        return direct_store(self.data_plane, meta, device, self.data_plane_pinned)

    def _fetch_independent(
        self,
        meta: KVBatchMeta,
        fields: list[str],
        timings: dict[str, float],
        device: torch.device | None,
        store: ReadsInto | None,
    ) -> tuple[dict[str, Column], dict[str, NonTensorStack], int]:
        t0 = time.perf_counter()
        if store is not None and device is not None:  # read into the pinned pool: the one host copy
            cols, objects = read_columns(self.data_plane, store, meta, fields, device)
        else:
            td = self.data_plane.kv_batch_get(meta, select_fields=fields, layout="jagged")
            objects = {f: v for f in fields if isinstance(v := td.get(f), NonTensorStack)}
            cols = columns_from_jagged(td, [f for f in fields if f not in objects])
        timings["read_s"] = time.perf_counter() - t0
        return cols, objects, wire_bytes(cols)

    def _fetch_broadcast(
        self, meta: KVBatchMeta, fields: list[str], group: Any, timeout_s: float | None, timings: dict[str, float]
    ) -> tuple[dict[str, Column], dict[str, NonTensorStack], Literal["leader", "sibling"], int, int]:
        deadline = time.monotonic() + (self.data_plane_timeout_s if timeout_s is None else timeout_s)
        device = comm_device(group)
        src = dist.get_global_rank(group, 0)
        digest = batch_digest(meta, fields)
        group_rank = dist.get_rank(group)
        if group_rank < 0:
            raise InvalidArgument("this rank is not a member of the group replica_group() returned; fix the hook")
        kw: dict[str, Any] = {"src": src, "group": group, "device": device, "deadline": deadline}
        if group_rank == 0:
            t0 = time.perf_counter()
            try:
                store = self._direct(meta, device)
                if store is not None:  # read into the pinned pool, to the comm device
                    cols, objects = read_columns(self.data_plane, store, meta, fields, device)
                    wire = {f: cols[f] if f in cols else objects_column(f, objects[f].tolist()) for f in fields}
                else:
                    td = self.data_plane.kv_batch_get(meta, select_fields=fields, layout="jagged")
                    wire = columns_from_jagged(td, fields)
                    del td
                if device.type == "cuda":  # to the GPU through the pinned pipeline; staged there
                    wire = move_columns(wire, device, self.data_plane_pinned)
                t1 = time.perf_counter()
                desc = plan_buffers(wire, rows=meta.size, digest=digest)
                buffers = stage(wire, desc, device)
                store_bytes = wire_bytes({f: c for f, c in wire.items() if c.schema.kind != "object"})
                del wire
                payload = desc.to_bytes()
                self._sync()
            except Exception as e:
                info = ErrorInfo.from_exception(e, dist.get_rank())
                send_descriptor(Descriptor(rows=meta.size, digest=digest, error=info).to_bytes(), **kw)
                raise error_from_info(info) from e
            t2 = time.perf_counter()
            sent = send_descriptor(payload, **kw)
            code = agree(Agreement.OK, group=group, device=device, deadline=deadline)
            if code != Agreement.OK:
                raise _group_failure(code)
            broadcast_buffers(buffers, src=src, group=group, deadline=deadline)
            self._sync()
            timings.update(read_s=t1 - t0, stage_s=t2 - t1, broadcast_s=time.perf_counter() - t2)
            return unstage(desc, buffers), {}, "leader", store_bytes, sent + desc.nbytes
        t0 = time.perf_counter()
        payload, received = recv_descriptor(**kw)
        t1 = time.perf_counter()
        code, buffers = Agreement.OK, []
        local_error: DataPlaneError | None = None
        try:
            desc = Descriptor.from_bytes(payload)
        except DataPlaneError as e:
            code, local_error = Agreement.FAILED, e
        else:
            if desc.error is not None:
                raise error_from_info(desc.error)
            if desc.digest != digest:
                code, local_error = Agreement.MISMATCH, _group_failure(Agreement.MISMATCH)
            else:
                try:
                    buffers = allocate(desc, device)
                except Exception as e:
                    code = Agreement.FAILED
                    local_error = DataPlaneError(
                        f"could not allocate {desc.nbytes} bytes on {device} to receive the shard ({e}); "
                        "free memory or fetch a smaller shard"
                    )
        final = agree(code, group=group, device=device, deadline=deadline)
        if final != Agreement.OK:
            raise local_error if local_error is not None else _group_failure(final)
        broadcast_buffers(buffers, src=src, group=group, deadline=deadline)
        self._sync()
        timings.update(wait_s=t1 - t0, broadcast_s=time.perf_counter() - t1)
        return unstage(desc, buffers), {}, "sibling", 0, received + desc.nbytes

    @staticmethod
    def _materialize(
        cols: dict[str, Column],
        objects: dict[str, NonTensorStack],
        fields: list[str],
        rows: int,
        layout: Layout,
        pad_values: PadValues,
        pad_to_multiple: int,
        pad_to_length: int | None,
        device: torch.device | None,
        pinned: PinnedMode = "auto",
    ) -> TensorDict:
        if device is not None:
            cols = move_columns(cols, device, pinned)
        pickled = [f for f, c in cols.items() if c.schema.codec == "pickle"]
        decoded = decode_columns(
            cols,
            rows,
            layout=layout,
            pad_values=pad_values,
            pad_to_multiple=pad_to_multiple,
            pad_to_length=pad_to_length,
            pickle_fields=pickled,
        )
        items = {f: objects[f] if f in objects else decoded.get(f) for f in fields}
        return TensorDict(items, batch_size=[rows], device=device)

    def _remember_width(self, meta: KVBatchMeta, width: int) -> None:
        if self._dp_pad_widths is None:
            self._dp_pad_widths = {}
        widths = self._dp_pad_widths
        widths[batch_digest(meta, ())] = width
        while len(widths) > 8:
            del widths[next(iter(widths))]

    # -- write back -------------------------------------------------------------------------------
    def write_back(
        self,
        meta: KVBatchMeta,
        fields: TensorDictBase | Mapping[str, Any],
        *,
        token_fields: TokenFields = "auto",
        check_lengths: bool = True,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta | None:
        """Write this shard's results; only :meth:`is_writeback_leader` ranks write (one put per key).

        Sizes are checked against the meta first (see :mod:`dataplane.worker.writeback` for the
        rules, including how padded per-token tensors are packed to jagged with
        ``meta.sequence_lengths``). Call it on every rank; the others return at once.

        Returns:
            ``meta`` with the written fields added on the writing rank; None on the others.
        """
        t_start = time.perf_counter()
        if not isinstance(meta, KVBatchMeta):
            raise SchemaError(f"write_back takes a KVBatchMeta, got {type(meta).__name__}")
        if not self.is_writeback_leader():
            return None
        client = self.data_plane
        width = (self._dp_pad_widths or {}).get(batch_digest(meta, ()))
        prepared = prepare_writeback(
            meta,
            fields,
            token_fields=token_fields,
            pad_widths=() if width is None else (width,),
            check_lengths=check_lengths,
            to_cpu=self.data_plane_pinned == "never" and not client.capabilities.device_tensors,
        )
        made: list[torch.Tensor] = []  # host copies made here, nobody else's: the store may keep them
        if self.data_plane_pinned != "never" and not client.capabilities.device_tensors:
            prepared = to_host(  # packed on the GPU first
                prepared,
                always=self.data_plane_pinned == "always",
                empty=client.empty if self.data_plane_direct else None,
                made=made,
            )
        store = getattr(client, "store", None)
        keep = store.adopting(made) if made and self.data_plane_direct and isinstance(store, AdoptsPuts) else None
        with keep if keep is not None else contextlib.nullcontext():
            written = client.kv_batch_put(list(meta.keys), prepared, partition_id=meta.partition_id, tags=tags)
        seconds = time.perf_counter() - t_start
        notify_stats_observers(WriteBackStats(rows=meta.size, fields=tuple(prepared.keys()), seconds=seconds))
        out = meta.with_fields(written.fields)
        return out if tags is None else out.stamp_tags(tags)

    # -- microbatches -----------------------------------------------------------------------------
    def iter_microbatches(
        self, data: TensorDictBase, meta: KVBatchMeta, *, micro_batch_size: int | None = None
    ) -> Iterator[TensorDictBase]:
        """Microbatches of fetched ``data`` per ``meta.extra_info["microbatches"]`` (see
        :func:`dataplane.worker.microbatch.iter_microbatches`)."""
        return iter_microbatches(data, meta, micro_batch_size=micro_batch_size)


def _group_failure(code: int) -> DataPlaneError:
    if code == Agreement.MISMATCH:
        return InvalidArgument(
            "a rank of the replica group fetched another meta or other select_fields than its leader; every rank "
            "of a group must fetch the same shard with the same fields -- check how shards are sent to TP/CP/PP "
            "siblings"
        )
    return DataPlaneError(
        "a rank of the replica group could not take the shard (its own error says why); nothing was broadcast"
    )
