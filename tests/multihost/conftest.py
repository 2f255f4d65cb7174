"""Fixtures of the multi-host tests: ``hosts``, two network namespaces joined by a switch (root only),
checked at the end to leave no namespace or process behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataplane.testing.netns import Hosts, unavailable


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
