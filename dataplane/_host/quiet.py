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
* Typed errors: where a backend logs a failure that dataplane raises as a typed error the caller
  handles (``CapacityExceeded``, ``KeyNotFound``), the record is dropped by a ``logging.Filter`` on
  the logger that writes it, for exactly the messages in :data:`TYPED_ERROR_RECORDS`; a record of
  TransferQueue's actors, which Ray forwards to this process's stderr, is dropped from that stream
  by the same patterns (:func:`quiet_typed_errors`). Every other record of those loggers passes.

``DATAPLANE_BACKEND_LOGS=1`` turns all of this off: every backend logs as it would without dataplane.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "BACKEND_LOGS_ENV",
    "HARMLESS_STDERR",
    "TYPED_ERROR_RECORDS",
    "backend_logs",
    "filtered_stderr",
    "quiet_typed_errors",
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


# Records a backend logs for a failure that dataplane raises as a typed error (logger -> patterns of
# the message), each dropped where it would reach stderr:
TYPED_ERROR_RECORDS: dict[str, tuple[re.Pattern[str], ...]] = {
    # A put into a full tq://?backend=simple (CapacityExceeded): the storage manager's two lines in
    # this process ("Unexpected error during put to storage unit ..." and "put_data failed ...").
    "transfer_queue.storage.managers.simple_storage_manager": (
        re.compile(
            r"^\[[^\]]*\]: (Unexpected error during put to storage unit|put_data failed\.) .*Storage capacity exceeded"
        ),
    ),
    # ... and the storage unit's line for it (a Ray actor: forwarded to this process by Ray).
    "transfer_queue.storage.simple_storage": (
        re.compile(r"^\[[^\]]*\]: worker error during \S*PUT_DATA from sender=.*Storage capacity exceeded"),
    ),
    # A get or clear of keys that are not there, or of a partition that is not (KeyNotFound, or
    # nothing to do): the controller's warnings (an actor).
    "transfer_queue.controller": (
        re.compile(
            r"^Keys \[.*\] were not found in partition .*\. They will be excluded from the retrieved BatchMeta\."
        ),
        re.compile(r"^\[[^\]]*\]: Partition .* not found\. Returning empty BatchMeta\."),
    ),
}

_TYPED_LOCK = threading.Lock()
_FILTERED_MARK = "_dataplane_typed_errors"


class _TypedErrorFilter(logging.Filter):
    """Drops the records of one logger whose message matches one of its :data:`TYPED_ERROR_RECORDS`."""

    def __init__(self, patterns: tuple[re.Pattern[str], ...]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        if backend_logs():
            return True
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def typed_error_line(line: str) -> bool:
    """Whether ``line``, as a backend's log handler formats a record (``... - LEVEL - logger -
    message``), is one of :data:`TYPED_ERROR_RECORDS`."""
    for name, patterns in TYPED_ERROR_RECORDS.items():
        _, sep, message = line.partition(f" - {name} - ")
        if sep and any(p.search(message) for p in patterns):
            return True
    return False


def quiet_typed_errors() -> None:
    """Filter :data:`TYPED_ERROR_RECORDS` out of this process's logging and out of the actor output
    Ray forwards to it. Idempotent; call it after ``ray.init`` (Ray installs its forwarder there).
    No-op for the records under :func:`backend_logs` (checked per record)."""
    with _TYPED_LOCK:
        for name, patterns in TYPED_ERROR_RECORDS.items():
            logger = logging.getLogger(name)
            if not any(isinstance(f, _TypedErrorFilter) for f in logger.filters):
                logger.addFilter(_TypedErrorFilter(patterns))
        _filter_forwarded_lines()


def _filter_forwarded_lines() -> None:
    """Wrap the handler through which Ray prints its workers' output here (``log_to_driver``) so that
    it drops the lines of :func:`typed_error_line`. Ray's dispatcher is not public API: where it is
    not as expected, nothing is wrapped (the lines then show, as they did)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except Exception:  # no Ray, or another one: leave its output alone
        return
    lock, handlers = getattr(dispatcher, "_lock", None), getattr(dispatcher, "handlers", None)
    if lock is None or not isinstance(handlers, list):
        return
    with lock:
        try:
            wrapped = [
                (name, handler if getattr(handler, _FILTERED_MARK, False) else _dropping_typed_errors(handler))
                for name, handler in dispatcher.handlers
            ]
        except (TypeError, ValueError):  # entries of another shape: leave them as they are
            return
        dispatcher.handlers = wrapped


def _dropping_typed_errors(handler: Callable[[Any], None]) -> Callable[[Any], None]:
    def handle(data: Any) -> None:
        lines = data.get("lines") if isinstance(data, dict) and not backend_logs() else None
        if isinstance(lines, list) and any(isinstance(x, str) and typed_error_line(x) for x in lines):
            kept = [x for x in lines if not (isinstance(x, str) and typed_error_line(x))]
            if not kept:
                return
            data = {**data, "lines": kept}
        handler(data)

    setattr(handle, _FILTERED_MARK, True)
    return handle
