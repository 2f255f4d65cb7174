"""One-way dependencies, checked on the source (``ast``, nothing is imported).

* nothing in ``dataplane`` imports ``integrations`` or ``benchmarks``, nor a backend at module top level;
* no adapter imports another adapter's modules (an adapter is a top-level name under
  ``dataplane.adapters``: ``memory``, the ``mooncake`` and ``transfer_queue`` packages; the legacy
  flat files ``_mc_*``/``_mooncake_*`` and ``_tq_*`` count as theirs);
* ``benchmarks/`` imports no private part of ``dataplane`` (a ``_``-prefixed module or name);
* ``integrations/`` imports only public names of ``dataplane``: no ``_``-prefixed module or name,
  and, where the module defines ``__all__``, only names in it (or its public submodules).

Imports are ``import x``, ``from x import y`` (relative ones resolved) and
``importlib.import_module("x")`` / ``__import__("x")`` with a literal name, at any depth (inside
functions and ``if TYPE_CHECKING:`` too). The checkers are unit-tested on snippets below, so they
can fail without depending on the tree.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = "dataplane.adapters"
# Flat files of the layout before adapters became packages: private prefix -> adapter.
LEGACY_PREFIXES = {"_mc_": "mooncake", "_mooncake_": "mooncake", "_tq_": "transfer_queue"}


@dataclass(frozen=True, slots=True)
class Import:
    """One import: the module named, the names taken from it (empty for ``import x``), the line."""

    module: str
    names: tuple[str, ...]
    line: int

    def targets(self) -> Iterator[tuple[str, str | None]]:
        """(module, name) pairs; ``from m import n`` yields ``(m, n)`` (``n`` may be a submodule)."""
        if not self.names:
            yield self.module, None
        for n in self.names:
            yield self.module, None if n == "*" else n


def _resolve_relative(module: str | None, level: int, importer: str, is_package: bool) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def imports_in(source: str, importer: str, *, is_package: bool = False) -> list[Import]:
    """Every import of ``source`` (the module ``importer``; ``is_package`` for an ``__init__``)."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = _resolve_relative(node.module, node.level, importer, is_package)
            found.append(Import(module, tuple(alias.name for alias in node.names), node.lineno))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                target = arg.value
                if target.startswith("."):
                    package = next((k.value for k in node.keywords if k.arg == "package"), None)
                    if not (isinstance(package, ast.Constant) and isinstance(package.value, str)):
                        continue
                    level = len(target) - len(target.lstrip("."))
                    target = _resolve_relative(target[level:] or None, level, package.value, True)
                found.append(Import(target, (), node.lineno))
    return found


def adapter_of(module: str) -> str | None:
    """The adapter a module belongs to, by its top-level name under ``dataplane.adapters``; None for
    modules outside it and for private modules there that belong to no adapter (shared kit)."""
    if not module.startswith(ADAPTERS + "."):
        return None
    top = module[len(ADAPTERS) + 1 :].split(".")[0]
    if not top.startswith("_"):
        return top
    return next((a for prefix, a in LEGACY_PREFIXES.items() if top.startswith(prefix)), None)


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _of_dataplane(module: str) -> bool:
    return module == "dataplane" or module.startswith("dataplane.")


# -- the tree ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Source:
    module: str
    path: str
    text: str
    is_package: bool


def sources_under(folder: str) -> list[Source]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append(Source(".".join(parts), str(rel), path.read_text(), is_package))
    return out


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _tree_all(module: str) -> frozenset[str] | None:
    path = _module_file(module)
    return None if path is None else static_all(path.read_text())


def _tree_is_module(module: str) -> bool:
    return _module_file(module) is not None


def static_all(source: str) -> frozenset[str] | None:
    """``__all__`` of a module when it is a literal list or tuple of str (``+=`` of such counted)."""
    names: set[str] | None = None
    for node in ast.parse(source).body:
        value, target = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            target, value = node.target, node.value
        if not (isinstance(target, ast.Name) and target.id == "__all__") or value is None:
            continue
        if not isinstance(value, (ast.List, ast.Tuple)) or not all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
        ):
            return None  # computed: cannot tell statically
        listed = {e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        names = (names or set()) | listed if isinstance(node, ast.AugAssign) else listed
    return None if names is None else frozenset(names)


# -- the three checkers --------------------------------------------------------------------------------
def cross_adapter_imports(sources: Iterable[Source]) -> list[str]:
    """``path:line: A imports B's module`` for every adapter module that imports another adapter's."""
    offenders = []
    for src in sources:
        own = adapter_of(src.module)
        if own is None:
            continue
        for imp in imports_in(src.text, src.module, is_package=src.is_package):
            for module, name in imp.targets():
                # ``from dataplane.adapters import _mooncake_procs`` names a module through ``name``
                candidates = [module] if name is None else [module, f"{module}.{name}"]
                other = next((a for c in candidates if (a := adapter_of(c)) not in (None, own)), None)
                if other is not None:
                    shown = module if name is None else f"{module}.{name}"
                    offenders.append(f"{src.path}:{imp.line}: adapter {own} imports {shown} of adapter {other}")
    return offenders


def private_dataplane_imports(sources: Iterable[Source]) -> list[str]:
    """``path:line: imports X`` for every import of a ``_``-prefixed module or name of dataplane."""
    offenders = []
    for src in sources:
        for imp in imports_in(src.text, src.module, is_package=src.is_package):
            for module, name in imp.targets():
                if not _of_dataplane(module):
                    continue
                parts = module.split(".") + ([name] if name else [])
                if any(_is_private(p) for p in parts):
                    offenders.append(f"{src.path}:{imp.line}: imports {'.'.join(parts)}")
    return offenders


def non_public_dataplane_imports(
    sources: Iterable[Source],
    *,
    all_of: Callable[[str], frozenset[str] | None] = _tree_all,
    is_module: Callable[[str], bool] = _tree_is_module,
) -> list[str]:
    """Private imports as above, plus names missing from the ``__all__`` of a module that has one
    (a public submodule imported by name is fine)."""
    offenders = private_dataplane_imports(sources)
    for src in sources:
        for imp in imports_in(src.text, src.module, is_package=src.is_package):
            for module, name in imp.targets():
                if not _of_dataplane(module) or name is None or _is_private(name) or name.startswith("__"):
                    continue
                if any(_is_private(p) for p in module.split(".")) or is_module(f"{module}.{name}"):
                    continue
                exported = all_of(module)
                if exported is not None and name not in exported:
                    offenders.append(
                        f"{src.path}:{imp.line}: imports {name} from {module}, which is not in its __all__"
                    )
    return offenders


# -- the tree's tests ------------------------------------------------------------------------------
def test_core_never_imports_upper_layers() -> None:
    offenders = [
        f"{src.path}:{imp.line} imports {imp.module}"
        for src in sources_under("dataplane")
        for imp in imports_in(src.text, src.module, is_package=src.is_package)
        if imp.module.split(".")[0] in ("integrations", "benchmarks")
    ]
    assert not offenders, offenders


def test_backends_are_imported_lazily() -> None:
    """Backend packages may only be imported inside functions, never at module top level."""
    offenders = []
    for src in sources_under("dataplane"):
        for node in ast.parse(src.text).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{src.path}: {n}" for n in names if n.split(".")[0] in ("ray", "transfer_queue", "mooncake")]
    # the one exception: a sampler class Ray must send by reference, imported only inside a function
    allowed = {"dataplane/adapters/transfer_queue/_claim_sampler.py: transfer_queue.sampler"}
    assert not [o for o in offenders if o not in allowed], offenders
    importers = [s.path for s in sources_under("dataplane") if "_claim_sampler import" in s.text]
    for path in importers:  # ... and only lazily
        tree = ast.parse(next(s for s in sources_under("dataplane") if s.path == path).text)
        assert not any(isinstance(n, ast.ImportFrom) and "_claim_sampler" in (n.module or "") for n in tree.body), path


def test_no_adapter_imports_another_adapters_modules() -> None:
    offenders = cross_adapter_imports(sources_under("dataplane/adapters"))
    assert not offenders, "\n".join(offenders)


def test_benchmarks_import_no_private_dataplane_module() -> None:
    offenders = private_dataplane_imports(sources_under("benchmarks"))
    assert not offenders, "\n".join(offenders)


def test_integrations_import_only_public_dataplane_names() -> None:
    offenders = non_public_dataplane_imports(sources_under("integrations"))
    assert not offenders, "\n".join(offenders)


def test_the_tree_is_what_the_checks_see() -> None:
    """The checks read real files: every adapter is found, and there is code to check."""
    adapters = {adapter_of(s.module) for s in sources_under("dataplane/adapters")} - {None}
    assert {"memory", "mooncake", "transfer_queue"} <= adapters
    assert sources_under("benchmarks") and sources_under("integrations")


# -- the checkers on snippets ----------------------------------------------------------------------
def _src(module: str, text: str, *, is_package: bool = False) -> Source:
    return Source(module, module.replace(".", "/") + ".py", text, is_package)


@pytest.mark.parametrize(
    ("module", "adapter"),
    [
        ("dataplane.adapters.memory", "memory"),
        ("dataplane.adapters.mooncake", "mooncake"),
        ("dataplane.adapters.mooncake.store.put", "mooncake"),
        ("dataplane.adapters.transfer_queue._deploy", "transfer_queue"),
        ("dataplane.adapters._mc_store", "mooncake"),
        ("dataplane.adapters._mooncake_procs", "mooncake"),
        ("dataplane.adapters._tq_mooncake", "transfer_queue"),
        ("dataplane.adapters._slots", None),
        ("dataplane.adapters", None),
        ("dataplane._host.procs", None),
        ("dataplane.store", None),
    ],
)
def test_adapter_of(module: str, adapter: str | None) -> None:
    assert adapter_of(module) == adapter


def test_imports_in_resolves_relative_and_dynamic_imports() -> None:
    text = """
import os, dataplane.adapters.memory as m
from . import ops
from .._host import procs
from ..mooncake.master import start_master
def f():
    import importlib
    importlib.import_module("dataplane.adapters.mooncake")
    __import__("dataplane.codec")
    importlib.import_module(".store", package="dataplane.adapters.mooncake")
    importlib.import_module(name)  # not a literal: not seen
"""
    got = [(i.module, i.names) for i in imports_in(text, "dataplane.adapters.transfer_queue.call_loop")]
    assert got == [
        ("os", ()),
        ("dataplane.adapters.memory", ()),
        ("dataplane.adapters.transfer_queue", ("ops",)),
        ("dataplane.adapters._host", ("procs",)),
        ("dataplane.adapters.mooncake.master", ("start_master",)),
        ("importlib", ()),
        ("dataplane.adapters.mooncake", ()),
        ("dataplane.codec", ()),
        ("dataplane.adapters.mooncake.store", ()),
    ]
    in_init = imports_in("from .ops import TQOps", "dataplane.adapters.transfer_queue", is_package=True)
    assert in_init[0].module == "dataplane.adapters.transfer_queue.ops"


@pytest.mark.parametrize(
    "text",
    [
        "from dataplane.adapters.mooncake.master import start_master",
        "from ..mooncake import master",
        "import dataplane.adapters.mooncake",
        "from dataplane.adapters import mooncake",
        "from dataplane.adapters import _mooncake_procs",
        "from dataplane.adapters._mc_handle import AdminClient",
        "def f():\n    from dataplane.adapters._mooncake_procs import start_master",
        "import importlib\nimportlib.import_module('dataplane.adapters.mooncake._procs')",
    ],
)
def test_cross_adapter_import_is_caught(text: str) -> None:
    offenders = cross_adapter_imports([_src("dataplane.adapters.transfer_queue.deploy", text)])
    assert len(offenders) == 1 and "adapter transfer_queue imports" in offenders[0] and "mooncake" in offenders[0]
    if "from .." not in text:  # the same line in a flat file of the legacy layout
        assert len(cross_adapter_imports([_src("dataplane.adapters._tq_deploy", text)])) == 1


@pytest.mark.parametrize(
    "text",
    [
        "from . import store",
        "from .store import put",
        "from dataplane.adapters.transfer_queue._wire import MARKER",
        "from dataplane._host import procs",
        "from dataplane.adapters import _slots",
        "from dataplane.storage import KVStore",
        "import mooncake.store",  # the backend itself, not our adapter
    ],
)
def test_own_adapter_and_shared_kit_imports_pass(text: str) -> None:
    assert cross_adapter_imports([_src("dataplane.adapters.transfer_queue.deploy", text)]) == []


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("import dataplane.adapters._mc_read as R", True),
        ("from dataplane._threads import Helper", True),
        ("from dataplane.adapters import _mooncake_procs", True),
        ("from dataplane.store import _check_tags", True),
        ("from dataplane._host.procs import start", True),
        ("def f():\n    from dataplane.adapters._mc_handle import AdminClient", True),
        ("import importlib\nimportlib.import_module('dataplane._host')", True),
        ("from dataplane.adapters.mooncake import start_master", False),
        ("from dataplane import connect, __version__", False),
        ("import dataplane.preshard", False),
        ("from benchmarks._harness import timer", False),  # the benchmark's own private module
        ("import _thread", False),
    ],
)
def test_private_dataplane_import_is_caught(text: str, caught: bool) -> None:
    assert bool(private_dataplane_imports([_src("benchmarks.put_get", text)])) is caught


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("from dataplane.worker.writeback import _pack_padded", True),
        ("from dataplane._host import procs", True),
        ("import dataplane.adapters._tq_ops", True),
        ("from dataplane.columns import helper_not_in_all", True),
        ("from dataplane import columns, connect", False),
        ("from dataplane.columns import first_write", False),
        ("from dataplane.nomodule_all import anything", False),  # no __all__: any public name
        ("import dataplane.columns", False),
    ],
)
def test_non_public_dataplane_import_is_caught(text: str, caught: bool) -> None:
    alls = {"dataplane": frozenset({"connect"}), "dataplane.columns": frozenset({"first_write"})}
    modules = {"dataplane.columns"}
    offenders = non_public_dataplane_imports(
        [_src("integrations.rl.grpo", text)], all_of=alls.get, is_module=modules.__contains__
    )
    assert bool(offenders) is caught, offenders


def test_static_all() -> None:
    assert static_all("__all__ = ['a', 'b']\n__all__ += ('c',)") == {"a", "b", "c"}
    assert static_all("x = 1") is None
    assert static_all("__all__ = [n for n in dir()]") is None
    assert static_all("__all__: list[str] = ['a']") == {"a"}
