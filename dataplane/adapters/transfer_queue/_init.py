"""``tq.init`` for the process that owns a TransferQueue deployment, with TQ's actors started side by
side and the controller given dataplane's claim sampler (see :func:`tq_init`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dataplane._host.quiet import filtered_stderr
from dataplane.adapters.transfer_queue._deploy_config import CONTROLLER_NAME, TQ_NAMESPACE

__all__ = ["tq_init"]


def tq_init(conf: dict[str, Any]) -> Any:
    """``tq.init(conf)`` for the owner, with TQ's actors started side by side.

    ``tq.init`` creates the controller actor, waits until it serves, and only then creates the
    storage units and waits for them. Each actor's worker spends seconds importing
    ``transfer_queue`` (torch, tensordict), so start-up paid that once per actor, in sequence. The
    units need nothing from the controller: here they start together and the imports overlap.
    Otherwise the same steps as ``tq.init`` 0.1.11 (its metrics exporter or a sampler object go
    through ``tq.init`` itself).
    """
    import ray
    import transfer_queue.interface as itf
    from omegaconf import OmegaConf

    final = OmegaConf.merge(
        OmegaConf.create({}, flags={"allow_objects": True}),
        OmegaConf.load(str(Path(itf.__file__).parent / "config.yaml")),  # not the package: it may be a facade
        conf,
    )
    sampler = final.controller.sampler
    if final.metrics.enabled or not isinstance(sampler, str) or not hasattr(itf, sampler):
        return itf.init(conf)
    sampler_cls: Any = getattr(itf, sampler)
    if sampler == "SequentialSampler":  # the default: dataplane's, which also serves claims
        from dataplane.adapters.transfer_queue._claim_sampler import ClaimSampler
        from dataplane.adapters.transfer_queue._sampler import CLAIM_SAMPLER_NAME

        sampler_cls = ClaimSampler
        final.controller.sampler = CLAIM_SAMPLER_NAME  # stored with the config: attaching processes see it
    try:
        itf._TQ_CONTROLLER = itf.TransferQueueController.options(name=CONTROLLER_NAME, namespace=TQ_NAMESPACE).remote(
            sampler=sampler_cls, polling_mode=final.controller.polling_mode
        )
    except ValueError:  # another process created it just now: attach, as tq.init does
        itf._init_from_existing()
        return final
    controller_info = itf._TQ_CONTROLLER.get_zmq_server_info.remote()
    backend = final.backend.storage_backend
    storage: dict[str, Any] = {}
    itf._TQ_STORAGE = storage
    provider = itf.StorageBootstrapProvider.get_provider(backend)
    if provider is None:
        raise RuntimeError(f"TransferQueue has no storage backend {backend!r}")
    resources_ = provider(final)  # SimpleStorage: creates the units and waits for them
    if resources_ is not None:
        storage[backend] = resources_
    final.controller.zmq_info = ray.get(controller_info)
    ray.get(itf._TQ_CONTROLLER.store_config.remote(final))
    with filtered_stderr():  # Mooncake's glog: "Local segment descriptor not found" (harmless)
        itf._maybe_create_tq_client(final)
    return final
