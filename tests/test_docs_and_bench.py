"""The README's example runs, and the benchmark's JSON matches its documented schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(import torch, dataplane.*?)```", text, re.S)
    assert block is not None, "README lost its usage example"
    out = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([3, 8])" in out.stdout


def test_quick_benchmark_json_matches_schema(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.put_get",
        "--quick",
        "--backend",
        "memory",
        "--sizes",
        "1",
        "--fields",
        "1,4",
    ]
    out = subprocess.run(
        [*cmd, "--no-progress", "--json", str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(path.read_text())
    schema = json.loads((ROOT / "benchmarks" / "put_get.schema.json").read_text())
    jsonschema.validate(report, schema)
    assert report["backends"] == {"memory": "ok"}
    assert {(r["backend"], r["n_fields"]) for r in report["results"]} == {("memory", 1), ("memory", 4)}
    assert "put GB/s" in out.stdout
