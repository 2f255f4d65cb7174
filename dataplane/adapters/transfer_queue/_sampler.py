"""The sampler dataplane starts TransferQueue's controller with: its ``SequentialSampler``, plus claims.

A claim (:mod:`dataplane.adapters.transfer_queue._claims`) is one ``get_meta(mode="fetch")`` whose
``sampling_config`` carries ``dataplane_claim``: the rows the claimant saw ready, as global indexes in
first-put order, the fields they must hold and the tag filter. The controller serves every request
in one thread and calls the sampler there, so the sampler's check of each index (still a row of the
partition, not consumed by the task, its marker naming every required field, its tags matching) and
the controller's consumption mark of what it returns are one atomic step: an index cleared (and
perhaps handed to another key) after the claimant read it is never marked for a row it did not see
ready. Requests without ``dataplane_claim`` sample as ``SequentialSampler`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CLAIM_KEY", "CLAIM_SAMPLER_NAME", "claim_indexes"]

#: The ``sampling_config`` key of a claim.
CLAIM_KEY = "dataplane_claim"
#: ``controller.sampler`` in the config dataplane stores on the controller it started with this sampler.
CLAIM_SAMPLER_NAME = "dataplane.ClaimSampler"


def _ready(tags: Any, need: frozenset[str], tag_filter: Mapping[str, Any] | None) -> bool:
    from dataplane.adapters.transfer_queue._layout import MARKER
    from dataplane.adapters.transfer_queue._tokens import marker_fields
    from dataplane.claims import tags_match

    marker = tags.get(MARKER) if isinstance(tags, Mapping) else None
    if not isinstance(marker, str) or not need <= marker_fields(marker):
        return False
    return tags_match({t: v for t, v in tags.items() if t != MARKER}, tag_filter)


def claim_indexes(ready_indexes: list[int], partition: Any, spec: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The indexes a claim takes: of ``spec["order"]``, those still in the partition, unconsumed
    (in ``ready_indexes``) and ready, at most ``spec["n"]``; all of them marked consumed."""
    if partition is None:
        return [], []
    unconsumed = set(ready_indexes)  # every index of the partition the task has not consumed
    live = set(partition.global_indexes)
    need, tag_filter, n = frozenset(spec["fields"]), spec.get("tag_filter"), int(spec["n"])
    picked: list[int] = []
    for i in spec["order"]:
        if len(picked) >= n:
            break
        if i in unconsumed and i in live and _ready(partition.custom_meta.get(i), need, tag_filter):
            picked.append(i)
            unconsumed.discard(i)
    return picked, picked
