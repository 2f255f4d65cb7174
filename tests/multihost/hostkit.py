"""Helpers of the multi-host tests: the docs' recipes, an environment for processes in a host, and a
data-plane client process driven one command at a time (``host_client.py``)."""

from __future__ import annotations

import contextlib
import json
import re
import select
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from dataplane.testing.netns import Host, Hosts

ROOT = Path(__file__).resolve().parents[2]


def recipe(doc: str, name: str) -> str:
    """The fenced block after ``<!-- recipe: NAME ... -->`` in ``doc`` (a path under the repo root):
    the docs' cluster recipes are the commands these tests run."""
    text = (ROOT / doc).read_text()
    m = re.search(r"<!-- recipe: " + re.escape(name) + r"\b[^>]*-->\s*```[a-z]*\n(.*?)```", text, re.S)
    if m is None:
        raise AssertionError(f"{doc} has no recipe {name!r}")
    return m.group(1).strip()


def url_of(doc: str, name: str, **vars: str) -> str:
    """The URL of a client recipe (``dataplane.connect(f"...")``) with ``vars`` filled in."""
    code = recipe(doc, name)
    m = re.search(r'f"([a-z]+://[^"]*)"', code)
    assert m is not None, code
    return m.group(1).format(**vars)


def env(**vars: str) -> dict[str, str]:
    """What a process in a host gets: this interpreter's tools first on PATH, the checkout importable."""
    path = f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return {"PATH": path, "PYTHONPATH": str(ROOT), "NO_PROXY": "*", **vars}


def start_recipe(hosts: Hosts, host: Host, doc: str, name: str, log: Path, **vars: str) -> subprocess.Popen[Any]:
    """Run a shell recipe of ``doc`` in ``host`` with ``vars`` in its environment, output to ``log``."""
    with log.open("ab") as out:
        return hosts.popen(
            host, ["bash", "-c", recipe(doc, name)], env=env(**vars), stdout=out, stderr=subprocess.STDOUT
        )


class HostClient:
    """A ``host_client.py`` process in one host, connected to ``url``: one command at a time. With
    ``defer=True`` it starts (imports) now and connects at :meth:`connect`."""

    def __init__(self, hosts: Hosts, host: Host, url: str, *, defer: bool = False, **vars: str) -> None:
        argv = [sys.executable, str(ROOT / "tests/multihost/host_client.py"), *(["--defer"] if defer else []), url]
        # stderr to a file: Mooncake logs every retry while a peer is dead, and a pipe nobody reads
        # fills up and blocks the process in its next write
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the finalizer below)
        weakref.finalize(self, self._log.close)
        self.proc = hosts.popen(
            host,
            argv,
            env=env(**vars),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def connect(self, timeout_s: float = 120.0) -> None:
        """Connect a deferred client; raises unless it answers ready within ``timeout_s``."""
        assert self.ask("connect", timeout_s=timeout_s)["ready"]

    def ask(self, *command: str, timeout_s: float = 90.0) -> dict[str, Any]:
        """Send ``command`` (none: wait for the ready line) and return the JSON answer."""
        if command:
            assert self.proc.stdin is not None
            self.proc.stdin.write(" ".join(command) + "\n")
            self.proc.stdin.flush()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line.startswith("{"):  # skip what else the process printed (Ray's start-up lines)
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            line = self.proc.stdout.readline() if ready else ""
            if not ready or not line:
                break
        if not line.startswith("{"):
            err = ""
            if line == "":  # end of output: the process is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
            if self.proc.poll() is not None:
                rest = self.proc.stdout.read() if self.proc.stdout is not None else ""
                self._log.seek(0)
                err = (rest + self._log.read().decode(errors="replace"))[-3000:]
            raise AssertionError(f"no answer to {command} in {timeout_s:g} s (rc={self.proc.poll()}): {err}")
        return json.loads(line)  # type: ignore[no-any-return]
