"""Checkpoints of an RL run, and resuming one exactly.

Two halves:

* **a trainer rank's state** (:func:`save_worker_state` / :func:`load_worker_state`, run by every rank
  of the group through :meth:`TrainerActor.save_state <integrations.rl.trainer_actor.TrainerActor.save_state>`):
  each model's weights and optimizer state through ``torch.distributed.checkpoint`` (every rank writes
  its own shards; nothing is gathered to one rank), and per rank its learning-rate schedule, its
  ``weight_version`` and its RNG states (``rank{r}.pt``, one file per rank: DCP would merge equal keys
  of different ranks);
* **the run** (:class:`RunCheckpoints`): one directory per saved step (``step_000010/``: the trainers'
  state and the driver's ``driver.json``: step, versions, the step summaries so far), written beside
  (``.tmp-step_000010``), fsynced and renamed in place, then a ``latest`` pointer replaced last
  (written beside, fsynced, renamed); the oldest directories past ``keep`` are removed after. A run
  killed at any point resumes from the last directory ``latest`` names, which is whole.

The synchronous loops need nothing else to resume bit for bit: the store holds nothing between
steps (each step clears its partition), and every sample and shuffle is drawn from a generator seeded
by ``(seed, step, ...)``, so the rollout actor needs only the weights (synced after loading) and the
step number. The asynchronous controller keeps rows between steps (its replay buffer's committed
groups): :meth:`AsyncGRPO.checkpoint <integrations.rl.controller.AsyncGRPO.checkpoint>` drains the
rollouts in flight and adds a core snapshot of those rows (``buffer/``) and the slot table to the
step directory.

The directory must be visible to every trainer rank (one host, or a shared filesystem).

>>> import tempfile
>>> ckpt = RunCheckpoints(tempfile.mkdtemp(), keep=2)
>>> ckpt.latest() is None
True
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dataplane import DataPlaneError, InvalidArgument
from dataplane.checks import check_int

__all__ = ["CHECKPOINT_FORMAT", "RunCheckpoints", "load_worker_state", "save_worker_state"]

CHECKPOINT_FORMAT = "dataplane-rl-checkpoint/1"
_LATEST = "latest"
_DRIVER = "driver.json"


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank{rank}.pt"


def save_worker_state(worker: Any, path: str | os.PathLike[str], *, rank: int) -> None:
    """Save one model of a trainer group (a collective: every rank of the group calls it with the same
    ``path``): DCP of ``{"model", "optim"}`` and this rank's ``rank{rank}.pt`` (schedule, version, RNG)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    path = Path(path)
    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    sched = getattr(worker, "lr_scheduler", None)
    extras = {
        "weight_version": int(worker.weight_version),
        "lr_scheduler": None if sched is None else sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": repr(random.getstate()),
    }
    tmp = _rank_file(path, rank).with_suffix(".tmp")
    torch.save(extras, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, _rank_file(path, rank))


def load_worker_state(worker: Any, path: str | os.PathLike[str], *, rank: int) -> None:
    """Load what :func:`save_worker_state` saved into a freshly built worker of the same shape (a
    collective). The optimizer's state is built first (``get_state_dict`` on the fresh optimizer), so
    DCP loads into every entry."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    path = Path(path)
    if not _rank_file(path, rank).is_file():
        raise DataPlaneError(f"{path} has no {_rank_file(path, rank).name}: not a whole checkpoint of this group")
    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, checkpoint_id=str(path))
    set_state_dict(worker.model, worker.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extras = torch.load(_rank_file(path, rank), weights_only=True)
    worker.weight_version = int(extras["weight_version"])
    sched = getattr(worker, "lr_scheduler", None)
    if sched is not None and extras["lr_scheduler"] is not None:
        sched.load_state_dict(extras["lr_scheduler"])
    torch.set_rng_state(extras["torch_rng"])
    if extras["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extras["cuda_rng"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


class RunCheckpoints:
    """A run's checkpoint directory: ``step_NNNNNN/`` per saved step and a ``latest`` pointer.

    Args:
        root: the directory (created if missing).
        keep: how many step directories to keep (the newest), >= 1.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = check_int("keep", keep, low=1)
        self.root.mkdir(parents=True, exist_ok=True)

    def latest(self) -> Path | None:
        """The step directory ``latest`` names, or None when nothing was saved yet."""
        pointer = self.root / _LATEST
        if not pointer.is_file():
            return None
        try:
            name = str(json.loads(pointer.read_text())["dir"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataPlaneError(
                f"{pointer} is not a checkpoint pointer ({e}); remove it or pick another directory"
            ) from e
        path = self.root / name
        if not (path / _DRIVER).is_file():
            raise DataPlaneError(f"{pointer} names {name}, which holds no {_DRIVER}: the directory was damaged")
        return path

    def save(
        self, step: int, policy: Any, driver: dict[str, Any], *, extra: Callable[[Path], None] | None = None
    ) -> Path:
        """Save after ``step`` (0-based, the last finished one): the trainers' state
        (``policy.save_checkpoint``), ``extra(directory)`` (what else the run keeps there, e.g. a
        snapshot of the rows it holds) and ``driver`` (JSON), then point ``latest`` at it, then prune."""
        check_int("step", step, low=0)
        name = f"step_{step + 1:06d}"
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        policy.save_checkpoint(str(tmp))
        if extra is not None:
            extra(tmp)
        doc = {"format": CHECKPOINT_FORMAT, "step": step, **driver}
        (tmp / _DRIVER).write_text(json.dumps(doc, indent=1) + "\n")
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = self.root / f".{_LATEST}.tmp"
        pointer.write_text(json.dumps({"dir": name, "step": step}) + "\n")
        with open(pointer, "rb") as f:
            os.fsync(f.fileno())
        os.replace(pointer, self.root / _LATEST)
        _fsync_dir(self.root)
        self._prune(keep=name)
        return final

    def load(self, policy: Any) -> dict[str, Any]:
        """Load the trainers' state from the latest step directory (``policy.load_checkpoint``) and
        return its driver document (``step``: the last finished step; and whatever the driver saved)."""
        path = self.latest()
        if path is None:
            raise InvalidArgument(f"{self.root} holds no checkpoint to resume from; run without --resume first")
        doc = json.loads((path / _DRIVER).read_text())
        if doc.get("format") != CHECKPOINT_FORMAT:
            raise DataPlaneError(f"{path / _DRIVER} is format {doc.get('format')!r}, not {CHECKPOINT_FORMAT!r}")
        policy.load_checkpoint(str(path))
        return doc  # type: ignore[no-any-return]

    def _prune(self, keep: str) -> None:
        steps = sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_"))
        for old in steps[: max(0, len(steps) - self.keep)]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
