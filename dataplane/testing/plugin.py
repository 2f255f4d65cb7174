"""pytest plugin (entry point ``pytest11``): registers dataplane's markers for adapter test suites."""

from __future__ import annotations

from typing import Any

MARKERS = {
    "gpu": "needs CUDA GPUs (run on a GPU machine; skipped elsewhere)",
    "tq": "needs TransferQueue and Ray (pip install 'dataplane[tq]')",
    "mooncake": "needs Mooncake Store (pip install 'dataplane[mooncake]')",
    "multiprocess": "spawns real processes",
    "slow": "takes more than a few seconds",
}


def pytest_configure(config: Any) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
