"""A thread pool started on first use, and again in a forked child (which inherits none of its threads)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LazyPool", "usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class LazyPool:
    """``workers`` threads named ``name-*`` that sleep when idle; none exist until the first submit."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = workers, name
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0

    @property
    def started(self) -> bool:
        return self._pool is not None and self._pid == os.getpid()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        pool = self._pool
        if pool is None or self._pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pid != os.getpid():
                    self._pool = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix=self._name)
                    self._pid = os.getpid()
                pool = self._pool
        return pool.submit(fn, *args)

    def close(self) -> None:
        """Let the threads go once their work is done (no wait)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=False)
