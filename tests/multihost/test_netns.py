"""The hosts themselves (``dataplane.testing.netns``): three namespaces reach each other over the switch
and nothing else (no route leaves them), and closing leaves nothing behind."""

from __future__ import annotations

import ipaddress
import sys

import pytest

from dataplane.testing.netns import Hosts, unavailable, wait_for_port

pytestmark = [pytest.mark.multihost, pytest.mark.multiprocess]

SERVE = "import socket,sys; s=socket.create_server((sys.argv[1], 18080)); c,_=s.accept(); c.sendall(b'hi'); c.close()"
ASK = "import socket,sys; print(socket.create_connection((sys.argv[1], 18080), timeout=10).recv(2).decode())"


def test_three_hosts_reach_each_other_and_no_other_address() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests make network namespaces: {reason}")
    hosts = Hosts(3)
    try:
        a, b, c = hosts
        assert len({a.address, b.address, c.address}) == 3
        assert all(ipaddress.ip_address(h.address) in hosts.network for h in hosts)
        for h in hosts:
            # the only route is the hosts' own /24: a packet to any other address has nowhere to go
            routes = hosts.run(h, ["ip", "-4", "route", "show"], timeout_s=10).stdout.strip().splitlines()
            assert [r.split()[0] for r in routes] == [str(hosts.network)], routes
            outside = hosts.run(h, ["ip", "route", "get", "192.0.2.1"], timeout_s=10)  # TEST-NET-1: asks, sends nothing
            assert outside.returncode != 0 and "unreachable" in outside.stderr, outside
        server = hosts.popen(a, [sys.executable, "-c", SERVE, a.address])
        wait_for_port(hosts, a, 18080)
        (listener,) = [x for x in hosts.listening(a) if x.port == 18080]
        assert listener.address == a.address and "create_server" in listener.command  # and whose it is
        got = hosts.run(c, [sys.executable, "-c", ASK, a.address], timeout_s=30)
        assert got.returncode == 0 and got.stdout.strip() == "hi", got.stderr
        assert server.wait(timeout=10) == 0
    finally:
        hosts.close()
    assert hosts.leftovers() == []
