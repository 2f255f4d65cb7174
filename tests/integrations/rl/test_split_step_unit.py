"""The split step's pieces in one process: metric aggregation, gradient norm and clipping, the state
machine's errors, and parity with a one-shot step on a plain (unsharded) model. Also runs the
doctests of every ``integrations`` module."""

from __future__ import annotations

import doctest
import importlib
import math
import pkgutil
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import integrations
from dataplane import InvalidArgument
from integrations.rl.conventions import token_logprobs
from integrations.rl.losses import ClippedPolicyLoss
from integrations.rl.split_step import (
    SplitTrainStepMixin,
    TrainStepError,
    aggregate_metrics,
    clip_grad_norm_,
    grad_norm,
)
from integrations.rl.workers.model import TinyCausalLM, TinyConfig


def test_metrics_follow_the_naming_rule() -> None:
    got = aggregate_metrics(
        [
            {"loss": 6.0, "ratio_min": 0.5, "ratio_max": 2.0, "num_valid_tokens": 3.0, "lr": 0.1},
            {"loss": 2.0, "ratio_min": 0.25, "ratio_max": 1.0, "num_valid_tokens": 5.0, "lr": 0.2},
        ],
        8.0,
    )
    assert got == {"loss": 1.0, "lr": 0.2, "num_valid_tokens": 8.0, "ratio_max": 2.0, "ratio_min": 0.25}
    assert aggregate_metrics([{"loss": 3.0}], 0.0) == {"loss": 0.0}, "nothing valid: no division by zero"


def test_grad_norm_and_clipping_match_torch() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 4)
    a(x).pow(2).sum().backward()
    b(x).pow(2).sum().backward()
    expect = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    total = clip_grad_norm_(list(a.parameters()), 0.5)
    assert math.isclose(total, float(expect), rel_tol=1e-6)
    assert math.isclose(float(grad_norm(a.parameters())), 0.5, rel_tol=1e-5)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


class Plain(SplitTrainStepMixin):
    """The state machine on an unsharded model in one process (no process group)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = TinyCausalLM(TinyConfig(dim=16, n_layers=1, n_heads=2, max_len=16))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_world_group(self) -> Any:
        return None

    def loss_inputs(self, batch: Any, loss_fn: Any) -> torch.Tensor:
        return token_logprobs(self.model(batch["input_ids"]), batch["input_ids"])


def batch(b: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, 8, dtype=torch.int64)
    mask[:, :4] = 0
    return TensorDict(
        {
            "input_ids": torch.randint(0, 32, (b, 8), generator=g),
            "loss_mask": mask,
            "prev_logprobs": -torch.rand(b, 8, generator=g),
            "advantages": torch.randn(b, generator=g),
        },
        batch_size=[b],
    )


def test_split_equals_one_shot_in_one_process_and_dummies_add_nothing() -> None:
    loss_fn = ClippedPolicyLoss()
    mbs = [batch(2, 1), batch(0, 2), batch(2, 3)]  # 4 rows x 4 valid tokens, and an empty dummy
    split = Plain()
    split.begin_train_step(loss_fn)
    per_mb = [split.train_microbatch(mb) for mb in mbs]
    metrics = split.finish_train_step()
    assert per_mb[1]["loss"] == 0 and per_mb[1]["num_valid_tokens"] == 0
    assert metrics["num_elements"] == 16 and metrics["num_microbatches"] == 3 and split.weight_version == 1
    ref = Plain()
    ref.optimizer.zero_grad()
    for mb in mbs:
        (loss_fn(ref.loss_inputs(mb, loss_fn), mb).loss / 16).backward()
    clip_grad_norm_(ref.model.parameters(), ref.max_grad_norm)
    ref.optimizer.step()
    for p, q in zip(split.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q), "N = 16 is a power of two: bitwise equal"


def test_state_machine_errors_are_typed() -> None:
    w = Plain()
    with pytest.raises(TrainStepError, match="begin_train_step"):
        w.train_microbatch(batch(1, 0))
    with pytest.raises(TrainStepError):
        w.finish_train_step()
    with pytest.raises(InvalidArgument, match="loss_type"):
        w.begin_train_step(lambda outputs, batch: None)
    assert not w.train_step_open, "a rejected begin opens nothing"
    w.begin_train_step(ClippedPolicyLoss())
    with pytest.raises(TrainStepError, match="already open"):
        w.begin_train_step(ClippedPolicyLoss())
    w.abort_train_step()
    w.abort_train_step()
    assert not w.train_step_open and w.weight_version == 0


def _modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(integrations.__path__, "integrations.")]


@pytest.mark.parametrize("name", _modules())
def test_doctests(name: str) -> None:
    """Every module's examples run; a module whose public functions have examples must have some run."""
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} doctest(s) of {name} failed"
    if name not in WITHOUT_EXAMPLES:
        assert result.attempted > 0, f"{name} has no runnable example; add one or list it in WITHOUT_EXAMPLES"


# Package indexes, process-group glue and Ray glue (their examples need a process group or a Ray:
# the docs show them as code, tests/integrations/rl/test_rl_loops.py runs them).
WITHOUT_EXAMPLES = {
    "integrations.rl.workers",
    "integrations.rl.workers.dtensor",
    "integrations.rl.workers.megatron",
    "integrations.rl.workers.megatron_tiny",
    "integrations.rl.workers.tiny",
    "integrations.rl.examples",
    "integrations.rl.examples.common",
    "integrations.rl.examples.cli",
    "integrations.rl.examples.grpo_tiny",
    "integrations.rl.examples.ppo_tiny",
    "integrations.rl.examples.grpo_async_tiny",
    "integrations.rl.examples.grpo_text",
    "integrations.rl.weight_sync",
    "integrations.rl.sync_loop",
    # the verl facade: install() changes the process's import path and environment, and the facade
    # answers from the deployment it names (tests/integrations/verl runs both in processes of their own)
    "integrations.verl",
    "integrations.verl.facade",
    "integrations.verl.installer",
}
