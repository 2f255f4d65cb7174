"""How a ``mooncake://`` client is configured and connected: :class:`MooncakeConfig`, the master and
store server ``mooncake://local`` starts (:class:`LocalDeployment`), and :func:`connect`. The
package docstring (:mod:`dataplane.adapters.mooncake`) describes the adapter as a whole."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, fields, replace
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

from dataplane._host.mooncake_master import MasterHandle, apply_client_env_defaults, start_master
from dataplane.adapters.mooncake._handle import AdminClient, StoreHandle
from dataplane.adapters.mooncake._index import check_ns
from dataplane.adapters.mooncake._servers import StoreServerHandle, start_real_client, start_store_server
from dataplane.adapters.mooncake._store import MooncakeStore
from dataplane.checks import check_bytes, parse_bytes
from dataplane.errors import BackendUnavailable, DataPlaneError, InvalidArgument
from dataplane.registry import check_options, export_url, url_bool, url_option
from dataplane.store_client import StoreClient

__all__ = ["DEPLOYMENT_KEY", "LocalDeployment", "MooncakeConfig", "connect", "deployment_token", "parse_bytes"]

log = logging.getLogger(__name__)

_BYTE_OPTIONS = ("segment_bytes", "client_segment_bytes", "local_buffer_bytes", "pool_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeConfig:
    """Options of ``mooncake://`` (also accepted as URL query parameters).

    Attributes:
        master: ``"HOST:PORT"`` of a running master's RPC port, or None to start our own (``local``).
        metrics_port: the master's admin HTTP port (``--metrics_port``; listing keys goes through it).
        ns: key namespace, so several jobs can share one master.
        segment_bytes: RAM the store server of ``mooncake://local`` lends to the pool. This and every
            other ``*_bytes`` option is a size as every backend takes it: ``67108864``, ``"64MiB"``,
            ``"1GiB"`` (:func:`dataplane.checks.check_bytes`).
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
        for name in _BYTE_OPTIONS:
            object.__setattr__(self, name, check_bytes(name, getattr(self, name)))
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
        known = [f.name for f in fields(cls)]
        query = parse_qs(parsed.query)
        check_options("mooncake", query, [k for k in known if k != "master"])  # the master is the URL's host
        check_options("mooncake", options, known, how="keyword")
        for key, raw_list in query.items():
            raw = raw_list[-1]
            if key in _BYTE_OPTIONS:
                values[key] = raw  # a size, parsed as every byte option is (__post_init__)
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
        return cls(**{"master": master, **values, **options})


@dataclass(eq=False)
class LocalDeployment:
    """The master and store server a ``mooncake://local`` client started (and stops)."""

    master: MasterHandle
    server: StoreServerHandle

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


# Outside every namespace (a namespace holds no "."), so no listing, clear or sweep of ours sees it.
DEPLOYMENT_KEY = ".dataplane/deployment"
# Copies of the token, one per segment up to this many: with a single copy, the crash of the store
# server holding it made every client that connected next wait out its token timeout and run with
# unchecked metas, and once the master expired the segment the next client wrote a new token, so
# the deployment's earlier metas read as another deployment's (tests/multihost/test_mooncake_hosts.py).
TOKEN_REPLICAS = 8


def deployment_token(handle: StoreHandle, timeout_s: float = 5.0) -> str:
    """The master's deployment token: the first client writes a random one under
    :data:`DEPLOYMENT_KEY` (Mooncake keeps an existing key's value), on every segment mounted then
    (up to :data:`TOKEN_REPLICAS`), and every client reads back the one that won. A new master (also on
    the same ports) starts without it, so it gets a new token. "" when it can be neither written nor
    read (a full store): metas are then not checked."""
    deadline = time.monotonic() + timeout_s
    mine = uuid.uuid4().hex[:16].encode()
    wrote = False
    while True:
        try:
            found = handle.get_bytes(DEPLOYMENT_KEY)
            if found:
                return found.decode("ascii", "replace")
            if not wrote:
                wrote = handle.put_if_absent(DEPLOYMENT_KEY, mine, replicas=TOKEN_REPLICAS) == 0
        except DataPlaneError as e:
            log.debug("dataplane: reading the deployment token failed: %s", e)
        if time.monotonic() >= deadline:
            log.warning(
                "dataplane: could not read or write the Mooncake deployment token %r; metas of this client "
                "are not checked against their deployment",
                DEPLOYMENT_KEY,
            )
            return ""
        time.sleep(0.02)  # another client's put of it is still being written


def connect(url_or_config: str | MooncakeConfig | None = None, **options: Any) -> StoreClient:
    """Open a ``mooncake://`` client (see :class:`MooncakeConfig` and the package docstring)."""
    if isinstance(url_or_config, MooncakeConfig):
        check_options("mooncake", options, [f.name for f in fields(MooncakeConfig)], how="keyword")
        cfg = replace(url_or_config, **options)
    else:
        cfg = MooncakeConfig.from_url(url_or_config or "mooncake://local", **options)
    apply_client_env_defaults()
    deployment: LocalDeployment | None = None
    if cfg.master is None:
        try:
            master = start_master(host="127.0.0.1", client_ttl_s=cfg.client_ttl_s)
        except (RuntimeError, OSError) as e:
            raise BackendUnavailable(f"could not start mooncake_master: {e}") from e
        try:
            if cfg.shm:
                server = start_real_client(master, segment_bytes=cfg.segment_bytes, protocol=cfg.protocol)
            else:
                server = start_store_server(
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
        try:  # fail now, with a clear message, on a wrong metrics_port
            admin.all_keys(min(cfg.timeout_s, 10.0))
        except BackendUnavailable as e:
            if deployment is not None:
                raise
            raise BackendUnavailable(
                f"{e}. To join a deployment another process started, pass that process's client.url to "
                "dataplane.connect() (it carries metrics_port, ns and real_client), or run dataplane.connect() "
                "with no argument in a process it started ($DATAPLANE_URL)"
            ) from e
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
    store.joined_by = f"mooncake://{host}:{port}?metrics_port={metrics}&ns={cfg.ns}&protocol={cfg.protocol}"
    if real_client is not None:
        store.joined_by += f"&real_client={real_client}"
    try:
        store.deployment_token = deployment_token(handle, min(cfg.timeout_s, 10.0))
    except BaseException:
        store.close()
        if deployment is not None:
            deployment.stop()
        raise
    log.debug("dataplane: mooncake client %s in pid %d joined %s", handle.hostname, os.getpid(), store.master_address)
    on_close: list[Any] = []
    if deployment is not None:
        on_close = [export_url(store.url), deployment.stop]  # the undo runs first
    return StoreClient(store, timeout_s=cfg.timeout_s, pickle_fields=cfg.pickle_fields, on_close=on_close)
