"""Start a Ray for one host whose processes listen on loopback only (``ray`` is imported lazily).

What ``tq://`` does when it starts a Ray, for jobs on other backends that still run Ray actors (the
RL examples on ``mooncake://local``)::

    from dataplane.local_ray import init_local_ray
    init_local_ray(num_cpus=4)   # no-op if this process already runs Ray
"""

from __future__ import annotations

from typing import Any

from dataplane._host.quiet import ray_logging_level
from dataplane.adapters.transfer_queue._ray import loopback_ray
from dataplane.checks import check_int
from dataplane.errors import InvalidArgument

__all__ = ["init_local_ray"]


def init_local_ray(num_cpus: int, **ray_init_kwargs: Any) -> bool:
    """Start a single-host Ray bound to 127.0.0.1, unless this process already runs one.

    Every process of it (GCS, raylet, workers, actors) binds loopback only: nothing listens on the
    machine's other addresses. ``num_cpus`` is required: Ray's default (every core) leaves nothing to
    spare on small machines, and an actor that asks for more CPUs than are free waits forever.

    Args:
        num_cpus: logical CPUs Ray hands out (fractions of them to actors with ``num_cpus=0.5``).
        ray_init_kwargs: more ``ray.init`` arguments (``runtime_env``, ``log_to_driver``, ...);
            ``include_dashboard`` defaults to False.

    Returns:
        True when this call started Ray, False when Ray was already initialised (nothing changed).
    """
    import ray

    check_int("num_cpus", num_cpus, low=1)
    for name in ("address", "_node_ip_address", "num_cpus"):
        if name in ray_init_kwargs:
            raise InvalidArgument(f"init_local_ray sets {name} itself; call ray.init directly to choose it")
    if ray.is_initialized():
        return False
    ray_init_kwargs.setdefault("include_dashboard", False)
    ray_init_kwargs.setdefault("logging_level", ray_logging_level())
    with loopback_ray():
        # address="local": never join a `ray start` cluster that ray.init() would find on disk.
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **ray_init_kwargs)
    return True
