"""``mooncake://`` across two hosts (network namespaces), deployed with the docs' cluster recipe.

Host A runs the master and a store server, host B a store server; writers and readers run on both.
Rows written on one host read bit-exact on the other; every process listens on its own host's
address (Mooncake's transfer engine also on the wildcard, its documented exception); after host B's
store server dies, readers on A get the documented typed error in bounded time, never a wrong row.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostkit import ROOT, HostClient, env, recipe, start_recipe, url_of

from dataplane.testing.netns import Host, Hosts, wait_for_port

pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'dataplane[mooncake]'")

pytestmark = [pytest.mark.multihost, pytest.mark.mooncake, pytest.mark.multiprocess]

DOC = "docs/backends/mooncake.md"


def _url(head: Host, node: Host) -> str:
    return url_of(DOC, "mooncake-client", HEAD_IP=head.address, NODE_IP=node.address)


RPC_PORT, ADMIN_PORT = 50051, 9003
SEGMENT_BYTES = 128 << 20
ENGINE_PORTS = range(15000, 17001)  # Mooncake's transfer engine: handshake and data ports, on the wildcard
ROWS = 48
FAILED_READ_S = 45.0  # a Mooncake transfer gives up after 60 s at worst; ours retries briefly


def _admin(hosts: Hosts, head: Host, code: str) -> str:
    """Run ``code`` (with ``base``, the master's admin URL, and ``u``, urllib.request) on the head host."""
    prelude = f"import json, urllib.parse as p, urllib.request as u; base = 'http://{head.address}:{ADMIN_PORT}'\n"
    done = hosts.run(head, [sys.executable, "-c", prelude + code], timeout_s=30, env=env())
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _segments(hosts: Hosts, head: Host) -> str:
    return _admin(hosts, head, "print(u.urlopen(base + '/get_all_segments', timeout=5).read().decode())")


def _endpoints(hosts: Hosts, head: Host) -> dict[str, str]:
    """Where the master placed every object of the job's namespace: key -> transport endpoint."""
    code = """
out = {}
for k in u.urlopen(base + '/get_all_keys', timeout=5).read().decode().split():
    if k.startswith('dataplane/'):
        try:
            r = json.loads(u.urlopen(base + '/query_key?key=' + p.quote(k), timeout=5).read())
        except Exception:  # gone since the listing, or not readable yet
            continue
        out[k] = r['data'][0]['transport_endpoint_']
print(json.dumps(out))
"""
    return json.loads(_admin(hosts, head, code).strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(180)
def test_mooncake_across_two_hosts(hosts: Hosts, tmp_path: Path) -> None:
    a, b = hosts
    t0 = time.monotonic()
    start_recipe(hosts, a, DOC, "mooncake-master", tmp_path / "master.log", HEAD_IP=a.address)
    wait_for_port(hosts, a, RPC_PORT)
    wait_for_port(hosts, a, ADMIN_PORT)
    servers = [
        start_recipe(
            hosts,
            h,
            DOC,
            "mooncake-store-server",
            tmp_path / f"store_{h.index}.log",
            HEAD_IP=a.address,
            NODE_IP=h.address,
            SEGMENT_BYTES=str(SEGMENT_BYTES),
        )
        for h in (a, b)
    ]
    server_b = servers[1]
    deadline = time.monotonic() + 60
    while not (a.address in (s := _segments(hosts, a)) and b.address in s):
        assert time.monotonic() < deadline, f"store servers never registered: {s!r}"
        time.sleep(0.5)
    # each store server announced its own host's address (the segment names), never loopback
    assert "127.0.0.1" not in s and "localhost" not in s, s
    t_up = time.monotonic() - t0

    # a client on each host; rows written on one host read bit-exact on the other
    clients = [HostClient(hosts, h, _url(a, h)) for h in (a, b)]
    ready = [c.ask() for c in clients]
    token = ready[0]["token"]
    assert all(r["ready"] for r in ready) and token and ready[1]["token"] == token, ready  # one deployment
    for c, h in zip(clients, (a, b), strict=True):
        r = c.ask("write", "p", f"from{h.index}", str(ROWS))
        assert r["ok"] and r["error"] is None, r
    tags = ["from0", "from1"]
    # Mooncake places each object on either host's segment: write until host B holds some (the crash
    # below must lose something)
    while not any(e.startswith(b.address + ":") for e in _endpoints(hosts, a).values()):
        assert len(tags) < 12, "Mooncake never placed an object on host B's segment"
        tags.append(f"more{len(tags)}")
        assert clients[0].ask("write", "p", tags[-1], "4")["ok"]
    placed = _endpoints(hosts, a)
    assert {e.split(":")[0] for e in placed.values()} <= {a.address, b.address}, placed
    for c, other in zip(clients, (b, a), strict=True):
        r = c.ask("read", "p", f"from{other.index}", str(ROWS))
        assert r["ok"] and not r["mismatched"] and r["error"] is None, r
    t_rw = time.monotonic() - t0 - t_up

    # one replica group over both hosts (gloo over their link): the leader on A reads and broadcasts,
    # the sibling on B gets the same bytes, the leader alone writes back, and B reads what it wrote
    ranks = [
        hosts.popen(
            h,
            [sys.executable, str(ROOT / "tests/multihost/host_rank.py"), str(h.index), a.address, "29511", _url(a, h)],
            env=env(GLOO_SOCKET_IFNAME="eth0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for h in (a, b)
    ]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"rank gave no result (rc={proc.returncode}): {err[-3000:]}"
        results.append(json.loads(lines[-1]))
    leader, sibling = results
    assert leader["error"] is None and sibling["error"] is None, results
    assert leader["exact"] and sibling["exact"], results
    assert leader["fetch"][:2] == ["leader_broadcast", "leader"] and leader["fetch"][2] > 0, results
    assert sibling["fetch"][:2] == ["leader_broadcast", "sibling"] and sibling["fetch"][2] == 0, results
    assert sibling["fetch"][3] > 0, "the sibling's rows came over the hosts' link"
    assert leader["wrote"] and not sibling["wrote"] and sibling["written_back_exact"], results

    # every listener of the deployment is on its own host's address, or Mooncake's engine wildcard
    for h in (a, b):
        for listener in hosts.listening(h):
            own = listener.address == h.address
            engine = listener.wildcard and listener.port in ENGINE_PORTS
            assert own or engine, (h, listener, hosts.listening(h))
            assert not listener.address.startswith("127."), (h, listener)
    assert {(a.address, RPC_PORT), (a.address, ADMIN_PORT)} <= {(x.address, x.port) for x in hosts.listening(a)}

    # host B's store server crashes: a new reader on A gets the documented typed error in bounded time
    # (BackendUnavailable while the master still lists B's segment, KeyNotFound once it expired it);
    # no reader ever gets a wrong row (a client that read them before may still serve them from
    # Mooncake's local hot cache: the right bytes)
    hosts.stop(server_b, sig=signal.SIGKILL)  # a crash: nothing unmounts its segment
    # a client that connects after the crash joins at once, with the deployment's token (it has a
    # copy on every segment: B's death loses one)
    t_join = time.monotonic()
    fresh = HostClient(hosts, a, _url(a, a))
    joined = fresh.ask()
    assert joined["ready"] and joined["token"] == token, (joined, token)
    assert time.monotonic() - t_join < 20, "joining waited on the dead store server"
    failed = []
    for tag in tags:
        n = str(ROWS) if tag.startswith("from") else "4"
        for c in (clients[0], fresh):
            r = c.ask("read", "p", tag, n, timeout_s=FAILED_READ_S + 30)
            assert not r["mismatched"], json.dumps(r)
            assert r["error"] is None or r["error"][0] in ("BackendUnavailable", "KeyNotFound"), json.dumps(r)
            assert r["seconds"] < FAILED_READ_S, r
            if c is fresh and r["error"] is not None:
                failed.append((tag, r["error"][0], round(r["seconds"], 2)))
    assert failed, f"objects lived on host B ({placed}), yet every read after its crash succeeded"
    print(
        f"up {t_up:.1f} s, writes+reads {t_rw:.1f} s, ranks {leader['seconds']:.1f} s, total {time.monotonic() - t0:.1f} s; after the crash {failed}"
    )


def test_recipes_are_the_commands_the_docs_show() -> None:
    """The docs' recipe blocks exist and bind the host's own address, never the wildcard."""
    master = recipe(DOC, "mooncake-master")
    assert "--rpc_address=$HEAD_IP" in master and "--metrics_host=$HEAD_IP" in master and "0.0.0.0" not in master
    assert "--host $NODE_IP" in recipe(DOC, "mooncake-store-server")
    assert "{HEAD_IP}" in recipe(DOC, "mooncake-client")
