"""The worked third-party adapter of docs/extending.md (examples/third_party_adapter) passes the
shipped conformance suite, found the way an installed package is found: through its
``dataplane.adapters`` entry point.

Nothing is pip-installed: a ``*.dist-info`` directory with the example's METADATA and
entry_points.txt (made from its pyproject.toml) goes on ``sys.path``, where
``importlib.metadata`` discovers it as it discovers any installed distribution.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

import dataplane
from dataplane.client import DataPlaneClient
from dataplane.errors import SchemaError
from dataplane.testing import ClientConformance

try:
    import tomllib
except ImportError:  # Python 3.10
    pytest.skip("reading the example's pyproject.toml needs Python 3.11+ (tomllib)", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_adapter"
GROUP = "dataplane.adapters"


@pytest.fixture(scope="module", autouse=True)
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The example as if pip-installed: its package and a dist-info with its entry points on sys.path."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path_factory.mktemp("site")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = [f"[{GROUP}]"] + [f"{name} = {target}" for name, target in project["entry-points"][GROUP].items()]
    info.joinpath("entry_points.txt").write_text("\n".join(lines) + "\n")
    added = [str(site), str(EXAMPLE)]
    sys.path[:0] = added
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)
        importlib.invalidate_caches()


def test_the_entry_point_registers_the_scheme() -> None:
    (ep,) = [ep for ep in entry_points(group=GROUP) if ep.name == "sqlite"]
    assert ep.value == "dataplane_sqlite:connect"
    assert dataplane.available_adapters()["sqlite"] is True
    with dataplane.connect("sqlite://?timeout_s=5") as client:
        assert client.capabilities.backend == "sqlite" and not client.capabilities.cross_process


def test_a_file_is_shared_by_its_clients_schema_included(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'rows.db'}"
    with dataplane.connect(url) as writer, dataplane.connect(url) as reader:
        assert reader.capabilities.cross_process
        meta = writer.kv_batch_put(["a", "b"], {"x": torch.arange(4.0).view(2, 2)}, partition_id="p")
        assert torch.equal(reader.kv_batch_get(meta, select_fields="x")["x"], torch.arange(4.0).view(2, 2))
        with pytest.raises(SchemaError, match="fixed by its first write"):
            reader.kv_batch_put(["c"], {"x": torch.zeros(1, 2, dtype=torch.int64)}, partition_id="p")
        assert sorted(writer.kv_list("p")["p"]) == ["a", "b"]


def test_a_size_means_what_it_means_on_the_built_in_backends() -> None:
    """The example parses its byte option with the core's parser (dataplane.checks.check_bytes)."""
    with dataplane.connect("sqlite://?capacity_bytes=4KiB") as client:
        client.kv_batch_put(["a"], {"x": torch.zeros(1, 1024)}, partition_id="p")  # 4096 bytes: fits
        with pytest.raises(dataplane.CapacityExceeded):
            client.kv_batch_put(["b"], {"x": torch.zeros(1, 1024)}, partition_id="p")
    with pytest.raises(dataplane.InvalidArgument, match="capacity_bytes must be a size in bytes"):
        dataplane.connect("sqlite://", capacity_bytes="lots")


class TestSqliteAdapterConformance(ClientConformance):
    def make_client(self, **options: Any) -> DataPlaneClient:
        return dataplane.connect("sqlite://", **options)

    def make_limited_client(
        self, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> DataPlaneClient:
        return dataplane.connect("sqlite://", capacity_bytes=capacity_bytes, capacity_rows=capacity_rows)


def test_the_code_docs_extending_quotes_is_the_example_s() -> None:
    doc = (EXAMPLE.parents[1] / "docs" / "extending.md").read_text()
    source = (EXAMPLE / "dataplane_sqlite" / "store.py").read_text()
    start = doc.index("def _row_bytes(")
    quoted = doc[start : doc.index("```", start)].rstrip()
    assert quoted in source, "docs/extending.md quotes _row_bytes differently from the example: update one"
