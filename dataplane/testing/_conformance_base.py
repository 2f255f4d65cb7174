"""The base of the conformance suite (:class:`~dataplane.testing.conformance.ClientConformance`): the
hooks an adapter implements, the shared fixtures and the helpers its tests use."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from dataplane.client import DataPlaneClient

__all__ = ["AWKWARD_KEYS", "ConformanceBase"]

_SLOW = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


AWKWARD_KEYS: tuple[str, ...] = (
    "ключ",  # non-ASCII: Cyrillic, CJK, emoji, an emoji of several code points (zero-width joiners)
    "鍵",
    "🦆",
    "👩\u200d👩\u200d👧",
    "\u00e9",  # é, one code point (NFC) ...
    "e\u0301",  # ... and e + combining acute (NFD): the same text, another key
    "\uff21",  # fullwidth A (NFKC folds it to "A", which is a key of its own here too)
    "A",
    "/",  # separators adapters use inside their own names
    "a/b",
    ":",
    "@",
    "k:1@f",
    "..",
    ".",
    "%2F",
    ",",
    ";",
    "a b",  # whitespace and control characters
    " ",
    "\t",
    "a\nb",
    "\r\n",
    "\u3000",
    "\u200b",
    "\x1b[31m",
    "'",  # quoting and escaping
    '"',
    "\\",
    "*",
    "?",
    "__dataplane__x",  # what dataplane's own reserved names look like
    "__dataplane__/schema/x",
    ".dataplane/deployment",
    "k" * 512,  # the longest keys, ASCII and not
    "鍵" * 512,
)
"""Keys every adapter stores, lists and clears as it does ``"k0"`` (one key rule for every backend:
:func:`dataplane.meta.check_keys`)."""


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], list):
        return [x for p in parts for x in p]
    if parts[0].is_nested:
        return _jagged([r for p in parts for r in p.unbind()])
    return torch.cat(parts)


def _rows_of(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind()) if t.is_nested else list(t.unbind(0))


class ConformanceBase:
    """What every part of the conformance suite stands on: :meth:`make_client` (the adapter's hook),
    :meth:`make_limited_client` and the ``client`` and ``pid`` fixtures."""

    def make_client(self, **options: Any) -> DataPlaneClient:
        raise NotImplementedError("subclass ClientConformance and return a fresh client from make_client()")

    def make_limited_client(
        self, *, capacity_bytes: int | None = None, capacity_rows: int | None = None
    ) -> DataPlaneClient | None:
        """A client whose store holds at most this much, or None if the adapter cannot bound it."""
        return None

    # -- fixtures -------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls) -> Iterator[DataPlaneClient]:  # a classmethod: pytest 9.1+ deprecates class-scoped instance methods
        c = cls().make_client()
        yield c
        c.close()

    @pytest.fixture
    def pid(self, client: DataPlaneClient) -> Iterator[str]:
        name = f"conf-{uuid.uuid4().hex[:10]}"
        yield name
        if not getattr(client, "closed", False):
            client.kv_clear(partition_id=name)
