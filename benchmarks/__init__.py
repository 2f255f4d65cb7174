"""Benchmarks for dataplane; run from a checkout, e.g. ``python -m benchmarks.put_get``."""

from benchmarks.harness import quiet_torch_fx_notice

quiet_torch_fx_notice()  # torch's notice about its tracing API, printed by any nested tensor build
