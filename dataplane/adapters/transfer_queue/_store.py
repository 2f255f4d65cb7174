"""The ``tq://`` store over TransferQueue: its options (:class:`TQConfig`), the one deployment a
process shares between its clients, and :func:`connect`. The package docstring
(:mod:`dataplane.adapters.transfer_queue`) describes the adapter as a whole."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal
from urllib.parse import parse_qs, urlparse

from dataplane._host.quiet import quiet_typed_errors
from dataplane.adapters.transfer_queue._claims import TQClaims
from dataplane.adapters.transfer_queue._deploy_config import TQDeployConfig
from dataplane.adapters.transfer_queue._deployment import TQDeployment, start_or_attach
from dataplane.adapters.transfer_queue._layout import MARKER, stored_keys, user_listing
from dataplane.adapters.transfer_queue._ops import SCHEMA_EXTRA, TQOps
from dataplane.checks import check_bytes
from dataplane.claims import ConsumptionStatus
from dataplane.client import Capabilities, Listing
from dataplane.codec.wire import Column
from dataplane.errors import (
    BackendUnavailable,
    CapacityExceeded,
    ClientClosed,
    DataPlaneError,
    DataPlaneTimeout,
    InvalidArgument,
)
from dataplane.meta import KVBatchMeta, RowInfo
from dataplane.registry import check_options, url_option
from dataplane.storage import ClaimedRow, KVStore
from dataplane.store_client import StoreClient

__all__ = ["TQConfig", "TQStore", "attached_clients", "connect"]

log = logging.getLogger(__name__)

_Described = list[RowInfo | None]  # an alias: inside TQStore, ``list`` is its method
_Claimed = list[ClaimedRow]

_GIB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class TQConfig:
    """Options of ``tq://`` (each is also a URL query parameter: ``tq://?backend=simple&units=2``).

    Attributes:
        backend: ``"simple"`` (TQ's SimpleStorage actors keep the rows in their heap) or
            ``"mooncake"`` (Mooncake Store over TCP; a ``mooncake_master`` is started on free
            loopback ports and stopped by PID, never TQ's ``auto_init``). ``None``: attach to the
            TransferQueue this Ray cluster already runs, never start one (what Ray actors use).
        units: SimpleStorage units, one Ray actor and one Ray CPU each.
        capacity_rows: SimpleStorage capacity, in rows per unit (TQ's ``total_storage_size`` split
            over the units); a put beyond it raises ``CapacityExceeded``. ``None``: unbounded.
        segment_bytes: Mooncake: memory the owner lends to the pool, i.e. its capacity; a put
            that does not fit raises ``CapacityExceeded`` (objects are hard-pinned, never evicted).
            Both ``*_bytes`` options are sizes as every backend takes them: ``67108864``,
            ``"64MiB"``, ``"1GiB"`` (:func:`dataplane.checks.check_bytes`).
        worker_segment_bytes: Mooncake: memory each attached process lends. 0 (default) keeps all
            rows in the owner's segment, so they survive workers that exit.
        master: Mooncake: join this ``host:port`` master instead of starting one (never stopped).
        ray_address: Ray cluster to join (also the URL's host, ``tq://host:6379``). ``None``: the
            process's Ray, else ``$RAY_ADDRESS``, else a local Ray started (and later stopped) here.
        num_cpus: CPUs of a local Ray started here (default: TQ's actors + ``max(2, cores)``).
        timeout_s: bound on every call. TQ's own storage timeouts are derived from it, so a dead
            storage unit raises ``BackendUnavailable`` and a hung controller ``DataPlaneTimeout``
            within it.
        init_timeout_s: bound on starting or attaching to TransferQueue (``tq.init`` hangs forever
            when Ray lacks CPUs; we check first and bound it anyway).
        pickle_fields: object fields this client may write and read with pickle (opt-in by name).
    """

    scheme: ClassVar[str] = "tq"

    backend: Literal["simple", "mooncake"] | None = None
    units: int = 1
    capacity_rows: int | None = None
    segment_bytes: int = _GIB
    worker_segment_bytes: int = 0
    master: str | None = None
    ray_address: str | None = None
    num_cpus: int | None = None
    timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    pickle_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "segment_bytes", check_bytes("segment_bytes", self.segment_bytes))
        object.__setattr__(self, "worker_segment_bytes", check_bytes("worker_segment_bytes", self.worker_segment_bytes))
        if self.backend not in (None, "simple", "mooncake"):
            raise InvalidArgument(f"backend must be 'simple', 'mooncake' or None, got {self.backend!r}")
        if self.timeout_s <= 0 or self.init_timeout_s <= 0:
            raise InvalidArgument("timeout_s and init_timeout_s must be > 0")
        if self.capacity_rows is not None and self.backend == "mooncake":
            raise InvalidArgument("capacity_rows bounds backend=simple; size backend=mooncake with segment_bytes")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> TQConfig:
        parsed = urlparse(url)
        if parsed.scheme != "tq":
            raise InvalidArgument(f"not a tq:// URL: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        known = [f.name for f in fields(cls)]
        check_options("tq", query, known)
        check_options("tq", options, known, how="keyword")
        values: dict[str, Any] = {}
        for key, raw in query.items():
            if key in ("segment_bytes", "worker_segment_bytes"):
                values[key] = raw  # a size, parsed as every byte option is (__post_init__)
            elif key in ("units", "capacity_rows", "num_cpus"):
                values[key] = url_option(url, key, raw, lambda r: int(float(r)))
            elif key in ("timeout_s", "init_timeout_s"):
                values[key] = url_option(url, key, raw, float)
            elif key == "pickle_fields":
                values[key] = tuple(x for x in raw.split(",") if x)
            elif key in ("backend", "master", "ray_address"):
                values[key] = raw or None
            else:  # an option only a config object or a keyword can set
                raise InvalidArgument(f"tq:// option {key!r} cannot be given in the URL; pass it as a keyword")
        if parsed.netloc:
            values.setdefault("ray_address", parsed.netloc)
        return cls(**{**values, **options})

    def deploy_config(self) -> TQDeployConfig:
        return TQDeployConfig(
            storage=self.backend or "simple",
            attach_only=self.backend is None,
            num_storage_units=self.units,
            storage_capacity_rows=self.capacity_rows,
            ray_address=self.ray_address,
            ray_num_cpus=self.num_cpus,
            init_timeout_s=self.init_timeout_s,
            op_timeout_s=self.timeout_s,
            mooncake_master_address=self.master,
            mooncake_segment_bytes=self.segment_bytes,
            mooncake_worker_segment_bytes=self.worker_segment_bytes,
        )


# One TransferQueue client per process (TQ keeps it in a module global): every tq:// client of this
# process shares one deployment handle, refcounted; the last one to close closes the handle.
_SHARED_LOCK = threading.Lock()
_SHARED: TQDeployment | None = None
_SHARED_REFS = 0


def _acquire(cfg: TQDeployConfig) -> TQDeployment:
    """The process's deployment handle, started or attached on first use (``ValueError`` when ``cfg``
    asks for another storage than the one this process is on)."""
    global _SHARED, _SHARED_REFS
    with _SHARED_LOCK:
        dep = _SHARED
        if dep is not None and (dep.closed or _client_gone()):
            log.warning("the TransferQueue client of this process was closed behind dataplane's back; reopening")
            _SHARED, _SHARED_REFS, dep = None, 0, None
        if dep is None:
            dep = start_or_attach(cfg)
            _SHARED, _SHARED_REFS = dep, 0
        elif not cfg.attach_only and dep.storage != cfg.storage:
            raise ValueError(
                f"this process is already on a TransferQueue with backend {dep.storage!r}; one runs per Ray "
                f"cluster, so backend {cfg.storage!r} cannot open next to it (close its clients first, or "
                f"connect with 'tq://' to use it)"
            )
        _SHARED_REFS += 1
        return dep


def _release(dep: TQDeployment) -> None:
    global _SHARED, _SHARED_REFS
    with _SHARED_LOCK:
        if dep is _SHARED:
            _SHARED_REFS -= 1
            if _SHARED_REFS > 0:
                return
            _SHARED, _SHARED_REFS = None, 0
    dep.close()  # the owner tears the deployment down; anyone else closes only its client


def attached_clients() -> int:
    """How many open ``tq://`` clients this process has (they share one TransferQueue client)."""
    with _SHARED_LOCK:
        return _SHARED_REFS if _SHARED is not None else 0


def _client_gone() -> bool:
    itf = sys.modules.get("transfer_queue.interface")
    return itf is None or getattr(itf, "_TQ_CLIENT", None) is None


def _map_error(op: str, e: BaseException) -> DataPlaneError:
    text = f"{type(e).__name__}: {e}"
    if "capacity exceeded" in text.lower():
        return CapacityExceeded(
            f"TransferQueue is full ({text}); clear consumed rows (kv_clear) or raise capacity_rows"
        )
    if "StorageUnitTimeout" in text or "no answer in" in text:
        return BackendUnavailable(f"TransferQueue {op}: a storage unit does not answer ({text}); is it alive?")
    return BackendUnavailable(f"TransferQueue {op} failed: {text}")


class TQStore(KVStore):
    """One dataplane client's view of the process's TransferQueue attachment."""

    def __init__(self, config: TQConfig) -> None:
        self.config = config
        try:
            self._dep = _acquire(config.deploy_config())
        except (RuntimeError, ValueError, OSError, ImportError) as e:
            kind = InvalidArgument if isinstance(e, ValueError) else BackendUnavailable
            raise kind(f"cannot open tq:// ({type(e).__name__}: {e})") from e
        except TimeoutError as e:
            raise DataPlaneTimeout(f"TransferQueue did not start or attach in time: {e}") from e
        quiet_typed_errors()  # TQ's log lines for what this adapter raises typed (after ray.init: see there)
        try:
            self._ops = TQOps(self._dep)
            self._claims = TQClaims(self._ops, self._dep.conf)
        except BaseException:
            _release(self._dep)
            raise
        self.backend = self._dep.storage
        self._closed = False
        self._lock = threading.Lock()
        self._caps = Capabilities(backend="transfer_queue", cross_process=True, cross_node=True)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def deployment(self) -> TQDeployment:
        return self._dep

    @property
    def url(self) -> str:
        """``tq://?ray_address=GCS``: a plain process on this host, or on another host of this Ray
        cluster, attaches with it; inside Ray (an actor) it attaches as ``tq://`` does."""
        return self._dep.url

    @property
    def deployment_id(self) -> str:
        return self._dep.deployment_id

    @property
    def round_trips(self) -> int:
        """Controller requests this client has sent so far."""
        return self._ops.round_trips

    def _run(self, op: str, factory: Any, *args: Any, timeout_s: float) -> Any:
        if self._closed:
            raise ClientClosed("this tq:// client is closed; create a new one with dataplane.connect()")
        try:
            return self._dep.run(factory, *args, timeout=timeout_s)
        except DataPlaneError:
            raise
        except TimeoutError as e:
            raise DataPlaneTimeout(
                f"TransferQueue {op} did not finish within {timeout_s:g}s; the controller, a storage unit or the "
                "mooncake_master may be hung or dead"
            ) from e
        except (RuntimeError, ValueError, OSError, ConnectionError) as e:
            raise _map_error(op, e) from e
        except Exception as e:
            if type(e).__module__.startswith("zmq"):
                raise _map_error(op, e) from e
            raise

    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None,
        *,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        if tags is not None and any(MARKER in t for t in tags):
            raise InvalidArgument(f"the tag name {MARKER!r} is reserved by dataplane")
        out: dict[str, Any] = self._run(
            "put", self._ops.put, partition_id, stored_keys(keys), columns, tags, timeout_s, timeout_s=timeout_s
        )
        return out

    def get(
        self,
        partition_id: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        meta: KVBatchMeta | None,
        timeout_s: float,
    ) -> Mapping[str, Column]:
        carried = meta.extra_info.get(SCHEMA_EXTRA) if meta is not None else None
        carried = carried if isinstance(carried, Mapping) else None
        out: Mapping[str, Column] = self._run(
            "get", self._ops.get, partition_id, stored_keys(keys), fields, carried, timeout_s=timeout_s
        )
        return out

    def clear(self, partition_id: str, keys: Sequence[str] | None, *, timeout_s: float) -> None:
        if keys is None:  # the whole partition, and its finished mark
            self._run("clear", self._clear_all, partition_id, timeout_s, timeout_s=timeout_s)
            return
        self._run("clear", self._ops.clear, partition_id, stored_keys(keys), timeout_s=timeout_s)

    async def _clear_all(self, partition_id: str, budget_s: float) -> None:
        await asyncio.gather(self._ops.clear(partition_id, None), self._claims.mark(partition_id, False, budget_s))

    # -- consumption by task: TQ's own consumption tracking (see ._claims) --------------------------
    def claim(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        n: int,
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> _Claimed:
        out: _Claimed = self._run(
            "claim", self._claims.claim, partition_id, task_name, fields, n, tag_filter, timeout_s, timeout_s=timeout_s
        )
        return out

    def consumption(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        tag_filter: Mapping[str, Any] | None,
        *,
        timeout_s: float,
    ) -> ConsumptionStatus:
        out: ConsumptionStatus = self._run(
            "consumption", self._claims.consumption, partition_id, task_name, fields, tag_filter, timeout_s=timeout_s
        )
        return out

    def reset_claims(self, partition_id: str, task_name: str | None, *, timeout_s: float) -> None:
        self._run("reset_consumption", self._claims.reset, partition_id, task_name, timeout_s=timeout_s)

    def mark_finished(self, partition_id: str, finished: bool, *, timeout_s: float) -> None:
        self._run("mark_finished", self._claims.mark, partition_id, finished, timeout_s, timeout_s=timeout_s)

    def list(self, partition_id: str | None, *, timeout_s: float) -> Listing:
        out: Listing = self._run("list", self._ops.list, partition_id, timeout_s=timeout_s)
        return user_listing(out)

    def describe(self, partition_id: str, keys: Sequence[str], *, timeout_s: float) -> _Described:
        found = self._run("describe", self._ops.describe, partition_id, stored_keys(keys), timeout_s=timeout_s)
        return [None if x is None else RowInfo(*x) for x in found]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _release(self._dep)


def connect(url_or_config: str | TQConfig | None = None, **options: Any) -> StoreClient:
    """Open a ``tq://`` client (see :class:`TQConfig` for the options).

    ``connect("tq://?backend=simple")`` starts TransferQueue with SimpleStorage unless this Ray
    cluster already runs one (then it attaches); ``connect("tq://")`` only attaches.
    """
    if isinstance(url_or_config, TQConfig):
        check_options("tq", options, [f.name for f in fields(TQConfig)], how="keyword")
        cfg = replace(url_or_config, **options)
    else:
        cfg = TQConfig.from_url(url_or_config or "tq://", **options)
    store = TQStore(cfg)
    return StoreClient(store, timeout_s=cfg.timeout_s, pickle_fields=cfg.pickle_fields)
