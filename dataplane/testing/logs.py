"""What a healthy run must not print: lines of a captured stderr at WARNING or above.

>>> noisy_lines("INFO fine\\nE1127 12:00:00.000 42 x.cpp:1] broken\\n2026-11-27 WARNING ray -- hm")
['E1127 12:00:00.000 42 x.cpp:1] broken', '2026-11-27 WARNING ray -- hm']
"""

from __future__ import annotations

import re

__all__ = ["NOISE", "noisy_lines"]

# Python logging's WARNING/ERROR/CRITICAL words, tracebacks, and glog's W/E/F line prefixes.
NOISE = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL|Traceback)\b|^[WEF]\d{4} ", re.IGNORECASE)


def noisy_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` at WARNING or above (Python logging, glog, tracebacks)."""
    return [line for line in stderr.splitlines() if NOISE.search(line)]
