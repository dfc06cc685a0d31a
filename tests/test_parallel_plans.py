"""Parallel plans declared by the modules (trident.backbone.parallel_plan, carried out by
trident.parallel.tensor_parallel), and the one test of a strategy: whether it shards the weights
(trident.parallel.fsdp.shards_weights), by its class, never by its name.

Fast, in one process: what each kind of module declares, a new kind of module split by its declaration alone,
the configured head counts left as built, and which ``trainer.strategy`` values shard; a read of ``src/`` finds no
strategy recognised by its name."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trident.backbone import Columns, FeedForward, Heads, MultiHeadAttention, ParallelPlan, Rows
from trident.models import CausalLM, SequenceClassifier, VisionTransformer, vit_geometry
from trident.parallel.fsdp import ShardedStrategy, parallelize, shards_weights, strategy_class
from trident.parallel.tensor_parallel import tensor_parallelize

from .conftest import compose_config
from .sharding_helpers import fake_two_ranks
from .test_tensor_parallel import backbone

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def two_ranks() -> Iterator[DeviceMesh]:
    """Rank 0 of a tensor-parallel group of 2 (torch's fake process group)."""
    with fake_two_ranks() as mesh:
        yield mesh


def test_each_kind_of_module_declares_its_plan() -> None:
    cfg = backbone()  # 4 query heads, 2 key/value heads of 8; swiglu, d_ff 48
    attention = MultiHeadAttention(32, 4, n_kv_heads=2)
    assert attention.parallel_plan() == {"": Heads(), "qkv_proj": Columns(parts=(32, 16, 16)), "out_proj": Rows()}
    cross = MultiHeadAttention(32, 4, n_kv_heads=2, cross=True)
    assert cross.parallel_plan() == {"": Heads(), "q_proj": Columns(), "kv_proj": Columns(parts=(16, 16)),
                                     "out_proj": Rows()}
    # swiglu's fused fc_in: the gate and the value split apart (each rank's hidden units need both).
    assert FeedForward(32, 48, activation="swiglu").parallel_plan() == {"fc_in": Columns(parts=(48, 48)), "fc_out": Rows()}
    assert FeedForward(32, 48, activation="gelu").parallel_plan() == {"fc_in": Columns(), "fc_out": Rows()}
    assert CausalLM(cfg, vocab_size=50).parallel_plan() == {"embed": Rows(whole_input=True), "head": Columns(gather=True)}
    # A classifier's and a ViT's embeddings and heads declare nothing: they stay whole.
    vit_cfg = backbone(**vit_geometry(8, 4, "cls"), activation="gelu")
    for net in (SequenceClassifier(cfg, 50, 3), VisionTransformer(vit_cfg, patch_size=4, in_channels=3, num_classes=3)):
        assert not hasattr(net, "parallel_plan")


class Scaled(nn.Module):
    """A kind of module the mechanics have never seen: one projection split by its declaration alone."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def parallel_plan(self) -> ParallelPlan:
        return {"proj": Columns(gather=True)}

    def forward(self, x: Tensor) -> Tensor:
        return 2 * self.proj(x)


def test_a_new_kind_of_module_is_split_by_what_it_declares(two_ranks: DeviceMesh) -> None:
    net = nn.Sequential(Scaled(), nn.Linear(6, 4))  # the plain Linear declares nothing: whole
    tensor_parallelize(net, two_ranks["tensor_parallel"])
    assert isinstance(net[0].proj.weight, DTensor) and net[0].proj.weight.placements == (Shard(0),)
    assert net[0].proj.weight.to_local().shape == (3, 8)
    assert not isinstance(net[1].weight, DTensor)


def test_the_configured_head_counts_stay_as_built_and_the_plan_gives_the_local_ones(two_ranks: DeviceMesh) -> None:
    """No attribute the configuration set is changed: the rank's share is read through the plan's head share."""
    plain = CausalLM(backbone(), vocab_size=50)
    split = CausalLM(backbone(), vocab_size=50)
    parallelize(split, two_ranks, "32-true")
    for before, after in zip(plain.decoder.blocks, split.decoder.blocks, strict=True):
        built = {k: v for k, v in vars(before.self_attn).items() if not k.startswith("_") and k != "head_rng"}
        assert {k: vars(after.self_attn)[k] for k in built} == built
        assert (after.self_attn.heads, after.self_attn.kv_heads, after.self_attn.ranks) == (4, 2, 2)
        assert (after.self_attn.n_heads, after.self_attn.n_kv_heads) == (2, 1)
        assert before.self_attn.ranks == 1 and before.self_attn.split_sizes == before.self_attn.widths == (32, 16, 16)


def test_a_tied_matrix_stays_one_parameter_split_alike(two_ranks: DeviceMesh) -> None:
    net = CausalLM(backbone(), vocab_size=50)
    tensor_parallelize(net, two_ranks["tensor_parallel"])
    assert net.head.weight is net.embed.weight and net.embed.weight.placements == (Shard(0),)
    untied = CausalLM(backbone(), vocab_size=50, tie_embeddings=False)
    tensor_parallelize(untied, two_ranks["tensor_parallel"])
    assert untied.head.weight is not untied.embed.weight


def test_a_tied_matrix_split_two_ways_is_refused(two_ranks: DeviceMesh) -> None:
    class Mismatched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def parallel_plan(self) -> ParallelPlan:
            return {"a": Columns(), "b": Rows()}

    with pytest.raises(ValueError, match="share one weight, which their parallel plans split differently"):
        tensor_parallelize(Mismatched(), two_ranks["tensor_parallel"])


class OwnSharded(ShardedStrategy):
    """A strategy of a user's own, named after nothing trident knows: it shards, as its base does."""


@pytest.mark.parametrize(("strategy", "shards"), [
    ({"_target_": "trident.parallel.fsdp.ShardedStrategy", "tensor_parallel_size": 2}, True),
    ({"_target_": f"{__name__}.OwnSharded"}, True),
    ({"_target_": "lightning.pytorch.strategies.ModelParallelStrategy"}, True),
    ({"_target_": "lightning.pytorch.strategies.FSDPStrategy"}, True),
    ({"_target_": "lightning.pytorch.strategies.DDPStrategy"}, False),
    ({"_target_": "no.such.Strategy"}, False),  # Hydra refuses it when it builds the trainer
    ({"_target_": "os.getcwd"}, False),  # a function, not a class
    ({"tensor_parallel_size": 2}, False),
    ("fsdp", True), ("FSDP", True), ("fsdp_cpu_offload", True),  # Lightning's registry: FSDPStrategy (FSDP1)
    ("ddp", False), ("ddp_spawn", False), ("deepspeed", False), ("auto", False), ("my_fsdp", False), (None, False),
    (OwnSharded, True), (DDPStrategy, False), (ShardedStrategy(), True), (DDPStrategy(), False),
])
def test_a_strategy_shards_the_weights_by_its_class(strategy: object, shards: bool) -> None:
    assert shards_weights(strategy) is shards


def test_the_strategy_class_comes_from_the_target_or_lightnings_registry() -> None:
    assert strategy_class(compose_config(["trainer=fsdp_cpu"]).trainer.strategy) is ShardedStrategy
    assert strategy_class("fsdp") is FSDPStrategy and strategy_class("ddp") is DDPStrategy
    assert strategy_class("auto") is None and strategy_class({"_target_": "os.getcwd"}) is None
    assert issubclass(ShardedStrategy, ModelParallelStrategy)


# How code recognises a strategy by its name: a class name, a substring of its config value, a comparison of its
# value with a name, a _target_ cut down to its last dotted part.
BY_NAME = [
    re.compile(r"Strategy\.__name__"),
    re.compile(r"type\([^)]*strategy[^)]*\)\.__name__", re.IGNORECASE),
    re.compile(r"[\"'](fsdp|ddp|deepspeed|model_?parallel|sharded)[\w-]*[\"']\s+(not\s+)?in\b", re.IGNORECASE),
    re.compile(r"strategy[\w.\[\]\"'()]*\s*(==|!=)\s*[\"']", re.IGNORECASE),
    re.compile(r"\bin\s+str\(\s*[\w.]*strategy", re.IGNORECASE),
    re.compile(r"_target_[^\n]*\.rsplit\("),
]


def strategies_recognised_by_name(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if any(pattern.search(line) for pattern in BY_NAME)]


def test_no_strategy_is_recognised_by_its_name_in_src() -> None:
    found = {str(path.relative_to(SRC)): lines for path in sorted(SRC.rglob("*.py"))
             if (lines := strategies_recognised_by_name(path.read_text()))}
    assert not found, f"strategies recognised by their names (use trident.parallel.fsdp.shards_weights): {found}"


def test_the_read_catches_each_way_of_naming_a_strategy() -> None:
    for line in ['NAMES = {ShardedStrategy.__name__, FSDPStrategy.__name__}',
                 'return "fsdp" in str(strategy).lower()',
                 'if type(trainer.strategy).__name__ == "ModelParallelStrategy":',
                 'if cfg.trainer.strategy == "ddp":',
                 'kind = str(strategy.get("_target_", "")).rsplit(".", 1)[-1]']:
        assert strategies_recognised_by_name(line), line
    assert not strategies_recognised_by_name('devices=1, num_nodes=1, strategy="auto")')
    assert not strategies_recognised_by_name("if shards_weights(cfg.trainer.get('strategy')):")
