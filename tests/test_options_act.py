"""Options seen to act in the task that train.py trains, not only in the composed config: weight
tying, embedding scale, pretrained weights, the targets the loss sees (Mixup/CutMix, label
smoothing), the SDPA kernel, torch.compile, debug=overfit and logger=tensorboard."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer as TimmViT

import trident.objectives.tokens
import trident.runs.lifecycle
import trident.runs.pipeline
from trident.runs.pipeline import train
from trident.weights.adapters.timm_vit import timm_to_trident

from .conftest import SMALL, compose_config
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL

pytestmark = pytest.mark.usefixtures("single_thread")

# One optimizer step, no validation or test: enough to see what the task was built with.
ONE_STEP = ["logger=none", "test=false", "trainer.max_steps=1", "trainer.limit_val_batches=0",
            "callbacks.throughput=null", "callbacks.lr_monitor=null"]


TrainedTask = Callable[..., L.LightningModule]


@pytest.fixture
def trained_task(monkeypatch: pytest.MonkeyPatch) -> TrainedTask:
    """``trained_task(overrides, tmp_path, on_build=...)``: train with ``overrides`` and return the
    very task object the pipeline trained (``on_build`` sees it before training starts)."""

    def run(overrides: list[str], output_dir: Path, on_build: Callable[[L.LightningModule], None] | None = None
            ) -> L.LightningModule:
        built: list[L.LightningModule] = []
        compile_network = trident.runs.lifecycle.compile_network

        def spy(task: L.LightningModule, enabled: Any) -> None:
            built.append(task)
            if on_build is not None:
                on_build(task)
            compile_network(task, enabled)

        monkeypatch.setattr(trident.runs.lifecycle, "compile_network", spy)
        train(compose_config(overrides, output_dir=output_dir))
        (task,) = built
        return task

    return run


@pytest.mark.parametrize("mode", ["all", "decoder", "none"])
def test_translation_weight_tying_is_parameter_identity(mode: str, trained_task: TrainedTask, tmp_path: Path) -> None:
    net = trained_task([*SMALL_MT, *ONE_STEP, f"task.tie_embeddings={mode}"], tmp_path).net
    src, tgt, head = net.src_embed.weight, net.tgt_embed.weight, net.head.weight
    assert (src is tgt) == (mode == "all")
    assert (tgt is head) == (mode in ("all", "decoder"))
    distinct = {id(p) for p in net.parameters()}
    assert len({id(src), id(tgt), id(head)} & distinct) == {"all": 1, "decoder": 2, "none": 3}[mode]


@pytest.mark.parametrize("tie", [True, False])
def test_lm_weight_tying_is_parameter_identity(tie: bool, trained_task: TrainedTask, tmp_path: Path) -> None:
    net = trained_task([*SMALL, *ONE_STEP, f"task.tie_embeddings={str(tie).lower()}"], tmp_path).net
    assert (net.head.weight is net.embed.weight) == tie


@pytest.mark.parametrize(("preset", "scale"), [(SMALL, True), (SMALL, False), (SMALL_MT, True), (SMALL_MT, False)])
def test_scale_embeddings_multiplies_by_sqrt_d_model(
    preset: list[str], scale: bool, trained_task: TrainedTask, tmp_path: Path,
) -> None:
    net = trained_task([*preset, *ONE_STEP, f"task.scale_embeddings={str(scale).lower()}"], tmp_path).net
    embedding = net.embed if hasattr(net, "embed") else net.tgt_embed
    ids = torch.tensor([[3, 4, 5]])
    factor = math.sqrt(net.cfg.d_model) if scale else 1.0
    torch.testing.assert_close(embedding(ids), embedding.weight[ids] * factor)


def test_pretrained_weights_are_those_of_the_task_that_trains(trained_task: TrainedTask, tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = TimmViT(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4,
                        mlp_ratio=4.0, qkv_bias=True)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / "vit.pth"
    torch.save(reference.state_dict(), path)
    expected = timm_to_trident(reference.state_dict())
    at_start: dict[str, torch.Tensor] = {}

    def snapshot(task: L.LightningModule) -> None:
        at_start.update({k: v.detach().clone() for k, v in task.net.state_dict().items()})

    # No model=nano: the sizes come from the file (whose heads timm does not record: 64 channels each).
    overrides = [o for o in VIT_SMALL if o != "model=nano"]
    trained_task([*overrides, *ONE_STEP, "augment=none", f"init_from={path}"], tmp_path / "run", snapshot)
    assert expected.keys() <= at_start.keys()
    for key, value in expected.items():
        torch.testing.assert_close(at_start[key], value, msg=key)


def loss_calls(task: L.LightningModule, records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Record (logits, targets, loss) of every call of the task's training loss."""
    for criterion in (task.objective.hard_loss, task.objective.soft_loss):  # labels, or Mixup's class probabilities
        criterion.register_forward_hook(lambda module, args, out: records.append((args[0].detach(), args[1].detach(), out.detach())))


def test_mixup_and_cutmix_give_the_loss_soft_smoothed_targets(trained_task: TrainedTask, tmp_path: Path) -> None:
    records: list = []
    trained_task([*VIT_SMALL, *ONE_STEP, "augment=mixup", "trainer.max_steps=3"], tmp_path,
                 lambda task: loss_calls(task, records))
    assert len(records) == 3
    for logits, targets, loss in records:
        assert targets.shape == logits.shape and targets.is_floating_point()
        torch.testing.assert_close(targets.sum(-1), torch.ones(len(targets)))
        assert targets.min() >= 0.1 / 10 - 1e-6, "label smoothing 0.1 over 10 classes"
        assert (targets.max(-1).values < 1 - 0.1 + 0.1 / 10 + 1e-6).all()
        torch.testing.assert_close(loss, torch.sum(-targets * logits.log_softmax(-1), -1).mean())
    # Mixed pairs: some rows put weight on two classes (mixup or cutmix mixed two different labels).
    assert any(((targets > 0.1).sum(-1) >= 2).any() for _, targets, _ in records)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_label_smoothing_shapes_the_image_loss(smoothing: float, trained_task: TrainedTask, tmp_path: Path) -> None:
    records: list = []
    trained_task([*VIT_SMALL, *ONE_STEP, "augment=none", f"task.label_smoothing={smoothing}"], tmp_path,
                 lambda task: loss_calls(task, records))
    ((logits, labels, loss),) = records
    assert labels.dtype == torch.long
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=smoothing))
    assert not torch.allclose(loss, F.cross_entropy(logits, labels, label_smoothing=0.1))


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_label_smoothing_reaches_the_translation_loss(smoothing: float, trained_task: TrainedTask, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    loss_function = trident.objectives.tokens.chunked_cross_entropy  # task.loss_chunk's default: on

    def spy(*args: Any, label_smoothing: float, **kwargs: Any) -> Any:
        seen.append(label_smoothing)
        return loss_function(*args, label_smoothing=label_smoothing, **kwargs)

    monkeypatch.setattr(trident.objectives.tokens, "chunked_cross_entropy", spy)
    trained_task([*SMALL_MT, *ONE_STEP, f"task.label_smoothing={smoothing}"], tmp_path)
    assert seen == [smoothing]


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_sdpa_backend_is_the_kernel_the_training_step_runs(backend: str, trained_task: TrainedTask, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA may use only the chosen kernel during the task's forward passes."""
    enabled: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        enabled.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    trained_task([*SMALL, *ONE_STEP, f"model.sdpa_backend={backend}"], tmp_path)
    assert enabled and set(enabled) == {(backend == "math", backend == "flash")}


@pytest.mark.slow
def test_compile_true_runs_a_compiled_training_step(trained_task: TrainedTask, tmp_path: Path) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    task = trained_task([*SMALL, *ONE_STEP, "compile=true"], tmp_path)
    assert task.net._compiled_call_impl is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "no graph was compiled"
    torch._dynamo.reset()


def test_overfit_drives_the_loss_of_one_batch_toward_zero(trained_task: TrainedTask, tmp_path: Path) -> None:
    records: list[float] = []

    def record_losses(task: L.LightningModule) -> None:
        original = task.training_step

        def step(batch: Any, batch_idx: int) -> torch.Tensor:
            loss = original(batch, batch_idx)
            records.append(float(loss))
            return loss

        task.training_step = step  # type: ignore[method-assign]

    trained_task([*SMALL, "debug=overfit", "logger=none", "test=false", "trainer.max_steps=100", "model.dropout=0.0",
                  "trainer.val_check_interval=100", "callbacks.throughput=null", "optimizer.lr=3e-3",
                  "scheduler=constant", "scheduler.warmup_steps=0"], tmp_path, record_losses)
    assert len(records) == 100
    assert records[-1] < 0.1 * records[0], f"loss {records[0]:.3f} -> {records[-1]:.3f}"


def test_tensorboard_logger_writes_event_files(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(compose_config([*SMALL, "logger=tensorboard", "test=false"], output_dir=run))
    (events,) = run.glob("tensorboard/**/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert {"train/loss", "val/loss"} <= set(accumulator.Tags()["scalars"])
    assert [e.step for e in accumulator.Scalars("train/loss")] == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def perturbed_lm_checkpoint(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """A short LM run's checkpoint with noise on every weight: an almost untrained model repeats
    one token greedily, which would hide differences between decoding modes."""
    run = tmp_path_factory.mktemp("sample") / "run"
    train(compose_config([*SMALL, *ONE_STEP], output_dir=run))
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for value in checkpoint["state_dict"].values():
        if value.is_floating_point():
            value.add_(torch.randn(value.shape, generator=generator) * 0.3)
    path = run / "perturbed.ckpt"
    torch.save(checkpoint, path)
    return path


def sample_command(capsys: pytest.CaptureFixture[str], checkpoint: Path, *args: str) -> str:
    from trident.commands.sample import main

    capsys.readouterr()
    main([str(checkpoint), "--prompt", "ROMEO:", "--max-new-tokens", "60", *args])  # past the 32-token window
    return capsys.readouterr().out


def test_sample_command_options_act(perturbed_lm_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trident.commands.sample import load_lm_checkpoint
    from trident.models import generate

    greedy = sample_command(capsys, perturbed_lm_checkpoint, "--temperature", "0")
    assert len(set(greedy)) >= 6, "greedy text too uniform to compare decoding modes"
    assert sample_command(capsys, perturbed_lm_checkpoint, "--temperature", "0", "--no-cache") == greedy
    assert sample_command(capsys, perturbed_lm_checkpoint, "--temperature", "0.8", "--top-p", "0") == greedy
    nucleus = sample_command(capsys, perturbed_lm_checkpoint, "--top-p", "0.9", "--seed", "3")
    assert nucleus != greedy
    assert sample_command(capsys, perturbed_lm_checkpoint, "--top-p", "0.9", "--seed", "3", "--no-cache") == nucleus
    # The command's text is generate() with the same settings on the checkpoint's network.
    task = load_lm_checkpoint(perturbed_lm_checkpoint)
    assert task.tokenizer is not None
    prompt = torch.tensor([task.tokenizer.encode("ROMEO:").ids])
    out = generate(task.net, prompt, 60, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(3))
    assert nucleus.startswith(task.tokenizer.decode(out[0].tolist()) + "\n")


def test_several_prompts_are_sampled_as_one_batch_each_as_alone(perturbed_lm_checkpoint: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Prompts of different lengths, left-padded into one batch: each greedy text is the one its prompt gives alone."""
    from trident.commands.sample import main

    texts = []
    for prompts in (["ROMEO:", "JULIET: O Romeo, Romeo"], ["ROMEO:"], ["JULIET: O Romeo, Romeo"]):
        capsys.readouterr()
        main([str(perturbed_lm_checkpoint), *(f"--prompt={p}" for p in prompts), "--max-new-tokens", "20",
              "--temperature", "0"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] + texts[2]
    assert texts[1].startswith("ROMEO:") and texts[2].startswith("JULIET: O Romeo, Romeo")
