"""Checks of an RL example run's JSON that the CPU and GPU test modules share (no backend imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
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


def check_tensorboard(directory: Any, steps: int, groups: tuple[str, ...]) -> set[str]:
    """The run's TensorBoard event files (read back with TensorBoard's own reader) hold a scalar of
    every tag of ``groups`` (``"reward"``, ``"policy"``, ...: the tag prefixes of
    :data:`integrations.rl.step_log.SCALARS` the run has) for every step ``0..steps-1``, and
    ``steps.jsonl`` one line per step. Returns the tags found."""
    import json
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from integrations.rl.step_log import SCALARS

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    found = set(acc.Tags()["scalars"])
    want = {tag for tag in SCALARS.values() if tag.split("/")[0] in groups}
    want -= {"policy/kl"} if "kl" not in groups else set()
    assert want <= found, sorted(want - found)
    for tag in want:
        assert [e.step for e in acc.Scalars(tag)] == list(range(steps)), tag
    lines = Path(directory, "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(steps))
    return found


def write_rollout(
    owner: Any,
    fields: dict[str, Any],
    lengths: list[int],
    *,
    uids: list[str],
    group: int,
    partition: str,
    mb_tokens: int,
) -> tuple[Any, list[Any]]:
    """Write a rollout's rows (``input_ids`` and ``loss_mask`` token-aligned) and cut them into two DP
    shards whose plans have several microbatches each (what the worker tests want to exercise)."""
    from dataplane.columns import first_write
    from dataplane.preshard import shard_meta_for_dp

    meta = first_write(
        owner,
        fields,
        uids=uids,
        group_size=group,
        partition_id=partition,
        token_fields=["input_ids", "loss_mask"],
        lengths=lengths,
    )
    shards = shard_meta_for_dp(meta, 2, max_tokens_per_microbatch=mb_tokens)
    assert all(len(s.extra_info["microbatches"]) > 1 for s in shards), "the test wants several microbatches"
    return meta, shards


def run_example(example: str, tmp_path: Path, *args: str, timeout_s: float = 600) -> dict[str, Any]:
    """``python -m integrations.rl.examples.<example> ARGS --json ...`` as a user runs it; its JSON."""
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run(
        [sys.executable, "-m", f"integrations.rl.examples.{example}", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]
