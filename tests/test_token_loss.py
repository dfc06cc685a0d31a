"""One loss reduction for every task (issue 50 item 2): the summed token losses of an optimizer step over the trained
tokens of its global batch, whatever the gradient accumulation and the number of data-parallel ranks.

The micro-batches below train 1 and 16 target tokens: a mean per micro-batch (the old reduction) weighs the single
token 16 times, and the step's weights move ~50 % away from the one-batch step's.
"""

from __future__ import annotations

import copy
import csv
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trident.data.chat import IGNORE_INDEX
from trident.errors import DataError
from trident.launch.preemption import PreemptionCheckpoint
from trident.runs.pipeline import train
from trident.tasks.lm import LanguageModelTask
from trident.tracking.steps import StepLearningRateMonitor, ValidationRowStep, count_validation_in_optimizer_steps
from trident.tracking.wandb_files import wait_for_offline_runs
from trident.training.callbacks import Throughput
from trident.training.token_loss import StepLoss, TokenMean, checked_mean_loss, data_parallel_group

from .conftest import SMALL, compose_config

BACKBONE = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 8, "pos_encoding": "learned",
            "dropout": 0.0}
VOCAB = 11


class SGDLanguageModel(LanguageModelTask):
    """Plain SGD (lr 1, no momentum): the weights after one step are the initial ones minus the gradient, so they
    compare the gradients themselves (Adam would hide their scale)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def micro_batches() -> list[tuple[Tensor, Tensor]]:
    """Two micro-batches (2, 8) of 1 and 16 trained targets."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, VOCAB, (4, 8), generator=generator)
    targets = torch.randint(0, VOCAB, (4, 8), generator=generator)
    targets[:2] = IGNORE_INDEX
    targets[0, 3] = 5  # the first micro-batch trains one token, the second all 16
    return [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])]


class Batches(Dataset):
    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]


def one_step(task: LanguageModelTask, batches: list[Any], accumulate: int, **trainer: Any) -> dict[str, Tensor]:
    """``task``'s weights after one optimizer step over ``batches`` (each a whole micro-batch), and its logged loss."""
    trainer_ = L.Trainer(accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         accelerator="cpu", devices=1, **{"max_steps": 1, **trainer})
    trainer_.fit(task, DataLoader(Batches(batches), batch_size=None, shuffle=False))
    return {**{k: v.detach().clone() for k, v in task.net.state_dict().items()},
            "train/loss": trainer_.callback_metrics["train/loss"]}


# 1e6 clips nothing; 0.01 clips this step's gradient (norm about 2): Lightning clips after the task's
# on_before_optimizer_step has rescaled the gradients to the global token mean, so the clipped step is the batch's
# (clipped before, the accumulated gradient, 8.5 times the mean's here, clipped to a step 8.5 times too short). The
# clipped step is read as a small difference of float32 weights: 1e-5 of its largest element.
@pytest.mark.parametrize(("clip", "tolerance"), [(None, 1e-6), (1e6, 1e-6), (0.01, 1e-5)])
def test_accumulated_step_equals_the_batch_twice_as_large(clip: float | None, tolerance: float) -> None:
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"})
    first, second = micro_batches()
    whole = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    accumulated = one_step(copy.deepcopy(task), [first, second], 2, gradient_clip_val=clip)
    batch = one_step(copy.deepcopy(task), [whole], 1, gradient_clip_val=clip)
    start = task.net.state_dict()
    for name, value in batch.items():
        if name == "train/loss":
            # The step's loss over its 17 tokens, not the last micro-batch's.
            assert float(accumulated[name]) == pytest.approx(float(value), rel=1e-6)
            continue
        step = value - start[name]
        torch.testing.assert_close(accumulated[name] - start[name], step, rtol=1e-4, atol=tolerance * float(step.abs().max()))


def test_an_accumulated_step_is_the_gradient_of_the_mean_over_the_trained_tokens() -> None:
    """Against plain autograd (no Lightning, no rescale): SGD at lr 1 moves the weights by minus the gradient of
    the mean cross entropy over the 17 trained tokens. (The other tests compare runs of the same reduction: a
    count off by one, in both, passed them.)"""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"})
    first, second = micro_batches()
    reference = copy.deepcopy(task)
    logits = reference.net(torch.cat([first[0], second[0]]))  # (4, 8, V)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.cat([first[1], second[1]]).flatten(),
                                      ignore_index=IGNORE_INDEX).backward()
    stepped = one_step(copy.deepcopy(task), [first, second], 2)
    for name, param in reference.net.named_parameters():
        expected = param.detach() - param.grad
        torch.testing.assert_close(stepped[name], expected, rtol=1e-4, atol=1e-6 * float(param.grad.abs().max()))


def test_an_epochs_short_last_window_steps_on_its_own_tokens() -> None:
    """Epochs of 3 micro-batches at accumulate_grad_batches=2: Lightning steps after the third alone (dividing its
    loss by 2 all the same). The two steps equal steps on the first two as one batch, then the third."""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"})
    first, second = micro_batches()
    whole = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    accumulated = one_step(copy.deepcopy(task), [first, second, second], 2, max_steps=-1, max_epochs=1)
    batches = one_step(copy.deepcopy(task), [whole, second], 1, max_steps=-1, max_epochs=1)
    for name, value in batches.items():
        torch.testing.assert_close(accumulated[name], value, rtol=1e-4, atol=1e-6)


def test_the_loss_training_step_returns_has_the_size_of_a_mean_whatever_the_first_micro_batch() -> None:
    """The factor c of the returned loss (what the fp16 scaler and the learning-rate finder see) follows the step
    just taken; a first micro-batch of no token sets none. Fixed from the first micro-batch for good, a first
    micro-batch of 0 or 1 tokens made every later loss the sum of thousands (fp16 gradients overflow)."""
    loss = StepLoss()
    weight = torch.ones((), requires_grad=True)
    assert float(loss.micro_batch(weight * 0, torch.tensor(0), None)) == 0.0
    assert loss.scale is None
    assert float(loss.micro_batch(weight * 3.0, torch.tensor(1), None)) == pytest.approx(3.0)  # c = 1 / 1 token
    loss.finish([weight], accumulate=2, group=None)  # a step of 0 and 1 tokens: c = 1 / 0.5
    for _ in range(2):  # a step of 2 x 1000 tokens
        assert float(loss.micro_batch(weight * 2000.0, torch.tensor(1000), None)) == pytest.approx(4000.0)
    loss.finish([weight], accumulate=2, group=None)
    assert float(loss.micro_batch(weight * 2000.0, torch.tensor(1000), None)) == pytest.approx(2.0)  # c = 1 / 1000


def test_two_ranks_of_unequal_counts_get_the_gradient_of_their_global_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's side of 2 data-parallel ranks, in one process: rank 1's sums arrive through the (faked)
    all-reduce and its gradient through DDP's average. Rank 0 trains 1 token, rank 1 7: the step's gradient is the
    8 tokens' mean, not rank 0's own count's nor one rank's share (the slow DDP tests run the real thing)."""
    group = object()
    weight = torch.ones((), requires_grad=True)
    a0, a1 = 3.0, 5.0  # d(summed loss)/d(weight) of rank 0's 1 token and of rank 1's 7

    def all_reduce(values: Tensor, group_: Any) -> Tensor:
        assert group_ is group
        # rank 1's (1,): its first micro-batch's count; (names, 2): its step's loss sum (2 a token) and count
        return values + (7.0 if values.shape == (1,) else torch.tensor([[a1 * 2.0, 7.0]], dtype=torch.float64))

    monkeypatch.setattr("trident.training.token_loss._all_reduce_sum", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group_=None: 2)
    loss = StepLoss()
    returned = loss.micro_batch(weight * a0, torch.tensor(1), group)
    returned.backward()
    weight.grad = (weight.grad + loss.scale * a1) / 2  # DDP's mean of the ranks' gradients
    metrics = loss.finish([weight], accumulate=1, group=group)
    assert float(weight.grad) == pytest.approx((a0 + a1) / 8)
    assert metrics["train/loss"] == pytest.approx((a0 + 2 * a1) / 8)


def test_the_token_count_is_summed_over_the_data_parallel_ranks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under tensor parallelism (trainer=fsdp, a mesh of data_parallel x tensor_parallel) the ranks of a
    tensor-parallel group share one batch: the count and the rescale are over the data-parallel dimension's group.
    (Over every rank, the count and the number of ranks both double and the gradient comes out the same: only the
    group itself tells the two apart.)"""
    groups = {"data_parallel": object(), "tensor_parallel": object()}

    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name: str) -> Any:
            return type("SubMesh", (), {"get_group": lambda _self: groups[name]})()

    module = type("Module", (), {"device_mesh": Mesh()})()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert data_parallel_group(module) is groups["data_parallel"]
    module.device_mesh = None  # DDP: every rank averages gradients
    assert data_parallel_group(module) is torch.distributed.group.WORLD


class RankBatches(Dataset):
    """Each DDP rank's own micro-batches, in order (``use_distributed_sampler=False``)."""

    def __init__(self, per_rank: list[list[Any]]) -> None:
        self.per_rank = per_rank

    def __len__(self) -> int:
        return len(self.per_rank[0])

    def __getitem__(self, index: int) -> Any:
        return self.per_rank[torch.distributed.get_rank()][index]


@pytest.mark.slow
def test_ranks_of_unequal_token_counts_step_and_validate_over_the_global_tokens() -> None:
    """2 gloo ranks x 2 accumulated micro-batches: rank 0 trains 1 and 16 tokens, rank 1 16 and 16. The weights after
    the step equal one process's on the 4 as one batch (DDP's average over ranks and Lightning's 1/2 undone; each
    micro-batch normalising by its own count weighs rank 0's single token 16x, each rank by its own count, then DDP's
    mean over ranks (a mean of rank means, which equal counts hide), weighs rank 0's 17 tokens ~2x). One spawn of 2
    ranks checks both: a fresh process costs more than the step. Validation: rank 0 holds 17 tokens, rank 1 none
    (only ignored targets), as a small chat split can deal them: val/loss is the 17 tokens' mean, not a mean of rank
    means (NaN); and rank 1, which holds none of them, goes on with rank 0 (its check of "no token" once read its own
    count, torchmetrics restoring the local states after the synced compute: rank 1 alone stopped with "has no token
    to average" and this run failed)."""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"})
    first, second = micro_batches()
    unanswered = (first[0], torch.full_like(first[1], IGNORE_INDEX))
    whole = (torch.cat([first[0], second[0], second[0], second[0]]), torch.cat([first[1], second[1], second[1], second[1]]))
    expected = one_step(copy.deepcopy(task), [whole], 1)
    ranks = copy.deepcopy(task)
    trainer = L.Trainer(max_steps=1, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accelerator="cpu", devices=2, strategy="ddp_spawn", use_distributed_sampler=False)
    trainer.fit(ranks, DataLoader(RankBatches([[first, second], [second, second]]), batch_size=None, shuffle=False),
                DataLoader(RankBatches([[first, second], [unanswered, unanswered]]), batch_size=None, shuffle=False))
    start = task.net.state_dict()
    for name, value in ranks.net.state_dict().items():  # ddp_spawn hands rank 0's weights back
        step = expected[name] - start[name]
        torch.testing.assert_close(value - start[name], step, rtol=1e-4, atol=1e-6 * float(step.abs().max()))
    with torch.no_grad():  # the validation after the step, on rank 0's 17 tokens
        summed, count = zip(*(ranks._loss(batch) for batch in (first, second)))
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(float(sum(summed) / sum(count)), rel=1e-5)


class ValidatedSteps(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize(("batches", "interval", "max_steps", "every_n_epochs", "validated"), [
    (40, 10, 20, None, [10, 20]),  # issue 58's case: accumulation 2, val_check_interval=10: once in 10 optimizer steps
    (5, 3, 9, None, [3, 6, 9]),  # epochs of 5 micro-batches: 3 steps each (the last one short), counted across epochs
    # check_val_every_n_epoch set (task=vit's 1): the interval counts the epoch's optimizer steps, from each epoch's start
    (8, 2, 8, 1, [2, 4, 6, 8]),  # epochs of 4 steps; Lightning counted micro-batches: after every step
    (5, 2, 9, 1, [2, 5, 8]),  # epochs of 3 steps (the last one short): the second of each
])
def test_val_check_interval_counts_optimizer_steps_under_accumulation(batches: int, interval: int, max_steps: int,
                                                                      every_n_epochs: int | None,
                                                                      validated: list[int]) -> None:
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1e-3}, {"name": "constant"})
    _, second = micro_batches()
    record = ValidatedSteps()
    trainer = L.Trainer(max_steps=max_steps, accumulate_grad_batches=2, val_check_interval=interval,
                        check_val_every_n_epoch=every_n_epochs, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[record])
    count_validation_in_optimizer_steps(trainer)  # as the pipeline's build_trainer does
    trainer.fit(task, DataLoader(Batches([second] * batches), batch_size=None), DataLoader(Batches([second]), batch_size=None))
    assert record.steps == validated


def test_a_step_of_no_trained_token_leaves_zero_gradients_not_nan() -> None:
    loss = StepLoss()
    weight = torch.ones(3, requires_grad=True)
    summed = (weight * 0).sum()  # a micro-batch with no trained token sums to 0
    loss.micro_batch(summed, torch.tensor(0), None).backward()
    metrics = loss.finish([weight], accumulate=1, group=None)
    assert torch.equal(weight.grad, torch.zeros(3))
    assert metrics == {}  # nothing trained, nothing to log (never 0/0)


def test_a_validation_without_a_trained_token_stops_the_run_naming_the_cause() -> None:
    """Issue 50 item 1: validation rows whose targets are all ignored (chat prompts filling data.block_size) made
    val/loss 0/0 = NaN, which ModelCheckpoint takes for +inf: the run went on and "completed" with its worst
    checkpoint as the best. The first validation now stops it in one line."""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"})
    first, second = micro_batches()
    unanswered = (first[0], torch.full_like(first[1], IGNORE_INDEX))
    trainer = L.Trainer(max_steps=2, val_check_interval=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    loader = DataLoader(Batches([second, second]), batch_size=None)
    with pytest.raises(DataError, match="val/loss has no token to average at step 1: every target of the split is ignored"):
        trainer.fit(task, loader, DataLoader(Batches([unanswered]), batch_size=None))


def test_epoch_loss_is_token_weighted_and_an_epoch_without_tokens_stops_in_one_line() -> None:
    mean = TokenMean()
    mean.update(torch.tensor(3.0), torch.tensor(1))  # a batch of one token, loss 3
    mean.update(torch.tensor(99.0), torch.tensor(99))  # 99 tokens of loss 1
    assert checked_mean_loss(mean, "val/loss", 10) == pytest.approx(102 / 100)  # not (3 + 1) / 2
    mean.update(torch.tensor(0.0), torch.tensor(0))
    with pytest.raises(DataError, match="val/loss has no token to average at step 10"):
        checked_mean_loss(mean, "val/loss", 10)
    mean.update(torch.tensor(math.inf), torch.tensor(4))
    with pytest.raises(Exception, match="val/loss is inf at step 3: the model's predictions are not finite"):
        checked_mean_loss(mean, "val/loss", 3)


# --------------------------------------------------------------------------------------------
# Through the pipeline (issue 58 items 4-6): what a run under accumulation logs, read back from its files.

STEPS_RUN = [*SMALL, "model.dropout=0.0", "callbacks.throughput.window=1",
             "+logger.csv._target_=lightning.pytorch.loggers.CSVLogger", "+logger.csv.name=csv"]


@pytest.fixture(scope="module")
def accumulated_and_whole(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> dict[str, Path]:
    """The same 4 optimizer steps of 8 blocks: 2 micro-batches of 4 (accumulated), and one batch of 8."""
    runs = {"accumulated": ["data.batch_size=4", "trainer.accumulate_grad_batches=2"], "whole": ["data.batch_size=8"]}
    directories = {}
    for name, overrides in runs.items():
        directories[name] = tmp_path_factory.mktemp(name) / "run"
        train(compose_config([*STEPS_RUN, *overrides], output_dir=directories[name]))
    return directories


def _history(run_dir: Path) -> list[dict[str, Any]]:
    (run,) = wait_for_offline_runs(run_dir)
    return run.history


def _steps_of(history: list[dict[str, Any]], key: str) -> list[int]:
    return [int(row["trainer/global_step"]) for row in history if key in row]


@pytest.mark.slow
def test_accumulation_validates_every_interval_of_optimizer_steps_on_one_step_axis(
        accumulated_and_whole: dict[str, Path]) -> None:
    """val_check_interval=2 with accumulate_grad_batches=2: validation after optimizer steps 2 and 4 (Lightning
    counted micro-batches: 4 validations), at the same step in W&B, metrics.jsonl, the CSV log and the checkpoint
    name; one row per optimizer step of train/loss and of the learning rate, one of throughput per window."""
    run_dir = accumulated_and_whole["accumulated"]
    history = _history(run_dir)
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in jsonl if row["stage"] == "validate"] == [2, 4]
    assert _steps_of(history, "val/loss") == [2, 4]
    with next(run_dir.rglob("metrics.csv")).open() as f:
        assert [int(row["step"]) for row in csv.DictReader(f) if row.get("val/loss")] == [2, 4]
    (best,) = (run_dir / "checkpoints").glob("best-step*.ckpt")
    validations = [row for row in jsonl if row["stage"] == "validate"]
    assert int(best.stem.removeprefix("best-step")) == min(validations, key=lambda row: row["val/loss"])["step"]
    assert _steps_of(history, "train/loss") == [0, 1, 2, 3]  # the training rows: the step under way
    lr_keys = {key for row in history for key in row if key.startswith("lr-")}  # one per parameter group
    assert lr_keys and all(_steps_of(history, key) == [0, 1, 2, 3] for key in lr_keys)
    assert _steps_of(history, "throughput/tokens_per_sec") == [1, 2, 3]  # window=1, the first step is warm-up


@pytest.mark.slow
def test_train_loss_under_accumulation_is_the_batch_twice_as_large_runs(accumulated_and_whole: dict[str, Path]) -> None:
    losses = {name: [row["train/loss"] for row in _history(run_dir) if "train/loss" in row]
              for name, run_dir in accumulated_and_whole.items()}
    assert len(losses["whole"]) == 4
    assert losses["accumulated"] == pytest.approx(losses["whole"], rel=1e-6)


class SignalAt(L.Callback):
    """A stop signal arriving during the first micro-batch of an optimizer step."""

    def __init__(self, preemption: PreemptionCheckpoint) -> None:
        self.preemption = preemption

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            self.preemption.received = "SIGTERM"


def test_a_stop_signal_mid_accumulation_saves_after_the_optimizer_step(tmp_path: Path) -> None:
    """Saved after the micro-batch under way (its step's first of 2), the checkpoint held no accumulated gradient:
    the resumed run stepped on the window's second micro-batch alone (its tokens alone in the mean). The save waits
    for the step's last micro-batch, as the docstring's "finish the current training step" says."""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1e-3}, {"name": "constant"})
    _, second = micro_batches()
    preemption = PreemptionCheckpoint(tmp_path)
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        accelerator="cpu", devices=1, callbacks=[preemption, SignalAt(preemption)])
    with pytest.raises(SIGTERMException):
        trainer.fit(task, DataLoader(Batches([second] * 8), batch_size=None))
    saved = torch.load(preemption.path, weights_only=False)
    assert saved["global_step"] == 2  # after the second optimizer step, its 4 micro-batches done
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 4


class RecordingLogger(Logger):
    """The rows Lightning and the callbacks send to a logger: (step, metric names)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, set[str]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), set(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def steps_of(self, prefix: str) -> list[int]:
        return [step for step, names in self.rows if any(name.startswith(prefix) for name in names)]


def test_one_step_axis_under_accumulation_in_process() -> None:
    """A fast twin of the pipeline's test: accumulate_grad_batches=2, val_check_interval=2, 4 optimizer steps:
    training, learning-rate and throughput rows at the step under way (0-3, throughput after the warm-up step),
    validation rows at the optimizer steps they follow (2, 4), each once."""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1e-3}, {"name": "constant"})
    _, second = micro_batches()
    logger = RecordingLogger()
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, val_check_interval=2, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        callbacks=[ValidationRowStep(), StepLearningRateMonitor(logging_interval="step"), Throughput(window=1, peak_flops=1e12)])
    count_validation_in_optimizer_steps(trainer)
    trainer.fit(task, DataLoader(Batches([second] * 8), batch_size=None), DataLoader(Batches([second]), batch_size=None))
    assert logger.steps_of("train/loss") == [0, 1, 2, 3]
    assert logger.steps_of("lr-") == [0, 1, 2, 3]
    assert logger.steps_of("throughput/") == [1, 2, 3]
    assert logger.steps_of("val/loss") == [2, 4]
