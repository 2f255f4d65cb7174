"""The README's usage example runs as written, and the README stays a front page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRONT_PAGE_BYTES = 12_288
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_readme_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(import torch, dataplane.*?)```", text, re.S)
    assert block is not None, "README lost its usage example"
    out = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([3, 8])" in out.stdout


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a markdown page, outside code blocks, without #anchors."""
    targets = LINK.findall(FENCE.sub("", page.read_text()))
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_is_a_front_page() -> None:
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= FRONT_PAGE_BYTES, (
        f"README.md is {size} bytes, over {FRONT_PAGE_BYTES}: it is a front page. A feature gets a link and a "
        "line in the README and its page in docs/ (list the page in docs/index.md)"
    )
    for page in (readme, ROOT / "docs" / "index.md"):
        broken = [t for t in relative_links(page) if not (page.parent / t).exists()]
        assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
