"""Mooncake store-server processes: a dedicated server that lends a segment to the pool.

Data in Mooncake dies with the process whose segment holds it, so ``mooncake://local`` runs one
dedicated server: a Mooncake "real client" (``mooncake_client``, shared memory with the clients of
this host) or our plain store server (:mod:`.store_server`, reached over TCP). Both are
supervised children (:mod:`dataplane._host.processes`); the master comes from
:mod:`dataplane._host.mooncake_master`. Never imports ``mooncake``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, ClassVar

from dataplane._host.mooncake_master import MasterHandle, child_env, find_binary
from dataplane._host.processes import ProcHandle, reserve_ports, spawn_logged, tcp_connectable, track, url_host

__all__ = [
    "SERVER_ERROR_PREFIX",
    "SERVER_READY_PREFIX",
    "STREAMING_COPY_ENV",
    "STREAMING_COPY_FROM",
    "STREAMING_COPY_TUNABLE",
    "StoreServerHandle",
    "find_real_client_binary",
    "start_real_client",
    "start_store_server",
    "store_server_env",
]

# A store server copies every object between its segment and a client's memory with glibc's memcpy
# (over shared memory the real client copies both ways). glibc streams a copy past the caches
# (non-temporal stores) only above a threshold it derives from the cache size it detects, often far
# above a batch's objects; streamed from 256 KiB up, large gets are faster and the reader's own caches
# stay warm. Such a copy is several times slower where the destination lies 1-700 bytes past the
# source within a page; objects padded to whole pages (_index.OBJECT_ALIGN) keep both sides on a page. A value the user gave this tunable
# in GLIBC_TUNABLES wins; DATAPLANE_STREAMING_COPY=0 leaves glibc's own.
STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
STREAMING_COPY_ENV = "DATAPLANE_STREAMING_COPY"
STREAMING_COPY_FROM = 256 << 10


SERVER_READY_PREFIX = "DATAPLANE_MOONCAKE_SERVER_READY "
SERVER_ERROR_PREFIX = "DATAPLANE_MOONCAKE_SERVER_ERROR "


def store_server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`child_env` for a store server: also copies of 256 KiB or more streamed past the caches
    (:data:`STREAMING_COPY_TUNABLE`), unless ``GLIBC_TUNABLES`` already sets that tunable or
    ``$DATAPLANE_STREAMING_COPY`` is ``0``. Other tunables are kept; glibc ignores this one where it
    does not apply (not x86)."""
    env = child_env(extra)
    if env.get(STREAMING_COPY_ENV, "1").strip() == "0":
        return env
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(t.partition("=")[0].strip() == STREAMING_COPY_TUNABLE for t in tunables.split(":")):
        return env
    ours = f"{STREAMING_COPY_TUNABLE}={STREAMING_COPY_FROM:#x}"
    env["GLIBC_TUNABLES"] = f"{tunables}:{ours}" if tunables.strip(":") else ours
    return env


def find_real_client_binary() -> str:
    """Path of ``mooncake_client``, a Mooncake "real client" (``$DATAPLANE_MOONCAKE_CLIENT`` overrides)."""
    return find_binary("mooncake_client", "DATAPLANE_MOONCAKE_CLIENT")


@dataclass(eq=False)
class StoreServerHandle(ProcHandle):
    stop_first: ClassVar[bool] = True  # its close() talks to the master
    pid: int
    host: str
    master_address: str
    segment_bytes: int
    segment_name: str = ""  # store.get_hostname(), e.g. "127.0.0.1:13776" (ReplicateConfig.preferred_segment)
    rpc_address: str = ""  # a real client's (mooncake_client) service address: clients attach there
    log_path: str | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def request_stop(self) -> None:
        """Ask the server to stop (EOF on stdin, SIGTERM) without waiting; ``stop()`` then reaps it."""
        self._before_stop()
        p = self._proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)

    def _before_stop(self) -> None:
        # EOF on stdin is the server's second stop signal (it also handles SIGTERM).
        p = self._proc
        if p is not None and p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass

    def __enter__(self) -> StoreServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[3])  # .../<root>/dataplane/adapters/mooncake/this.py


def _read_line(fd_file: IO[bytes], timeout_s: float, proc: subprocess.Popen[bytes]) -> tuple[str | None, str]:
    """Read one line from a binary pipe with a deadline. Returns (line, reason-if-none)."""
    buf = b""
    fd = fd_file.fileno()
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, f"no ready line within {timeout_s:.0f}s"
        r, _, _ = select.select([fd], [], [], min(left, 0.5))
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                proc.poll()
                return None, f"stdout closed before ready (rc={proc.returncode})"
            buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace"), ""


def start_store_server(
    master: MasterHandle | str,
    *,
    segment_bytes: int,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 60,
    local_buffer_bytes: int = 16 << 20,
    protocol: str = "tcp",
    rdma_devices: str = "",
    launch: str = "module",
    env: dict[str, str] | None = None,
) -> StoreServerHandle:
    """Spawn a process that mounts a ``segment_bytes`` segment into the pool and just holds it.

    It runs ``python -m dataplane.adapters.mooncake.store_server`` (``launch="module"``) or the file by
    path with ``python -P`` (``launch="path"``: does not import ``dataplane/__init__``). It stops on
    SIGTERM, on EOF of its stdin (our process died or closed it), when its parent changes, or via
    PDEATHSIG, and ``close()``s its store before exiting. Objects in its segment vanish with it.
    """
    addr = master.address if isinstance(master, MasterHandle) else str(master)
    if isinstance(master, MasterHandle) and not master.alive():
        raise RuntimeError(f"master {addr} (pid {master.pid}) is not running")
    mhost, _, mport = addr.rpartition(":")
    if not tcp_connectable(mhost.strip("[]"), int(mport), 3.0):
        raise RuntimeError(f"mooncake master {addr} is not reachable (TCP connect failed)")
    server_args = [
        "--master",
        addr,
        "--host",
        host,
        "--segment-bytes",
        str(int(segment_bytes)),
        "--local-buffer-bytes",
        str(int(local_buffer_bytes)),
        "--protocol",
        protocol,
        "--rdma-devices",
        rdma_devices,
        "--parent-pid",
        str(os.getpid()),
    ]
    extra_env: dict[str, str] = dict(env or {})
    if launch == "module":
        argv = [sys.executable, "-m", "dataplane.adapters.mooncake.store_server", *server_args]
        root = _package_root()
        pp = os.environ.get("PYTHONPATH", "")
        if root not in pp.split(os.pathsep):
            extra_env.setdefault("PYTHONPATH", pp + os.pathsep + root if pp else root)
    elif launch == "path":
        argv = [sys.executable, "-P", str(Path(__file__).with_name("store_server.py")), *server_args]
    else:
        raise ValueError("launch must be 'module' or 'path'")
    proc, log_path = spawn_logged(argv, "dataplane-mooncake-server-", pipes=True, env=store_server_env(extra_env))
    h = StoreServerHandle(
        pid=proc.pid, host=host, master_address=addr, segment_bytes=int(segment_bytes), log_path=log_path, _proc=proc
    )
    track(h)
    why = ""
    out = proc.stdout
    assert out is not None
    try:
        while True:
            line, why = _read_line(out, startup_timeout_s, proc)
            if line is None:
                break
            if line.startswith(SERVER_READY_PREFIX):
                info = json.loads(line[len(SERVER_READY_PREFIX) :])
                h.segment_name = info.get("segment_name", "")
                out.close()  # the server moved its fd 1 to the log after this line
                return h
            if line.startswith(SERVER_ERROR_PREFIX):
                why = line[len(SERVER_ERROR_PREFIX) :]
                break
    except BaseException:
        h.stop(timeout_s=5.0)
        raise
    tail = h.tail_log(25)
    h.stop(timeout_s=5.0)
    raise RuntimeError(f"mooncake store server failed to start (master {addr}): {why}\n--- server log tail ---\n{tail}")


def start_real_client(
    master: MasterHandle,
    *,
    segment_bytes: int,
    host: str = "127.0.0.1",
    protocol: str = "tcp",
    rdma_devices: str = "",
    startup_timeout_s: float = 30.0,
    settle_s: float = 0.3,
    attempts: int = 3,
) -> StoreServerHandle:
    """Spawn ``mooncake_client``: a store server that lends ``segment_bytes`` to the pool and serves
    clients of this host through shared memory (they attach to ``handle.rpc_address`` with
    ``setup_dummy``; it listens on the abstract socket ``@mooncake_client_<port>.sock`` for their
    memory, so deployments on distinct ports never meet). Ready means its RPC port accepts
    connections and it is still alive ``settle_s`` later; PDEATHSIG stops it if we die."""
    binary = find_real_client_binary()
    if not master.alive():
        raise RuntimeError(f"master {master.address} (pid {master.pid}) is not running")
    why = ""
    for _ in range(attempts):
        ports, socks = reserve_ports(1, host)
        port = ports[0]
        argv = [
            binary,
            f"--master_server_address={master.address}",
            "--metadata_server=P2PHANDSHAKE",
            f"--host={host}",
            f"--port={port}",
            f"--global_segment_size={int(segment_bytes)}",
            f"--protocol={protocol}",
            f"--device_names={rdma_devices}",
            f"--threads={max(1, min(os.cpu_count() or 1, 8))}",
        ]
        proc, log_path = spawn_logged(argv, "dataplane-mooncake-client-", release=socks, env=store_server_env())
        h = StoreServerHandle(
            pid=proc.pid,
            host=host,
            master_address=master.address,
            segment_bytes=int(segment_bytes),
            rpc_address=f"{url_host(host)}:{port}",
            log_path=log_path,
            _proc=proc,
        )
        track(h)
        deadline = time.monotonic() + startup_timeout_s
        while proc.poll() is None and time.monotonic() < deadline and not tcp_connectable(host, port, 0.5):
            time.sleep(0.05)
        end = time.monotonic() + settle_s
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if proc.poll() is None and tcp_connectable(host, port, 2.0):
            return h
        why = (
            f"exited rc={proc.returncode}"
            if proc.poll() is not None
            else f"port {port} not accepting connections within {startup_timeout_s:.0f}s"
        )
        why += f"\n--- mooncake_client log tail ---\n{h.tail_log(25)}"
        h.stop(timeout_s=5.0)
    raise RuntimeError(f"mooncake_client failed to start (master {master.address}): {why}")
