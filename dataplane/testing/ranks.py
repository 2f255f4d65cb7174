"""Run a function on every rank of a real ``torch.distributed`` group of fresh processes.

For tests of workers that train or fetch over process groups: each rank is a separate process
(forked from a forkserver, so imports are paid once), joins a gloo group over loopback, runs
``target(rank, world, *args)`` and sends back its return value. Nothing waits forever: the group has
a collective timeout and the whole run a deadline, after which the processes are killed. NCCL groups
of GPU ranks work the same way (``backend="nccl"``, spawned processes).

>>> def hello(rank: int, world: int) -> int:  # doctest: +SKIP
...     t = torch.ones(1)
...     dist.all_reduce(t)
...     return int(t.item())
>>> run_ranks(hello, 2)  # doctest: +SKIP
[2, 2]
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataplane.errors import DataPlaneError, InvalidArgument

__all__ = ["RankFailure", "free_port", "run_ranks"]


class RankFailure(DataPlaneError, RuntimeError):
    """A rank raised, crashed or did not report in time; the message has every rank's traceback."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    pg_timeout_s: float,
    threads: int | None,
    backend: str,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        kw: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)  # eager NCCL init: new_group builds communicators
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
        out: tuple[str, Any] = ("ok", target(rank, world, *args))
    except BaseException:
        out = ("error", traceback.format_exc())
    # Pickled here, by value: torch's queue would pass tensors as shared-memory handles, which die with
    # this process (it exits at once below).
    results.put((rank, pickle.dumps(out)))
    results.close()
    results.join_thread()
    os._exit(0)  # a failed collective may still be pending: skip the process group's teardown


def run_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
    threads: int | None = 1,
    backend: Literal["gloo", "nccl"] = "gloo",
    start_method: str | None = None,
) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` fresh processes forming one process group.

    Args:
        target: a module-level function (it is pickled by name); its return value must pickle.
        world: number of ranks.
        args: passed to every rank after ``rank`` and ``world``.
        timeout_s: deadline for every rank to report.
        pg_timeout_s: the process group's collective timeout.
        threads: ``torch.set_num_threads`` in each rank (None leaves torch's default). Ranks sharing
            a few cores run several times faster with one thread each than oversubscribed.
        backend: ``gloo`` (CPU) or ``nccl`` (rank ``r`` on GPU ``r``).
        start_method: default ``forkserver`` for gloo (fast: the server has torch imported once) and
            ``spawn`` for NCCL (each rank starts CUDA in a fresh interpreter).

    Returns:
        the return values, in rank order.

    Raises:
        RankFailure: a rank raised or crashed (every traceback is in the message), or ranks did not
            report within ``timeout_s`` (they are killed).
    """
    if backend not in ("gloo", "nccl"):
        raise InvalidArgument(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx: Any = mp.get_context(start_method or ("forkserver" if backend == "gloo" else "spawn"))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(target, r, world, port, pg_timeout_s, threads, backend, results, args), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            got[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            # Ranks that reported exit at once; one that did not report by the deadline is killed now.
            p.join(timeout=10 if len(got) == world else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    errors = [f"rank {r}:\n{o[1]}" for r, o in sorted(got.items()) if o[0] == "error"]
    missing = sorted(set(range(world)) - set(got))
    if missing:
        errors.append(f"ranks {missing} reported nothing within {timeout_s:.0f} s (crashed or hung; killed)")
    if errors:
        raise RankFailure("\n".join(errors))
    return [got[r][1] for r in range(world)]
