"""Consumption by task: what a claim asks for, what a task's consumption looks like, and the one
selection rule every backend applies.

A *task* (``"train"``, ``"ref_logprobs"``, ...) claims rows of a partition that hold every one of its
``required_fields`` (and match an optional tag filter) and that it has not claimed yet; each row is
handed to a task at most once, whichever process claims, until the row is cleared or the task's
claims are reset. Tasks need no registration, as in TransferQueue: a task that never claimed has
claimed nothing. The client methods are :meth:`~dataplane.DataPlaneClient.claim_meta`,
:meth:`~dataplane.DataPlaneClient.consumption_status`,
:meth:`~dataplane.DataPlaneClient.reset_consumption` and
:meth:`~dataplane.DataPlaneClient.mark_finished`; what is atomic on each backend:
``docs/claims.md``.

>>> import dataplane, torch
>>> with dataplane.connect() as c:
...     _ = c.kv_batch_put(["a", "b"], {"x": torch.ones(2)}, partition_id="p")
...     c.claim_meta("train", partition_id="p", required_fields="x", batch_size=8).keys
...     c.claim_meta("train", partition_id="p", required_fields="x", batch_size=8).keys
('a', 'b')
()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dataplane.codec.wire import validate_field_name
from dataplane.errors import InvalidArgument, SchemaError

__all__ = [
    "MAX_TASK_LEN",
    "ConsumptionStatus",
    "check_required",
    "check_tag_filter",
    "check_task",
    "count_status",
    "tags_match",
]

MAX_TASK_LEN = 200
"""The most characters a task name holds."""

_MISSING = object()


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumptionStatus:
    """Where one task stands on one partition (:meth:`~dataplane.DataPlaneClient.consumption_status`).

    Every row of the partition is counted once: claimed by the task, or not claimed and ready (it
    holds every required field and matches the tag filter), or not claimed and not ready.

    Attributes:
        partition_id: the partition.
        task_name: the task.
        claimed: rows the task has claimed (rows cleared since are not counted).
        ready: rows the task has not claimed that a claim would hand out now.
        not_ready: rows the task has not claimed that lack a required field or fail the filter.
        finished: a producer marked the partition finished (:meth:`~dataplane.DataPlaneClient.mark_finished`).

    >>> s = ConsumptionStatus(partition_id="p", task_name="t", claimed=2, ready=0, not_ready=0, finished=True)
    >>> s.total, s.all_consumed, s.drained
    (2, True, True)
    """

    partition_id: str
    task_name: str
    claimed: int
    ready: int
    not_ready: int
    finished: bool = False

    @property
    def total(self) -> int:
        """Rows in the partition now."""
        return self.claimed + self.ready + self.not_ready

    @property
    def all_consumed(self) -> bool:
        """The partition holds rows and the task has claimed every one (TransferQueue's
        ``check_consumption_status``: False for an empty partition)."""
        return self.total > 0 and self.claimed == self.total

    @property
    def drained(self) -> bool:
        """A producer marked the partition finished and no row is left for the task to claim."""
        return self.finished and self.ready == 0 and self.not_ready == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ConsumptionStatus:
        return cls(**dict(d))


def check_task(task_name: object) -> str:
    """``task_name`` if it names a task: a non-empty printable ``str`` of at most 200 characters.

    Raises:
        InvalidArgument: it does not (a typo'd ``None`` must not claim rows for an anonymous task).

    >>> check_task("train")
    'train'
    """
    if not isinstance(task_name, str) or not task_name or len(task_name) > MAX_TASK_LEN:
        raise InvalidArgument(
            f"task_name must be a non-empty str of at most {MAX_TASK_LEN} characters (e.g. 'train'), got {task_name!r}"
        )
    if not task_name.isprintable():
        raise InvalidArgument(f"task_name {task_name!r} holds control characters; use printable text")
    return task_name


def check_required(required_fields: object, *, allow_none: bool = False) -> tuple[str, ...]:
    """The required fields as a tuple of valid, distinct field names (one str counts as one field).

    Raises:
        InvalidArgument: none given (a claim must say what a ready row holds), or a repeat.
        SchemaError: a name that is no field name.
    """
    if required_fields is None and allow_none:
        return ()
    if isinstance(required_fields, str):
        required_fields = [required_fields]
    if not isinstance(required_fields, Sequence) or not required_fields:
        raise InvalidArgument(
            "required_fields must name at least one field a row needs before the task may claim it, "
            f"e.g. ['input_ids', 'advantages']; got {required_fields!r}"
        )
    out = tuple(validate_field_name(f) for f in required_fields)
    if len(set(out)) != len(out):
        raise InvalidArgument(f"required_fields has duplicates: {list(out)}")
    return out


def check_tag_filter(tag_filter: object) -> dict[str, Any] | None:
    """A tag filter as a dict ``{tag: value}`` (a row matches when each tag equals its value), or None.

    Raises:
        SchemaError: not a mapping with str keys.
    """
    if tag_filter is None:
        return None
    if not isinstance(tag_filter, Mapping) or not all(isinstance(k, str) for k in tag_filter):
        raise SchemaError(
            f"tag_filter must be a dict of tag name -> value, e.g. {{'weight_version': 3}}; got {tag_filter!r}"
        )
    return dict(tag_filter)


def tags_match(tags: Mapping[str, Any], tag_filter: Mapping[str, Any] | None) -> bool:
    """Whether a row's merged ``tags`` hold every tag of ``tag_filter`` with an equal value.

    >>> tags_match({"v": 3, "uid": "u0"}, {"v": 3}), tags_match({"v": 2}, {"v": 3}), tags_match({}, None)
    (True, False, True)
    """
    if not tag_filter:
        return True
    return all(tags.get(k, _MISSING) == v for k, v in tag_filter.items())


def count_status(
    partition_id: str,
    task_name: str,
    rows: Iterable[tuple[bool, frozenset[str], Mapping[str, Any]]],
    required: Sequence[str],
    tag_filter: Mapping[str, Any] | None,
    *,
    finished: bool,
) -> ConsumptionStatus:
    """A :class:`ConsumptionStatus` from each row's (claimed by the task, fields, tags)."""
    claimed = ready = not_ready = 0
    need = frozenset(required)
    for was_claimed, fields, tags in rows:
        if was_claimed:
            claimed += 1
        elif need <= fields and tags_match(tags, tag_filter):
            ready += 1
        else:
            not_ready += 1
    return ConsumptionStatus(
        partition_id=partition_id,
        task_name=task_name,
        claimed=claimed,
        ready=ready,
        not_ready=not_ready,
        finished=finished,
    )
