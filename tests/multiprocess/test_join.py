"""Joining a deployment from other processes, and metas that know their deployment.

* The README's "Many processes" script runs as written on ``mooncake://local`` and on
  ``tq://?backend=simple``: an owner puts rows, a plain subprocess given only ``client.url`` and a
  Ray actor that joins with ``dataplane.connect()`` (``$DATAPLANE_URL``) read them back bit-exact.
* ``client.url`` and ``$DATAPLANE_URL`` on ``memory://`` and ``mooncake://``; a get by a meta that
  another deployment wrote raises ``DeploymentMismatch`` naming both, before any I/O.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dataplane
from dataplane.registry import URL_ENV
from dataplane.store_client import StoreClient
from dataplane.testing import noisy_lines

ROOT = Path(__file__).resolve().parents[2]
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
HAVE_TQ = all(importlib.util.find_spec(m) is not None for m in ("transfer_queue", "ray"))


def readme_blocks() -> list[str]:
    """The python blocks of the README's "Many processes" section."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Many processes\n(.*?)^## ", text, re.S | re.M)
    assert section is not None, "README lost its Many processes section"
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert blocks, "the Many processes section has no python snippet"
    return blocks


@pytest.fixture
def no_url_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(URL_ENV, raising=False)
    yield


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "url",
    [
        # soak (both): the script's processes cost CI ~40 s on mooncake:// and ~50 s on tq:// (a Ray and a
        # TransferQueue of its own); test_mooncake_url_env_and_deployment_mismatch and the tq:// multi-process
        # tests cover joining by URL in CI
        pytest.param("mooncake://local", marks=[pytest.mark.mooncake, pytest.mark.soak]),
        pytest.param("tq://?backend=simple", marks=[pytest.mark.tq, pytest.mark.soak]),
    ],
)
def test_readme_many_processes_script_reads_the_owners_rows_everywhere(url: str) -> None:
    """The owner, a subprocess given ``client.url`` and a Ray actor print the same bf16 rows."""
    (script,) = readme_blocks()
    assert 'URL = "mooncake://local"' in script
    script = script.replace('URL = "mooncake://local"', f"URL = {url!r}", 1)
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    # A healthy run of the recipe is quiet (owner, reader, actor). On mooncake:// the script starts
    # Ray itself (its own ray.init, not dataplane's), which notes that token authentication is on.
    noisy = [line for line in noisy_lines(out.stderr) if not (url.startswith("mooncake") and "token-auth" in line)]
    assert not noisy, f"{url}: the recipe printed on stderr:\n" + "\n".join(noisy)
    rows = [ast.literal_eval(line) for line in out.stdout.splitlines() if line.startswith("[[")]
    assert len(rows) == 3, out.stdout
    assert len(rows[0]) == 2 and len(rows[0][0]) == 3
    assert rows[0] == rows[1] == rows[2]  # bf16 -> float is exact, and so is a float's repr
    print(f"{url}: {time.monotonic() - t0:.1f} s")


def test_memory_url_and_deployment_mismatch(no_url_env: None) -> None:
    a, b, private = dataplane.connect("memory://rollouts"), dataplane.connect("memory://rollouts"), dataplane.connect()
    with a, b, private:
        assert (a.url, private.url) == ("memory://rollouts", "")
        meta = a.kv_batch_put(["k0", "k1"], {"r": torch.tensor([1.0, 2.0])}, partition_id="p")
        assert meta.deployment and meta.deployment_url == "memory://rollouts"
        assert b.kv_batch_get(meta, select_fields="r")["r"].tolist() == [1.0, 2.0]  # one store, one id
        private.kv_batch_put(["k0", "k1"], {"r": torch.zeros(2)}, partition_id="p")
        with pytest.raises(dataplane.DeploymentMismatch, match=r"written to memory://rollouts.*per process"):
            private.kv_batch_get(meta, select_fields="r")
        by_hand = dataplane.KVBatchMeta(partition_id="p", keys=meta.keys)  # never checked
        assert private.kv_batch_get(by_hand, select_fields="r")["r"].tolist() == [0.0, 0.0]
        assert isinstance(dataplane.DeploymentMismatch("x"), dataplane.InvalidArgument)
    again = dataplane.connect("memory://rollouts")  # a new store of that name: a new deployment
    with again, pytest.raises(dataplane.DeploymentMismatch):
        again.kv_batch_get(meta, select_fields="r")


def test_connect_with_no_url_joins_dataplane_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URL_ENV, "memory://from-env")
    with dataplane.connect("memory://from-env") as owner, dataplane.connect() as joined:
        meta = owner.kv_batch_put(["k"], {"r": torch.tensor([3.0])}, partition_id="p")
        assert joined.url == "memory://from-env"
        assert joined.kv_batch_get(meta, select_fields="r")["r"].tolist() == [3.0]
    monkeypatch.setenv(URL_ENV, "")
    with dataplane.connect() as private:
        assert private.url == "" and private.capabilities.backend == "memory"


@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.skipif(not HAVE_MOONCAKE, reason="needs Mooncake Store (pip install 'dataplane[mooncake]')")
def test_mooncake_url_env_and_deployment_mismatch(no_url_env: None) -> None:
    """Two ``mooncake://local`` deployments in one process: each knows its own rows."""
    first = dataplane.connect("mooncake://local?segment_bytes=64MiB")
    try:
        assert os.environ[URL_ENV] == first.url and first.url.startswith("mooncake://127.0.0.1:")
        second = dataplane.connect("mooncake://local?segment_bytes=64MiB&shm=false")
        try:
            assert os.environ[URL_ENV] == first.url  # an owner never replaces another's URL
            assert isinstance(first, StoreClient) and isinstance(second, StoreClient)
            ids = first.store.deployment_id, second.store.deployment_id
            assert all(ids) and ids[0] != ids[1]
            meta = first.kv_batch_put(["a", "b"], {"x": torch.arange(6).view(2, 3)}, partition_id="train")
            second.kv_batch_put(["a", "b"], {"x": torch.zeros(2, 3, dtype=torch.int64)}, partition_id="train")
            with pytest.raises(dataplane.DeploymentMismatch) as info:
                second.kv_batch_get(meta, select_fields="x")
            text = str(info.value)
            assert first.url in text and second.url in text and f"dataplane.connect({first.url!r})" in text
            # the same master spelt another way is the same deployment
            with dataplane.connect(first.url.replace("127.0.0.1", "localhost", 1)) as joined:
                assert joined.store.deployment_id == ids[0]  # type: ignore[attr-defined]
                assert torch.equal(joined.kv_batch_get(meta, select_fields="x")["x"], torch.arange(6).view(2, 3))
                joined.kv_clear(partition_id="train")
                assert joined.kv_list() == {}  # the deployment's token is no row of anyone's
            with dataplane.connect(first.url) as late:  # the token outlives clears
                assert late.store.deployment_id == ids[0]  # type: ignore[attr-defined]
            master = first.url.split("?")[0]  # no metrics_port: the default one is not this master's
            with pytest.raises(dataplane.BackendUnavailable, match=r"pass that process's client\.url"):
                dataplane.connect(master, timeout_s=2)
        finally:
            second.close()
        assert os.environ[URL_ENV] == first.url
    finally:
        first.close()
    assert URL_ENV not in os.environ  # removed with the deployment it named
