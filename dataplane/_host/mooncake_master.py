"""A ``mooncake_master`` on free ports, and the environment every Mooncake client process wants.

Shared by the Mooncake adapter and TransferQueue's Mooncake backend (our own master on free ports:
TQ's ``auto_init`` would kill every ``mooncake_master`` on the host). Never imports ``mooncake`` (the
binary is located with ``importlib.util.find_spec``, which does not execute the package).

Facts this module is built on (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1):

* The master binds an RPC port and an admin/metrics HTTP port (``/health``); with
  ``--enable_http_metadata_server=true`` it also binds a third (HTTP metadata) port. We reserve all
  three while holding the sockets, so they are distinct, and always pass them explicitly.
* On an RPC-port clash the master reports ``serving`` on ``/health`` and then exits rc=1 ~2 s later
  without any error message. A master that starts cleanly listens on its RPC port before
  ``/health`` is ok (~0.1 s after its start); one that clashes never does. So readiness =
  ``/health`` ok AND the master itself listening on its RPC port (read from ``/proc``; where that
  cannot be told, the process still alive ~2.5 s later).
* SIGTERM gives a graceful exit (rc 0).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dataplane._host.processes import (
    ProcHandle,
    http_health,
    listens_on,
    reserve_ports,
    spawn_logged,
    tcp_connectable,
    track,
    url_host,
)

__all__ = [
    "MasterHandle",
    "apply_client_env_defaults",
    "child_env",
    "client_env_defaults",
    "find_binary",
    "find_master_binary",
    "start_master",
]

# Read by the Mooncake client library when a MooncakeDistributedStore is created / set up.
_ENV_DEFAULTS: dict[str, str] = {
    # glog level by NAME (numbers and FATAL are ignored); silences ~15 INFO lines per setup.
    "MC_LOG_LEVEL": "WARNING",
    # Default 1024 each: a cross-process batch of more than ~2-4K keys to one peer overflows the TCP
    # lane queue ("TCP lane queue-full rejection"), hangs 60 s and returns -800.
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    # Default 20 retries (~90 s) when the master is unreachable; 2 gives up after ~9 s.
    "MC_STORE_CLIENT_SETUP_RETRIES": "2",
}


def client_env_defaults() -> dict[str, str]:
    """The Mooncake env defaults we want in every process that creates a store (a copy).

    They are read when a store is created/set up, so apply them (without overriding values the
    user set) before the first ``MooncakeDistributedStore().setup(...)`` in the client process, e.g.
    ``for k, v in client_env_defaults().items(): os.environ.setdefault(k, v)``.
    """
    return dict(_ENV_DEFAULTS)


def apply_client_env_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``setdefault`` each of :func:`client_env_defaults` into ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    for k, v in _ENV_DEFAULTS.items():
        env.setdefault(k, v)
    return env  # type: ignore[return-value]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a Mooncake child process: ours + defaults (user-set values win) + ``extra``."""
    env = dict(os.environ)
    apply_client_env_defaults(env)
    if extra:
        env.update(extra)
    return env


def find_binary(name: str, override_env: str) -> str:
    """Path of the Mooncake executable ``name``: ``$<override_env>``; ``<site-packages>/mooncake/<name>``
    (the wheel ships it there); ``PATH``."""
    override = os.environ.get(override_env)
    if override:
        return override
    spec = importlib.util.find_spec("mooncake")  # top-level: locates, does not execute
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            cand = Path(loc) / name
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise RuntimeError(
        f"{name} binary not found: install the Mooncake extra "
        f"(pip install 'mooncake-transfer-engine-non-cuda') or set {override_env}"
    )


def find_master_binary() -> str:
    """Path of ``mooncake_master`` (``$DATAPLANE_MOONCAKE_MASTER`` overrides)."""
    return find_binary("mooncake_master", "DATAPLANE_MOONCAKE_MASTER")


@dataclass(eq=False)
class MasterHandle(ProcHandle):
    host: str
    rpc_port: int
    metrics_port: int
    pid: int
    http_metadata_port: int | None = None  # reserved; only bound with --enable_http_metadata_server
    log_path: str | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """``host:rpc_port``, what clients pass as ``master_server_addr``."""
        return f"{url_host(self.host)}:{self.rpc_port}"

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """GET ``http://host:metrics_port/health`` says ok (and the process, if ours, is alive)."""
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return http_health(self.host, self.metrics_port, timeout_s)

    def __enter__(self) -> MasterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _try_start_master(
    binary: str,
    host: str,
    ports: list[int],
    socks: list[socket.socket],
    flags: list[str],
    startup_timeout_s: float,
    settle_s: float = 2.5,
) -> tuple[MasterHandle | None, str]:
    rpc, metrics, http = ports
    argv = [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={rpc}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics}",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={http}",
        *flags,
    ]
    proc, log_path = spawn_logged(argv, "dataplane-mooncake-master-", release=socks, env=child_env())
    h = MasterHandle(
        host=host,
        rpc_port=rpc,
        metrics_port=metrics,
        pid=proc.pid,
        http_metadata_port=http,
        log_path=log_path,
        _proc=proc,
    )
    track(h)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        if proc.poll() is not None:
            return h, f"exited rc={proc.returncode} before /health was ok"
        if http_health(host, metrics, 1.0):
            break
        if time.monotonic() > deadline:
            return h, f"/health not ok within {startup_timeout_s:.0f}s"
        time.sleep(0.1)
    t_ok = time.monotonic()
    # An RPC-port clash only shows ~2 s after "serving": the master exits rc=1 with no message. A
    # master that listens on its RPC port itself has bound it, so no clash can follow: ready now.
    while time.monotonic() - t_ok < settle_s:
        if proc.poll() is not None:
            return h, (
                f"exited rc={proc.returncode} {time.monotonic() - t_ok:.1f}s after /health was ok "
                f"(port clash on rpc {rpc}?)"
            )
        if listens_on(proc.pid, rpc):
            break
        time.sleep(0.1)
    if not http_health(host, metrics, 2.0):
        return h, "/health no longer ok after settling"
    if not tcp_connectable(host, rpc, 2.0):
        return h, f"rpc port {rpc} not accepting connections"
    return h, ""


def start_master(
    *,
    host: str = "127.0.0.1",
    client_ttl_s: int = 10,
    lease_ttl_ms: int = 10000,
    eviction_high_watermark: float = 0.95,
    startup_timeout_s: float = 30.0,
    attempts: int = 3,
    extra_args: tuple[str, ...] = (),
) -> MasterHandle:
    """Start a ``mooncake_master`` on three fresh ports of ``host`` and wait until it is ready.

    Ready means ``/health`` is ok and the master listens on its RPC port (where ``/proc`` cannot
    tell, that it is still alive ~2.5 s later: a clashing RPC port shows no sooner). On failure the
    attempt is torn down and retried on new ports, up to ``attempts`` times (``startup_timeout_s`` is
    per attempt); then ``RuntimeError`` carries the master's last log lines. The master's
    stdout/stderr go to a temp file (``handle.log_path``), removed by ``stop()``.
    ``extra_args`` are appended verbatim (gflags ``--flag=value``) and win over ours.
    """
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    binary = find_master_binary()
    flags = [
        f"--client_ttl={int(client_ttl_s)}",
        f"--default_kv_lease_ttl={int(lease_ttl_ms)}",
        f"--eviction_high_watermark_ratio={float(eviction_high_watermark)}",
        "--logtostderr",
        *extra_args,
    ]
    failures: list[str] = []
    for i in range(attempts):
        ports, socks = reserve_ports(3, host)
        h, why = _try_start_master(binary, host, ports, socks, flags, startup_timeout_s)
        if h is not None and not why:
            return h
        tail = h.tail_log(25) if h is not None else "(not started)"
        if h is not None:
            h.stop(timeout_s=5.0)
        failures.append(
            f"attempt {i + 1}/{attempts} (rpc={ports[0]} metrics={ports[1]} "
            f"http={ports[2]}): {why}\n--- master log tail ---\n{tail}"
        )
    raise RuntimeError("mooncake_master failed to start:\n" + "\n".join(failures))
