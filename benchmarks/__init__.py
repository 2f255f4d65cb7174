"""Benchmarks for dataplane; run from a checkout, e.g. ``python -m benchmarks.put_get``."""
