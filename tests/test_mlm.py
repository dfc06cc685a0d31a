"""Masked language modelling (task=mlm): BERT masking statistics, loss only on selected positions,
a bidirectional encoder with key-padding masks under every positional encoding, config checks,
FLOPs, exact resume, the fill_mask command and eval.py, and learning beyond the unigram baseline."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from trident.backbone import PositionalEncoding, TransformerConfig
from trident.backbone.positional import base as positional_registry
from trident.commands.evaluate import evaluate
from trident.commands.fill_mask import fill_in, load_mlm_checkpoint
from trident.commands.fill_mask import main as fill_mask_main
from trident.data.masking import IGNORE_INDEX, Masking, mask_tokens, masking_generator
from trident.errors import ConfigError
from trident.models import MaskedLM
from trident.runs.pipeline import check_config, constructor_args, instantiate, train
from trident.tasks.mlm import MaskedLanguageModelTask
from trident.tracking.wandb_files import find_offline_runs, wait_for_offline_runs
from trident.training.flops import masked_lm_flops

from .conftest import ROOT, SMALL, compose_config
from .test_flops_mfu import counted_training_flops, tiny_cfg
from .test_resume import WITH_CSV, train_losses

pytestmark = pytest.mark.usefixtures("single_thread")

# The LM's small settings (nano model, blocks of 32, a few batches), without its sampling options.
SMALL_MLM = ["task=mlm", *(o for o in SMALL if not o.startswith("task.sampling"))]
ENCODINGS = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]


def mlm_config(tmp_path: Path, *overrides: str) -> DictConfig:
    return compose_config([*SMALL_MLM, *overrides], output_dir=tmp_path / "run")


# --------------------------------------------------------------------------------------------
# Masking


def corrupt(masking: Masking, shape: tuple[int, int] = (64, 500), vocab: int = 1000,
            seed: int = 0) -> tuple[Tensor, ...]:
    """Mask random ids of a ``vocab``-token corpus vocabulary; [MASK] is ``vocab + 1``, so that a random
    replacement drawn one past the regular tokens (``vocab``, e.g. [PAD]) is told apart from a mask."""
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1234))
    inputs, targets = mask_tokens(ids, masking, mask_id=vocab + 1, num_regular_tokens=vocab,
                                  generator=masking_generator(torch.device("cpu"), seed))
    return ids, inputs, targets


@pytest.mark.parametrize(("rate", "mask_fraction", "random_fraction"), [(0.15, 0.8, 0.1), (0.3, 0.5, 0.25)])
def test_masking_selects_the_rate_and_splits_it_as_configured(rate: float, mask_fraction: float,
                                                               random_fraction: float) -> None:
    ids, inputs, targets = corrupt(Masking(rate, mask_fraction, random_fraction))
    selected = targets != IGNORE_INDEX
    assert (selected.sum(dim=1) == round(rate * 500)).all(), "exactly round(rate x length) per sequence"
    # Only selected positions carry a target, and it is the original token; the others keep their input.
    assert torch.equal(targets[selected], ids[selected])
    assert torch.equal(inputs[~selected], ids[~selected])
    n = int(selected.sum())
    masked = (inputs[selected] == 1001).float().mean().item()
    replaced = ((inputs[selected] != 1001) & (inputs[selected] != ids[selected])).float().mean().item()
    unchanged = (inputs[selected] == ids[selected]).float().mean().item()
    # A random token equals the original with probability 1/1000; the split is checked to 4 standard errors.
    for observed, expected in ((masked, mask_fraction), (replaced, random_fraction * 0.999),
                               (unchanged, 1 - mask_fraction - random_fraction * 0.999)):
        assert abs(observed - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (observed, expected)
    assert (inputs[inputs != 1001] < 1000).all(), "random replacements come from the regular vocabulary"


def test_selected_positions_are_uniform_and_masks_depend_on_the_key_alone() -> None:
    _, _, targets = corrupt(Masking(), shape=(2000, 20))
    per_position = (targets != IGNORE_INDEX).float().mean(dim=0)  # 3 of 20 = 0.15 everywhere
    assert (per_position - 0.15).abs().max() < 4 * (0.15 * 0.85 / 2000) ** 0.5
    first, again, other = corrupt(Masking(), seed=5), corrupt(Masking(), seed=5), corrupt(Masking(), seed=6)
    torch.manual_seed(99)  # the global RNG plays no part
    assert torch.equal(first[1], again[1]) and not torch.equal(first[1], other[1])


@pytest.fixture(scope="module")
def mlm_task_and_batch(tmp_path_factory: pytest.TempPathFactory) -> tuple[MaskedLanguageModelTask, Tensor]:
    """The task as the pipeline builds it (every selected token becomes [MASK], so that the selection can
    be read off the inputs), and one validation batch."""
    cfg = mlm_config(tmp_path_factory.mktemp("mlm"), "task.mask_token_fraction=1.0", "task.random_token_fraction=0.0")
    data = instantiate(constructor_args(cfg, "data"))
    data.prepare_data()
    data.setup()
    task = instantiate(constructor_args(cfg, "task"), backbone=vars(check_config(cfg)), optimizer={}, scheduler={},
                       **data.task_inputs(), _recursive_=False)
    return task, next(iter(data.val_dataloader()))


def test_loss_is_on_the_positions_the_test_masks_only(mlm_task_and_batch: tuple[MaskedLanguageModelTask, Tensor]) -> None:
    task, ids = mlm_task_and_batch
    positions = (torch.tensor([0, 0, 1, 3]), torch.tensor([3, 17, 0, 31]))  # (row, column): chosen here
    inputs, targets = ids.clone(), torch.full_like(ids, IGNORE_INDEX)
    inputs[positions], targets[positions] = task.mask_id, ids[positions]
    loss, _, _ = task._loss(inputs, targets)  # summed over the 4 positions (the step divides by its global count)
    logits = task.net(inputs).float().detach().requires_grad_()  # (B, T, V): every position
    expected = F.cross_entropy(logits[positions], ids[positions], reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert logits.grad is not None
    selected = torch.zeros_like(ids, dtype=torch.bool)
    selected[positions] = True
    assert (logits.grad[~selected] == 0).all() and (logits.grad[selected].abs().sum(dim=-1) > 0).all()


def test_logged_loss_is_on_the_masked_inputs_only(mlm_task_and_batch: tuple[MaskedLanguageModelTask, Tensor],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the step: the logged loss is the cross entropy at the [MASK] tokens of the inputs the model
    saw (5 = round(0.15 x 32) per block), against the original tokens; every other position carries none."""
    task, ids = mlm_task_and_batch
    inputs, _ = task.mask(ids, "test", 0)  # the step masks batch 0 the same way: its inputs, not its targets
    masked = inputs == task.mask_id
    assert masked.sum(dim=1).tolist() == [5] * ids.size(0) and torch.equal(inputs[~masked], ids[~masked])
    logged: dict[str, Any] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **_: logged.__setitem__(name, value))
    with torch.no_grad():
        task.test_step(ids, 0)
        task.on_test_epoch_end()  # the epoch's token-weighted loss and perplexity
        logits = task.net(inputs).float()[masked]  # (N, V) at the masks
    expected = F.cross_entropy(logits, ids[masked])
    assert float(logged["test/loss"]) == pytest.approx(float(expected), rel=1e-5)
    # Perplexity and accuracy of the masked tokens: exp of that loss, and the share of exact guesses.
    assert float(logged["test/ppl"]) == pytest.approx(math.exp(float(expected)), rel=1e-4)
    accuracy = (logits.argmax(dim=-1) == ids[masked]).float().mean()
    assert float(logged["test/acc"].compute()) == pytest.approx(float(accuracy))


def test_perplexity_of_a_confident_wrong_guess_is_exp_of_the_finite_loss(
        mlm_task_and_batch: tuple[MaskedLanguageModelTask, Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50 item 14: one masked token predicted wrong with a logit gap of 300 (its probability underflows
    fp32's softmax) made torchmetrics' Perplexity infinite beside a finite loss; val/ppl is exp of val/loss."""
    task, ids = mlm_task_and_batch
    _, targets = task.mask(ids, "val", 0)
    forward = task.net.forward

    def confident(*args: Any, **kwargs: Any) -> Tensor:
        logits = forward(*args, **kwargs)  # (N, V)
        wrong = (targets[targets != IGNORE_INDEX][0] + 1) % logits.size(-1)
        logits[0, wrong] = logits[0].max() + 300.0
        return logits

    monkeypatch.setattr(task.net, "forward", confident)
    logged: dict[str, Any] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **_: logged.__setitem__(name, value))
    monkeypatch.setattr(type(task), "trainer", property(lambda self: SimpleNamespace(sanity_checking=True, is_global_zero=False)))
    with torch.no_grad():
        task.validation_step(ids, 0)
        task.on_validation_epoch_end()
    assert math.isfinite(logged["val/loss"]) and logged["val/loss"] > 300 / targets.ne(IGNORE_INDEX).sum().item()
    assert logged["val/ppl"] == pytest.approx(math.exp(logged["val/loss"]), rel=1e-9)


# --------------------------------------------------------------------------------------------
# The network: bidirectional, padding-invariant, FLOPs


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_encoder_sees_both_sides_and_ignores_padding(encoding: str) -> None:
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, max_seq_len=32,
                            pos_encoding=encoding)
    model = MaskedLM(cfg, 20).eval()
    ids = torch.randint(0, 18, (1, 12))
    later = ids.clone()
    later[0, 10] = (ids[0, 10] + 1) % 18
    with torch.no_grad():
        out = model(ids)
        assert not torch.allclose(out[0, 2], model(later)[0, 2]), "a later token changes an earlier position's output"
        padded = torch.cat([ids, torch.full((1, 5), 19)], dim=1)
        padding = torch.arange(17)[None, :] >= 12
        torch.testing.assert_close(model(padded, key_padding_mask=padding)[:, :12], out, rtol=1e-5, atol=1e-5)


def test_without_positions_every_mask_of_a_block_gets_the_same_prediction() -> None:
    """What the pos_encoding=none warning says: a bidirectional encoder without positions is
    permutation-equivariant, so identical inputs get identical outputs wherever they stand."""
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, pos_encoding="none")
    model = MaskedLM(cfg, 20).eval()
    ids = torch.tensor([[3, 19, 5, 7, 19, 2, 19, 11]])  # 19 plays [MASK]
    with torch.no_grad():
        out = model(ids, select=ids == 19)  # (3, V)
    torch.testing.assert_close(out[0], out[1])
    torch.testing.assert_close(out[0], out[2])
    with torch.no_grad():
        out = MaskedLM(dataclasses.replace(cfg, pos_encoding="rope"), 20).eval()(ids, select=ids == 19)
    assert not torch.allclose(out[0], out[1]), "with positions, masks at different places differ"


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_masked_lm_flops_equal_the_flop_counter(activation: str) -> None:
    cfg = tiny_cfg(activation)
    model, ids = MaskedLM(cfg, 50), torch.randint(0, 50, (3, 16))
    select = torch.zeros(3, 16, dtype=torch.bool)
    select[:, [1, 5, 9]] = True
    select[0, 0] = True  # 10 predicted positions
    assert masked_lm_flops(cfg, 50, 3, 16, 10) == counted_training_flops(lambda: model(ids, select=select))


# --------------------------------------------------------------------------------------------
# Config checks (before any work)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.mask_rate=0"], r"task.mask_rate must be in \(0, 1\), got 0"),
    (["task.mask_rate=1.5"], r"task.mask_rate must be in \(0, 1\)"),
    (["task.random_token_fraction=-0.1"], r"task.random_token_fraction must be in \[0, 1\]"),
    (["task.mask_token_fraction=0.95"], r"exceeds 1"),
    (["task.mask_rate=0.9", "data.block_size=4"], r"selects 4 of the 4 tokens.*raise data.block_size"),
    (["data.block_size=1"], r"selects 1 of the 1 tokens"),
])
def test_bad_settings_fail_at_config_time(overrides: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(mlm_config(tmp_path, *overrides))


@pytest.mark.parametrize("data", ["mnist", "bible_en_de"])
def test_data_that_is_not_text_is_refused(data: str) -> None:
    with pytest.raises(ConfigError, match=rf"data={data} is not text data for task=mlm: choose .*shakespeare"):
        check_config(compose_config(["task=mlm", f"data={data}"]))


class PastOnlyEncoding(PositionalEncoding):
    """A test encoding defined for keys before the query only."""

    name: ClassVar[str] = "past_only"
    supports_bidirectional: ClassVar[bool] = False


@pytest.fixture
def past_only_encoding(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(positional_registry._REGISTRY, "past_only", PastOnlyEncoding)
    yield


def test_an_encoding_without_a_bidirectional_form_is_refused(past_only_encoding: None, tmp_path: Path) -> None:
    cfg = mlm_config(tmp_path)
    cfg.pos_encoding.name = "past_only"
    with pytest.raises(ConfigError, match=r"pos_encoding=past_only cannot serve the bidirectional encoder.*alibi"):
        check_config(cfg)
    with pytest.raises(ConfigError, match=r"pos_encoding=past_only only describes keys before the query"):
        MaskedLM(TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, pos_encoding="past_only"), 20)


def test_pos_encoding_none_warns_that_masks_are_indistinguishable(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    check_config(mlm_config(tmp_path, "pos_encoding=none"))
    assert "every [MASK] of a block gets the same prediction" in caplog.text


# --------------------------------------------------------------------------------------------
# Pipeline: a short run, its checkpoint, fill_mask and eval.py; exact resume


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """Six steps of the BPE model, so that fill_mask meets subword tokens and the lstrip [MASK]."""
    run_dir = tmp_path_factory.mktemp("mlm") / "run"
    train(compose_config([*SMALL_MLM, "data.tokenizer=bpe", "data.vocab_size=400", "logger=wandb", *WITH_CSV,
                          "trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.throughput.window=2"],
                         output_dir=run_dir))
    return run_dir


def test_short_run_logs_masked_metrics_and_examples(short_run: Path) -> None:
    header = (next(short_run.glob("csv/version_*/metrics.csv"))).read_text().splitlines()[0].split(",")
    assert {"train/loss", "val/loss", "val/ppl", "val/acc", "test/acc", "throughput/mfu"} <= set(header)
    task = load_mlm_checkpoint(short_run / "checkpoints" / "last.ckpt")
    assert task.tokenizer is not None
    assert task.tokenizer.token_to_id("[MASK]") == task.mask_id == task.num_regular_tokens, "specials after the corpus"
    assert "[MASK]" in (short_run / "tokenizer.json").read_text()
    (run,) = wait_for_offline_runs(short_run)
    assert run.metric("val/acc") and run.summary["test/acc"] == pytest.approx(float(run.metric("test/acc")[-1]))
    tables = list(short_run.rglob("media/table/masked_examples_*.table.json"))
    assert tables and "[MASK]" in tables[0].read_text(), "a W&B table of masked blocks with the predictions"


def test_fill_mask_command_fills_each_mask(short_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = str(short_run / "checkpoints" / "last.ckpt")
    texts = ["To be or not to [MASK]", "And [MASK] said, Let there be [MASK] and the waters"]
    fill_mask_main([checkpoint, *texts, "--top-k", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 1 + 2 and lines[0].startswith("To be or not to") and "[MASK]" not in lines[0]
    assert [line.split(":")[0] for line in lines if line.startswith("  ")] == ["  [MASK] 1", "  [MASK] 1", "  [MASK] 2"]
    # Texts of different lengths are padded together: each gets the predictions it gets alone.
    task = load_mlm_checkpoint(Path(checkpoint))
    together = task.fill_mask(texts, top_k=3)
    alone = [task.fill_mask([text], top_k=3)[0] for text in texts]
    for got, expected in zip(together, alone):
        assert [[t for t, _ in c] for c in got] == [[t for t, _ in c] for c in expected]
        torch.testing.assert_close([[p for _, p in c] for c in got], [[p for _, p in c] for c in expected])


def test_fill_in_replaces_the_space_a_bpe_token_brings() -> None:
    assert fill_in("to [MASK] or [MASK]", [" be", "x"]) == "to be or x"


def test_fill_mask_without_a_mask_is_one_line(short_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fill_mask_main([str(short_run / "checkpoints" / "last.ckpt"), "no mask here"])
    assert exit_info.value.code == 2
    expected = "error: no [MASK] in 'no mask here': write [MASK] where a token is to be predicted"
    assert capsys.readouterr().err.strip() == expected


@pytest.mark.slow  # the harness imported and run: ~7 s on a shared CPU
def test_the_harness_scores_a_shipped_multiple_choice_task_on_an_mlm_run(short_run: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """trident-harness on the run: pseudo-log-likelihoods rank the choices (acc, acc_norm); generation, one line."""
    pytest.importorskip("lm_eval")
    from trident.commands.harness import main as harness_main

    harness_main([str(short_run), "--tasks", "trident_shakespeare_next_line", "--limit", "4", "--batch_size", "32",
                  "--output_path", str(tmp_path)])
    (results,) = tmp_path.glob("results_*.json")
    scores = json.loads(results.read_text())["results"]["trident_shakespeare_next_line"]
    assert 0 <= scores["acc,none"] <= 1 and 0 <= scores["acc_norm,none"] <= 1
    with pytest.raises(SystemExit) as exit_info:
        harness_main([str(short_run), "--tasks", "trident_shakespeare_complete_line", "--limit", "1",
                      "--output_path", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "is a masked language model, which does not generate text: run tasks it scores (multiple_choice, "
        "loglikelihood, loglikelihood_rolling), not generate_until ones")


def test_eval_script_scores_an_mlm_checkpoint(short_run: Path) -> None:
    checkpoint = short_run / "checkpoints" / "last.ckpt"
    metrics = evaluate([f"ckpt_path={checkpoint}", "trainer.limit_test_batches=2"])
    assert 0 <= metrics["test/acc"] <= 1
    assert metrics["test/ppl"] == pytest.approx(np.exp(metrics["test/loss"]), rel=1e-4)
    assert (short_run / "eval" / "last.json").is_file()


def test_mlm_resumes_mid_epoch_step_for_step(tmp_path: Path) -> None:
    overrides = [*SMALL_MLM, *WITH_CSV, "logger=none", "model.dropout=0.1", "trainer.max_steps=6",
                 "trainer.limit_train_batches=4", "trainer.val_check_interval=6", "test=false",
                 "+callbacks.periodic._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                 f"+callbacks.periodic.dirpath={tmp_path / 'periodic'}", "+callbacks.periodic.every_n_train_steps=3",
                 "+callbacks.periodic.save_top_k=-1", "+callbacks.periodic.monitor=step",
                 "+callbacks.periodic.mode=max",
                 "+callbacks.periodic.filename='step{step}'", "+callbacks.periodic.auto_insert_metric_name=false",
                 "callbacks.throughput=null", "callbacks.lr_monitor=null"]
    train(compose_config(overrides, output_dir=tmp_path / "a"))
    mid_epoch = tmp_path / "periodic" / "step3.ckpt"
    train(compose_config([*overrides, f"ckpt_path={mid_epoch}"], output_dir=tmp_path / "b"))
    expected, resumed = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(expected) == list(range(6)) and sorted(resumed) == [3, 4, 5]
    torch.testing.assert_close(resumed, {step: expected[step] for step in resumed}, rtol=0, atol=1e-6)
    assert len(set(expected.values())) == 6


@pytest.mark.slow
def test_masked_accuracy_rises_well_above_the_unigram_baseline(tmp_path: Path) -> None:
    cfg = mlm_config(tmp_path, "data.block_size=64", "data.batch_size=32", "trainer.max_steps=300",
                     "trainer.val_check_interval=300", "trainer.limit_val_batches=8", "logger=none", "test=false",
                     "callbacks.throughput=null")
    metrics = train(cfg)
    data = instantiate(constructor_args(cfg, "data"))
    data.setup()
    counts = np.bincount(np.asarray(data.splits["validation"]))
    unigram = counts.max() / counts.sum()  # always guessing the most frequent character (the space)
    assert metrics["val/acc"] > 2 * unigram, (metrics["val/acc"], unigram)


@pytest.mark.slow
def test_ddp_job_of_a_sweep_with_wandb(tmp_path: Path) -> None:
    """`train.py -m trainer=ddp_cpu task=mlm pos_encoding=relative`: 2 gloo processes, the default
    (offline) W&B logger, no traceback on any rank, one W&B run for the job."""
    overrides = [o for o in SMALL_MLM if not o.startswith("trainer.limit_val_batches")]
    command = [sys.executable, str(ROOT / "train.py"), "-m", "trainer=ddp_cpu", "pos_encoding=relative", *overrides,
               "trainer.limit_val_batches=2", f"paths.output_root={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    result = subprocess.run(command, check=False, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    jobs = sorted(p for p in tmp_path.glob("multirun/*/*/*") if p.is_dir())
    assert [p.name for p in jobs] == ["0_mlm-shakespeare-nano-relative-seed1337"]
    (run,) = find_offline_runs(jobs[0])
    assert run.config["trainer"]["devices"] == 2 and run.metric("val/acc") and "test/acc" in run.summary
