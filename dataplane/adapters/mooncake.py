"""``mooncake://``: Mooncake Store directly, zero-copy, no Ray needed.

``mooncake://local`` starts and owns a ``mooncake_master`` and one store-server process (which lends
``segment_bytes`` of RAM to the pool) on free loopback ports, waits until both are healthy, and stops
both on ``close()``; they also stop if the owning process dies (``PR_SET_PDEATHSIG``, plus a stdin
watchdog for the TCP server). ``mooncake://HOST:PORT`` joins a running master (``HOST:PORT`` is its
RPC address); other processes of the job join the owner's deployment with ``client.store.join_url``.

Transport. By default (``shm=true``) the store server of ``mooncake://local`` is a Mooncake "real
client" (``mooncake_client``, shipped in the wheel) and every client of the deployment attaches to
it (``setup_dummy``): the real client copies between its segment and the caller's shared memory,
about 8-10 GB/s on a 2-core VM against 1-2 GB/s for loopback TCP. Mooncake cannot read other memory
of the caller, so a put sends tensors that lie in that shared memory as they are (tensors from
``client.empty()``, or from a get: a write-back) and copies any other tensor into it first; gets
land in it and are returned as they are. Such memory stays mapped until the process exits (Mooncake
never unmaps it), so it is kept in 256 MiB regions and reused, by later clients of the process too
(:mod:`._mc_shm`).
``shm=false`` starts a plain store server instead, reached over loopback TCP. Mooncake logs two
harmless error lines around attaching and closing (``Failed to receive hot cache fd``, ``Dummy
Client not connected``); ``MC_LOG_LEVEL`` (default ``WARNING``) does not silence glog errors.

Clients lend no memory by default (``client_segment_bytes=0``): in Mooncake an object dies with the
process whose segment holds it, so data lives in dedicated store servers and outlives the writers.

Layout (see :mod:`dataplane.adapters._mc_index`): per put call, one data object per field holding
every row back to back, plus one small immutable index object, written in one batch call. Chosen
with ``python -m benchmarks.mooncake_layout`` (raw Mooncake, ``benchmarks/results/mooncake_layout.md``):
every object costs ~30-40 us of its own, so one object per (row, field) made puts and whole-batch
gets 1.6-9x slower over shared memory and 1.8-20x over TCP (2-core VM and 16-core host); it wins
only where a data-parallel rank reads every 4th row of a large batch (over shared memory 1.2-1.3x
faster at 16 MB and 2.3-2.7x at 128 MB; over TCP 1.1-1.6x at 128 MB only), since per-field objects
are then read whole and gathered. One object per put holding every field is 1.1-1.5x faster at 1 MB
and within -7% and +13% at 16 and 128 MB, but would make every get of some of the fields a ranged
read (~40 us per range). So only small puts are packed that way: a put of at most 1 MiB with two or
more non-empty fields (a rollout put on its own, say) is one data object, its fields at 64-byte
aligned offsets its index names, and a get reads each packed put it needs once, whole (256 such
rollouts of 8 fields: a get of all of them 45-81 -> 11-16 ms on the 2-core VM, ``python -m
benchmarks.results.single_row_puts URL rollouts``). The index object costs nothing measurable.

Round trips. A put: one listing of the master's keys (``/get_all_keys`` on its admin port, ~0.1 ms:
the schema check against every writer) plus one batch write. A client's later puts of the same
fields (same dtypes) into that partition skip the listing: they ask the master only whether the
client's own latest put of each field is still there (``/batch_query_keys``, a few keys). A put
still there passed the check when it was written, and a clear that emptied the field since would
have removed it; anything else (a new field, another dtype, the put gone) lists. A get: one
listing, one batch read that lands directly in pooled, registered buffers which become the returned
tensors (the rows of one put, in order), or that reads whole objects / merged row ranges (whichever
the cost model says is cheaper) and gathers locally, then one query (or a listing, where the rows
came from so many puts that it costs less): the bytes read are kept only while the index object of
every put they came from is still there after the read. (A clear
removes objects a read may be in the middle of, and Mooncake may hand the space to another put at
once, so a read can return another object's bytes with no error; clears remove index objects
before the data they name, so an index still there after the read vouches for its data.) Index
objects are immutable and cached (one read of a put not seen before, trusted the same way); a put
returns its index in ``meta.extra_info["mooncake_index"]``, so a get by that meta in another
process needs no index read either (the hint is used only while the listing still shows it: a
stale hint never returns stale data), and a read hint in ``meta.extra_info["mooncake_read"]`` (the
put's objects and sizes), so such a get issues its read first, then its one listing (which both
vouches for the read and shows whether other puts came since), and decodes the index meanwhile (on
a helper thread beside the read where the host has the cores, ``DATAPLANE_DECODE_THREAD``).
Where the master lacks ``/batch_query_keys``, the queries fall back to listings.
Listing costs grow with the number of keys in the master, anyone's (~1 us per key: 10,000 keys add
~3-9 ms to every get and to a client's first put into a partition, ``python -m
benchmarks.mooncake_scale``), so give dataplane a master of its own rather than one shared with,
say, an inference engine's KV cache.

Rules this adapter relies on:

* One writer per (key, field) at a time. Writers in different processes may share a partition
  (distinct keys); two concurrent writers of one key race, and the later ``put_id`` (wall time) wins.
* Keys are ASCII, at most 512 characters. Objects are hard-pinned: a full store raises
  ``CapacityExceeded`` instead of evicting unread rollouts. ``kv_clear(keys)`` writes a tombstone and
  removes the puts nothing reads any more; rows only re-written (never cleared) keep their old
  objects until a clear touches the partition. ``kv_clear(partition_id=...)`` removes the puts its
  listing shows (a put racing it stays whole) and data left by writers that died mid-put over 10
  minutes before. Removal is forced (every read takes a 10 s lease that would block it), which is
  why reads check after reading that what they read is still there.
* Never ``fork()`` a process holding a client: the child gets ``BackendUnavailable``. Use ``spawn``.
* ``timeout_s`` bounds our retries and the listing; a Mooncake transfer itself cannot be interrupted
  (its engine gives up after 60 s). After a store server dies its rows read as ``BackendUnavailable``
  (transfer failures, retried briefly) and, once the master expires it (``client_ttl_s``), as
  ``KeyNotFound``. Capacity is the store servers' segments: there is no per-client row or byte cap.

Running on a cluster (one master, one store server per node that lends memory)::

    # head node
    mooncake_master --rpc_address=0.0.0.0 --rpc_port=50051 --metrics_port=9003 --client_ttl=10
    # every node that lends memory (routable address of this node; 64 GiB here): a real client, so
    # the processes of that node reach it through shared memory; its copies of 256 KiB and more
    # streamed past the caches, as mooncake://local starts it (_mooncake_procs.STREAMING_COPY_TUNABLE)
    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x40000 \\
    mooncake_client --master_server_address=HEAD:50051 --metadata_server=P2PHANDSHAKE --host=$NODE_IP \\
        --port=50052 --global_segment_size=68719476736 --protocol=rdma --device_names=mlx5_0,mlx5_1
    # every process of the job, on a node running a real client
    client = dataplane.connect("mooncake://HEAD:50051?metrics_port=9003&real_client=127.0.0.1:50052")
    # or, on a node without one: a network client of the store servers
    client = dataplane.connect("mooncake://HEAD:50051?metrics_port=9003&protocol=rdma&rdma_devices=mlx5_0")

A plain store server (no shared memory) is
``python -m dataplane.adapters._mooncake_server --master HEAD:50051 --host $NODE_IP --segment-bytes N
--protocol rdma --rdma-devices mlx5_0 --no-stdin-watchdog``.

``protocol`` is ``tcp`` (default) or ``rdma``; ``rdma_devices`` is a comma list of HCA names
(``ibv_devices`` lists them); Mooncake silently falls back to TCP when it finds no RDMA device, so
check its log. Each process announces ``local_hostname`` to its peers; by default the address of
the interface that routes to the master (never a link-local one: peers cannot reach it). With RDMA,
a put copies tensors that are not in this client's registered pool (``client.empty()`` hands out
pooled memory) into it first; reads always land in registered buffers.

>>> import dataplane, torch  # doctest: +SKIP
>>> with dataplane.connect("mooncake://local?segment_bytes=256MiB") as c:  # doctest: +SKIP
...     meta = c.kv_batch_put(["a", "b"], {"x": torch.arange(2)}, partition_id="train")
...     c.kv_batch_get(meta, select_fields="x")["x"].tolist()
[0, 1]
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass, fields
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

from dataplane.adapters import _mooncake_procs as procs
from dataplane.adapters._mc_handle import MAX_KEYS_PER_CALL, AdminClient, StoreHandle
from dataplane.adapters._mc_index import check_ns
from dataplane.adapters._mc_store import HINT_KEY, MooncakeStore
from dataplane.adapters._mooncake_procs import apply_client_env_defaults, start_master
from dataplane.errors import BackendUnavailable, InvalidArgument
from dataplane.registry import url_bool, url_option
from dataplane.store import StoreClient

__all__ = [
    "HINT_KEY",
    "MAX_KEYS_PER_CALL",
    "AdminClient",
    "LocalDeployment",
    "MooncakeConfig",
    "MooncakeStore",
    "apply_client_env_defaults",
    "connect",
    "start_master",
]

log = logging.getLogger(__name__)

_SIZE_RE = re.compile(r"^\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: str | int | float) -> int:
    """``"512MiB"``, ``"2GB"``, ``"1e9"`` or an int -> bytes (binary units either way)."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise InvalidArgument(f"not a size: {value!r}; use e.g. 268435456, 256MiB or 1GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "")[:1].lower()])


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeConfig:
    """Options of ``mooncake://`` (also accepted as URL query parameters).

    Attributes:
        master: ``"HOST:PORT"`` of a running master's RPC port, or None to start our own (``local``).
        metrics_port: the master's admin HTTP port (``--metrics_port``; listing keys goes through it).
        ns: key namespace, so several jobs can share one master.
        segment_bytes: RAM the store server of ``mooncake://local`` lends to the pool.
        client_segment_bytes: RAM this client lends (0: objects never die with this process).
        local_buffer_bytes: Mooncake's staging buffer per client (unused by our zero-copy calls).
        protocol: ``tcp`` or ``rdma``.
        rdma_devices: comma list of RDMA device names, e.g. ``mlx5_0,mlx5_1``.
        local_hostname: address announced to peers (default: the interface that routes to the master).
        pool_bytes: most bytes of registered buffers kept for reads.
        client_ttl_s: ``--client_ttl`` of a local master: how long a dead server's objects stay listed.
        shm: ``mooncake://local`` only: run the store server as a Mooncake real client
            (``mooncake_client``) and move data to and from it through shared memory (default);
            false runs a plain store server reached over loopback TCP.
        real_client: ``HOST:PORT`` of a real client on this host to attach to (shared memory)
            instead of reaching the store servers over the network.
        timeout_s: bound on every call.
        pickle_fields: object fields that may use pickle (opt-in by name).
    """

    scheme = "mooncake"
    master: str | None = None
    metrics_port: int = 9003
    ns: str = "dataplane"
    segment_bytes: int = 1 << 30
    client_segment_bytes: int = 0
    local_buffer_bytes: int = 16 << 20
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    local_hostname: str | None = None
    pool_bytes: int = 2 << 30
    client_ttl_s: int = 10
    shm: bool = True
    real_client: str | None = None
    timeout_s: float = 60.0
    pickle_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_ns(self.ns)
        if self.protocol not in ("tcp", "rdma"):
            raise InvalidArgument(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        for name in ("segment_bytes", "client_segment_bytes", "local_buffer_bytes", "pool_bytes"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0")
        if self.master is None and self.segment_bytes <= 0:
            raise InvalidArgument("mooncake://local needs segment_bytes > 0 for its store server")
        if self.timeout_s <= 0:
            raise InvalidArgument("timeout_s must be > 0")
        if self.real_client is not None and (self.master is None or not re.fullmatch(r".+:[0-9]+", self.real_client)):
            raise InvalidArgument(
                f"real_client={self.real_client!r}: give HOST:PORT of a mooncake_client on this host, and join a "
                "master (mooncake://HOST:PORT); mooncake://local starts its own (shm=true)"
            )
        if self.client_segment_bytes and (self.real_client is not None or (self.master is None and self.shm)):
            raise InvalidArgument(
                "a client attached to a real client (shared memory) lends no segment; drop client_segment_bytes, "
                "or connect without real_client (mooncake://local?shm=false)"
            )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MooncakeConfig:
        parsed = urlparse(url)
        if parsed.scheme != "mooncake":
            raise InvalidArgument(f"not a mooncake:// URL: {url!r}")
        values: dict[str, Any] = {}
        known = {f.name: f for f in fields(cls)}
        for key, raw_list in parse_qs(parsed.query).items():
            raw = raw_list[-1]
            if key not in known or key == "master":
                raise InvalidArgument(f"unknown mooncake:// option {key!r}; known: {sorted(set(known) - {'master'})}")
            if key.endswith("_bytes"):
                values[key] = parse_bytes(raw)
            elif key in ("metrics_port", "client_ttl_s"):
                values[key] = url_option(url, key, raw, int)
            elif key == "timeout_s":
                values[key] = url_option(url, key, raw, float)
            elif key == "shm":
                values[key] = url_option(url, key, raw, url_bool)
            elif key == "pickle_fields":
                values[key] = tuple(x for x in raw.split(",") if x)
            else:
                values[key] = raw
        where = parsed.netloc
        if where in ("", "local"):
            master = None
        else:
            if parsed.port is None or not parsed.hostname:
                raise InvalidArgument(f"mooncake://HOST:PORT needs the master's RPC port, got {url!r}")
            master = where
        for key in ("segment_bytes", "client_segment_bytes", "local_buffer_bytes", "pool_bytes"):
            if isinstance(options.get(key), str):
                options[key] = parse_bytes(options[key])
        return cls(master=master, **{**values, **options})


@dataclass(eq=False)
class LocalDeployment:
    """The master and store server a ``mooncake://local`` client started (and stops)."""

    master: procs.MasterHandle
    server: procs.StoreServerHandle

    @property
    def pids(self) -> tuple[int, int]:
        return self.master.pid, self.server.pid

    def stop(self) -> None:
        """Stop both (idempotent). The server was asked to stop when the owner began closing; it gets
        a short grace, then SIGKILL: its segment is anonymous memory and the master goes next anyway."""
        try:
            self.server.stop(timeout_s=0.5)
        finally:
            self.master.stop(timeout_s=5.0)


def _split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _announce_address(master_host: str, master_port: int) -> str:
    """The local address peers should use: the interface that routes to the master."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_host, master_port))  # no packet is sent: this only picks a route
        addr = str(s.getsockname()[0])
    if ipaddress.ip_address(addr).is_link_local:
        log.warning(
            "dataplane: the route to the Mooncake master leaves from link-local %s, which peers cannot reach; "
            "pass local_hostname=<routable address>",
            addr,
        )
    return addr


def connect(url_or_config: str | MooncakeConfig | None = None, **options: Any) -> StoreClient:
    """Open a ``mooncake://`` client (see :class:`MooncakeConfig` and the module docstring)."""
    if isinstance(url_or_config, MooncakeConfig):
        cfg = url_or_config
    else:
        cfg = MooncakeConfig.from_url(url_or_config or "mooncake://local", **options)
    procs.apply_client_env_defaults()
    deployment: LocalDeployment | None = None
    if cfg.master is None:
        try:
            master = procs.start_master(host="127.0.0.1", client_ttl_s=cfg.client_ttl_s)
        except (RuntimeError, OSError) as e:
            raise BackendUnavailable(f"could not start mooncake_master: {e}") from e
        try:
            if cfg.shm:
                server = procs.start_real_client(master, segment_bytes=cfg.segment_bytes, protocol=cfg.protocol)
            else:
                server = procs.start_store_server(
                    master, segment_bytes=cfg.segment_bytes, launch="path", protocol=cfg.protocol
                )
        except BaseException as e:
            master.stop()
            if isinstance(e, (RuntimeError, OSError)):
                raise BackendUnavailable(f"could not start a Mooncake store server: {e}") from e
            raise
        deployment = LocalDeployment(master, server)
        host, port, metrics = "127.0.0.1", master.rpc_port, master.metrics_port
        real_client = server.rpc_address or None
    else:
        host, port = _split_host_port(cfg.master)
        metrics = cfg.metrics_port
        real_client = cfg.real_client
        try:
            socket.create_connection((host, port), timeout=5.0).close()
        except OSError as e:
            raise BackendUnavailable(f"Mooncake master {cfg.master} is not reachable: {e}") from e
    try:
        admin = AdminClient(host, metrics)
        admin.all_keys(min(cfg.timeout_s, 10.0))  # fail now, with a clear message, on a wrong metrics_port
        handle = StoreHandle(
            local_hostname=cfg.local_hostname or _announce_address(host, port),
            master_address=f"{host}:{port}",
            segment_bytes=cfg.client_segment_bytes,
            local_buffer_bytes=cfg.local_buffer_bytes,
            protocol=cfg.protocol,
            rdma_devices=cfg.rdma_devices,
            real_client=real_client,
        )
    except BaseException:
        if deployment is not None:
            deployment.stop()
        raise
    store = MooncakeStore(
        handle, admin, ns=cfg.ns, protocol=cfg.protocol, pool_bytes=cfg.pool_bytes, writer=uuid.uuid4().hex[:8]
    )
    store.deployment = deployment
    store.master_address = f"{host}:{port}"
    store.join_url = f"mooncake://{host}:{port}?metrics_port={metrics}&ns={cfg.ns}&protocol={cfg.protocol}"
    if real_client is not None:
        store.join_url += f"&real_client={real_client}"
    log.debug("dataplane: mooncake client %s in pid %d joined %s", handle.hostname, os.getpid(), store.master_address)
    return StoreClient(
        store,
        timeout_s=cfg.timeout_s,
        pickle_fields=cfg.pickle_fields,
        on_close=[deployment.stop] if deployment is not None else [],
    )
