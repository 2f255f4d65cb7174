"""Fixtures of the multi-host tests: ``hosts``, two network namespaces joined by a switch (root only),
checked at the end to leave no namespace or process behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataplane.testing.netns import Hosts, unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests make network namespaces: {reason}")
    made = Hosts(2)
    try:
        yield made
    finally:
        made.close()
        assert made.leftovers() == [], "the hosts' teardown left something behind"


def recipe(doc: str, name: str) -> str:
    """The fenced block after ``<!-- recipe: NAME ... -->`` in ``doc`` (a path under the repo root):
    the docs' cluster recipes are the commands these tests run."""
    text = (ROOT / doc).read_text()
    m = re.search(r"<!-- recipe: " + re.escape(name) + r"\b[^>]*-->\s*```[a-z]*\n(.*?)```", text, re.S)
    if m is None:
        raise AssertionError(f"{doc} has no recipe {name!r}")
    return m.group(1).strip()
