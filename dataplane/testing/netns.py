"""Several "hosts" on one Linux machine: network namespaces joined by a switch, for multi-host tests.

Each host is a network namespace with its own loopback and one address on a private ``/24``; the
hosts reach each other through a bridge that lives in a namespace of its own, so the machine's own
network stack is never touched. Processes started with :meth:`Hosts.popen` run inside a host's
namespace (``ip netns exec``) and are ended by PID when the hosts close; closing also deletes every
namespace (and with them their interfaces), also when the test failed or was interrupted.

Needs root (``CAP_NET_ADMIN``) and ``ip`` from iproute2: :func:`unavailable` says why not.

    with Hosts(2) as hosts:
        a, b = hosts
        server = hosts.popen(a, ["python", "-m", "http.server", "--bind", a.address, "8000"])
        hosts.run(b, ["python", "-c", f"import urllib.request as u; u.urlopen('http://{a.address}:8000')"])
        assert all(s.address == a.address for s in hosts.listening(a))
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dataplane._host.processes import pid_alive
from dataplane.errors import DataPlaneError, InvalidArgument

__all__ = [
    "Host",
    "Hosts",
    "HostsError",
    "Listener",
    "parse_tcp_listeners",
    "sweep_stale",
    "unavailable",
    "wait_for_port",
]

_PREFIX = "dpns"  # every namespace this module creates: dpns<pid>x<run><role>
_LIVE: weakref.WeakSet[Hosts] = weakref.WeakSet()


class HostsError(DataPlaneError, RuntimeError):
    """Setting up or tearing down the namespaces failed (the message has the failing command's output)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace: ``name`` (for ``ip netns exec``), its ``address`` on the hosts' network, its index."""

    name: str
    address: str
    index: int


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening TCP socket of a namespace: local ``address`` (``0.0.0.0``/``::`` for a wildcard) and
    ``port``; :meth:`Hosts.listening` also names the ``command`` line of the process that holds it
    ("" when unknown; not part of equality)."""

    address: str
    port: int
    command: str = field(default="", compare=False, repr=False)

    @property
    def wildcard(self) -> bool:
        return self.address in ("0.0.0.0", "::")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, a kernel that refuses), or None."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run as root"
    if shutil.which("ip") is None:
        return "needs `ip` from iproute2 (apt-get install iproute2)"
    probe = f"{_PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def sweep_stale() -> list[str]:
    """Delete namespaces this module made in processes that are gone (a run killed before its teardown)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_PREFIX) or "x" not in name:
            continue
        pid = name[len(_PREFIX) : name.index("x")]
        if pid.isdigit() and not pid_alive(int(pid)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


class Hosts:
    """``n`` hosts (network namespaces) on one ``/24``, joined by a bridge in a namespace of their own.

    Args:
        n: how many hosts (2 to 250).
        subnet: the hosts' network (default: a ``10.x.y.0/24`` picked from this process's PID);
            host ``i`` gets the address ``.i+1``.

    Iterating gives the :class:`Host` objects. Use as a context manager (or call :meth:`close`).
    """

    _runs = 0

    def __init__(self, n: int = 2, *, subnet: str | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 250:
            raise InvalidArgument(f"n must be an int in 2..250, got {n!r}")
        reason = unavailable()
        if reason is not None:
            raise HostsError(reason)
        sweep_stale()
        Hosts._runs += 1
        pid = os.getpid()
        self._tag = f"{_PREFIX}{pid}x{Hosts._runs}"
        if subnet is None:
            subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250 + Hosts._runs % 5}.0/24"
        net = ipaddress.ip_network(subnet)
        if net.prefixlen != 24 or net.version != 4:
            raise InvalidArgument(f"subnet must be an IPv4 /24, got {subnet!r}")
        self.network = net
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._names: list[str] = []
        self._closed = False
        _LIVE.add(self)
        try:
            self._build(n)
        except BaseException:
            self.close()
            raise

    # -- construction -----------------------------------------------------------------------------
    def _netns(self, role: str) -> str:
        name = f"{self._tag}{role}"
        _ip("netns", "add", name)
        self._names.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _build(self, n: int) -> None:
        switch = self._netns("s")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            ns = self._netns(f"h{i}")
            address = str(self.network.network_address + i + 1)
            # the pair is made inside the switch namespace, then one end moves to the host
            _ip("-n", switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0")
            _ip("-n", switch, "link", "set", "eth0", "netns", ns)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self.hosts.append(Host(name=ns, address=address, index=i))

    # -- use ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.name, *argv]

    def popen(
        self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host`` (a new session, so the hosts end it and its children by PID)."""
        if self._closed:
            raise HostsError("these hosts are closed")
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(self.argv(host, argv), env=full_env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, host: Host, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host`` to completion (stdout and stderr captured as text; killed after
        ``timeout_s``, raising ``subprocess.TimeoutExpired``)."""
        proc = self.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self, proc: subprocess.Popen[Any], *, grace_s: float = 5.0, sig: int = signal.SIGTERM) -> int | None:
        """End ``proc`` and its session: ``sig`` (SIGTERM; SIGKILL for a crash), then SIGKILL after
        ``grace_s``. Returns its exit code."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # children left behind by a leader that exited
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        return proc.returncode

    def listening(self, host: Host) -> list[Listener]:
        """Every listening TCP socket in ``host``'s namespace (IPv4 and IPv6), each with the command
        line of the process of the namespace that holds it."""
        found: list[tuple[Listener, int]] = []
        for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
            done = subprocess.run(self.argv(host, ["cat", table]), capture_output=True, text=True, timeout=10)
            found += parse_tcp_listeners(done.stdout, v6=v6)
        holders = _socket_holders(self._pids_in(host.name))
        return [replace(listener, command=holders.get(inode, "")) for listener, inode in found]

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End every process started here (by PID), delete every namespace; idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for proc in reversed(self._procs):
            try:
                self.stop(proc, grace_s=3.0)
            except Exception as e:  # keep tearing down
                errors.append(f"pid {proc.pid}: {e}")
        for name in self._names:  # whatever still runs in our namespaces (daemons that left our sessions)
            for pid in self._pids_in(name):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for name in reversed(self._names):
            done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=30)
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"ip netns del {name}: {done.stderr.strip()}")
        _LIVE.discard(self)
        if errors:
            raise HostsError("tearing the hosts down left something behind: " + "; ".join(errors))

    @staticmethod
    def _pids_in(name: str) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
        return [int(x) for x in done.stdout.split() if x.isdigit()]

    def pids(self, host: Host) -> list[int]:
        """Every process running in ``host``'s namespace (also those that left the sessions :meth:`popen` made)."""
        return self._pids_in(host.name)

    def leftovers(self) -> list[str]:
        """What of this run still exists: its namespaces and live processes (empty after :meth:`close`)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        names = [line.split()[0] for line in listed.splitlines() if line.startswith(self._tag)]
        procs = [f"pid {p.pid}" for p in self._procs if p.poll() is None]
        return names + procs

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_tcp_listeners(table: str, *, v6: bool) -> list[tuple[Listener, int]]:
    """The listening sockets of a ``/proc/net/tcp`` (``v6``: ``tcp6``) table's text, each with its
    socket inode (which ``/proc/PID/fd`` links name, to tell whose socket it is).

    >>> parse_tcp_listeners("sl local rem st x x x x x inode\\n0: 0100007F:1F90 00000000:0000 0A 0 0 0 0 0 42", v6=False)
    [(Listener(address='127.0.0.1', port=8080), 42)]
    """
    out = []
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
            continue
        hex_addr, hex_port = cols[1].split(":")
        out.append((Listener(_proc_address(hex_addr, v6), int(hex_port, 16)), int(cols[9])))
    return out


def _socket_holders(pids: Sequence[int]) -> dict[int, str]:
    """Socket inode -> the command line of the process (of ``pids``) holding it."""
    out: dict[int, str] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.setdefault(int(target[8:-1]), command)
    return out


def _proc_address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # four little-endian 32-bit words
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped) if address.ipv4_mapped is not None else str(address)


@atexit.register
def _close_all() -> None:  # an interrupted run: its teardown may not have happened
    for hosts in list(_LIVE):
        with contextlib.suppress(Exception):
            hosts.close()


def wait_for_port(hosts: Hosts, host: Host, port: int, *, timeout_s: float = 30.0) -> None:
    """Wait until something listens on ``port`` in ``host`` (raises :class:`HostsError` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(listener.port == port for listener in hosts.listening(host)):
            return
        time.sleep(0.2)
    raise HostsError(f"nothing listens on port {port} in {host.name} after {timeout_s:g} s")
