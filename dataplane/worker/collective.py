"""The collectives of a leader broadcast, each bounded by a deadline.

One round is: the descriptor (a fixed-size header broadcast, plus a second broadcast only when the
descriptor outgrows the header), an agreement all-reduce in which every rank reports whether it can
take the buffers, then one broadcast per flat buffer. The only step in which a rank waits on
another's I/O is the descriptor, and the leader always sends one -- its data or its error -- so a
failing read never strands a sibling. Every wait polls the collective's completion against a
deadline and raises :class:`~dataplane.errors.DataPlaneTimeout` instead of blocking forever.

Everything travels as uint8 views, so any dtype goes over any backend (gloo lacks some).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dataplane.errors import BackendUnavailable, DataPlaneError, DataPlaneTimeout

__all__ = [
    "HEADER_BYTES",
    "Agreement",
    "agree",
    "broadcast_buffers",
    "comm_device",
    "recv_descriptor",
    "send_descriptor",
]

HEADER_BYTES = 4096
_MAGIC = b"DPW1"
_PREFIX = 16  # magic (4) + reserved (4) + payload length (8, little-endian)


class Agreement:
    """Codes ranks all-reduce (MAX) after the descriptor: the highest one wins."""

    OK = 0
    MISMATCH = 1  # a sibling's meta or select_fields differ from the leader's
    FAILED = 2  # a rank could not take the buffers (allocation, decode, ...)


def comm_device(group: Any) -> torch.device:
    """Where the group's collectives need their tensors: the current CUDA device for NCCL, else CPU.

    >>> comm_device(None).type  # no group: nothing to broadcast, CPU
    'cpu'
    """
    if group is None:
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work: Any, deadline: float, what: str) -> None:
    """Wait for ``work`` until ``deadline`` (``time.monotonic``); typed errors, never a silent hang."""
    delay = 1e-5
    try:
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise DataPlaneTimeout(
                    f"replica group: timed out waiting for {what}. A rank of the group is not taking part (it "
                    "died, is stuck, or called fetch with another policy/meta). The group's collectives are now "
                    "out of step: abort the job. If the leader's read is legitimately slow, raise timeout_s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-4)  # a wake-up every 0.1 ms at most: the step's latency, not CPU, matters
        work.wait()
    except DataPlaneError:
        raise
    except RuntimeError as e:
        raise BackendUnavailable(
            f"replica group: the collective for {what} failed ({e}); a rank of the group probably died -- "
            "check the other ranks' logs"
        ) from e


def _broadcast(tensor: torch.Tensor, *, src: int, group: Any, deadline: float | None, what: str) -> None:
    work = dist.broadcast(tensor.view(torch.uint8), src=src, group=group, async_op=True)
    assert work is not None
    if deadline is None:
        work.wait()  # stream-ordered on NCCL: the process-group timeout bounds it
    else:
        _wait(work, deadline, what)


def send_descriptor(payload: bytes, *, src: int, group: Any, device: torch.device, deadline: float) -> int:
    """Leader side: broadcast ``payload``; returns the bytes sent."""
    header = bytearray(HEADER_BYTES)
    header[:4] = _MAGIC
    header[8:16] = len(payload).to_bytes(8, "little")
    inline = min(len(payload), HEADER_BYTES - _PREFIX)
    header[_PREFIX : _PREFIX + inline] = payload[:inline]
    wait_until = deadline if device.type == "cpu" else None
    _broadcast(
        torch.frombuffer(header, dtype=torch.uint8).to(device),
        src=src,
        group=group,
        deadline=wait_until,
        what="the descriptor",
    )
    rest = payload[inline:]
    if rest:
        tail = torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(device)
        _broadcast(tail, src=src, group=group, deadline=wait_until, what="the descriptor's tail")
    return HEADER_BYTES + len(rest)


def recv_descriptor(*, src: int, group: Any, device: torch.device, deadline: float) -> tuple[bytes, int]:
    """Sibling side: the leader's descriptor bytes and the bytes received."""
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
    _broadcast(header, src=src, group=group, deadline=deadline, what="the leader's descriptor")
    raw = bytes(header.cpu().numpy().tobytes())
    if raw[:4] != _MAGIC:
        raise DataPlaneError(
            "replica group: the leader sent something that is not a dataplane descriptor; another collective "
            "is interleaved with fetch on this group -- give the data plane its own group or serialize the calls"
        )
    length = int.from_bytes(raw[8:16], "little")
    inline = min(length, HEADER_BYTES - _PREFIX)
    payload = raw[_PREFIX : _PREFIX + inline]
    received = HEADER_BYTES
    if length > inline:
        tail = torch.empty(length - inline, dtype=torch.uint8, device=device)
        _broadcast(tail, src=src, group=group, deadline=deadline, what="the descriptor's tail")
        payload += bytes(tail.cpu().numpy().tobytes())
        received += length - inline
    return payload, received


def agree(code: int, *, group: Any, device: torch.device, deadline: float) -> int:
    """All-reduce MAX of every rank's :class:`Agreement` code."""
    flag = torch.tensor([code], dtype=torch.int32, device=device)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
    assert work is not None
    _wait(work, deadline, "the group's agreement to receive the buffers")
    return int(flag.item())


def broadcast_buffers(buffers: Sequence[torch.Tensor], *, src: int, group: Any, deadline: float) -> None:
    """Broadcast each flat buffer. On CUDA the calls are stream-ordered (bounded by the group's timeout)."""
    works = []
    for buf in buffers:
        if buf.numel():
            work = dist.broadcast(buf.view(torch.uint8), src=src, group=group, async_op=True)
            assert work is not None
            works.append(work)
    for work in works:
        if buffers and buffers[0].device.type == "cpu":
            _wait(work, deadline, "the data buffers")
        else:
            work.wait()
