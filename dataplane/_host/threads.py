"""Threads started on first use, and again in a forked child (which inherits none of them): a pool,
and a single helper thread with a lighter hand-off."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Helper", "LazyPool", "Task", "usable_cpus"]


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


class Task:
    """A call handed to a :class:`Helper`; :meth:`result` waits for it."""

    __slots__ = ("_done", "_error", "_fn", "_value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Lock()
        self._done.acquire()  # released once the call has returned or raised
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:
            self._error = e
        finally:
            self._done.release()

    def result(self, timeout: float) -> Any:
        """What the call returned, or raises what it raised (``TimeoutError`` after ``timeout`` s)."""
        if not self._done.acquire(timeout=timeout):
            raise TimeoutError
        self._done.release()
        if self._error is not None:
            raise self._error
        return self._value


def _serve(tasks: queue.SimpleQueue[Task | None]) -> None:
    while (task := tasks.get()) is not None:
        task.run()
        del task  # not held while waiting for the next: what it returned (a get's buffers) may go


class Helper:
    """One daemon thread named ``name`` that runs submitted calls in order. Handing a call over costs
    a queue put (no future, no pool bookkeeping): it sits on the path of every get that decodes beside
    its transfer."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue[Task | None] | None = None
        self._pid = 0

    @property
    def started(self) -> bool:
        return self._tasks is not None and self._pid == os.getpid()

    def submit(self, fn: Callable[[], Any]) -> Task:
        tasks = self._tasks
        if tasks is None or self._pid != os.getpid():
            with self._lock:
                if self._tasks is None or self._pid != os.getpid():
                    self._tasks, self._pid = queue.SimpleQueue(), os.getpid()
                    threading.Thread(target=_serve, args=(self._tasks,), name=self._name, daemon=True).start()
                tasks = self._tasks
        task = Task(fn)
        tasks.put(task)
        return task

    def close(self) -> None:
        """Let the thread go once the calls handed to it are done (no wait)."""
        with self._lock:
            tasks, self._tasks = self._tasks, None
        if tasks is not None and self._pid == os.getpid():
            tasks.put(None)
