"""``install(url)``: make ``import transfer_queue`` mean dataplane's facade in every process of a verl job."""

from __future__ import annotations

import atexit
import importlib.machinery
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dataplane
from dataplane import DataPlaneClient, InvalidArgument
from integrations.verl import facade

__all__ = ["SHIM_DIR", "env_vars", "install", "installed_url", "real_transfer_queue_path", "uninstall"]

log = logging.getLogger(__name__)

SHIM_DIR = str(Path(__file__).resolve().parent / "shim")
DEFAULT_URL = "mooncake://local"

_owner: DataPlaneClient | None = None
_ENV = ("PYTHONPATH", facade.URL_ENV, facade.STRICT_ENV, facade.PICKLE_ENV)


def real_transfer_queue_path() -> list[str]:
    """The directory of the real TransferQueue package (``[]`` when it is not installed), found on
    ``sys.path`` past the shim: the facade serves its submodules from there."""
    entries = [p for p in sys.path if os.path.realpath(p or ".") != os.path.realpath(SHIM_DIR)]
    spec = importlib.machinery.PathFinder.find_spec("transfer_queue", entries)
    if spec is None or not spec.submodule_search_locations:
        return []
    return list(spec.submodule_search_locations)


def _is_facade(module: Any) -> bool:
    return bool(getattr(module, "FACADE", False))


def installed_url() -> str | None:
    """The URL of the deployment :func:`install` started or joined in this process, or None."""
    return None if _owner is None else os.environ.get(facade.URL_ENV)


def env_vars() -> dict[str, str]:
    """What a process needs in its environment to see the facade (after :func:`install`): for a Ray
    cluster's ``runtime_env={"env_vars": ...}`` (processes on other nodes do not inherit the
    driver's environment)."""
    if _owner is None:
        raise RuntimeError("call integrations.verl.install(url) first")
    return {k: os.environ[k] for k in _ENV}


def install(
    url: str | None = None, *, strict: bool = False, pickle_fields: Sequence[str] = (), **options: Any
) -> dict[str, str]:
    """Back verl's ``transfer_queue`` calls with a dataplane deployment, in this process and in every
    process it starts afterwards (Ray's workers included).

    Call it in the driver before verl (or ``transfer_queue``) is imported and before Ray starts. It
    connects to ``url`` (``mooncake://local`` by default: a local Mooncake deployment this process
    owns; any multi-process URL works, ``tq://...`` too), then puts the facade's shim directory first
    on ``sys.path`` and ``$PYTHONPATH`` and names the deployment in ``$DATAPLANE_VERL_URL``, which
    the processes started afterwards inherit. On a Ray cluster, also pass :func:`env_vars` in the
    job's ``runtime_env`` (verl: ``ray_kwargs.ray_init.runtime_env.env_vars``).

    Args:
        url: the deployment (default ``mooncake://local``). ``memory://`` is refused: verl's
            workers are other processes.
        strict: raise :class:`~integrations.verl.facade.MissingRows` where TransferQueue silently
            drops missing keys and fields (stock verl relies on the dropping; see docs/verl.md).
        pickle_fields: object fields whose rows may hold what msgpack cannot (tensors in verl's
            ``multi_modal_inputs`` of a multimodal run): every process of the job reads and writes
            them with pickle. Unpickling runs code from whoever wrote the rows: a trusted job only.
            Without it, numpy arrays and scalars in object rows are stored as lists and numbers.
        options: passed to ``dataplane.connect``.

    Returns:
        The environment variables set (:func:`env_vars`).

    Raises:
        RuntimeError: TransferQueue or verl is already imported in this process (their modules hold
            the real classes: install first), or Ray was started before.
        InvalidArgument: ``url`` names a store other processes cannot join.
    """
    global _owner
    if _owner is not None:
        raise RuntimeError("integrations.verl.install() was already called in this process; uninstall() first")
    real = sys.modules.get("transfer_queue")
    if real is not None and not _is_facade(real):
        raise RuntimeError(
            "the real transfer_queue is already imported in this process, and modules that imported it "
            "(verl's) would keep TransferQueue's classes: call integrations.verl.install() before importing "
            "verl or transfer_queue"
        )
    if "verl.protocol" in sys.modules:
        raise RuntimeError("verl is already imported: call integrations.verl.install() before importing verl")
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        raise RuntimeError(
            "Ray is already running in this process, and its workers will not see the facade: call "
            "integrations.verl.install() before ray.init() (verl's main_ppo starts Ray itself)"
        )
    url = url or DEFAULT_URL
    # first, so that a Ray the connect starts (tq://) gives its workers the shim
    saved = {k: os.environ.get(k) for k in _ENV}
    bad = [f for f in pickle_fields if not isinstance(f, str) or not f or "," in f]
    if bad or isinstance(pickle_fields, str):
        raise InvalidArgument(f"pickle_fields must be a list of field names, got {pickle_fields!r}")
    os.environ[facade.STRICT_ENV] = "1" if strict else "0"
    os.environ[facade.PICKLE_ENV] = ",".join(pickle_fields)
    os.environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *[p for p in [saved["PYTHONPATH"]] if p]])
    sys.path.insert(0, SHIM_DIR)
    try:
        owner = dataplane.connect(url, pickle_fields=pickle_fields, **options)
    except BaseException:
        _restore(saved)
        raise
    if not owner.capabilities.cross_process or not owner.url:
        owner.close()
        _restore(saved)
        raise InvalidArgument(
            f"{url!r} is a store of this process only, and verl's workers are other processes: "
            "use mooncake://local (or a mooncake:// or tq:// deployment)"
        )
    os.environ[facade.URL_ENV] = owner.url
    _publish_to_ray(owner.url)
    _owner = owner
    facade._adopt(owner)
    atexit.register(uninstall)
    log.info("verl's transfer_queue is now dataplane's facade over %s (strict=%s)", owner.url, strict)
    return env_vars()


def _publish_to_ray(url: str) -> None:
    """Inside a Ray that is already up (a ``tq://`` deployment started it), workers started before
    the URL was known find it in Ray's internal KV."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(facade.URL_ENV, url, overwrite=True, namespace=facade.KV_NAMESPACE)


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    while SHIM_DIR in sys.path:
        sys.path.remove(SHIM_DIR)


def uninstall() -> None:
    """Close the deployment :func:`install` connected and undo its changes to this process (modules
    already imported keep the facade's classes). Idempotent."""
    global _owner
    owner, _owner = _owner, None
    if owner is None:
        return
    facade._forget()
    try:
        owner.close()
    finally:
        path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        rest = [p for p in path if p and p != SHIM_DIR]
        _restore(
            {
                "PYTHONPATH": os.pathsep.join(rest) or None,
                facade.URL_ENV: None,
                facade.STRICT_ENV: None,
                facade.PICKLE_ENV: None,
            }
        )
        mod = sys.modules.get("transfer_queue")
        if mod is not None and _is_facade(mod):
            for name in [n for n in sys.modules if n == "transfer_queue" or n.startswith("transfer_queue.")]:
                del sys.modules[name]
