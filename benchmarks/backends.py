"""Backends beyond memory for ``benchmarks.put_get``; each adapter's module adds its own entries."""

from __future__ import annotations

from benchmarks.base import BenchBackend

BACKENDS: list[BenchBackend] = []

try:
    from benchmarks.backends_tq import BACKENDS as _TQ
except ImportError:  # module not there: adapter not built in this checkout
    _TQ = []
try:
    from benchmarks.backends_mooncake import BACKENDS as _MOONCAKE
except ImportError:
    _MOONCAKE = []

BACKENDS += _MOONCAKE + _TQ  # the direct path first: its teardown overlaps TransferQueue's start-up
