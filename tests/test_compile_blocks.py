"""``compile=blocks`` (issue 57): each Transformer block compiled on its own, in place, before FSDP shards those
same blocks (torchtitan's ``apply_compile`` order); ``compile=true`` (the whole network) and ``false`` as before;
any other value one ConfigError line."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

import trident.runs.lifecycle
from trident.backbone import TransformerBlock, TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM, EncoderDecoder, generate
from trident.models.decoding import Decoding, beam_search, greedy_decode
from trident.parallel.fsdp import DATA_PARALLEL, parallelize
from trident.runs.pipeline import train
from trident.tasks.networks import compile_network

from .conftest import SMALL, compose_config
from .sharding_helpers import one_rank_process_group

pytestmark = pytest.mark.usefixtures("single_thread")


class _Task(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def backbone() -> TransformerConfig:
    return TransformerConfig(d_model=32, n_heads=4, n_layers=3, d_ff=64, max_seq_len=16, dropout=0.0,
                             pos_encoding="rope")


def blocks_of(net: nn.Module) -> list[nn.Module]:
    return [module for module in net.modules() if isinstance(module, TransformerBlock)]


def test_blocks_compiles_each_block_in_place_and_nothing_else() -> None:
    task = _Task(EncoderDecoder(backbone(), vocab_size=50))
    names = list(task.state_dict())
    compile_network(task, "blocks")
    assert len(blocks_of(task.net)) == 6
    assert all(block._compiled_call_impl is not None for block in blocks_of(task.net))
    assert task.net._compiled_call_impl is None and task.net.encoder._compiled_call_impl is None
    assert list(task.state_dict()) == names  # checkpoints keep their parameter names
    plain = _Task(CausalLM(backbone(), vocab_size=50))
    compile_network(plain, False)
    assert not any(m._compiled_call_impl is not None for m in plain.modules() if isinstance(m, nn.Module))
    compile_network(plain, True)
    assert plain.net._compiled_call_impl is not None and blocks_of(plain.net)[0]._compiled_call_impl is None


@pytest.mark.parametrize("value", ["yes", "block", 1, None])
def test_a_bad_compile_value_is_one_config_error(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^compile must be true, false or blocks, got .*: true compiles the whole"):
        compile_network(_Task(CausalLM(backbone(), vocab_size=50)), value)


def test_blocks_without_a_transformer_block_is_refused() -> None:
    with pytest.raises(ConfigError, match="compile=blocks found no Transformer block in _Task's networks: use compile=true"):
        compile_network(_Task(nn.Linear(3, 3)), "blocks")


def test_the_command_line_value_reaches_compile_network_as_blocks(tmp_path: Path) -> None:
    assert compose_config(["compile=blocks"], output_dir=tmp_path).compile == "blocks"
    assert compose_config(["compile=true"], output_dir=tmp_path).compile is True


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    with one_rank_process_group(tmp_path):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=(DATA_PARALLEL,))


def test_compiled_blocks_are_the_fsdp_units_and_give_the_plain_gradients(
        mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_network then parallelize (the run's order): FSDP wraps the compiled blocks themselves, one graph
    serves the three blocks, and the gradients are eager's. Dynamo's eager backend: it traces as inductor does
    without its code generation (a minute here; the inductor run is the slow test below)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.manual_seed(0)
    plain = CausalLM(backbone(), vocab_size=50)
    task = _Task(CausalLM(backbone(), vocab_size=50))
    task.net.load_state_dict(plain.state_dict())
    compile_network(task, "blocks")
    parallelize(task.net, mesh, "32-true")
    units = [m for m in task.net.modules() if isinstance(m, FSDPModule)]
    assert units == [task.net, *task.net.decoder.blocks]
    assert all(block._compiled_call_impl is not None for block in task.net.decoder.blocks)
    ids = torch.randint(0, 50, (2, 8))
    for net in (plain, task.net):
        net(ids).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "one graph for the three blocks"
    for (name, p), q in zip(plain.named_parameters(), task.net.parameters(), strict=True):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, msg=name)
    torch._dynamo.reset()


def training_losses(overrides: list[str], output_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], Any]:
    """The training losses of train.py's pipeline with ``overrides``, and the task it trained."""
    built: list[Any] = []
    losses: list[float] = []
    def spy(task: Any, mode: Any) -> None:
        built.append(task)
        step = task.training_step

        def recorded(batch: Any, batch_idx: int) -> torch.Tensor:
            loss = step(batch, batch_idx)
            losses.append(float(loss))
            return loss

        task.training_step = recorded
        compile_network(task, mode)  # the real one, not an earlier call's spy

    monkeypatch.setattr(trident.runs.lifecycle, "compile_network", spy)
    train(compose_config(overrides, output_dir=output_dir))
    return losses, built[0]


@pytest.mark.slow
def test_compile_blocks_trains_an_lm_with_eager_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.py's pipeline, inductor: two steps of the nano LM with compile=blocks lose what eager loses."""
    torch._dynamo.reset()
    one_step = [*SMALL, "logger=none", "test=false", "trainer.max_steps=2", "trainer.limit_val_batches=0",
                "callbacks.throughput=null", "callbacks.lr_monitor=null"]
    eager, _ = training_losses(one_step, tmp_path / "eager", monkeypatch)
    compiled, task = training_losses([*one_step, "compile=blocks"], tmp_path / "blocks", monkeypatch)
    assert all(block._compiled_call_impl is not None for block in blocks_of(task.net))
    assert task.net._compiled_call_impl is None
    assert len(compiled) == 2
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.fixture
def default_recompile_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Dynamo with torch's default recompile_limit (8, restored after the test: compile_network raises it), its
    counters cleared and its eager backend (the guards and variants are inductor's, without code generation)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(recompile_limit=8):
        yield
    torch._dynamo.reset()


def test_an_encoder_decoder_validates_and_decodes_within_the_recompile_limit(default_recompile_limit: None) -> None:
    """An encoder's and a decoder's blocks share TransformerBlock.forward's code, whose variants dynamo caps at
    recompile_limit (8): training, evaluation, a KV cache's prefill and steps, greedy and beam search passed it
    within one validation, and the rest ran eagerly. compile=blocks gives each stack the cap."""
    torch.manual_seed(0)
    net = EncoderDecoder(TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, max_seq_len=32, dropout=0.1),
                         vocab_size=50)
    compile_network(_Task(net), "blocks")
    for batch, length in ((3, 7), (4, 9)):  # a second shape: dynamo's recompile with dynamic sizes
        net(torch.randint(3, 50, (batch, length)), torch.randint(3, 50, (batch, length + 1))).sum().backward()
    net.eval()
    src = torch.randint(3, 50, (3, 7))
    decoding = Decoding(bos_id=1, eos_id=2, max_len_b=4)
    with torch.no_grad():
        net(src, torch.randint(3, 50, (3, 8)))
        greedy_decode(net, src, decoding)
        beam_search(net, src, decoding, beam_size=2)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] == frames["total"], "a block's variant ran eagerly: dynamo's recompile limit was hit"


def test_an_lm_trains_validates_and_samples_within_the_recompile_limit(default_recompile_limit: None) -> None:
    """One stack's variants: training at two shapes, evaluation and sampling under inference_mode and no_grad,
    left-padded prompts (per-row rope tables) passed torch's 8 as well: compile=blocks gives a stack 16."""
    torch.manual_seed(0)
    net = CausalLM(TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, max_seq_len=32, dropout=0.1,
                                     pos_encoding="rope"), vocab_size=50)
    compile_network(_Task(net), "blocks")
    for batch, length in ((2, 8), (3, 12)):
        net(torch.randint(0, 50, (batch, length))).sum().backward()
    net.eval()
    padding = torch.tensor([[True, True, False, False, False], [False] * 5])  # the first prompt left-padded
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            net(torch.randint(0, 50, (2, 8)))
            generate(net, torch.randint(0, 50, (1, 5)), 3, temperature=0.0)
            generate(net, torch.randint(0, 50, (2, 5)), 3, temperature=0.0, padding=padding)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] == frames["total"], "a block's variant ran eagerly: dynamo's recompile limit was hit"
