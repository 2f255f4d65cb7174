"""Checks of an RL example run's JSON that the CPU and GPU test modules share (no backend imported)."""

from __future__ import annotations

from typing import Any

import pytest


def check_trainer_times(doc: dict[str, Any], *, data_plane: bool) -> None:
    """Every step has the trainer ranks' data and compute seconds (per rank, within the step's time);
    data-plane runs spend some in reads and write-backs; the run's figures are the steps' sums."""
    for s in doc["steps"]:
        data, compute = s["trainer_data_seconds"], s["trainer_compute_seconds"]
        assert data >= 0 and compute >= 0 and data + compute <= s["seconds"], s
        if s["rows_trained"]:
            assert compute > 0 and (data > 0 if data_plane else True), s
    for key in ("trainer_data_seconds", "trainer_compute_seconds"):
        assert doc[key] == pytest.approx(sum(s[key] for s in doc["steps"]))
    if data_plane:
        assert doc["trainer_data_seconds"] > 0
