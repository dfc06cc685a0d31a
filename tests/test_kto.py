"""KTO (issue 53): objective=kto's loss, every logged metric and the policy's gradient equal TRL's KTOTrainer on one
batch, from unpaired rows and from pairs (split as TRL's unpair_preference_dataset splits them), in full fine-tuning
and with LoRA against a peft model; its bad inputs one line each."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.convert_helpers import randomise
from tests.test_preference import (
    ROWS,
    ExactHead,
    assert_gradients_equal,
    copy_adapters_into_peft,
    llama,
    preference_data,
    read_state,
    trident_task,
    write_jsonl,
)
from trident.data.preference import PreferenceBatch, UnpairedBatch
from trident.errors import ConfigError, DataError
from trident.objectives.kto import METRICS, mismatched

__all__ = ["llama"]  # the module fixture, shared with tests/test_preference.py

# Unpaired rows, desirable and not in no order, with unequal counts (3 and 2 after the pairs' answers).
UNPAIRED = [{"prompt": row["prompt"], "completion": row[answer], "label": answer == "chosen"}
            for row, answer in zip(ROWS + ROWS[:1], ["chosen", "rejected", "rejected", "chosen", "chosen"], strict=True)]


def trl_kto(tmp_path: Path, llama: Path, policy: torch.nn.Module, reference: torch.nn.Module | None, rows: list[dict],
            peft_config: Any = None, **settings: Any) -> Any:
    import datasets
    import transformers
    from trl import KTOConfig, KTOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    answers = 2 * len(rows) if "chosen" in rows[0] else len(rows)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, per_device_train_batch_size=answers,
                     max_length=None, disable_dropout=True, **settings)
    return KTOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                      train_dataset=datasets.Dataset.from_list(rows), peft_config=peft_config)


def trl_step(trainer: Any, indices: list[int]) -> torch.Tensor:
    """TRL's loss of the answers ``indices`` of its train set (their KL sequences as its collator made them), its
    gradient taken; its metrics are in ``trainer._metrics["train"]``."""
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in indices])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss


def check_metrics(loss: Any, trainer: Any, names: tuple[str, ...] = METRICS) -> None:
    for name in names:
        assert float(loss.parts[name][0]) == pytest.approx(trainer._metrics["train"][name][-1], abs=1e-5), name


@pytest.mark.parametrize(("rows", "settings"), [
    (UNPAIRED, {"beta": 0.3, "desirable_weight": 1.3, "undesirable_weight": 0.7}),
    (ROWS, {"beta": 0.2}),
    (UNPAIRED, {"beta": 0.3, "loss_type": "apo_zero_unpaired"}),
], ids=["unpaired", "pairs", "apo_zero_unpaired"])
def test_the_loss_every_metric_and_the_gradient_equal_trls_kto_trainer(
        tmp_path: Path, llama: Path, rows: list[dict], settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch through trident's objective=kto and TRL's KTOTrainer from the same reference and policy weights:
    the same tokens (TRL's KL sequences: each prompt with the previous row's answer), loss, metrics and gradients."""
    import transformers
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactHead)
    data = preference_data(tmp_path, llama, rows)
    reference_hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    policy_hf = randomise(copy.deepcopy(reference_hf), seed=7, std=0.05)
    trainer = trl_kto(tmp_path, llama, policy_hf, reference_hf, rows, **settings)
    task = trident_task(llama, {"name": "kto", **settings}, reference=tmp_path / "reference.safetensors")
    assert set(task.companions) == {"reference"}
    task.net.load_state_dict(read_state(policy_hf, tmp_path / "policy"), strict=True)
    task.train()
    answers = data.pairs["train"]
    batch = answers.collate([(i,) for i in range(len(answers))])
    assert isinstance(batch, UnpairedBatch if rows is UNPAIRED else PreferenceBatch)
    trl_rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    kl_inputs, _ = mismatched(batch.inputs, batch.targets)
    for i, row in enumerate(trl_rows):  # tokenised as TRL tokenises (standard rows: eos appended), its KL rows too
        length = len(row["prompt_ids"]) + len(row["completion_ids"])
        assert batch.inputs[i, :length].tolist() == row["prompt_ids"] + row["completion_ids"]
        kl_row = row["prompt_ids"] + row.get("KL_completion_ids", [])  # none for apo_zero_unpaired
        assert "KL_completion_ids" not in row or kl_inputs[i, : len(kl_row)].tolist() == kl_row
    loss, _ = task.objective(task, batch, "train")
    mean = loss.summed / loss.count
    mean.backward()
    trl_loss = trl_step(trainer, list(range(len(trl_rows))))
    torch.testing.assert_close(mean, trl_loss.to(mean.dtype), atol=1e-5, rtol=1e-5)
    assert int(loss.count) == len(trl_rows)
    check_metrics(loss, trainer)
    kto = settings.get("loss_type", "kto") == "kto"
    assert (float(loss.parts["kl"][0]) > 0) == kto, "a reference point above its clamp at 0 (apo: none)"

    assert_gradients_equal(task, trainer.model)


def test_a_batch_without_desirable_answers_trains_on_the_others_as_trl_does(
        tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of undesirable answers only: TRL's loss is the mean over them and it logs no chosen reward or margin;
    trident's loss is the same and those metrics have weight 0 (left out of the step's and the epoch's means)."""
    import transformers
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactHead)
    rows = [row for row in UNPAIRED if not row["label"]] + [UNPAIRED[0]]  # the train set needs a desirable one
    data = preference_data(tmp_path, llama, rows)
    reference_hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    policy_hf = randomise(copy.deepcopy(reference_hf), seed=7, std=0.05)
    trainer = trl_kto(tmp_path, llama, policy_hf, reference_hf, rows, beta=0.3)
    task = trident_task(llama, {"name": "kto", "beta": 0.3}, reference=tmp_path / "reference.safetensors")
    task.net.load_state_dict(read_state(policy_hf, tmp_path / "policy"), strict=True)
    batch = data.pairs["train"].collate([(0,), (1,)])
    assert not batch.desirable.any()
    loss, _ = task.objective(task, batch, "train")
    trainer.train_dataset = trainer.train_dataset.select([0, 1])  # its KL rows as a batch of these two makes them
    trainer.train_dataset = trainer._prepare_dataset(trainer.train_dataset, trainer.processing_class, trainer.args, "x")
    trl_loss = trl_step(trainer, [0, 1])
    torch.testing.assert_close(loss.summed / loss.count, trl_loss.to(torch.float64), atol=1e-5, rtol=1e-5)
    check_metrics(loss, trainer, ("rewards/rejected", "logps/rejected", "kl"))
    assert "rewards/chosen" not in trainer._metrics["train"] and "rewards/margins" not in trainer._metrics["train"]
    assert all(int(loss.parts[name][1]) == 0 for name in ("rewards/chosen", "logps/chosen", "rewards/margins"))


def test_with_lora_the_loss_metrics_and_adapter_gradients_equal_trl_with_a_peft_model(
        tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """finetune=lora against TRL's KTOTrainer with peft's LoRA on the same modules holding the same adapter weights:
    both take the base network, adapters off, as the reference policy (of the answers and of the KL sequences)."""
    import peft
    import transformers
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactHead)
    data = preference_data(tmp_path, llama, UNPAIRED)
    lora = {"targets": ["q", "v"], "rank": 4, "alpha": 8.0, "dropout": 0.0}
    task = trident_task(llama, {"name": "kto", "beta": 0.5}, lora=lora)
    assert not task.companions
    generator = torch.Generator().manual_seed(5)
    adapters = {name: p for name, p in task.net.named_parameters() if "lora_" in name}
    with torch.no_grad():
        for param in adapters.values():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM")
    trainer = trl_kto(tmp_path, llama, model, None, UNPAIRED, beta=0.5, peft_config=config)

    peft_params = copy_adapters_into_peft(adapters, trainer.model)
    task.train()
    batch = data.pairs["train"].collate([(i,) for i in range(len(UNPAIRED))])
    loss, _ = task.objective(task, batch, "train")
    (loss.summed / loss.count).backward()
    trl_loss = trl_step(trainer, list(range(len(UNPAIRED))))
    torch.testing.assert_close(loss.summed / loss.count, trl_loss.to(torch.float64), atol=1e-5, rtol=1e-5)
    check_metrics(loss, trainer)
    for name, param in adapters.items():
        torch.testing.assert_close(param.grad, peft_params[name].grad.to(torch.float64), atol=1e-5,
                                   rtol=1e-5, msg=name)


@pytest.mark.parametrize(("row", "named"), [
    ({"prompt": "Line", "completion": " fox"}, "row 6 has no 'label'"),
    ({"prompt": "Line", "completion": " fox", "label": "yes"}, r"row 6: 'label' is 'yes': give true"),
    ({"prompt": "Line", "completion": "  ", "label": True}, "row 6: the 'completion' is empty"),
    ({"completion": " fox", "label": True}, "row 6 has no 'prompt'"),
])
def test_a_bad_unpaired_row_is_one_line_naming_it(tmp_path: Path, llama: Path, row: dict[str, Any], named: str) -> None:
    with pytest.raises(DataError, match=rf"pairs.jsonl {named}"):
        preference_data(tmp_path, llama, [*UNPAIRED, row])


def test_unpaired_and_paired_files_together_are_one_line(tmp_path: Path, llama: Path) -> None:
    from trident.data.preference import PreferenceDataModule

    unpaired, pairs = write_jsonl(tmp_path / "a.jsonl", UNPAIRED), write_jsonl(tmp_path / "b.jsonl", ROWS)
    data = PreferenceDataModule(source="files", files=[str(unpaired), str(pairs)], tokenizer=str(llama),
                                cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="a.jsonl holds unpaired rows .* and .*b.jsonl pairs .*: give every file in one format"):
        data.prepare_data()


def test_unpaired_rows_in_batches_of_one_are_refused_in_one_line(tmp_path: Path, llama: Path) -> None:
    """TRL refuses per_device_train_batch_size=1 for KTO: the KL sequence of a batch of one is its own answer."""
    with pytest.raises(ConfigError, match="unpaired rows \\(objective=kto\\) need data.batch_size of 2 or more"):
        preference_data(tmp_path, llama, UNPAIRED, batch_size=1)


def test_a_pairwise_objective_on_unpaired_rows_names_kto(tmp_path: Path, llama: Path) -> None:
    data = preference_data(tmp_path, llama, UNPAIRED)
    task = trident_task(llama, {"name": "orpo"})
    with pytest.raises(ConfigError, match="objective=orpo trains on pairs .* unpaired rows .*: train them with objective=kto"):
        task.objective(task, data.pairs["train"].collate([(0,), (1,)]), "train")


@pytest.mark.parametrize(("overrides", "named"), [
    (["data=preference", "objective=kto"], "objective=kto starts from trained weights"),
    (["data=preference", "objective=kto", "init_from=x", "task.objective.loss_type=sigmoid"], "not a KTO loss"),
    (["data=preference", "objective=kto", "init_from=x", "task.objective.desirable_weight=0"],
     "desirable_weight=0 must be positive"),
    (["objective=kto", "init_from=x"], "objective=kto trains on pairs of chosen and rejected answers, not data=shakespeare"),
])
def test_a_kto_run_that_cannot_work_is_one_line_before_any_work(overrides: list[str], named: str) -> None:
    from tests.conftest import compose_config
    from trident.objectives import build_objective
    from trident.tasks.lm import LanguageModelTask

    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=named):
        LanguageModelTask.validate_config(cfg)
        build_objective(cfg.task.objective, "lm", LanguageModelTask.TRAINS_WITH)


def test_the_unpaired_rows_are_read_from_every_file_kind(tmp_path: Path, llama: Path) -> None:
    """Conversational unpaired rows (TRL's format: prompt and completion lists of messages) read from JSON give the
    same answers as from JSONL; the labels ride with each answer."""
    rows = [{"prompt": [{"role": "user", "content": f"Line {i}: the quick"}],
             "completion": [{"role": "assistant", "content": "brown fox" if i % 2 else "lazy dog"}],
             "label": bool(i % 2)} for i in range(6)]
    (tmp_path / "a").mkdir()
    jsonl = preference_data(tmp_path / "a", llama, rows)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    from trident.data.preference import PreferenceDataModule

    data = PreferenceDataModule(source="files", files={s: str(path) for s in ("train", "validation", "test")},
                                tokenizer=str(llama), cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup()
    for name, array in data.pairs["train"].arrays.items():
        assert array.tolist() == jsonl.pairs["train"].arrays[name].tolist(), name
    assert data.pairs["train"].arrays["labels"].tolist() == [bool(i % 2) for i in range(6)]


def test_dpo_precomputing_its_reference_on_unpaired_rows_names_kto(tmp_path: Path, llama: Path) -> None:
    """precompute_ref=true reads every split's pairs when training starts: unpaired rows are refused there, in one line."""
    from types import SimpleNamespace

    data = preference_data(tmp_path, llama, UNPAIRED)
    task = trident_task(llama, {"name": "dpo", "precompute_ref": True})
    task._trainer = SimpleNamespace(datamodule=data, ckpt_path=None)  # what start() reads of the trainer
    with pytest.raises(ConfigError, match="objective=dpo trains on pairs .* unpaired rows .*: train them with objective=kto"):
        task.objective.start(task)


@pytest.mark.parametrize("disable", [True, False])
def test_kto_trains_without_dropout_by_default_as_trl(llama: Path, disable: bool) -> None:
    """KTOConfig.disable_dropout (True): the policy's dropout (LoRA's here) off when training starts, as the reference
    is scored; task.objective.disable_dropout=false keeps it."""
    task = trident_task(llama, {"name": "kto", "disable_dropout": disable},
                        lora={"targets": ["q", "v"], "rank": 2, "alpha": 4.0, "dropout": 0.05})
    task.objective.start(task)
    rates = {m.p for m in task.net.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == ({0.0} if disable else {0.0, 0.05})
