"""Process management for Mooncake Store: a ``mooncake_master`` and dedicated store-server processes.

Standard library only. This module imports nothing from ``dataplane`` and never imports ``mooncake``
at import time (the binary is located with ``importlib.util.find_spec``, which does not execute the
package).

Facts this module is built on (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1):

* The master binds an RPC port and an admin/metrics HTTP port (``/health``); with
  ``--enable_http_metadata_server=true`` it also binds a third (HTTP metadata) port. We reserve all
  three while holding the sockets, so they are distinct, and always pass them explicitly.
* On an RPC-port clash the master reports ``serving`` on ``/health`` and then exits rc=1 ~2 s later
  without any error message. So readiness = ``/health`` ok AND the process still alive ~2.5 s later.
* SIGTERM gives a graceful exit (rc 0).

Orphan safety
-------------
Children are started with ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux, via ``ctypes`` in a
``preexec_fn``), so they get SIGTERM when the process that started them dies, even by SIGKILL.

Caveat: the "parent" that PDEATHSIG watches is the *thread* that called ``fork()``, not the process.
If a short-lived thread (e.g. a ``ThreadPoolExecutor`` worker, an asyncio ``to_thread`` call) spawns
the child and that thread later exits, the child is killed although our process is still alive. We
avoid this by doing every ``fork()`` on one long-lived daemon "spawner" thread owned by this module
(``_SPAWNER``); it lives until the process exits. Store servers additionally exit when their stdin
pipe reaches EOF (the write end lives only in our process) and when ``getppid()`` changes, which also
covers non-Linux hosts where PDEATHSIG does not exist. On non-Linux hosts a master started here is
NOT orphan-safe (no PDEATHSIG, and the C++ binary has no stdin watchdog).

A second caveat of the stdin watchdog: if this process later ``fork()``s other children (e.g.
``multiprocessing`` with the fork start method), they inherit the pipe's write end and the server will
only see EOF once they exit too (PDEATHSIG still fires when *we* die).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib.util
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MasterHandle",
    "StoreServerHandle",
    "start_master",
    "start_store_server",
    "client_env_defaults",
    "apply_client_env_defaults",
    "child_env",
    "store_server_env",
    "STREAMING_COPY_ENV",
    "STREAMING_COPY_FROM",
    "STREAMING_COPY_TUNABLE",
    "find_master_binary",
    "reserve_ports",
    "SERVER_READY_PREFIX",
    "SERVER_ERROR_PREFIX",
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

# A store server copies every object between its segment and a client's memory with glibc's memcpy
# (over shared memory the real client copies both ways). glibc streams a copy past the caches
# (non-temporal stores) only above a threshold it derives from the cache size it detects: 192 MiB on
# the 2-core VM, so 16 MB and 128 MB batches went through the caches. Streamed from 256 KiB up, raw
# Mooncake's 16 MB get there took 1.6 ms instead of 2.5 and a 64 MB one 4.6 instead of 7.9, and the
# reader's own caches stayed warm (benchmarks/results/mooncake_streaming_copy.md). Such a copy is 2-5x
# slower where the destination lies 1-700 bytes past the source within a page; objects padded to
# whole pages (_mc_index.OBJECT_ALIGN) keep both sides on a page. A value the user gave this tunable
# in GLIBC_TUNABLES wins; DATAPLANE_STREAMING_COPY=0 leaves glibc's own.
STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
STREAMING_COPY_ENV = "DATAPLANE_STREAMING_COPY"
STREAMING_COPY_FROM = 256 << 10


SERVER_READY_PREFIX = "DATAPLANE_MOONCAKE_SERVER_READY "
SERVER_ERROR_PREFIX = "DATAPLANE_MOONCAKE_SERVER_ERROR "

# Mooncake clients pick ports from these ranges at setup time (client identity port, transfer
# engine RPC port). Keep the master's ports out of them.
_MOONCAKE_CLIENT_PORT_RANGES = ((12300, 14300), (15000, 17000))

_PR_SET_PDEATHSIG = 1


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


def _find_binary(name: str, override_env: str) -> str:
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
    return _find_binary("mooncake_master", "DATAPLANE_MOONCAKE_MASTER")


def find_real_client_binary() -> str:
    """Path of ``mooncake_client``, a Mooncake "real client" (``$DATAPLANE_MOONCAKE_CLIENT`` overrides)."""
    return _find_binary("mooncake_client", "DATAPLANE_MOONCAKE_CLIENT")


# ---------------------------------------------------------------------------------------------
# ports


def _in_mooncake_ranges(port: int) -> bool:
    return any(lo <= port <= hi for lo, hi in _MOONCAKE_CLIENT_PORT_RANGES)


def reserve_ports(n: int, host: str = "127.0.0.1") -> tuple[list[int], list[socket.socket]]:
    """Bind ``n`` distinct free TCP ports on ``host`` and return them with the still-open sockets.

    Hold the sockets while choosing (so no port is handed out twice) and close them right before the
    process that needs the ports starts. Ports inside Mooncake's client port ranges are skipped.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held: list[socket.socket] = []
    keep: list[socket.socket] = []
    try:
        for _ in range(n + 64):
            if len(keep) == n:
                break
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((host, 0))
            if _in_mooncake_ranges(s.getsockname()[1]):
                held.append(s)  # keep it bound so we do not get it again
            else:
                keep.append(s)
        if len(keep) != n:
            raise RuntimeError(f"could not reserve {n} free ports on {host}")
    except BaseException:
        for s in keep:
            s.close()
        raise
    finally:
        for s in held:
            s.close()
    return [s.getsockname()[1] for s in keep], keep


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# Never go through an http(s)_proxy from the environment for loopback health checks.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_health(host: str, port: int, timeout_s: float) -> bool:
    try:
        with _NO_PROXY_OPENER.open(f"http://{_url_host(host)}:{port}/health", timeout=timeout_s) as r:
            if r.status != 200:
                return False
            body = json.loads(r.read() or b"{}")
    except Exception:
        return False
    return body.get("status") == "ok" and body.get("service_ready", True) is not False


def _tcp_connectable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# spawning (orphan-safe)


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl  # noqa: B018  (resolve the symbol in the parent, not after fork)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _make_preexec(parent_pid: int, deathsig: int) -> Callable[[], None]:
    libc = _LIBC

    def _preexec() -> None:  # runs in the child between fork and exec
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, deathsig, 0, 0, 0)
        # If the parent died between fork() and prctl(), PDEATHSIG will never fire: bail out.
        if os.getppid() != parent_pid:
            os._exit(1)

    return _preexec


class _Spawner:
    """One long-lived daemon thread that performs every fork, so PDEATHSIG tracks the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._owner_pid = -1

    def _ensure(self) -> queue.SimpleQueue[Any]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._owner_pid != os.getpid():
                self._q = queue.SimpleQueue()
                self._owner_pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, args=(self._q,), name="dataplane-mooncake-spawner", daemon=True
                )
                self._thread.start()
            assert self._q is not None
            return self._q

    @staticmethod
    def _run(q: queue.SimpleQueue[Any]) -> None:
        while True:
            argv, kwargs, box, done = q.get()
            try:
                box.append(subprocess.Popen(argv, **kwargs))
            except BaseException as e:
                box.append(e)
            done.set()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if threading.current_thread() is self._thread and self._owner_pid == os.getpid():
            return subprocess.Popen(argv, **kwargs)
        q = self._ensure()
        box: list[Any] = []
        done = threading.Event()
        q.put((argv, kwargs, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        proc: subprocess.Popen[bytes] = box[0]
        return proc


_SPAWNER = _Spawner()


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    kwargs.setdefault("close_fds", True)
    # Own session: a terminal ^C goes to our process only; we stop the children in order.
    kwargs.setdefault("start_new_session", True)
    kwargs["preexec_fn"] = _make_preexec(os.getpid(), int(signal.SIGTERM))
    return _SPAWNER.popen(argv, **kwargs)


def _spawn_logged(
    argv: list[str],
    what: str,
    *,
    release: Sequence[socket.socket] = (),
    pipes: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Spawn ``argv`` with its output in a fresh temp log (``dataplane-mooncake-<what>-*.log``, removed
    if the spawn fails). ``release``: sockets holding its ports, closed just before. ``pipes``: its
    stdin and stdout are pipes to us and only stderr goes to the log; else stdin is /dev/null."""
    log_fd, log_path = tempfile.mkstemp(prefix=f"dataplane-mooncake-{what}-", suffix=".log")
    try:
        for sock in release:
            sock.close()
        if pipes:
            proc = _spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd, env=env, bufsize=0)
        else:
            proc = _spawn(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
    except BaseException:
        os.unlink(log_path)
        raise
    finally:
        os.close(log_fd)
    return proc, log_path


# ---------------------------------------------------------------------------------------------
# shared handle behaviour

# Strong refs: a handle dropped by its user is still stopped (and its log removed) at exit.
_LIVE: set[_ProcHandle] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive, unless its other threads are still exiting (leader shows Z first)
        with open(f"/proc/{pid}/status", "rb") as f:
            st = dict(ln.split(b":", 1) for ln in f.read().splitlines() if b":" in ln)
        return not (st.get(b"State", b"").strip().startswith(b"Z") and int(st.get(b"Threads", b"1")) <= 1)
    except (OSError, ValueError):
        return True


def _tail(path: str | None, n: int = 40) -> str:
    if not path:
        return "(no log)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(log unreadable: {e})"
    lines = [ln[:600] for ln in data.splitlines()]
    return "\n".join(lines[-n:]) if lines else "(log empty)"


class _ProcHandle:
    pid: int
    log_path: str | None
    _proc: subprocess.Popen[bytes] | None

    def alive(self) -> bool:
        """True while the process runs (reaps it if it has exited)."""
        if self._proc is not None:
            return self._proc.poll() is None
        return _pid_alive(self.pid)

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def tail_log(self, n: int = 40) -> str:
        return _tail(self.log_path, n)

    def _before_stop(self) -> None:
        pass

    def stop(self, timeout_s: float = 10.0, *, remove_log: bool = True) -> None:
        """SIGTERM by PID, wait up to ``timeout_s``, then SIGKILL; reaps. Idempotent."""
        self._before_stop()
        p = self._proc
        if p is not None:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)  # no-op if already reaped: no PID-reuse risk
                    p.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
            for s in (p.stdin, p.stdout, p.stderr):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
        elif _pid_alive(self.pid):  # handle built from a bare PID (not started by us)
            try:
                os.kill(self.pid, signal.SIGTERM)
                end = time.monotonic() + timeout_s
                while time.monotonic() < end and _pid_alive(self.pid):
                    time.sleep(0.05)
                if _pid_alive(self.pid):
                    os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _LIVE.discard(self)
        if remove_log and self.log_path:
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------------------------------------
# master


@dataclass(eq=False)
class MasterHandle(_ProcHandle):
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
        return f"{_url_host(self.host)}:{self.rpc_port}"

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """GET ``http://host:metrics_port/health`` says ok (and the process, if ours, is alive)."""
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return _http_health(self.host, self.metrics_port, timeout_s)

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
    proc, log_path = _spawn_logged(argv, "master", release=socks, env=child_env())
    h = MasterHandle(
        host=host,
        rpc_port=rpc,
        metrics_port=metrics,
        pid=proc.pid,
        http_metadata_port=http,
        log_path=log_path,
        _proc=proc,
    )
    _LIVE.add(h)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        if proc.poll() is not None:
            return h, f"exited rc={proc.returncode} before /health was ok"
        if _http_health(host, metrics, 1.0):
            break
        if time.monotonic() > deadline:
            return h, f"/health not ok within {startup_timeout_s:.0f}s"
        time.sleep(0.1)
    t_ok = time.monotonic()
    # An RPC-port clash only shows ~2 s after "serving": the master exits rc=1 with no message.
    while time.monotonic() - t_ok < settle_s:
        if proc.poll() is not None:
            return h, (
                f"exited rc={proc.returncode} {time.monotonic() - t_ok:.1f}s after /health was ok "
                f"(port clash on rpc {rpc}?)"
            )
        time.sleep(0.1)
    if not _http_health(host, metrics, 2.0):
        return h, "/health no longer ok after settling"
    if not _tcp_connectable(host, rpc, 2.0):
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

    Ready means ``/health`` is ok and the process is still alive ~2.5 s later. On failure the
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


# ---------------------------------------------------------------------------------------------
# store server


@dataclass(eq=False)
class StoreServerHandle(_ProcHandle):
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
    return str(Path(__file__).resolve().parents[2])  # .../<root>/dataplane/adapters/this.py


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

    It runs ``python -m dataplane.adapters._mooncake_server`` (``launch="module"``) or the file by
    path with ``python -P`` (``launch="path"``: does not import ``dataplane/__init__``). It stops on
    SIGTERM, on EOF of its stdin (our process died or closed it), when its parent changes, or via
    PDEATHSIG, and ``close()``s its store before exiting. Objects in its segment vanish with it.
    """
    addr = master.address if isinstance(master, MasterHandle) else str(master)
    if isinstance(master, MasterHandle) and not master.alive():
        raise RuntimeError(f"master {addr} (pid {master.pid}) is not running")
    mhost, _, mport = addr.rpartition(":")
    if not _tcp_connectable(mhost.strip("[]"), int(mport), 3.0):
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
        argv = [sys.executable, "-m", "dataplane.adapters._mooncake_server", *server_args]
        root = _package_root()
        pp = os.environ.get("PYTHONPATH", "")
        if root not in pp.split(os.pathsep):
            extra_env.setdefault("PYTHONPATH", pp + os.pathsep + root if pp else root)
    elif launch == "path":
        argv = [sys.executable, "-P", str(Path(__file__).with_name("_mooncake_server.py")), *server_args]
    else:
        raise ValueError("launch must be 'module' or 'path'")
    proc, log_path = _spawn_logged(argv, "server", pipes=True, env=store_server_env(extra_env))
    h = StoreServerHandle(
        pid=proc.pid, host=host, master_address=addr, segment_bytes=int(segment_bytes), log_path=log_path, _proc=proc
    )
    _LIVE.add(h)
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
        proc, log_path = _spawn_logged(argv, "client", release=socks, env=store_server_env())
        h = StoreServerHandle(
            pid=proc.pid,
            host=host,
            master_address=master.address,
            segment_bytes=int(segment_bytes),
            rpc_address=f"{_url_host(host)}:{port}",
            log_path=log_path,
            _proc=proc,
        )
        _LIVE.add(h)
        deadline = time.monotonic() + startup_timeout_s
        while proc.poll() is None and time.monotonic() < deadline and not _tcp_connectable(host, port, 0.5):
            time.sleep(0.05)
        end = time.monotonic() + settle_s
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if proc.poll() is None and _tcp_connectable(host, port, 2.0):
            return h
        why = (
            f"exited rc={proc.returncode}"
            if proc.poll() is not None
            else f"port {port} not accepting connections within {startup_timeout_s:.0f}s"
        )
        why += f"\n--- mooncake_client log tail ---\n{h.tail_log(25)}"
        h.stop(timeout_s=5.0)
    raise RuntimeError(f"mooncake_client failed to start (master {master.address}): {why}")


# ---------------------------------------------------------------------------------------------


@atexit.register
def _stop_all_at_exit() -> None:
    # store servers first: their close() talks to the master
    for h in sorted(_LIVE, key=lambda h: not isinstance(h, StoreServerHandle)):
        try:
            h.stop(timeout_s=5.0)
        except Exception:
            pass
