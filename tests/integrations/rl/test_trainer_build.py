"""The trainer actors take any RL worker: what a factory must build, the parallel state its class needs
(set up once per build, torn down before the next), the ``dp x tp x pp`` layout, the Megatron-to-rollout
name map, and ``--worker`` / ``--pp`` on the examples. On a CPU, without megatron-core: the Megatron
flows themselves run on a GPU (``test_megatron_flows_gpu.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from dataplane import InvalidArgument
from integrations.rl.examples import cli, grpo_async_tiny, grpo_tiny, ppo_tiny
from integrations.rl.policy import Policy
from integrations.rl.trainer_actor import TrainerActor, param_digest
from integrations.rl.workers import RLWorkerMixin, TinyCausalLM, TinyConfig
from integrations.rl.workers.build import ParallelStates, check_factories, worker_class
from integrations.rl.workers.layout import RankLayout
from integrations.rl.workers.megatron_weights import QKV, TINY_GPT, Gated, NameMap, tiny_name_map

_events: list[tuple[Any, ...]] = []


class Recording(RLWorkerMixin):
    """A worker whose class needs set-up (as Megatron's does) and records it."""

    @classmethod
    def setup_parallel_state(cls, layout: RankLayout) -> None:
        _events.append(("setup", cls.__name__, layout))

    @classmethod
    def teardown_parallel_state(cls) -> None:
        _events.append(("teardown", cls.__name__))

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Linear(3, 2)
        _events.append(("build", type(self).__name__))

    def compute_device(self) -> torch.device:
        return torch.device("cpu")


class RecordingToo(Recording):
    """The same hooks (inherited): one set-up serves both."""


class OwnHooks(Recording):
    @classmethod
    def setup_parallel_state(cls, layout: RankLayout) -> None:
        _events.append(("setup", "own", layout))


# -- what a factory builds ---------------------------------------------------------------------------
def test_a_factory_of_something_else_is_refused_with_a_typed_error_naming_what_it_needs() -> None:
    actor = TrainerActor(0, 1)
    with pytest.raises(InvalidArgument, match=r"factory 'policy' builds a Linear, not an RLWorkerMixin.*Megatron"):
        actor.build({"policy": functools.partial(nn.Linear, 2, 2)})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument, match=r"factory 'value' built a Linear, not an RLWorkerMixin.*DTensorRL"):
        actor.build({"policy": Recording, "value": lambda: nn.Linear(2, 2)})  # type: ignore[dict-item,return-value]
    with pytest.raises(InvalidArgument, match="'policy' worker"):
        actor.build({"reference": Recording})
    with pytest.raises(InvalidArgument, match="is a int, not callable"):
        actor.build({"policy": 3})  # type: ignore[dict-item]
    # the driver refuses what it can tell before starting any actor (no Ray needed for that)
    with pytest.raises(InvalidArgument, match="builds a dict, not an RLWorkerMixin"):
        Policy.spawn({"policy": dict}, dp=1)  # type: ignore[dict-item]
    assert worker_class(functools.partial(functools.partial(Recording, 1))) is Recording
    assert worker_class(lambda: Recording()) is None
    factory = lambda: Recording()  # noqa: E731
    factory.worker_class = OwnHooks  # type: ignore[attr-defined]
    assert check_factories({"policy": factory}) == {"policy": OwnHooks}


def test_build_sets_up_each_class_once_and_tears_it_down_before_a_rebuild() -> None:
    _events.clear()
    actor = TrainerActor(0, 1)
    actor.build({"policy": Recording, "reference": functools.partial(Recording, 0), "value": RecordingToo})
    layout = RankLayout(dp=1)
    assert _events == [
        ("setup", "Recording", layout),
        *[("build", n) for n in ("Recording", "Recording", "RecordingToo")],
    ]
    info = actor.describe()
    assert info["layout"] == {"dp": 1, "tp": 1, "pp": 1} and info["parallel_states"] == ["Recording"]
    assert info["workers"] == {"policy": "Recording", "reference": "Recording", "value": "RecordingToo"}
    digest = actor.param_digest()
    assert digest == param_digest(dict(Recording().model.named_parameters()))  # export_weights: the model's own

    _events.clear()
    actor.build({"policy": OwnHooks, "reference": Recording})  # two distinct hooks: each once
    assert _events == [
        ("teardown", "Recording"),
        ("setup", "own", layout),
        ("setup", "Recording", layout),
        ("build", "OwnHooks"),
        ("build", "Recording"),
    ]
    _events.clear()
    actor.build({"policy": lambda: Recording()})  # a factory that cannot tell its class: no set-up
    assert _events == [("teardown", "Recording"), ("build", "Recording")]  # OwnHooks inherits the same teardown
    assert actor.describe()["parallel_states"] == [] and actor.param_digest() == digest

    states = ParallelStates()
    states.setup([None, Recording], RankLayout(dp=2, tp=2))
    assert states.classes == ["Recording"]
    states.teardown()
    states.teardown()  # nothing left to tear down
    assert states.classes == []


# -- the layout -------------------------------------------------------------------------------------
def test_rank_layout_is_megatrons_order_and_a_value_object() -> None:
    layout = RankLayout.for_world(8, tp=2, pp=2)
    assert layout == RankLayout(dp=2, tp=2, pp=2) and layout.world == 8
    # Megatron's default order tp-cp-ep-dp-pp (CP = EP = 1): r = tp_rank + tp * (dp_rank + dp * pp_rank)
    for r in range(8):
        assert r == layout.tp_rank(r) + 2 * (layout.dp_rank(r) + 2 * layout.pp_rank(r))
    assert layout.leaders() == [0, 2]  # tp = pp = 0 of each DP rank
    assert RankLayout.for_world(4, tp=2).leaders() == [0, 2]  # the FSDP2 ("dp", "tp") mesh: rank = dp * tp + t
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert RankLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(InvalidArgument, match="do not split into tp=2 x pp=2"):
        RankLayout.for_world(6, tp=2, pp=2)
    with pytest.raises(InvalidArgument):
        RankLayout(dp=0)
    with pytest.raises(InvalidArgument, match="3 actors for dp=1 x tp=1 x pp=2"):
        Policy([object()] * 3, dp=1, pp=2)
    policy = Policy([object()] * 8, dp=2, tp=2, pp=2)
    assert [policy._dp(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert policy._leaders(list(range(8))) == [0, 2]


# -- Megatron names -> the rollout model's ------------------------------------------------------------
def megatron_named(model: TinyCausalLM) -> dict[str, torch.Tensor]:
    """What ``gather_megatron_parameters`` returns for a Megatron GPT computing ``model``'s function
    (written out by hand: q, k, v fused per head, the attention's biases zero)."""
    cfg = model.cfg
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hd = cfg.dim // cfg.n_heads
    out = {
        "embedding.word_embeddings.weight": sd["embed.weight"],
        "embedding.position_embeddings.weight": sd["pos.weight"],
        "decoder.final_layernorm.weight": sd["norm.weight"],
        "decoder.final_layernorm.bias": sd["norm.bias"],
    }
    if cfg.head == "lm":
        out["output_layer.weight"] = sd["head.weight"]
    else:
        out["output_layer.linear.weight"], out["output_layer.linear.bias"] = sd["head.weight"], sd["head.bias"]
    for i in range(cfg.n_layers):
        b, m = f"blocks.{i}.", f"decoder.layers.{i}."
        q, k, v = (sd[b + f"attn.{x}.weight"].reshape(cfg.n_heads, hd, cfg.dim) for x in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(3 * cfg.dim, cfg.dim)
        out[m + "self_attention.linear_qkv.bias"] = torch.zeros(3 * cfg.dim)
        out[m + "self_attention.linear_proj.weight"] = sd[b + "attn.o.weight"]
        out[m + "self_attention.linear_proj.bias"] = torch.zeros(cfg.dim)
        out[m + "mlp.linear_fc1.bias"], out[m + "mlp.linear_fc2.bias"] = sd[b + "up.bias"], sd[b + "down.bias"]
        for mine, theirs in (("norm1", "input_layernorm"), ("norm2", "pre_mlp_layernorm")):
            for p in ("weight", "bias"):
                out[m + f"{theirs}.{p}"] = sd[b + f"{mine}.{p}"]
        out[m + "mlp.linear_fc1.weight"], out[m + "mlp.linear_fc2.weight"] = sd[b + "up.weight"], sd[b + "down.weight"]
    return out


@pytest.mark.parametrize("head", ["lm", "value"])
def test_the_tiny_name_map_gives_the_rollout_model_its_own_weights(head: str) -> None:
    cfg = TinyConfig(vocab_size=8, dim=32, n_layers=2, n_heads=4, max_len=32, head=head)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = TinyCausalLM(cfg)
    names = tiny_name_map(cfg)
    megatron = megatron_named(model)
    mapped = names.apply(megatron, heads=4, groups=4, head_dim=8)
    assert list(mapped) == [n for n, _ in model.named_parameters()]  # the rollout model's order
    for n, p in model.named_parameters():
        assert torch.equal(mapped[n], p.detach()), n
    rollout = TinyCausalLM(cfg)
    rollout.load_state_dict(mapped)  # what RolloutActor.load_weights does, by name
    ids = torch.randint(0, 8, (2, 9))
    assert torch.equal(rollout(ids), model(ids))
    # the inverse (a Megatron model starting from the tiny model's weights): Megatron's names and layout back
    shapes = {n: tuple(t.shape) for n, t in megatron.items()}
    back = names.to_megatron(mapped, heads=4, groups=4, head_dim=8, shapes=shapes)
    assert list(back) == list(shapes) and all(torch.equal(back[n], megatron[n]) for n in shapes)

    # a Megatron GPT without linear biases: the tiny model gets zeros for its MLP's
    no_bias = {n: t for n, t in megatron.items() if not n.endswith("bias") or "layernorm" in n or "linear." in n}
    zeroed = names.apply(no_bias, heads=4, groups=4, head_dim=8)
    assert all(float(zeroed[f"blocks.{i}.{b}.bias"].abs().max()) == 0.0 for i in range(2) for b in ("up", "down"))
    nonzero = {**megatron, "decoder.layers.1.self_attention.linear_proj.bias": torch.ones(32)}
    with pytest.raises(InvalidArgument, match=r"linear_proj.bias is not zero.*freeze it at zero"):
        names.apply(nonzero, heads=4, groups=4, head_dim=8)

    # strict: a Megatron parameter nothing takes, a rollout parameter nothing fills, a wrong shape
    extra = {**megatron_named(model), "decoder.layers.0.self_attention.q_layernorm.weight": torch.ones(8)}
    with pytest.raises(InvalidArgument, match=r"places no rollout parameter for Megatron's \['decoder.layers.0"):
        names.apply(extra, heads=4, groups=4, head_dim=8)
    short = megatron_named(model)
    del short["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(InvalidArgument, match=r"missing \['blocks.1.down.weight'\]"):
        names.apply(short, heads=4, groups=4, head_dim=8)
    wide = megatron_named(model)
    wide["embedding.position_embeddings.weight"] = torch.zeros(32, 33)
    with pytest.raises(InvalidArgument, match=r"pos.weight: Megatron gives \(32, 33\)"):
        names.apply(wide, heads=4, groups=4, head_dim=8)


def test_name_map_splits_grouped_qkv_and_gated_mlps_and_cuts_a_padded_vocabulary() -> None:
    heads, groups, hd, dim = 4, 2, 3, 5
    q = torch.arange(heads * hd * dim, dtype=torch.float32).reshape(heads * hd, dim)
    k = -torch.arange(groups * hd * dim, dtype=torch.float32).reshape(groups * hd, dim) - 1
    v = k - 1000
    # Megatron's rows: per query group its 2 query heads, then its key head, then its value head
    fused = torch.cat(
        [
            torch.cat([q.reshape(groups, 2 * hd, dim)[g], k.reshape(groups, hd, dim)[g], v.reshape(groups, hd, dim)[g]])
            for g in range(groups)
        ]
    )
    table: dict[str, Any] = {
        "qkv.weight": QKV("q", "k", "v"),
        "fc1.weight": Gated("gate", "up"),
        "embed.weight": "embed",
    }
    fc1 = torch.randn(8, dim)
    targets = {"q": (12, 5), "k": (6, 5), "v": (6, 5), "gate": (4, 5), "up": (4, 5), "embed": (7, 5), "b.bias": (5,)}
    out = NameMap(table=table, targets=targets).apply(
        {"qkv.weight": fused, "fc1.weight": fc1, "embed.weight": torch.randn(8, dim)},  # vocab 7 padded to 8
        heads=heads,
        groups=groups,
        head_dim=hd,
    )
    assert torch.equal(out["q"], q) and torch.equal(out["k"], k) and torch.equal(out["v"], v)
    assert torch.equal(out["gate"], fc1[:4]) and torch.equal(out["up"], fc1[4:])
    assert out["embed"].shape == (7, 5) and torch.equal(out["b.bias"], torch.zeros(5))
    assert list(out) == list(targets)
    assert set(TINY_GPT.values()) >= {"embed.weight", "head.weight"}  # a table of plain data


# -- the examples' --worker and --pp -----------------------------------------------------------------
def parse(example: Any, *argv: str) -> grpo_tiny.Options:
    return cli.parse_args(list(argv), defaults=example.DEFAULTS, module=example.__name__, doc="doc")


@pytest.mark.parametrize("example", [grpo_tiny, ppo_tiny, grpo_async_tiny], ids=lambda m: m.__name__.rsplit(".")[-1])
def test_worker_flag_defaults_to_fsdp2_as_before_and_megatron_needs_cuda(example: Any, monkeypatch: Any) -> None:
    opts = parse(example)
    assert opts.worker == "fsdp2" and opts.pp == 1 and opts.ranks == 2
    assert parse(example, "--worker", "fsdp2") == opts
    factories = opts.factories()
    assert {worker_class(f).__name__ for f in factories.values()} == {"TinyDTensorWorker"}  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="--worker megatron trains with Megatron-Core, on GPUs only"):
        parse(example, "--worker", "megatron")
    with pytest.raises(InvalidArgument, match="--pp 2 needs --worker megatron"):
        parse(example, "--pp", "2")
    with pytest.raises(InvalidArgument, match="dp x tp x pp = 1 x 1 x 2 = 2 trainer ranks"):
        parse(example, "--worker", "megatron", "--device", "cuda", "--dp", "1", "--pp", "2")
    assert example.main(["--worker", "megatron", "--steps", "1"]) == 2  # refused before anything starts
    with pytest.raises(SystemExit):
        parse(example, "--worker", "deepspeed")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is not None, reason="megatron-core is installed here")
def test_megatron_without_megatron_core_says_how_to_get_it(monkeypatch: Any) -> None:
    from integrations.rl.workers.megatron import require_megatron

    with pytest.raises(InvalidArgument, match=r"needs megatron-core.*pip install 'dataplane\[megatron\]'"):
        require_megatron()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a GPU, but no megatron-core
    with pytest.raises(InvalidArgument, match="needs megatron-core"):
        parse(grpo_tiny, "--worker", "megatron", "--device", "cuda", "--dp", "1")


def test_megatron_options_refuse_what_the_megatron_flows_do_not_do(monkeypatch: Any) -> None:
    import integrations.rl.workers.megatron as megatron

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(megatron, "require_megatron", lambda: None)  # as on a GPU host with megatron-core
    opts = parse(ppo_tiny, "--worker", "megatron", "--device", "cuda", "--dp", "1", "--tp", "2")
    assert (opts.worker, opts.ranks) == ("megatron", 2)
    factories = opts.factories()
    assert {worker_class(f).__name__ for f in factories.values()} == {"TinyMegatronWorker"}  # type: ignore[union-attr]
    assert {f.keywords["init"] for f in factories.values()} == {"tiny"}  # type: ignore[attr-defined]
    assert factories["policy"].keywords["seed"] == opts.seed and factories["value"].keywords["seed"] == opts.seed + 1  # type: ignore[attr-defined]
    assert factories["policy"].keywords["tp"] == 2 and factories["value"].keywords["value_shift"] is True  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="--model qwen2 trains with --worker fsdp2"):
        replace(opts, model="qwen2")
    with pytest.raises(InvalidArgument, match="does not checkpoint yet"):
        replace(opts, checkpoint_dir="/tmp/x")
