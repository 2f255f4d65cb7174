"""A healthy connect/put/get/close is quiet, and what it starts listens on loopback only; a typed
error (``KeyNotFound``, ``CapacityExceeded``) is raised, not also printed.

One subprocess per backend serves both checks: it connects (starting the deployment), puts and gets
a batch, says READY and waits; this test then reads the listening TCP sockets of that process and of
every process under it (Mooncake's master and store server, Ray's GCS, raylet, agents, workers and
TransferQueue's actors), lets it close, and reads its stderr.

* stderr holds no WARNING, ERROR or CRITICAL line, no glog W/E/F line and no traceback
  (``DATAPLANE_BACKEND_LOGS`` unset).
* every listening socket is bound to loopback, except the two that each Mooncake transfer engine
  binds to the wildcard address (its handshake port and its TCP data port: Mooncake 0.3.13 binds
  them to ``INADDR_ANY`` / ``::`` in code, whatever it is told; docs/backends/mooncake.md, Security).

``tq://?backend=simple`` is not run here (a Ray start costs CI half a minute): its healthy run's
stderr is checked by the README recipe's test (tests/multiprocess/test_join.py), and the Ray, the
TransferQueue controller and the ZMQ sockets it would start come from the same code as
``tq://?backend=mooncake``'s, checked here (its storage units bind Ray's node address as the
controller does).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dataplane.observability import BACKEND_LOGS_ENV, filtered_stderr
from dataplane.testing import noisy_lines
from dataplane.testing.netns import parse_tcp_listeners

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys
import torch
import dataplane

client = dataplane.connect(sys.argv[1])
keys = [f"k{i}" for i in range(4)]
batch = torch.arange(8.0).reshape(4, 2)
meta = client.kv_batch_put(keys, {"x": batch}, partition_id="p")
got = client.kv_batch_get(meta, select_fields=["x"])
assert torch.equal(got["x"], batch), got
print("READY", flush=True)
sys.stdin.readline()
client.close()
print("DONE", flush=True)
"""

BACKENDS = [
    pytest.param("memory://", id="memory", marks=[pytest.mark.multiprocess]),
    pytest.param("mooncake://local", id="mooncake-local", marks=[pytest.mark.mooncake, pytest.mark.multiprocess]),
    # soak only: its Ray, TransferQueue and Mooncake cost CI ~33 s, the room the multi-host test took
    pytest.param(
        "tq://?backend=mooncake",
        id="tq-mooncake",
        marks=[pytest.mark.tq, pytest.mark.mooncake, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.soak],
    ),
]


# A typed error the caller handles is raised, not also logged: each once, then a healthy close.
ERRORS_CHILD = r"""
import sys
import torch
import dataplane
from dataplane.errors import CapacityExceeded, KeyNotFound

url, capacity = sys.argv[1], int(sys.argv[2])
client = dataplane.connect(url)
client.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 2)}, partition_id="p")
for keys, fields, partition in ((["a", "nope"], ["x"], "p"), (["a"], ["y"], "p"), (["a"], ["x"], "none")):
    try:
        client.kv_batch_get(keys, partition_id=partition, select_fields=fields)
    except KeyNotFound:
        pass
    else:
        raise AssertionError(f"a get of {keys} {fields} from {partition!r} did not raise KeyNotFound")
client.kv_clear(["nope"], partition_id="p")  # clearing a key that is not there: nothing to do, nothing said
if capacity:
    try:
        client.kv_batch_put([f"c{i}" for i in range(capacity)], {"x": torch.zeros(capacity, 2)}, partition_id="p")
    except CapacityExceeded:
        pass
    else:
        raise AssertionError("a put past capacity_rows did not raise CapacityExceeded")
    client.kv_batch_put(["c"], {"x": torch.ones(1, 2)}, partition_id="p")  # the store still works
client.close()
print("DONE", flush=True)
"""

TYPED_ERRORS = [
    pytest.param("mooncake://local", 0, id="mooncake-local", marks=[pytest.mark.mooncake, pytest.mark.multiprocess]),
    # soak only, as above: each starts a Ray, TransferQueue (and a Mooncake master)
    pytest.param(
        "tq://?backend=simple&capacity_rows=64",
        64,
        id="tq-simple",
        marks=[pytest.mark.tq, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.soak],
    ),
    pytest.param(
        "tq://?backend=mooncake",
        0,
        id="tq-mooncake",
        marks=[pytest.mark.tq, pytest.mark.mooncake, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.soak],
    ),
]


# ------------------------------------------------------------------------------------------ /proc


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket (IPv4 and IPv6) on the host."""
    found: dict[int, tuple[str, int]] = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            table = Path(path).read_text()
        except OSError:
            continue
        for listener, inode in parse_tcp_listeners(table, v6=v6):
            found[inode] = (listener.address, listener.port)
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def listening_sockets(root_pid: int) -> list[tuple[int, str, str, int]]:
    """(pid, cmdline, address, port) of every listening TCP socket held by ``root_pid`` or a descendant."""
    listening = _listening_inodes()
    out = []
    for pid in [root_pid, *_descendants(root_pid)]:
        for inode in _socket_inodes(pid):
            if inode in listening:
                out.append((pid, _cmdline(pid), *listening[inode]))
    return out


def is_loopback(address: str) -> bool:
    if address.startswith("::ffff:"):
        address = address[len("::ffff:") :]
    return address == "::1" or address.startswith("127.")


def _mooncake_engine(pid: int, cmd: str, root_pid: int, url: str) -> bool:
    """A process that runs a Mooncake transfer engine in this deployment."""
    if "mooncake_client" in cmd or "adapters.mooncake.store_server" in cmd or "store_server.py" in cmd:
        return True
    return pid == root_pid and url == "tq://?backend=mooncake"  # the owner lends its own segment


# ------------------------------------------------------------------------------------------ tests


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (BACKEND_LOGS_ENV, "RAY_ADDRESS", "DATAPLANE_URL")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.parametrize("url", BACKENDS)
def test_healthy_run_is_quiet_and_listens_on_loopback_only(url: str) -> None:
    pytest.importorskip("torch")
    if "mooncake" in url:
        pytest.importorskip("mooncake.store")
    if url.startswith("tq"):
        pytest.importorskip("transfer_queue")
    started = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=_child_env(),
            cwd=ROOT,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None and proc.stdin is not None

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.strip())
            lines.put("<EOF>")

        threading.Thread(target=pump, daemon=True).start()
        sockets: list[tuple[int, str, str, int]] = []
        try:
            line = lines.get(timeout=240)
            assert line == "READY", f"child said {line!r}"
            sockets = listening_sockets(proc.pid)
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert lines.get(timeout=120) == "DONE"
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()
            err.seek(0)
            stderr = err.read().decode(errors="replace")
    assert proc.returncode == 0, stderr
    noisy = noisy_lines(stderr)
    assert not noisy, f"{url}: a healthy run printed on stderr:\n" + "\n".join(noisy)

    wide = [s for s in sockets if not is_loopback(s[2])]
    unexplained = [s for s in wide if not _mooncake_engine(s[0], s[1], proc.pid, url)]
    assert not unexplained, f"{url}: listening beyond loopback: {unexplained}"
    per_engine: dict[int, int] = {}
    for pid, *_ in wide:
        per_engine[pid] = per_engine.get(pid, 0) + 1
    assert all(n <= 2 for n in per_engine.values()), f"{url}: more than Mooncake's 2 wildcard ports: {wide}"
    if url.startswith("tq"):  # Ray's processes were inspected: GCS, raylet and more all on loopback
        assert sum("gcs_server" in s[1] for s in sockets) >= 1, sockets
    print(f"{url}: {len(sockets)} listening sockets, {time.monotonic() - started:.1f}s")


@pytest.mark.parametrize(("url", "capacity"), TYPED_ERRORS)
def test_typed_errors_are_raised_not_logged(url: str, capacity: int) -> None:
    """``KeyNotFound`` (a missing key, field and partition; a clear of a missing key) and, where the
    backend is bounded, ``CapacityExceeded`` are raised and nothing is printed for them: the
    backends' own log lines for these failures are filtered (``dataplane._host.quiet``)."""
    if "mooncake" in url:
        pytest.importorskip("mooncake.store")
    if url.startswith("tq"):
        pytest.importorskip("transfer_queue")
    done = subprocess.run(
        [sys.executable, "-c", ERRORS_CHILD, url, str(capacity)],
        capture_output=True,
        text=True,
        env=_child_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-4000:]
    noisy = noisy_lines(done.stderr)
    assert not noisy, f"{url}: a typed error also printed on stderr:\n" + "\n".join(noisy)


def test_filtered_stderr_drops_only_known_harmless_lines(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    harmless = "E1127 20:39:38.824761  6986 dummy_client.cpp:1563] Failed to receive hot cache fd, status=-1\n"
    real = "E1127 20:39:38.900000  6986 client.cpp:10] Failed to connect to master\n"
    monkeypatch.delenv(BACKEND_LOGS_ENV, raising=False)
    with filtered_stderr():
        os.write(2, (harmless + real).encode())
    assert capfd.readouterr().err == real

    monkeypatch.setenv(BACKEND_LOGS_ENV, "1")  # the switch: everything the backends print
    with filtered_stderr():
        os.write(2, (harmless + real).encode())
    assert capfd.readouterr().err == harmless + real


def test_typed_error_records_are_filtered_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The records TransferQueue logs for a full store and for absent keys are dropped, in this
    process and from what Ray forwards from its actors; its other records pass, and
    ``DATAPLANE_BACKEND_LOGS=1`` passes everything."""
    import logging

    from dataplane._host.quiet import _dropping_typed_errors, quiet_typed_errors, typed_error_line

    monkeypatch.delenv(BACKEND_LOGS_ENV, raising=False)
    quiet_typed_errors()
    quiet_typed_errors()  # idempotent: one filter per logger
    manager = logging.getLogger("transfer_queue.storage.managers.simple_storage_manager")
    assert len(manager.filters) == 1
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    manager.addHandler(handler)
    try:
        full = (
            "RuntimeError: Failed to put data to storage unit SU0: Storage capacity exceeded: 64 existing + 1 new > 64"
        )
        manager.error(f"[SM_1]: Unexpected error during put to storage unit SU0: {full}")
        manager.error(f"[SM_1]: put_data failed. partition_id=p, num_samples=65, num_storage_units=1, error={full}")
        manager.error("[SM_1]: put_data failed. partition_id=p, error=RuntimeError: disk on fire")
        monkeypatch.setenv(BACKEND_LOGS_ENV, "1")
        manager.error(f"[SM_1]: put_data failed. error={full}")
    finally:
        manager.removeHandler(handler)
    assert seen == [
        "[SM_1]: put_data failed. partition_id=p, error=RuntimeError: disk on fire",
        f"[SM_1]: put_data failed. error={full}",
    ]

    monkeypatch.delenv(BACKEND_LOGS_ENV)
    absent = (
        "2026-12-06 05:00:00,000 - WARNING - transfer_queue.controller - Keys ['nope'] were not found in partition p. "
        "They will be excluded from the retrieved BatchMeta."
    )
    unit = (
        "2026-12-06 05:00:00,000 - ERROR - transfer_queue.storage.simple_storage - [SU0]: worker error during "
        "ZMQRequestType.PUT_DATA from sender=SM_1: ValueError: Storage capacity exceeded: 64 existing + 1 new > 64"
    )
    other = "2026-12-06 05:00:00,000 - WARNING - transfer_queue.controller - Partition p not found."
    assert typed_error_line(absent) and typed_error_line(unit) and not typed_error_line(other)
    printed: list[Any] = []
    forward = _dropping_typed_errors(printed.append)
    forward({"lines": [absent, other, unit], "pid": 7, "is_err": True})
    forward({"lines": [absent], "pid": 7, "is_err": True})  # nothing left: nothing printed
    assert printed == [{"lines": [other], "pid": 7, "is_err": True}]
