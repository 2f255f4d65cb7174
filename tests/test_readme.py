"""The README's usage example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(import torch, dataplane.*?)```", text, re.S)
    assert block is not None, "README lost its usage example"
    out = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([3, 8])" in out.stdout
