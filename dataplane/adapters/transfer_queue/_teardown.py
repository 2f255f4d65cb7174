"""Closing and cleaning up TransferQueue state: this process's client, the owner's teardown, and what
a failed start-up left (``ray`` and ``transfer_queue`` are imported lazily)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dataplane.adapters.transfer_queue._deploy_config import CONTROLLER_NAME, STORAGE_UNIT_NAME, TQ_NAMESPACE

logger = logging.getLogger(__name__)

__all__ = [
    "cancel_pending",
    "close_client_only",
    "close_quietly",
    "find_controller",
    "kill_named_actors",
    "mooncake_store_client",
    "owner_teardown",
    "reset_tq_globals",
]


def find_controller() -> Any | None:
    import ray

    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE)
    except ValueError:
        return None


_DRAIN_TIMEOUT_S = 5.0


def cancel_pending(client: Any) -> None:
    """Cancel the calls still pending on the TQ client's loop (one whose controller died, a put's
    rollback) and let them end there, before its close stops the loop: a coroutine left pending on
    a stopped loop is closed later by the garbage collector, in another context, where TQ's socket
    lease then fails (an "Exception ignored" at a random later moment)."""
    loop = getattr(client, "_loop", None)
    if loop is None or loop.is_closed() or not loop.is_running():
        return

    async def drain() -> int:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_DRAIN_TIMEOUT_S)
        return len(tasks)

    future = asyncio.run_coroutine_threadsafe(drain(), loop)
    try:
        cancelled = future.result(_DRAIN_TIMEOUT_S + 1.0)
    except Exception as e:  # the loop is wedged (a blocking call inside it): close goes on anyway
        future.cancel()
        logger.warning("could not cancel the TransferQueue calls still pending at close: %s", e)
        return
    if cancelled:
        logger.debug("cancelled %d TransferQueue calls still pending at close", cancelled)


def mooncake_store_client(client: Any) -> Any:
    manager = getattr(client, "storage_manager", None)
    storage_client = getattr(manager, "storage_client", None)
    return storage_client if type(storage_client).__name__ == "MooncakeStoreClient" else None


def close_quietly(storage_client: Any) -> None:
    if storage_client is None:
        return
    try:
        storage_client.close()
    except Exception as e:
        logger.warning("closing the Mooncake store client failed: %s", e)


def owner_teardown() -> None:
    """``tq.close()`` (storage units, client, controller), then the Mooncake client TQ never closes."""
    import transfer_queue.interface as itf  # never the top-level package: it may be the verl facade

    storage_client = mooncake_store_client(itf._TQ_CLIENT)
    try:
        itf.close()
    except Exception as e:
        logger.warning("tq.close() failed: %s", e)
    close_quietly(storage_client)


def close_client_only(itf: Any) -> None:
    """Close this process's TQ client and forget the controller; never ``tq.close()`` (kills it)."""
    client = itf._TQ_CLIENT
    itf._TQ_CLIENT = None
    itf._TQ_CONTROLLER = None
    if client is not None:
        try:
            client.close()
        except Exception as e:
            logger.warning("closing the TransferQueue client failed: %s", e)


def _created_by_this_job(handle: Any) -> bool:
    import ray

    try:
        return bool(handle._ray_actor_id.job_id.hex() == ray.get_runtime_context().get_job_id())
    except Exception:  # cannot tell: leave it alone
        return False


def kill_named_actors(num_units: int) -> None:
    """Kill what a failed start-up left: units (named in our job's namespace, so ours) and the
    controller if this job created it (never a controller another process started meanwhile)."""
    import ray

    for i in range(num_units):
        try:
            ray.kill(ray.get_actor(STORAGE_UNIT_NAME.format(i)))
        except Exception:  # not there: nothing to kill
            pass
    controller = find_controller()
    if controller is not None and _created_by_this_job(controller):
        ray.kill(controller)


def reset_tq_globals() -> None:
    import transfer_queue.interface as itf

    close_client_only(itf)
    itf._TQ_STORAGE = None
