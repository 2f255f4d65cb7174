"""Starting or joining the Ray a TransferQueue deployment runs on (``ray`` is imported lazily).

A Ray that dataplane starts binds loopback only and needs no ``runtime_env`` (its processes inherit
TQ's variables); a Ray that is joined gets them through the job's ``runtime_env``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping

from dataplane._host.quiet import ray_logging_level
from dataplane.adapters.transfer_queue._deploy_config import TQDeployConfig

__all__ = ["LOOPBACK_ENV", "ensure_ray", "is_loopback_address", "loopback_ray", "tcp_reachable"]

# A Ray that dataplane starts serves one job on one host: every process of it (GCS, raylet, agents,
# workers, our actors, this driver's core worker) binds loopback only. Ray maps a node address of
# 127.0.0.1 to the machine's address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is off (the single-host
# mode Ray uses on macOS/Windows); Ray's processes and TQ's ZMQ sockets then bind 127.0.0.1. A process
# that joins such a Ray needs the same setting, or its ray.init maps 127.0.0.1 away and never finds
# the GCS: we keep it in this process's environment (its subprocesses inherit it) and set it when
# we join a Ray on a loopback address.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextlib.contextmanager
def loopback_ray() -> Iterator[None]:
    """Around a ``ray.init`` that starts or joins a Ray on 127.0.0.1: Ray's single-host mode (for a
    ``ray`` imported before the variable was set, its module flag too, restored after)."""
    import ray._private.ray_constants as ray_constants

    os.environ.update(LOOPBACK_ENV)
    has_flag = hasattr(ray_constants, "ENABLE_RAY_CLUSTER")  # Ray 2.40-2.60 have it; the variable suffices where not
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if has_flag:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if has_flag:
            ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``env``'s entries that this process's environment lacks, set while Ray starts its processes
    (they inherit them) and removed after."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, value in added.items():
            if os.environ.get(key) == value:
                del os.environ[key]


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``host:port``, ``auto``) names a Ray on this host's loopback."""
    if address == "auto":
        try:
            import ray._private.services as services

            address = services.get_ray_address_from_environment("auto", None) or ""
        except Exception:  # no Ray found: ray.init will say so
            return False
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    return host == "localhost" or host == "::1" or host.startswith("127.")


def ensure_ray(cfg: TQDeployConfig, env: Mapping[str, str]) -> tuple[bool, bool]:
    """Make sure Ray is initialised here. Returns ``(we_called_ray_init, we_started_a_local_ray)``.

    A local Ray is started on loopback only (``_node_ip_address="127.0.0.1"``, no dashboard) unless ``ray_init_kwargs`` names ``_node_ip_address`` (then it binds there). Its processes
    inherit this process's environment, which already holds TQ's variables (:func:`apply_env`), so
    the job needs no ``runtime_env``: Ray then hands its prestarted idle workers to TQ's actors
    instead of starting new ones for them.
    """
    import ray

    if ray.is_initialized():
        return False, False
    kwargs = dict(cfg.ray_init_kwargs)
    kwargs.setdefault("logging_level", ray_logging_level())  # no token-auth warning, no INFO banner
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address:
        runtime_env = dict(kwargs.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**env, **dict(runtime_env.get("env_vars") or {})}
        with loopback_ray() if is_loopback_address(address) else contextlib.nullcontext():
            ray.init(address=address, runtime_env=runtime_env, **kwargs)
        return True, False
    kwargs.setdefault("include_dashboard", False)
    num_cpus = cfg.ray_num_cpus or cfg.ray_cpus_needed + max(2, os.cpu_count() or 1)
    if "_node_ip_address" in kwargs:  # the user says where it binds
        with _environ(env):
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
        return True, True
    kwargs["_node_ip_address"] = "127.0.0.1"
    with loopback_ray(), _environ(env):
        # address="local": never join a `ray start` cluster that ray.init() would find on disk.
        ray.init(address="local", num_cpus=num_cpus, **kwargs)
    return True, True


def tcp_reachable(address: str, timeout_s: float = 3.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
