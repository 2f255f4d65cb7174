"""Quiet backends: what a healthy connect, put, get and close print is nothing.

The backends log harmless lines at WARNING or ERROR on every healthy run: Mooncake's C++ client
(glog, straight to file descriptor 2, so Python's ``logging`` cannot reach it), Ray's token-auth
warning and start-up INFO lines, TransferQueue's loggers. Each is routed here:

* Python loggers (``ray``, ``transfer_queue``): levels while dataplane calls into them
  (:func:`ray_logging_level`; TQ's actors read ``TQ_LOGGING_LEVEL``, :func:`backend_env`).
* Child processes (``mooncake_master``, ``mooncake_client``, store servers): their output goes to
  their log files already; :func:`backend_env` lowers Mooncake's own level there too.
* C++ libraries inside this process: :func:`filtered_stderr` captures file descriptor 2 around the
  few native calls that log, drops only the lines listed in :data:`HARMLESS_STDERR` and writes
  everything else back to stderr, so a real error stays visible.

``DATAPLANE_BACKEND_LOGS=1`` turns all of this off: every backend logs as it would without dataplane.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

__all__ = [
    "BACKEND_LOGS_ENV",
    "HARMLESS_STDERR",
    "backend_logs",
    "filtered_stderr",
    "ray_logging_level",
]

BACKEND_LOGS_ENV = "DATAPLANE_BACKEND_LOGS"

# Lines a healthy run prints on stderr from native code in this process, each harmless:
HARMLESS_STDERR: tuple[re.Pattern[str], ...] = (
    # glog's notice that the host program did not call InitGoogleLogging (Mooncake's library never does).
    re.compile(r"^WARNING: Logging before InitGoogleLogging\(\) is written to STDERR$"),
    # A client attached to a real client asks it for the optional local hot cache, which dataplane
    # never enables; "not connected" is its reconnect probe racing our close().
    re.compile(
        r"^[EW]\d{4} [\d:.]+ +\d+ dummy_client\.cpp:\d+\] (Failed to receive hot cache fd|Dummy Client not connected)"
    ),
    # TransferQueue's Mooncake client asks for a segment descriptor the owner has not published yet.
    re.compile(r"^[EW]\d{4} [\d:.]+ +\d+ \S+\.cpp:\d+\] Local segment descriptor not found"),
)

_LOCK = threading.Lock()


def backend_logs() -> bool:
    """True when ``$DATAPLANE_BACKEND_LOGS`` asks for the backends' full logging (any value but ``0``)."""
    return os.environ.get(BACKEND_LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no")


def ray_logging_level() -> int:
    """``logging_level`` for a ``ray.init`` dataplane makes: ERROR (no token-auth warning, no INFO
    banner) unless :func:`backend_logs`."""
    return logging.INFO if backend_logs() else logging.ERROR


def _harmless(line: str) -> bool:
    return any(p.search(line) for p in HARMLESS_STDERR)


@contextlib.contextmanager
def filtered_stderr() -> Iterator[None]:
    """Capture file descriptor 2 for the block; on exit write back every line but the harmless ones.

    Lines other threads write meanwhile are captured too and written back (later, not lost). One
    block at a time per process; a nested block is a no-op. No-op under :func:`backend_logs` or
    where descriptor 2 cannot be duplicated.
    """
    if backend_logs() or not _LOCK.acquire(blocking=False):
        yield
        return
    try:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):
            yield
            return
        read_fd, write_fd = os.pipe()
        chunks: list[bytes] = []

        def drain() -> None:  # keeps the pipe from filling (and the writer from blocking)
            while True:
                data = os.read(read_fd, 65536)
                if not data:
                    return
                chunks.append(data)

        reader = threading.Thread(target=drain, name="dataplane-stderr", daemon=True)
        reader.start()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)  # the pipe's last writer is gone: the reader sees EOF
            os.close(saved)
            reader.join(5.0)
            with contextlib.suppress(OSError):
                os.close(read_fd)
            text = b"".join(chunks).decode("utf-8", "replace")
            kept = [line for line in text.splitlines(keepends=True) if not _harmless(line.rstrip("\n"))]
            if kept:
                with contextlib.suppress(OSError):
                    os.write(2, "".join(kept).encode("utf-8", "replace"))
    finally:
        _LOCK.release()
