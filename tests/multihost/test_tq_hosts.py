"""``tq://`` across two hosts (network namespaces), deployed with the docs' cluster recipe.

Host A runs the Ray head and the owner, host B a Ray worker node and a client that attaches; the
owner's TransferQueue has two storage units, which TransferQueue places one per node. Rows written on one host read bit-exact on the
other; when host B is lost, the owner's reads raise a typed error within their ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from hostkit import HostClient, recipe, start_recipe, url_of

from dataplane.testing.netns import Hosts, Listener, wait_for_port

pytest.importorskip("ray", reason="needs Ray: pip install 'dataplane[tq]'")
pytest.importorskip("transfer_queue", reason="needs TransferQueue: pip install 'dataplane[tq]'")

pytestmark = [pytest.mark.multihost, pytest.mark.tq]

DOC = "docs/backends/transfer_queue.md"
ROWS = 16
TIMEOUT_S = 4  # the owner's timeout_s: how long a read waits for a lost storage unit


@pytest.mark.timeout(240)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_tq_across_two_hosts(hosts: Hosts, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    a, b = hosts
    t0 = time.monotonic()
    # Ray's token authentication across nodes: every process of the deployment gets the same token;
    # Ray's files go to a directory of this test's own, not the machine's /tmp/ray
    ray_tmp = tempfile.mkdtemp(prefix="dpray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(ray_tmp, ignore_errors=True))
    ray_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_TMPDIR": ray_tmp}
    head_log, worker_log = tmp_path / "head.log", tmp_path / "worker.log"
    start_recipe(hosts, a, DOC, "tq-ray-head", head_log, HEAD_IP=a.address, NUM_CPUS="2", **ray_env)
    # the two clients start (import) while Ray comes up, and connect once it is
    owner_url = url_of(DOC, "tq-owner", HEAD_IP=a.address) + f"&units=2&timeout_s={TIMEOUT_S}"
    owner = HostClient(hosts, a, owner_url, defer=True, **ray_env)
    other = HostClient(hosts, b, url_of(DOC, "tq-client", HEAD_IP=a.address), defer=True, **ray_env)
    wait_for_port(hosts, a, 6379, timeout_s=60)
    start_recipe(
        hosts, b, DOC, "tq-ray-worker", worker_log, HEAD_IP=a.address, NODE_IP=b.address, NUM_CPUS="2", **ray_env
    )
    deadline = time.monotonic() + 90
    while "Ray runtime started" not in worker_log.read_text():
        assert time.monotonic() < deadline, worker_log.read_text()[-3000:]
        time.sleep(0.3)
    # two storage units: TransferQueue places them round-robin over the nodes, so each host holds rows
    owner.connect()
    other.connect()
    t_up = time.monotonic() - t0

    for c, h in ((owner, a), (other, b)):
        r = c.ask("write", "p", f"from{h.index}", str(ROWS))
        assert r["ok"] and r["error"] is None, r
    for c, src in ((owner, b), (other, a)):
        r = c.ask("read", "p", f"from{src.index}", str(ROWS))
        assert r["ok"] and not r["mismatched"] and r["error"] is None, r

    # nothing listens on an address of another host; what binds the wildcard is Ray's own: its daemons
    # and the gRPC server Ray's core worker runs in every process of the cluster (clients' too), in
    # Ray's worker port range. TransferQueue's sockets are on the host's address. (Ray 2.60's cluster
    # mode has no bind-address option: see the docs' Security section.)
    for h in (a, b):
        for listener in hosts.listening(h):
            assert listener.wildcard or listener.address in (h.address, "127.0.0.1"), (h, listener)
            if listener.wildcard:
                assert ray_owned(listener), (h, listener, listener.command)

    # host B is lost (every process on it killed, its storage unit with them): the owner's reads of
    # rows it held raise a typed error in bounded time
    for pid in hosts.pids(b):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    r = owner.ask("read", "p", "from0", str(ROWS), timeout_s=TIMEOUT_S + 60)  # written on A, half of them on B
    assert not r["mismatched"], r
    assert r["error"] is not None and r["error"][0] in ("DataPlaneTimeout", "BackendUnavailable"), r
    assert r["seconds"] < TIMEOUT_S + 15, r
    print(f"up {t_up:.1f} s, total {time.monotonic() - t0:.1f} s")
    for pid in hosts.pids(a):  # the rest of the deployment: no graceful stop to wait for
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


RAY_WORKER_PORTS = range(10002, 20000)  # `ray start`'s default --min-worker-port/--max-worker-port
RAY_DAEMONS = ("/ray/core/src/ray/", "ray::", "/site-packages/ray/")  # gcs_server, raylet, agents, monitors


def ray_owned(listener: Listener) -> bool:
    """Whether a listener is one that Ray opens: a daemon's, or a core worker's gRPC server."""
    return listener.port in RAY_WORKER_PORTS or any(d in listener.command for d in RAY_DAEMONS)


def test_tq_recipes_bind_the_nodes_addresses() -> None:
    assert "--node-ip-address=$HEAD_IP" in recipe(DOC, "tq-ray-head")
    assert "--node-ip-address=$NODE_IP" in recipe(DOC, "tq-ray-worker")
    assert "{HEAD_IP}" in recipe(DOC, "tq-owner") and "{HEAD_IP}" in recipe(DOC, "tq-client")
