"""``ClaimSampler``: TransferQueue's ``SequentialSampler``, plus claims (:mod:`._sampler` says how).

This module imports TransferQueue at its top so that Ray sends the class to the controller by
reference, and the controller's process resolves its base against the ``BaseSampler`` it checks
(also where a verl facade stands in for the package). Only code that starts a controller imports
it, inside a function (``_init.tq_init``), so ``import dataplane`` never imports TransferQueue.
"""

from __future__ import annotations

from typing import Any

from transfer_queue.sampler import SequentialSampler

from dataplane.adapters.transfer_queue._sampler import CLAIM_KEY, claim_indexes

__all__ = ["ClaimSampler"]


class ClaimSampler(SequentialSampler):  # type: ignore[misc]
    """``SequentialSampler`` that also serves claims (a request whose ``sampling_config`` holds
    :data:`~dataplane.adapters.transfer_queue._sampler.CLAIM_KEY`)."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        spec = kwargs.pop(CLAIM_KEY, None)
        if spec is None:
            return super().sample(ready_indexes, batch_size, *args, **kwargs)  # type: ignore[no-any-return]
        return claim_indexes(ready_indexes, kwargs.get("partition"), spec)
