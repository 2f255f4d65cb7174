"""A dedicated Mooncake store-server process: mounts a segment into the pool and holds it.

Started by ``dataplane.adapters.mooncake._servers.start_store_server``; stdlib + mooncake only (it may be run by path
with ``python -P``, so it must not import ``dataplane``). Protocol with the parent:

* exactly one line on the ORIGINAL stdout: ``DATAPLANE_MOONCAKE_SERVER_READY {json}`` or
  ``DATAPLANE_MOONCAKE_SERVER_ERROR <text>``; everything else written to fd 1 (Python or native
  code) is redirected to stderr (the parent's log file), so the parent never has to drain stdout;
* stops on SIGTERM/SIGINT/SIGHUP, on EOF of stdin when stdin is a pipe (the parent died or closed
  it), or when its parent PID changes; then ``close()``s the store (unmounting the segment, which
  drops the objects in it) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import stat
import sys
import time

READY_PREFIX = "DATAPLANE_MOONCAKE_SERVER_READY "
ERROR_PREFIX = "DATAPLANE_MOONCAKE_SERVER_ERROR "

_ENV_DEFAULTS = {  # keep in sync with dataplane._host.mooncake_master._ENV_DEFAULTS (this file must not import it)
    "MC_LOG_LEVEL": "WARNING",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_STORE_CLIENT_SETUP_RETRIES": "2",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dataplane-mooncake-server")
    p.add_argument("--master", required=True, help="master host:rpc_port")
    p.add_argument("--host", default="127.0.0.1", help="local_hostname advertised to peers")
    p.add_argument("--segment-bytes", type=int, required=True)
    p.add_argument("--local-buffer-bytes", type=int, default=16 << 20)
    p.add_argument("--protocol", default="tcp", help="tcp or rdma")
    p.add_argument("--rdma-devices", default="", help="comma list of RDMA devices, e.g. mlx5_0,mlx5_1")
    p.add_argument("--metadata-server", default="P2PHANDSHAKE")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when getppid() stops matching")
    p.add_argument("--no-stdin-watchdog", action="store_true")
    return p.parse_args(argv)


def _emit(fd: int, line: str) -> None:
    data = (line.rstrip("\n") + "\n").encode()
    while data:
        n = os.write(fd, data)
        data = data[n:]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)

    # Private channel for the one protocol line; fd 1 from now on goes where stderr goes.
    sys.stdout.flush()
    ready_fd = os.dup(1)
    os.dup2(2, 1)

    stop_reason: list[str] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)

    def _on_signal(signum: int, _frame: object) -> None:
        stop_reason.append(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    watch_stdin = False
    if not args.no_stdin_watchdog:
        try:
            mode = os.fstat(0).st_mode
            watch_stdin = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
        except OSError:
            watch_stdin = False

    try:
        from mooncake.store import MooncakeDistributedStore
    except Exception as e:
        _emit(ready_fd, ERROR_PREFIX + f"import mooncake.store failed: {e!r}")
        return 3

    store = MooncakeDistributedStore()
    t0 = time.monotonic()
    rc = store.setup(
        args.host,
        args.metadata_server,
        args.segment_bytes,
        args.local_buffer_bytes,
        args.protocol,
        args.rdma_devices,
        args.master,
    )
    if rc != 0:
        _emit(
            ready_fd,
            ERROR_PREFIX + f"setup() returned {rc} (master {args.master}, "
            f"segment {args.segment_bytes} B, {time.monotonic() - t0:.1f}s)",
        )
        return 2
    try:
        name = store.get_hostname()
    except Exception:
        name = ""
    _emit(
        ready_fd,
        READY_PREFIX
        + json.dumps(
            {
                "pid": os.getpid(),
                "segment_name": name,
                "segment_bytes": args.segment_bytes,
                "master": args.master,
                "setup_s": round(time.monotonic() - t0, 3),
            }
        ),
    )
    os.close(ready_fd)

    fds = [wake_r] + ([0] if watch_stdin else [])
    while not stop_reason:
        try:
            r, _, _ = select.select(fds, [], [], 1.0)
        except InterruptedError:
            r = []
        if wake_r in r:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
        if watch_stdin and 0 in r:
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                stop_reason.append("stdin EOF")
        if args.parent_pid and os.getppid() != args.parent_pid:
            stop_reason.append("parent changed")

    print(f"mooncake store server {os.getpid()} stopping: {stop_reason[0]}", file=sys.stderr, flush=True)
    t_close = time.monotonic()
    store.close()
    print(
        f"mooncake store server {os.getpid()} closed in {time.monotonic() - t_close:.2f}s", file=sys.stderr, flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
