"""Speed levers as config options: activation checkpointing, SDPA backend, fused optimizer,
torch.compile, data-loader workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from trident.backbone import Decoder, TransformerConfig
from trident.bench.memory import saved_activation_bytes
from trident.errors import ConfigError
from trident.models.seq2seq import EncoderDecoder
from trident.runs.pipeline import constructor_args, instantiate
from trident.tasks.networks import compile_network
from trident.training.optim import build_optimizer, fused_allowed, kernel_options

from .backbone_helpers import make_cfg, perturb_
from .conftest import SMALL, compose_config


def training_loss_and_grads(
    model: nn.Module, run: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(7)  # the same dropout masks for both models
    loss = run().square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("norm_first", [True, False])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(norm_first: bool) -> None:
    """Encoder-decoder with dropout: recomputation must replay the same dropout masks."""
    models = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = make_cfg(dropout=0.2, norm_first=norm_first, activation_checkpointing=checkpointing)
        models.append(EncoderDecoder(cfg, vocab_size=40).train())
    models[1].load_state_dict(models[0].state_dict())
    src, tgt = torch.randint(1, 40, (3, 10)), torch.randint(1, 40, (3, 7))
    src[0, 7:] = 0  # source padding exercises the padding mask under recomputation
    (loss_a, grads_a), (loss_b, grads_b) = (training_loss_and_grads(m, lambda m=m: m(src, tgt)) for m in models)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == len(list(models[0].parameters()))
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_activation_checkpointing_keeps_less_memory_for_backward() -> None:
    stacks = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        stacks[checkpointing] = Decoder(make_cfg(n_layers=4, activation_checkpointing=checkpointing)).train()
    x = torch.randn(2, 32, 32, requires_grad=True)
    plain = saved_activation_bytes(lambda: stacks[False](x))
    recomputed = saved_activation_bytes(lambda: stacks[True](x))
    # Without checkpointing every block keeps its activations; with it, only block inputs remain.
    assert recomputed * 4 < plain


def test_activation_checkpointing_only_when_a_backward_pass_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[nn.Module] = []

    def counting_checkpoint(block: nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(block)
        kwargs.pop("use_reentrant")
        return block(*args, **kwargs)

    monkeypatch.setattr("trident.backbone.stack.checkpoint", counting_checkpoint)
    torch.manual_seed(0)
    stack = Decoder(make_cfg(activation_checkpointing=True))
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        stack.train()(x)  # no gradients: nothing to recompute for
    stack.eval()(x)  # evaluation: no backward pass planned
    assert calls == []
    stack.train()(x)
    assert calls == list(stack.blocks)


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_cpu_sdpa_backends_match_auto(backend: str) -> None:
    auto = perturb_(Decoder(make_cfg()))
    forced = Decoder(make_cfg(sdpa_backend=backend))
    forced.load_state_dict(auto.state_dict())
    x = torch.randn(2, 12, 32)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 9:] = True
    torch.testing.assert_close(forced(x, key_padding_mask=padding), auto(x, key_padding_mask=padding))
    torch.testing.assert_close(forced(x), auto(x))


def test_cuda_only_sdpa_backend_fails_clearly_on_cpu() -> None:
    stack = Decoder(make_cfg(sdpa_backend="efficient"))
    with pytest.raises(ConfigError, match="model.sdpa_backend=efficient has no kernel.*use model.sdpa_backend=auto"):
        stack(torch.randn(1, 4, 32))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("sdpa_backend", "fastest", "model.sdpa_backend='fastest' is not supported"),
     ("activation_checkpointing", "yes", "model.activation_checkpointing must be true or false")],
)
def test_bad_lever_values_are_config_errors(option: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_cfg(**{option: value})


@pytest.mark.parametrize(
    ("name", "fused", "expected"),
    [("adamw", True, {"fused": True}), ("adamw", False, {"foreach": True}), ("adam", True, {"fused": True})],
)
def test_optimizer_uses_fused_kernels_where_it_has_them(name: str, fused: bool, expected: dict[str, bool]) -> None:
    model = nn.Linear(4, 4)
    optimizer = build_optimizer(model, {"name": name, "lr": 1e-3, "fused": fused})
    for key, value in expected.items():
        assert optimizer.defaults[key] is value
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the kernel runs on this device
    assert kernel_options(torch.optim.Rprop, fused=True) == {"foreach": True}, "Rprop has no fused kernel"


def test_optimizer_fused_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="optimizer.fused must be true or false"):
        build_optimizer(nn.Linear(2, 2), {"name": "adamw", "lr": 1e-3, "fused": "auto"})


@pytest.mark.parametrize(
    ("precision", "clip", "fused"),
    [("32-true", 1.0, True), ("bf16-mixed", None, True), ("bf16-mixed", 0.0, True), ("bf16-mixed", 1.0, True),
     ("16-mixed", 1.0, False), ("16-mixed", None, True), ("bf16-true", 1.0, True)],
)
def test_fused_optimizer_gives_way_to_clipping_only_under_the_fp16_grad_scaler(
    precision: str, clip: float | None, fused: bool
) -> None:
    cfg = {"name": "adamw", "lr": 1e-3, "fused": True}
    assert fused_allowed(cfg, precision, clip) == {**cfg, "fused": fused}
    assert cfg["fused"] is True  # the caller's config is left alone


class ClipProbe(L.Callback):
    """Records the optimizer's kernel and each step's gradient norm after clipping (the gradients the step took)."""

    last: ClipProbe | None = None

    def __init__(self) -> None:
        self.fused: bool | None = None
        self.norms: list[float] = []
        ClipProbe.last = self

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.fused = optimizer.defaults.get("fused")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = lambda: float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params])))
        optimizer.register_step_post_hook(lambda *_: self.norms.append(norm()))


def test_bf16_mixed_clips_the_global_batch_gradient_under_the_fused_optimizer(tmp_path: Path) -> None:
    """trainer=gpu's default (bf16-mixed, fused AdamW, clipping) on a CPU through the pipeline: Lightning's
    MixedPrecision refuses to clip a fused optimizer's gradients; TridentTask clips them itself (no GradScaler to
    unscale under bf16), after the global-batch rescale of two accumulated micro-batches: each step's norm is clip_val."""
    from trident.runs.pipeline import train

    clip = 1e-3  # far below a fresh network's gradient norm: every step is clipped
    train(compose_config([*SMALL, "precision=bf16", "optimizer.fused=true", f"trainer.gradient_clip_val={clip}",
                          "trainer.accumulate_grad_batches=2", "trainer.max_steps=2", "logger=none", "test=false",
                          f"+callbacks.probe._target_={__name__}.ClipProbe"], output_dir=tmp_path))
    probe = ClipProbe.last
    assert probe is not None and probe.fused is True
    assert probe.norms == pytest.approx([clip, clip], rel=1e-4)


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 3)


def test_compile_option_compiles_the_network_in_place() -> None:
    task = _Task()
    names = list(task.state_dict())
    compile_network(task, False)
    assert task.net._compiled_call_impl is None
    compile_network(task, True)
    assert task.net._compiled_call_impl is not None  # nn.Module.compile: calls go through torch.compile
    assert list(task.state_dict()) == names  # checkpoints keep their parameter names
    with pytest.raises(ConfigError, match="compile must be true, false or blocks"):
        compile_network(_Task(), "yes")


@pytest.mark.parametrize("task", ["lm", "translation", "vit"])
def test_data_loader_options_reach_the_data_module(task: str, tmp_path: Path) -> None:
    cfg = compose_config([f"task={task}", "data.num_workers=2", "data.pin_memory=true"], output_dir=tmp_path)
    datamodule = instantiate(constructor_args(cfg, "data"), _convert_="all")
    options = datamodule.loader_options()
    # A private generator keeps loaders from moving the global RNG (exact resume).
    assert isinstance(options.pop("generator"), torch.Generator)
    # Workers seeded by the data-parallel rank (one process here: 0), as the ranks of a tensor-parallel group share it.
    assert options.pop("worker_init_fn").keywords == {"rank": 0}
    assert options == {"num_workers": 2, "pin_memory": True, "persistent_workers": True}
    cfg = compose_config([f"task={task}"], output_dir=tmp_path)
    datamodule = instantiate(constructor_args(cfg, "data"), _convert_="all")
    options = datamodule.loader_options()
    options.pop("generator")
    options.pop("worker_init_fn")
    # No workers: nothing to keep alive (DataLoader refuses persistent_workers without workers).
    assert options == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}


def test_model_configs_expose_the_levers() -> None:
    cfg = compose_config(["model=base", "model.activation_checkpointing=true", "model.sdpa_backend=math"])
    assert cfg.model.activation_checkpointing is True and cfg.model.sdpa_backend == "math"
    assert TransformerConfig().activation_checkpointing is False  # off unless asked for
