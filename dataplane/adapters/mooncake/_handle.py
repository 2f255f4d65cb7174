"""A guarded Mooncake store handle: typed errors for return codes, chunked batches, no segfaults.

Mooncake reports failures as negative return codes and segfaults when a store is used after
``close()`` or in a forked child. Every call here goes through :meth:`StoreHandle._enter`, which
raises ``ClientClosed`` after close and ``BackendUnavailable`` in a forked child, and ``close()``
waits for calls in flight before closing the native store. A forked child never runs the native
destructor either: the child leaks one reference to the store object (closing it there crashes).
A batch read that names one key twice fills only the last of its buffers and reports every one as
read (0.3.13.post1, TCP and shared memory): :meth:`StoreHandle.get_into` splits such a call.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from dataplane._host.quiet import filtered_stderr
from dataplane.adapters.mooncake._shm import CHUNK, ShmArenas
from dataplane.errors import (
    BackendUnavailable,
    CapacityExceeded,
    ClientClosed,
    DataPlaneError,
    DataPlaneTimeout,
    KeyNotFound,
)

__all__ = ["MAX_KEYS_PER_CALL", "AdminClient", "StoreHandle", "error_for"]

log = logging.getLogger(__name__)

MAX_KEYS_PER_CALL = 1024

NOT_FOUND = -704
NOT_READY = -703
LEASE_EXPIRED = -707
NO_SPACE = -200
TRANSIENT = frozenset({-800, -900, -901, LEASE_EXPIRED, -714})  # transfer / RPC failures

_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (store full)",
    -400: "INVALID_KEY",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT (two writers on one key)",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}


def code_name(code: int) -> str:
    return f"{code} {_NAMES.get(code, 'UNKNOWN')}"


def error_for(code: int, what: str) -> DataPlaneError:
    """The typed error for a negative Mooncake return code."""
    name = code_name(code)
    if code == NOT_FOUND:
        return KeyNotFound(f"{what}: {name}")
    if code in (NO_SPACE, -1700):
        return CapacityExceeded(
            f"{what}: {name}. The Mooncake segments are full (objects are hard-pinned, never evicted), or no "
            "store server is mounted; clear consumed rows (kv_clear), or run store servers with more segment_bytes"
        )
    if code in TRANSIENT or code in (-101, -1):
        return BackendUnavailable(
            f"{what}: {name}. A Mooncake store server or the master is unreachable or died "
            "(data held in a dead server's segment is lost)"
        )
    return DataPlaneError(f"{what}: Mooncake returned {name}")


# forked children must never touch (or destroy) a parent's native store
_HANDLES: weakref.WeakSet[StoreHandle] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for h in list(_HANDLES):
        h._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class StoreHandle:
    """One ``MooncakeDistributedStore``, set up, guarded, with registered-buffer bookkeeping.

    With ``real_client`` (``HOST:PORT`` of a ``mooncake_client`` on this host) the store attaches to
    it (``setup_dummy``) and moves data through shared memory: every buffer then comes from
    :attr:`shm`, and ``segment_bytes``, ``protocol`` and the addresses are the real client's business.
    """

    def __init__(
        self,
        *,
        local_hostname: str,
        master_address: str,
        segment_bytes: int,
        local_buffer_bytes: int,
        protocol: str,
        rdma_devices: str,
        metadata_server: str = "P2PHANDSHAKE",
        real_client: str | None = None,
    ) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._fork_note = ""
        self._registered: dict[int, int] = {}  # ptr -> size
        self.shm: ShmArenas | None = None
        self.real_client = real_client
        store = MooncakeDistributedStore()
        if real_client is not None:
            with filtered_stderr():  # glog: "Failed to receive hot cache fd" (harmless, see _host.quiet)
                rc = store.setup_dummy(CHUNK, int(local_buffer_bytes), real_client)
            if rc != 0:
                raise BackendUnavailable(
                    f"could not attach to the Mooncake real client at {real_client} (rc={rc}); it must run on this "
                    "host (mooncake_client --port=PORT), or leave real_client unset to reach the store over the network"
                )
            self.shm = ShmArenas(store.alloc_from_mem_pool, self._register_span, store.unregister_buffer)
        else:
            rc = store.setup(
                local_hostname,
                metadata_server,
                int(segment_bytes),
                int(local_buffer_bytes),
                protocol,
                rdma_devices,
                master_address,
            )
        if rc != 0:
            raise BackendUnavailable(
                f"Mooncake client setup failed (rc={rc}) for master {master_address} as {local_hostname!r} "
                f"over {protocol}; check the master is up and that {local_hostname!r} is this host's routable address"
            )
        self._store: Any = store
        cfg = ReplicateConfig()
        cfg.with_hard_pin = True  # backpressure (-200) instead of silent eviction at 90 % full
        self.put_config = cfg
        self.hostname = str(store.get_hostname()) or f"shm:{real_client}"
        _HANDLES.add(self)

    # -- guard ----------------------------------------------------------------------------------
    def _forked(self) -> None:
        store, self._store = self._store, None
        if store is not None:  # leak it: its destructor would close the parent's client and crash
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
        self._fork_note = f"created in process {self._pid}"
        self._cond = threading.Condition()
        self._inflight = 0

    def check(self) -> None:
        """Raise what any call would raise now: ClientClosed after close, BackendUnavailable in a fork."""
        if os.getpid() != self._pid:
            raise BackendUnavailable(
                f"this Mooncake client was {self._fork_note or f'created in process {self._pid}'}; a forked "
                "child cannot use it (Mooncake crashes). Connect again in the child, and start workers "
                "with the 'spawn' start method"
            )
        if self._closed or self._store is None:
            raise ClientClosed("this Mooncake client is closed; connect again with dataplane.connect()")

    @contextlib.contextmanager
    def _enter(self) -> Iterator[Any]:
        self.check()
        with self._cond:
            self.check()
            self._inflight += 1
            store = self._store
        try:
            yield store
        finally:
            with self._cond:
                self._inflight -= 1
                if not self._inflight:
                    self._cond.notify_all()

    @property
    def usable(self) -> bool:
        return not self._closed and self._store is not None and os.getpid() == self._pid

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait for calls in flight, unregister buffers, close the native store. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if not self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout_s):
                log.warning("dataplane: closing a Mooncake client with %d calls still in flight", self._inflight)
            store, self._store = self._store, None
        if store is None or os.getpid() != self._pid:
            return
        if self.shm is not None:
            self.shm.release()
        for ptr in list(self._registered):
            store.unregister_buffer(ptr)
        self._registered.clear()
        with filtered_stderr():  # glog: "Dummy Client not connected" (harmless, see _host.quiet)
            store.close()

    # -- buffers --------------------------------------------------------------------------------
    def register(self, arr: np.ndarray) -> None:
        """BufferPool ``on_new`` hook: register a slab once for zero-copy transfers."""
        ptr = int(arr.ctypes.data)
        self._register_span(ptr, int(arr.nbytes))
        self._registered[ptr] = int(arr.nbytes)

    def _register_span(self, ptr: int, nbytes: int) -> None:
        with self._enter() as st:
            rc = st.register_buffer(ptr, nbytes)
        if rc != 0:
            raise error_for(rc, f"register_buffer of {nbytes} bytes")

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in one registered buffer (ranged reads need that; a
        shared-memory client has no ranged reads)."""
        return self.shm is None and self.reaches(ptr, nbytes)

    def reaches(self, ptr: int, nbytes: int) -> bool:
        """Whether a put can send ``[ptr, ptr + nbytes)`` as it is: it lies in this shared-memory
        client's memory, or in one registered buffer (RDMA)."""
        if self.shm is not None:
            return self.shm.holds(ptr, nbytes)
        return any(p <= ptr and ptr + nbytes <= p + n for p, n in list(self._registered.items()))

    def unregister(self, arr: np.ndarray) -> None:
        """BufferPool ``on_drop`` hook; a no-op once the store is closed (closing unregisters all)."""
        ptr = int(arr.ctypes.data)
        if ptr not in self._registered or not self.usable:
            return
        self._registered.pop(ptr, None)
        with contextlib.suppress(DataPlaneError), self._enter() as st:
            st.unregister_buffer(ptr)

    # -- calls ----------------------------------------------------------------------------------
    def put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``batch_upsert_from`` (hard-pinned), chunked; one return code per key."""
        out: list[int] = []
        with self._enter() as st:
            for a in range(0, len(keys), MAX_KEYS_PER_CALL):
                b = a + MAX_KEYS_PER_CALL
                out += st.batch_upsert_from(list(keys[a:b]), list(ptrs[a:b]), list(sizes[a:b]), self.put_config)
        return out

    def put_from_if_absent(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``batch_put_from`` (hard-pinned), chunked; one return code per key. A key that holds a value,
        or whose put is in flight, keeps it and reports 0 too (Mooncake turns -705 into success): read
        it back to learn whose value won."""
        out: list[int] = []
        with self._enter() as st:
            for a in range(0, len(keys), MAX_KEYS_PER_CALL):
                b = a + MAX_KEYS_PER_CALL
                out += st.batch_put_from(list(keys[a:b]), list(ptrs[a:b]), list(sizes[a:b]), self.put_config)
        return out

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``batch_get_into``, chunked; bytes read or a negative code per key. A key named more than
        once goes in separate calls: in one, Mooncake fills only its last buffer and reports every
        one as read."""
        if len(set(keys)) < len(keys):
            first = {k: i for i, k in reversed(list(enumerate(keys)))}  # each key's first place
            once = sorted(first.values())
            again = [i for i, k in enumerate(keys) if first[k] != i]  # may name a key twice still: recurse
            codes = [0] * len(keys)
            for part in (once, again):
                got = self.get_into([keys[i] for i in part], [ptrs[i] for i in part], [sizes[i] for i in part])
                for i, code in zip(part, got, strict=True):
                    codes[i] = code
            return codes
        out: list[int] = []
        with self._enter() as st:
            for a in range(0, len(keys), MAX_KEYS_PER_CALL):
                b = a + MAX_KEYS_PER_CALL
                out += st.batch_get_into(list(keys[a:b]), list(ptrs[a:b]), list(sizes[a:b]))
        return out

    def get_ranges(self, reads: Sequence[tuple[int, str, Sequence[tuple[int, int, int]]]]) -> list[list[int]]:
        """``get_into_ranges`` for reads (buffer ptr, key, ranges of (dst offset, src offset, size)), in as
        few calls as the key limit allows; returns bytes or a negative code per range of each read.
        Destinations must lie in registered buffers."""
        out: list[list[int]] = []
        with self._enter() as st:
            for a in range(0, len(reads), MAX_KEYS_PER_CALL):
                chunk = reads[a : a + MAX_KEYS_PER_CALL]
                groups: dict[int, list[int]] = {}  # ptr -> positions in chunk
                for j, (ptr, _, _) in enumerate(chunk):
                    groups.setdefault(ptr, []).append(j)
                ptrs = list(groups)
                pos = [groups[p] for p in ptrs]
                res = st.get_into_ranges(
                    ptrs,
                    [[chunk[j][1] for j in g] for g in pos],
                    [[[d for d, _, _ in chunk[j][2]] for j in g] for g in pos],
                    [[[x for _, x, _ in chunk[j][2]] for j in g] for g in pos],
                    [[[n for _, _, n in chunk[j][2]] for j in g] for g in pos],
                )
                got: list[list[int]] = [[] for _ in chunk]
                for g, per_key in zip(pos, res, strict=True):
                    for j, per_range in zip(g, per_key, strict=True):
                        got[j] = list(per_range)
                out += got
        return out

    def put_if_absent(self, key: str, data: bytes, *, replicas: int = 1) -> int:
        """``put`` of a small value (hard-pinned): Mooncake keeps the value already there, if any.
        ``replicas`` > 1 asks for copies on that many segments (as many as there are, if fewer), so
        the value outlives the store server of any one of them."""
        config = self.put_config
        if replicas > 1:
            from mooncake.store import ReplicateConfig

            config = ReplicateConfig()
            config.with_hard_pin = True
            config.replica_num = replicas
        with self._enter() as st:
            return int(st.put(key, data, config))

    def get_bytes(self, key: str) -> bytes:
        """A small value (b"" when absent, or while its put is still being written)."""
        with self._enter() as st:
            return bytes(st.get(key))

    def remove(self, keys: Sequence[str]) -> list[int]:
        out: list[int] = []
        with self._enter() as st:
            for a in range(0, len(keys), MAX_KEYS_PER_CALL):
                out += st.batch_remove(list(keys[a : a + MAX_KEYS_PER_CALL]), True)
        return out

    def remove_regex(self, pattern: str) -> int:
        """Remove every key matching ``pattern``; how many. A failure (Mooncake's negative code) raises
        ``BackendUnavailable``: a sweep that silently left claim markers or a finished mark behind
        would make later claims or streams wrong."""
        with self._enter() as st:
            rc = int(st.remove_by_regex(pattern, True))
        if rc < 0:
            from dataplane.errors import BackendUnavailable

            raise BackendUnavailable(
                f"Mooncake could not remove the keys matching {pattern!r} (code {rc}); retry the clear"
            )
        return rc


class _HTTPError(OSError):
    pass


def _lines(body: bytes, keep: re.Pattern[bytes] | None) -> list[str]:
    """The keys of a ``/get_all_keys`` answer (one per line). With ``keep``, a pattern of the form
    ``\\n(...)`` whose group is one whole line, only the lines it finds: the scan runs in C (a master
    shared with other users can hold far more keys than the caller's own, e.g. 0.3 ms against 5 ms
    for 50,000 keys)."""
    if keep is None:
        return body.decode("utf-8", "replace").split("\n")
    return [k.decode("utf-8", "replace") for k in keep.findall(b"\n" + body)]


class AdminClient:
    """``GET /get_all_keys`` (and ``/batch_query_keys``) on the master's admin port over one
    keep-alive socket per thread.

    A minimal HTTP/1.1 client (about 0.1 ms per call against 0.25 ms for ``http.client``): this
    listing is on the path of every put and get.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._request = f"GET /get_all_keys HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.listed = 0  # keys in the master at the last listing (anyone's): what one costs

    def _sock(self, timeout_s: float) -> socket.socket:
        if getattr(self._local, "pending", False):  # an answer was never read (its caller raised): start afresh
            self._drop()
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is None or getattr(self._local, "pid", None) != os.getpid():
            if self._closed:
                raise ClientClosed("this Mooncake client is closed")
            sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock, self._local.pid, self._local.buf = sock, os.getpid(), b""
            with self._lock:
                self._all.append(sock)
        sock.settimeout(timeout_s)
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        self._local.pending = False
        if sock is not None:
            sock.close()
            with self._lock:
                if sock in self._all:
                    self._all.remove(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._all = self._all, []
        for sock in socks:
            sock.close()

    def _read_until(self, sock: socket.socket, sep: bytes) -> bytes:
        buf: bytes = self._local.buf
        while sep not in buf:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise _HTTPError("connection closed by the master")
            buf += chunk
        head, _, self._local.buf = buf.partition(sep)
        return head

    def _read_n(self, sock: socket.socket, n: int) -> bytes:
        parts, have = [self._local.buf], len(self._local.buf)
        while have < n:
            chunk = sock.recv(max(1 << 16, n - have))
            if not chunk:
                raise _HTTPError("connection closed by the master")
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        self._local.buf = data[n:]
        return data[:n]

    def _get(self, timeout_s: float) -> bytes:
        sock = self._sock(timeout_s)
        sock.sendall(self._request)
        self._local.pending = True
        return self._answer(sock)

    def _answer(self, sock: socket.socket) -> bytes:
        self._local.pending = False  # from here on, a failure drops the socket (callers do)
        data: bytes = self._local.buf or sock.recv(1 << 16)
        end = data.find(b"\r\n\r\n")
        if end > 0 and data.startswith(b"HTTP/1.1 200 "):  # the usual answer, whole in one read: a few C calls
            top = data[:end].lower()
            at = top.find(b"\r\ncontent-length:")
            if at > 0 and b"\r\nconnection: close" not in top and b"\r\ntransfer-encoding:" not in top:
                stop = top.find(b"\r\n", at + 2)
                start, n = end + 4, int(top[at + 17 : stop if stop > 0 else end])
                if len(data) >= start + n:
                    self._local.buf = data[start + n :]
                    return data[start : start + n]
        self._local.buf = data
        head = self._read_until(sock, b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = head[0].split(" ", 2)
        if len(status) < 2 or status[1] != "200":
            raise _HTTPError(f"unexpected answer {head[0]!r}")
        headers = {k.strip().lower(): v.strip().lower() for k, _, v in (h.partition(":") for h in head[1:])}
        if "content-length" in headers:
            body = self._read_n(sock, int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while True:
                size = int(self._read_until(sock, b"\r\n").split(b";")[0], 16)
                parts.append(self._read_n(sock, size))
                self._read_until(sock, b"\r\n")
                if size == 0:
                    break
            body = b"".join(parts)
        else:
            raise _HTTPError("answer has no length")
        if headers.get("connection") == "close":
            self._drop()
        return body

    def _send(self, request: bytes, timeout_s: float) -> socket.socket | None:
        """Send ``request`` on this thread's socket (its answer to be read by :meth:`_wait`), or None
        where that failed (the socket is dropped)."""
        try:
            sock = self._sock(min(timeout_s, 30.0))
            sock.sendall(request)
        except OSError:
            self._drop()
            return None
        self._local.pending = True
        return sock

    def _wait(self, sock: socket.socket, deadline: float) -> bytes:
        """The body of the answer :meth:`_send` asked for, by ``deadline``."""
        sock.settimeout(max(0.001, min(deadline - time.monotonic(), 30.0)))
        return self._answer(sock)

    def start_all_keys(self, timeout_s: float, keep: re.Pattern[bytes] | None = None) -> Callable[[], list[str]]:
        """Send the listing request now and return a function that reads the answer: the master
        answers while the caller does other work. Any failure falls back to :meth:`all_keys`.
        ``keep``: only the keys this pattern's group 1 finds (see :func:`_lines`)."""
        deadline = time.monotonic() + timeout_s
        sock = self._send(self._request, timeout_s)
        if sock is None:
            return lambda: self.all_keys(max(0.001, deadline - time.monotonic()), keep)

        def answer() -> list[str]:
            try:
                return self._listed(self._wait(sock, deadline), keep)
            except (OSError, ValueError):
                self._drop()
                if self._closed:
                    raise ClientClosed("this Mooncake client is closed") from None
                return self.all_keys(max(0.001, deadline - time.monotonic()), keep)

        return answer

    def _listed(self, body: bytes, keep: re.Pattern[bytes] | None) -> list[str]:
        self.listed = body.count(b"\n")
        return _lines(body, keep)

    def start_existing(self, keys: Sequence[str], timeout_s: float) -> Callable[[], set[str] | None]:
        """Ask which of ``keys`` exist now (``/batch_query_keys``: the master looks up only these,
        however many keys it holds); the returned function waits for the answer, or returns None
        where the query failed (an older master without this endpoint, say): callers then list.
        Keys must not hold commas (the endpoint's separator); ours never do."""
        deadline = time.monotonic() + timeout_s
        query = ",".join(quote(k, safe="/") for k in keys)
        request = f"GET /batch_query_keys?keys={query} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n"
        sock = self._send(request.encode(), timeout_s)
        if sock is None:
            return lambda: None

        def answer() -> set[str] | None:
            try:
                found = json.loads(self._wait(sock, deadline))["data"]
                return {k for k, v in found.items() if isinstance(v, dict) and v.get("ok") is True}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                self._drop()
                return None

        return answer

    def all_keys(self, timeout_s: float, keep: re.Pattern[bytes] | None = None) -> list[str]:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        for attempt in range(3):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return self._listed(self._get(min(left, 30.0)), keep)
            except (OSError, ValueError) as e:
                last = e
                self._drop()
                if self._closed:
                    raise ClientClosed("this Mooncake client is closed") from e
                time.sleep(0.05 * attempt)
        if last is None:
            raise DataPlaneTimeout(f"listing keys from the Mooncake master took more than {timeout_s}s")
        raise BackendUnavailable(
            f"cannot list keys from the Mooncake master's admin port {self.host}:{self.port} ({last}); "
            "is the master up, and is metrics_port= its --metrics_port?"
        ) from last
