"""Deployment lifecycle of TransferQueue (``transferqueue`` 0.1.11) for the TQ adapter.

One TransferQueue exists per Ray cluster: a named actor ``TransferQueueController`` (namespace
``transfer_queue``) plus a storage backend. :func:`start_or_attach` either *attaches* to the one that
runs (``owner=False``; this is how a Ray actor or task joins with no arguments) or *starts* one and
owns it (``owner=True``). Only the owner tears shared things down.

Facts this module is built on (measured on ``transferqueue`` 0.1.11):

* ``tq.init`` hangs forever, silently, when Ray lacks ``1 + num_storage_units`` free CPUs: the
  controller and each SimpleStorage unit ask for ``num_cpus=1``. We check first and bound it.
* TQ reads its timeouts from the environment *at import time* (``TQ_SIMPLE_STORAGE_*``,
  ``TQ_NUM_THREADS``...). We set them before the first import, patch the module constants when
  ``transfer_queue`` was already imported, and put them in the Ray job's ``runtime_env`` when we call
  ``ray.init`` (actors of the job inherit it). :meth:`TQDeployment.runtime_env` gives the same
  dict for actors of a Ray you started yourself.
* ``tq.close()`` kills the shared controller in *every* process; a non-owner must only close its
  own client. No TQ path closes the Mooncake store client; we do.
* Mooncake ``auto_init`` pkills every ``mooncake_master`` on the host: we always use
  ``auto_init: false`` and run our own master (:mod:`dataplane._host.mooncake_master`), stopped by
  PID.
* Every Mooncake client lends ``global_segment_size`` bytes and objects placed there die with that
  process. The owner lends ``mooncake_segment_bytes``; it then re-stores the shared config with
  ``mooncake_worker_segment_bytes`` (default 0), so processes that attach lend nothing.
* Controller RPCs have no timeout. Bound every call with :meth:`TQDeployment.call` /
  :meth:`TQDeployment.acall`, or a whole coroutine of several calls with :meth:`TQDeployment.run`
  (see their docstrings for why this way).
* ``TQDeployConfig(attach_only=True)`` never starts anything (what ``tq://`` without a backend uses).
  One process should hold one handle: ``dataplane.adapters.transfer_queue`` shares it between the
  process's clients, refcounted.

Bounded calls, measured against a stopped or killed controller and master:

* ``dep.call(fn, ..., timeout=t)`` / ``await dep.acall(...)`` run ``tq.async_<fn>`` on the TQ client's
  own loop thread and wait at most ``t``; on timeout the task is cancelled (TQ discards the DEALER
  socket of the interrupted request, so no stale reply is read later) and ``TimeoutError`` is raised.
  This held for a SIGSTOPped and a killed controller and for a SIGSTOPped Mooncake master.
* ``asyncio.wait_for(tq.async_kv_batch_get(...), t)`` on the caller's loop is NOT a bound on
  MooncakeStore: TQ does the Mooncake get synchronously inside the coroutine, which blocked the
  caller's loop for 122 s. (On SimpleStorage it works and cleans up.)
* Caveats: a cancelled Mooncake get keeps the TQ loop thread busy until Mooncake gives up, so later
  calls time out too until then. A timed-out or failed put may leave "phantom" keys: ``kv_clear`` them.
  TQ's own ``StorageUnitTimeout`` (dead SimpleStorage unit, after ``MAX_ATTEMPTS*SEND_RECV+PROBE`` s)
  is a ``RuntimeError``, not a ``TimeoutError``.

Attaching from an async Ray actor works; ``await asyncio.to_thread(start_or_attach)`` avoids blocking
its loop during the (short, bounded) attach.

``ray`` and ``transfer_queue`` are imported lazily, inside functions.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from dataplane._host.quiet import filtered_stderr
from dataplane.adapters.transfer_queue._deploy_config import (
    TQDeployConfig,
    apply_env,
    build_conf,
    tq_env,
)
from dataplane.adapters.transfer_queue._init import tq_init
from dataplane.adapters.transfer_queue._ray import (
    ensure_ray,
    tcp_reachable,
)
from dataplane.adapters.transfer_queue._teardown import (
    cancel_pending,
    close_client_only,
    close_quietly,
    find_controller,
    kill_named_actors,
    mooncake_store_client,
    owner_teardown,
    reset_tq_globals,
)
from dataplane.registry import URL_ENV, export_url

logger = logging.getLogger(__name__)

__all__ = ["TQDeployment", "start_or_attach"]


def _wait_for_config(controller: Any, deadline: float) -> Any:
    """The shared config once the owner stored it (``tq.init`` would poll this forever)."""
    import ray

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                "TransferQueue controller exists but published no config in time: its owner may still be "
                "starting, or may have died; raise init_timeout_s or restart the owner"
            )
        conf = ray.get(controller.get_config.remote(), timeout=max(0.1, left))
        if conf is not None:
            return conf
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


class _Bounded(TimeoutError):
    """``fn`` did not finish in time; ``thread`` still runs it (a daemon thread)."""

    def __init__(self, message: str, thread: threading.Thread) -> None:
        super().__init__(message)
        self.thread = thread


def _run_bounded(fn: Any, timeout_s: float, what: str) -> Any:
    """Run ``fn()`` on a daemon thread; raise :class:`_Bounded` if it is not done in ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    thread = threading.Thread(target=target, name=f"dataplane-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Bounded(f"{what} did not finish within {timeout_s:.0f}s", thread)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _import_tq_meanwhile() -> threading.Thread | None:
    """Import ``transfer_queue`` (seconds: torch, tensordict) on a thread while ``ray.init`` waits
    for Ray's processes; the caller joins it after. ``None`` when it is imported already."""
    import sys

    import ray  # noqa: F401  (before the thread: both sides import from it)

    if "transfer_queue.interface" in sys.modules:
        return None

    def target() -> None:
        try:
            import transfer_queue.interface  # noqa: F401
        except BaseException:  # raised again by the import that follows the join
            pass

    thread = threading.Thread(target=target, name="dataplane-import-tq", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------------------------- deployment

# One TQ client per process (TQ keeps it in a module global); handles in this process share it.
_CLIENT_LOCK = threading.Lock()
_CLIENT_REFS = 0


@dataclass(eq=False)
class TQDeployment:
    """A process's handle on TransferQueue; ``owner`` says whether it started (and will stop) it.

    Use :meth:`call` / :meth:`acall` for bounded ``kv_*`` calls, :meth:`close` when done (idempotent;
    also a context manager).
    """

    cfg: TQDeployConfig
    owner: bool
    env: dict[str, str]
    conf: Any = None  # the effective TQ DictConfig
    ray_inited: bool = False  # we called ray.init (so close() calls ray.shutdown())
    ray_started: bool = False  # ... and it started a local Ray
    master: Any = None  # our MasterHandle, or None
    master_address: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    url: str = ""  # tq://?ray_address=GCS: what another process passes to dataplane.connect() to attach
    deployment_id: str = ""  # tq:CONTROLLER_ACTOR_ID: one per TransferQueue started
    _unexport: Any = field(default=None, repr=False)  # undoes the owner's $DATAPLANE_URL
    _closed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ bounded calls

    def _client_loop(self) -> asyncio.AbstractEventLoop:
        import transfer_queue.interface as itf

        client = itf._TQ_CLIENT
        if self._closed or client is None:
            raise RuntimeError("TransferQueue client is closed")
        loop: asyncio.AbstractEventLoop = client._loop
        return loop

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def client(self) -> Any:
        """This process's ``TransferQueueClient`` (TQ keeps one per process)."""
        import transfer_queue.interface as itf

        client = itf._TQ_CLIENT
        if self._closed or client is None:
            raise RuntimeError("TransferQueue client is closed")
        return client

    @property
    def storage(self) -> Literal["simple", "mooncake"]:
        """The storage backend of the deployment this handle is on (from the shared config)."""
        backend = str(self.conf.backend.storage_backend) if self.conf is not None else ""
        return "mooncake" if backend == "MooncakeStore" else "simple"

    def run(self, factory: Any, /, *args: Any, timeout: float | None = None) -> Any:
        """Run the coroutine ``factory(*args)`` on the TQ client's loop thread, bounded like :meth:`call`.

        On timeout the task is cancelled and ``TimeoutError`` is raised. Work the coroutine handed to
        other threads (``run_in_executor``) goes on until it returns.
        """
        import concurrent.futures

        loop = self._client_loop()
        limit = self.cfg.op_timeout_s if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(factory(*args), loop)
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            if future.done():  # a TimeoutError raised inside
                raise
            future.cancel()
            raise TimeoutError(
                f"TransferQueue operation did not finish within {limit:g}s (cancelled); the controller or a "
                f"storage unit may be hung or dead"
            ) from None

    def call(self, fn: str, /, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``transfer_queue.async_<fn>(*args, **kwargs)`` with a bound; e.g. ``call("kv_batch_get", ...)``.

        The coroutine runs on the TQ client's own loop thread (where the sync ``tq.kv_*`` would run
        it too, but they wait with no timeout). On timeout the task is cancelled there -- TQ then
        closes the DEALER socket of the interrupted request, so a late reply cannot be read by the
        next request -- and ``TimeoutError`` is raised. Safe from any thread, including a thread
        whose event loop is running (it blocks that thread, like any sync call). A timed-out put
        may have written part of its rows: the caller must ``kv_clear`` its keys.

        Why not ``asyncio.wait_for(tq.async_kv_*(...))`` on the caller's loop: it also cancels
        cleanly, but MooncakeStore's get does blocking I/O inside the coroutine, which blocks the
        caller's loop and delays the timeout until the I/O returns. Running on TQ's loop keeps the
        caller responsive on both backends.
        """
        import concurrent.futures

        import transfer_queue.interface as itf

        loop = self._client_loop()
        limit = self.cfg.op_timeout_s if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(getattr(itf, f"async_{fn}")(*args, **kwargs), loop)
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            if future.done():  # a TimeoutError raised by TQ itself
                raise
            future.cancel()
            raise TimeoutError(
                f"TransferQueue {fn} did not finish within {limit:g}s (cancelled); the controller or a "
                f"storage unit may be hung or dead"
            ) from None

    async def acall(self, fn: str, /, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Async twin of :meth:`call`: awaits TQ's loop without blocking the caller's loop."""
        import transfer_queue.interface as itf

        loop = self._client_loop()
        limit = self.cfg.op_timeout_s if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(getattr(itf, f"async_{fn}")(*args, **kwargs), loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except TimeoutError:
            if future.done() and not future.cancelled():
                raise
            future.cancel()
            raise TimeoutError(
                f"TransferQueue {fn} did not finish within {limit:g}s (cancelled); the controller or a "
                f"storage unit may be hung or dead"
            ) from None

    def ping(self, timeout: float = 5.0) -> bool:
        """True if the controller actor answers within ``timeout`` (a Ray call, not ZMQ)."""
        import ray

        controller = find_controller()
        if controller is None:
            return False
        try:
            ray.get(controller.get_config.remote(), timeout=timeout)
            return True
        except Exception:
            return False

    def runtime_env(self) -> dict[str, Any]:
        """``runtime_env`` for Ray actors/tasks that will attach, carrying TQ's env vars.

        Only needed when *you* called ``ray.init``; when we did, the job's runtime_env already has it.
        It also carries ``DATAPLANE_URL``, so ``dataplane.connect()`` with no argument attaches there.
        """
        env = dict(self.env)
        if self.url:
            env[URL_ENV] = self.url
        return {"env_vars": env}

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Owner: ``tq.close()``, close the Mooncake client, stop our master, ``ray.shutdown()`` if we
        called ``ray.init``. Non-owner: close only this process's client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._unexport is not None:
            self._unexport()
        global _CLIENT_REFS
        with _CLIENT_LOCK:
            _CLIENT_REFS = max(0, _CLIENT_REFS - 1)
            last_ref = _CLIENT_REFS == 0
        try:
            if self.owner or last_ref:
                import transfer_queue.interface as itf

                cancel_pending(itf._TQ_CLIENT)
            if self.owner:
                t0 = time.monotonic()
                owner_teardown()
                self.timings["close_s"] = time.monotonic() - t0
            elif last_ref:
                import transfer_queue.interface as itf

                storage_client = mooncake_store_client(itf._TQ_CLIENT)
                close_client_only(itf)
                close_quietly(storage_client)
        finally:
            if self.master is not None:
                try:
                    self.master.stop()
                except Exception as e:
                    logger.warning("stopping mooncake_master pid %s failed: %s", self.master.pid, e)
            if self.ray_inited:
                import ray

                ray.shutdown()

    def __enter__(self) -> TQDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_or_attach(cfg: TQDeployConfig | None = None) -> TQDeployment:
    """Attach to the TransferQueue of this Ray cluster, or start one and own it.

    Attach (``owner=False``) when a ``TransferQueueController`` actor exists: the stored config is
    used and ``cfg``'s storage settings are ignored. Otherwise start Ray if needed (explicit
    ``num_cpus``), check Ray CPU headroom, start our own ``mooncake_master`` for ``storage="mooncake"``,
    and run ``tq.init`` under ``cfg.init_timeout_s``; on any failure everything started here is
    cleaned up again.

    Raises:
        RuntimeError: not enough free Ray CPUs (the message says how to fix it), or start-up failed.
        TimeoutError: start-up or attach did not finish within ``init_timeout_s``.
        ImportError: ``transferqueue`` / ``ray`` (or Mooncake) is not installed.

    Example:
        >>> dep = start_or_attach(TQDeployConfig(storage="simple", num_storage_units=1))
        >>> meta = dep.call("kv_batch_put", keys=["a"], partition_id="p", fields=td)  # doctest: +SKIP
        >>> dep.close()
    """
    cfg = cfg or TQDeployConfig()
    t_start = time.monotonic()
    deadline = t_start + cfg.init_timeout_s
    env = tq_env(cfg)
    apply_env(env)  # before the first `import transfer_queue` in this process
    if cfg.attach_only and not (cfg.ray_address or os.environ.get("RAY_ADDRESS")):
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "no TransferQueue to attach to: this process is not in a Ray cluster (no ray.init, no "
                "RAY_ADDRESS). Start one first, e.g. dataplane.connect('tq://?backend=simple'), or pass "
                "ray_address"
            )
    # Ray workers of a Ray started here get $DATAPLANE_URL ("tq://": inside Ray it attaches to this
    # deployment); its GCS address (in client.url) is not known before ray.init.
    own = not cfg.attach_only and not os.environ.get(URL_ENV)
    importer = _import_tq_meanwhile()
    ray_inited, ray_started = ensure_ray(cfg, {**env, URL_ENV: "tq://"} if own else env)
    timings = {"ray_init_s": time.monotonic() - t_start}
    if importer is not None:
        importer.join()
    dep = TQDeployment(cfg=cfg, owner=False, env=env, ray_inited=ray_inited, ray_started=ray_started, timings=timings)
    global _CLIENT_REFS
    try:
        import transfer_queue.interface as itf

        apply_env(env)  # patch constants if TQ was imported before us
        controller = find_controller()
        t0 = time.monotonic()
        if controller is not None:
            conf = _wait_for_config(controller, deadline)
            if conf.backend.storage_backend == "MooncakeStore":
                from dataplane._host.mooncake_master import apply_client_env_defaults

                apply_client_env_defaults()  # read at store setup, which tq.init does below
                _check_mooncake_master(conf)
            if itf._TQ_CLIENT is None:
                _run_bounded(_quiet_attach, max(0.1, deadline - time.monotonic()), "TransferQueue attach")
            dep.conf = conf
            timings["attach_s"] = time.monotonic() - t0
        elif cfg.attach_only:
            raise RuntimeError(
                "no TransferQueue runs in this Ray cluster (no TransferQueueController actor); start one "
                "first, e.g. dataplane.connect('tq://?backend=simple') in the driver"
            )
        else:
            _start_owned(dep, deadline)
            timings["init_s"] = time.monotonic() - t0
        dep.url, dep.deployment_id = _identity()
        if dep.owner:
            dep._unexport = export_url(dep.url)
        with _CLIENT_LOCK:
            _CLIENT_REFS += 1
        return dep
    except BaseException:
        if dep.owner:
            owner_teardown()
        if dep.master is not None:
            dep.master.stop()
        if ray_inited:
            import ray

            ray.shutdown()
        raise


def _identity() -> tuple[str, str]:
    """``(url, deployment_id)`` of the TransferQueue this process is attached to: the URL names the
    Ray cluster's GCS (one TransferQueue runs per Ray cluster), the id its controller actor."""
    import ray
    import transfer_queue.interface as itf

    controller = itf._TQ_CONTROLLER or find_controller()
    try:
        actor_id = controller._ray_actor_id.hex() if controller is not None else ""
    except AttributeError:  # another Ray's handle type: the id stays unknown, never checked
        actor_id = ""
    gcs = ray.get_runtime_context().gcs_address
    return (f"tq://?ray_address={gcs}" if gcs else ""), (f"tq:{actor_id}" if actor_id else "")


def _quiet_attach() -> Any:
    """``tq.init()`` attaching to the running TransferQueue (it creates this process's client; on
    Mooncake the store's setup logs a harmless "Local segment descriptor not found")."""
    import transfer_queue.interface as itf

    with filtered_stderr():
        return itf.init()


def _check_mooncake_master(conf: Any) -> None:
    address = str(conf.backend.MooncakeStore.master_server_address)
    if not tcp_reachable(address):
        raise RuntimeError(
            f"TransferQueue's mooncake_master {address} is not reachable; its owner has probably "
            f"exited. Restart the owner process (the one that called start_or_attach first)."
        )


def _start_owned(dep: TQDeployment, deadline: float) -> None:
    import ray
    import transfer_queue.interface as itf

    cfg = dep.cfg
    need = cfg.ray_cpus_needed
    units = need - 1
    # Killed actors give their CPUs back a moment later (seen right after a close()): wait a little.
    total = float(ray.cluster_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
    grace_end = min(deadline, time.monotonic() + (10.0 if total >= need else 0.0))
    free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
    while free < need and time.monotonic() < grace_end:
        time.sleep(0.2)
        free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
    if free < need:
        raise RuntimeError(
            f"TransferQueue needs {need} free Ray CPUs (controller + {units} storage unit(s), "
            f"num_cpus=1 each) but this Ray cluster has {free:g} free of {total:g}; tq.init would "
            f"hang forever. Fix: let dataplane start Ray (ray_address=None, no ray.init before) or "
            f"call ray.init(num_cpus=N) with N >= {need} plus what your own actors use, lower num_storage_units, "
            f"or free CPUs held by other actors."
        )

    if cfg.storage == "mooncake":
        if cfg.mooncake_master_address:
            dep.master_address = cfg.mooncake_master_address
            if not tcp_reachable(dep.master_address):
                raise RuntimeError(f"mooncake_master_address {dep.master_address} is not reachable")
        else:
            from dataplane._host.mooncake_master import start_master

            t0 = time.monotonic()
            dep.master = start_master(host=cfg.local_hostname)
            dep.master_address = dep.master.address
            dep.timings["master_start_s"] = time.monotonic() - t0

    conf = build_conf(cfg, dep.master_address)
    try:
        final = _run_bounded(lambda: tq_init(conf), max(0.1, deadline - time.monotonic()), "tq.init")
    except BaseException as e:
        # Killing the actors also fails the tq.init thread's pending ray.get, so it ends too.
        kill_named_actors(units)
        if isinstance(e, _Bounded):
            e.thread.join(10.0)
        reset_tq_globals()
        if isinstance(e, _Bounded):
            raise TimeoutError(
                f"tq.init did not finish within {cfg.init_timeout_s:g}s (init_timeout_s); everything it "
                f"started was killed. Usual causes: Ray CPUs taken by other actors, or a slow/overloaded "
                f"node (raise init_timeout_s)."
            ) from None
        raise
    if itf._TQ_STORAGE is None:
        # Another process created the controller between our check and tq.init: we attached.
        logger.info("another process started TransferQueue first; attached instead")
        dep.conf = _wait_for_config(find_controller(), deadline)
        if dep.master is not None:
            dep.master.stop()
            dep.master = None
        return
    dep.owner = True
    dep.conf = final
    if cfg.storage == "mooncake":
        # Processes that attach build their client from the stored config: make them lend
        # `mooncake_worker_segment_bytes`, so data lives in the owner's segment only.
        shared = copy.deepcopy(final)
        shared.backend.MooncakeStore.global_segment_size = int(cfg.mooncake_worker_segment_bytes)
        ray.get(itf._TQ_CONTROLLER.store_config.remote(shared), timeout=max(0.1, deadline - time.monotonic()))
