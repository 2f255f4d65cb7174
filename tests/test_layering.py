"""One-way dependencies: nothing in ``dataplane`` imports ``integrations`` or ``benchmarks``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_core_never_imports_upper_layers() -> None:
    offenders = []
    for path in sorted((ROOT / "dataplane").rglob("*.py")):
        for mod in _imported_modules(path):
            if mod.split(".")[0] in ("integrations", "benchmarks"):
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, offenders


def test_backends_are_imported_lazily() -> None:
    """Backend packages may only be imported inside functions, never at module top level."""
    offenders = []
    for path in sorted((ROOT / "dataplane").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.name}: {n}" for n in names if n.split(".")[0] in ("ray", "transfer_queue", "mooncake")
            ]
    assert not offenders, offenders
