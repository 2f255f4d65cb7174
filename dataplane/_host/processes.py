"""Child processes that die with us: spawned orphan-safe, supervised, stopped by PID and at exit.

Standard library only; imports nothing from ``dataplane``.

Orphan safety
-------------
Children are started with ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux, via ``ctypes`` in a
``preexec_fn``), so they get SIGTERM when the process that started them dies, even by SIGKILL.

Caveat: the "parent" that PDEATHSIG watches is the *thread* that called ``fork()``, not the process.
If a short-lived thread (e.g. a ``ThreadPoolExecutor`` worker, an asyncio ``to_thread`` call) spawns
the child and that thread later exits, the child is killed although our process is still alive. We
avoid this by doing every ``fork()`` on one long-lived daemon "spawner" thread owned by this module
(``_SPAWNER``); it lives until the process exits. Children that can (the Mooncake store server)
additionally exit when their stdin pipe reaches EOF (the write end lives only in our process) and
when ``getppid()`` changes, which also covers non-Linux hosts where PDEATHSIG does not exist. On
non-Linux hosts a child without such a watchdog (a C++ binary) is NOT orphan-safe.

A second caveat of the stdin watchdog: if this process later ``fork()``s other children (e.g.
``multiprocessing`` with the fork start method), they inherit the pipe's write end and the child will
only see EOF once they exit too (PDEATHSIG still fires when *we* die).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

__all__ = [
    "ProcHandle",
    "http_health",
    "listens_on",
    "pid_alive",
    "reserve_ports",
    "spawn_logged",
    "tcp_connectable",
    "track",
    "url_host",
]

# Mooncake clients pick ports from these ranges at setup time (client identity port, transfer
# engine RPC port). Keep the ports we reserve out of them.
_MOONCAKE_CLIENT_PORT_RANGES = ((12300, 14300), (15000, 17000))

_PR_SET_PDEATHSIG = 1


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


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# Never go through an http(s)_proxy from the environment for loopback health checks.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_health(host: str, port: int, timeout_s: float) -> bool:
    try:
        with _NO_PROXY_OPENER.open(f"http://{url_host(host)}:{port}/health", timeout=timeout_s) as r:
            if r.status != 200:
                return False
            body = json.loads(r.read() or b"{}")
    except Exception:
        return False
    return body.get("status") == "ok" and body.get("service_ready", True) is not False


def tcp_connectable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a listening TCP socket (IPv4 or IPv6, any address) on ``port``.

    Read from ``/proc`` (the socket inodes of ``/proc/net/tcp*`` in state LISTEN, and those among
    ``pid``'s open files); None where that cannot be told (no ``/proc``: not Linux).
    """
    listening: set[int] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                listening.add(int(cols[9]))
    if not readable:
        return None
    if not listening:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # exited meanwhile
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in listening:
            return True
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


def spawn_logged(
    argv: list[str],
    log_prefix: str,
    *,
    release: Sequence[socket.socket] = (),
    pipes: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Spawn ``argv`` with its output in a fresh temp log (``<log_prefix>*.log``, removed if the spawn
    fails). ``release``: sockets holding its ports, closed just before. ``pipes``: its
    stdin and stdout are pipes to us and only stderr goes to the log; else stdin is /dev/null."""
    log_fd, log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
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
_LIVE: set[ProcHandle] = set()


def track(handle: ProcHandle) -> None:
    """Stop ``handle`` at exit unless it was stopped before."""
    _LIVE.add(handle)


def pid_alive(pid: int) -> bool:
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


class ProcHandle:
    """What every supervised child's handle does (subclasses are dataclasses with these fields)."""

    stop_first: ClassVar[bool] = False  # stopped before the others at exit
    pid: int
    log_path: str | None
    _proc: subprocess.Popen[bytes] | None

    def alive(self) -> bool:
        """True while the process runs (reaps it if it has exited)."""
        if self._proc is not None:
            return self._proc.poll() is None
        return pid_alive(self.pid)

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
        elif pid_alive(self.pid):  # handle built from a bare PID (not started by us)
            try:
                os.kill(self.pid, signal.SIGTERM)
                end = time.monotonic() + timeout_s
                while time.monotonic() < end and pid_alive(self.pid):
                    time.sleep(0.05)
                if pid_alive(self.pid):
                    os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _LIVE.discard(self)
        if remove_log and self.log_path:
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass


@atexit.register
def _stop_all_at_exit() -> None:
    # handles that must go first (a store server, whose close() talks to its master) first
    for h in sorted(_LIVE, key=lambda h: not h.stop_first):
        try:
            h.stop(timeout_s=5.0)
        except Exception:
            pass
