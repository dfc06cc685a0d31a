"""trident.parallel.fsdp in one process (a gloo group of one rank): which modules FSDP2 shards,
its mixed precision, activation checkpointing through the sharded blocks, gathered weights for
rank-0-only forwards, and the ``trainer=fsdp`` settings refused before any work. The 2-process runs
(losses equal to DDP's, every task): tests/test_fsdp.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hydra.utils
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trident.backbone import TransformerBlock, TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM, EncoderDecoder
from trident.parallel.fsdp import (
    DATA_PARALLEL,
    ShardedStrategy,
    check_sharding_config,
    mixed_precision,
    parallelize,
    shards_weights,
    whole_weights,
)
from trident.training.run_checks import check_callbacks, check_ema_config

from .conftest import compose_config
from .sharding_helpers import one_rank_process_group


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    with one_rank_process_group(tmp_path):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=(DATA_PARALLEL,))


def backbone(**options: object) -> TransformerConfig:
    settings = {"n_layers": 2, "dropout": 0.0, **options}
    return TransformerConfig(d_model=32, n_heads=4, d_ff=64, max_seq_len=16, **settings)  # type: ignore[arg-type]


def test_each_block_then_the_root_is_one_fsdp_unit(mesh: DeviceMesh) -> None:
    for net, stacks in [(CausalLM(backbone(), vocab_size=50), ["decoder"]),
                        (EncoderDecoder(backbone(), vocab_size=50), ["encoder", "decoder"])]:
        parallelize(net, mesh, "32-true")
        units = [m for m in net.modules() if isinstance(m, FSDPModule)]
        blocks = [block for name in stacks for block in getattr(net, name).blocks]
        assert units == [net, *blocks] and all(isinstance(b, TransformerBlock) for b in blocks)
        assert all(isinstance(p, DTensor) for p in net.parameters())
        parallelize(net, mesh, "32-true")  # configure_model again (the test after fit): nothing changes
        assert [m for m in net.modules() if isinstance(m, FSDPModule)] == units


def prefetched(unit: FSDPModule, direction: str) -> list[object]:
    return list(getattr(unit._get_fsdp_state(), f"_states_to_{direction}_prefetch"))  # FSDP2's own lists


def test_each_block_prefetches_the_next_in_forward_and_the_one_before_in_backward(mesh: DeviceMesh) -> None:
    """torchtitan's explicit prefetch, within each stack in block order (the encoder's last block prefetches none of
    the decoder's); shared blocks (model.share_layers) run out of order and prefetch nothing."""
    net = EncoderDecoder(backbone(n_layers=3), vocab_size=50)
    parallelize(net, mesh, "32-true")
    for stack in (net.encoder, net.decoder):
        states = [block._get_fsdp_state() for block in stack.blocks]
        assert [prefetched(block, "forward") for block in stack.blocks] == [[states[1]], [states[2]], []]
        assert [prefetched(block, "backward") for block in stack.blocks] == [[], [states[0]], [states[1]]]
    shared = CausalLM(backbone(n_layers=4, share_layers=2), vocab_size=50)
    parallelize(shared, mesh, "32-true")
    assert all(not prefetched(block, way) for block in shared.decoder.blocks for way in ("forward", "backward"))
    tokens = torch.randint(0, 50, (2, 8))
    net(tokens, tokens).sum().backward()  # prefetching runs: forward and backward as before


def test_bf16_runs_bf16_weights_and_reduces_in_fp32(mesh: DeviceMesh) -> None:
    policy = mixed_precision("bf16-mixed")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision("32-true").param_dtype is None
    net = CausalLM(backbone(), vocab_size=50)
    parallelize(net, mesh, "bf16-mixed")
    logits = net(torch.randint(0, 50, (2, 8)))  # (B, T, V)
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sharded_net_gives_the_plain_gradients_with_and_without_activation_checkpointing(
        checkpointing: bool, mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    plain = CausalLM(backbone(activation_checkpointing=checkpointing, dropout=0.1), vocab_size=50)
    sharded = CausalLM(backbone(activation_checkpointing=checkpointing, dropout=0.1), vocab_size=50)
    sharded.load_state_dict(plain.state_dict())
    parallelize(sharded, mesh, "32-true")
    ids = torch.randint(0, 50, (2, 8))
    for net in (plain, sharded):
        torch.manual_seed(1)  # the same dropout masks
        net(ids).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, msg=name)


def test_a_compiled_net_is_sharded_and_gives_the_plain_gradients(mesh: DeviceMesh) -> None:
    """compile=true under FSDP: compile_network compiles the network in place (nn.Module.compile) before
    configure_model shards it, and the compiled sharded net gives the plain gradients. The eager backend: dynamo
    traces through FSDP2's hooks as with inductor, without its code generation (a minute on a CPU; a 2-process
    trainer=fsdp_cpu compile=true run with inductor was checked by hand: docs/scaling.md)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    plain = CausalLM(backbone(), vocab_size=50)
    compiled = CausalLM(backbone(), vocab_size=50)
    compiled.load_state_dict(plain.state_dict())
    compiled.compile(backend="eager")
    parallelize(compiled, mesh, "32-true")
    ids = torch.randint(0, 50, (2, 8))
    for net in (plain, compiled):
        net(ids).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "no graph was compiled"
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, msg=name)


def test_whole_weights_gathers_for_forwards_without_collectives(mesh: DeviceMesh) -> None:
    net = CausalLM(backbone(), vocab_size=50)
    parallelize(net, mesh, "32-true")
    block = net.decoder.blocks[0]
    with whole_weights(net):
        assert not any(isinstance(p, DTensor) for p in block.parameters())
        with torch.no_grad():
            net(torch.randint(0, 50, (1, 4)))
        assert not any(isinstance(p, DTensor) for p in block.parameters()), "a forward keeps them gathered"
    assert all(isinstance(p, DTensor) for p in net.parameters())
    net(torch.randint(0, 50, (1, 4)))
    assert all(isinstance(p, DTensor) for p in block.parameters()), "after it, a block reshards after its forward"


def test_fsdp_presets_build_the_sharded_strategy() -> None:
    for preset, accelerator, devices in [("fsdp", "gpu", -1), ("fsdp_cpu", "cpu", 2)]:
        trainer = compose_config([f"trainer={preset}"]).trainer
        assert (trainer.accelerator, trainer.devices) == (accelerator, devices)
        assert shards_weights(trainer.strategy)
        strategy = hydra.utils.instantiate(trainer.strategy)
        assert isinstance(strategy, ShardedStrategy) and not strategy._save_distributed_checkpoint  # one file
    assert not shards_weights(compose_config(["trainer=ddp"]).trainer.strategy)


@pytest.mark.parametrize(("strategy", "named"), [
    ("fsdp", "trainer.strategy=fsdp is Lightning's FSDP1"),
    ({"_target_": "trident.parallel.fsdp.ShardedStrategy", "data_parallel_size": 1},
     "trainer.strategy.data_parallel_size cannot be set"),
    ({"_target_": "trident.parallel.fsdp.ShardedStrategy", "save_distributed_checkpoint": "yes"},
     "trainer.strategy.save_distributed_checkpoint must be true or false"),
])
def test_what_fsdp_cannot_honour_is_refused(strategy: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        check_sharding_config(strategy)
    with pytest.raises(ConfigError, match="callbacks=ema does not work with FSDP"):
        check_ema_config({"decay": 0.9}, strategy)


def test_callbacks_built_by_a_function_or_naming_nothing_pass_the_averaging_check(caplog: pytest.LogCaptureFixture) -> None:
    """Only a class that averages the weights is refused under FSDP: a ``_target_`` naming a factory function (Hydra
    instantiates it happily) or nothing at all (instantiate says so later) passes, without an error in the log."""
    fsdp = {"_target_": "trident.parallel.fsdp.ShardedStrategy"}
    callbacks = {"factory": {"_target_": "os.getcwd"}, "typo": {"_target_": "no.such.Thing"},
                 "off": None, "progress": {"_target_": "lightning.pytorch.callbacks.RichProgressBar"}}
    check_callbacks(callbacks, fsdp)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    with pytest.raises(ConfigError, match="callbacks.swa .StochasticWeightAveraging. does not work with FSDP"):
        check_callbacks({**callbacks, "swa": {"_target_": "lightning.pytorch.callbacks.StochasticWeightAveraging"}}, fsdp)
