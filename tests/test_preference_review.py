"""Review of preference tuning (issue 53): data=preference reads an ``init_from`` source's chat template and special
tokens from their one home (the run's record, staged as data=chat stages them), and encodes standard pairs with a
base model's tokenizer (no chat template) as TRL's DPOTrainer does: each answer ending in the tokenizer's eos."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.test_preference import CHAT_TEMPLATE, ROWS, llama, write_jsonl  # noqa: F401 (llama: a fixture)
from trident.data.preference import PreferenceDataModule
from trident.errors import DataError

CONVERSATIONS = [{"prompt": [{"role": "user", "content": f"Line {i}: the quick"}],
                  "chosen": [{"role": "assistant", "content": "brown fox jumps"}],
                  "rejected": [{"role": "assistant", "content": "lazy dog" * (i + 1)}]} for i in range(3)]


@pytest.fixture(scope="module")
def base_llama(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The Llama directory as a base model's: its special tokens, no chat template."""
    directory = tmp_path_factory.mktemp("base") / "llama"
    shutil.copytree(llama, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    return directory


def trl_ids(tmp_path: Path, directory: Path, rows: list[dict[str, Any]]) -> list[tuple[int, list[int], list[int]]]:
    """TRL's DPOTrainer's tokenization of ``rows`` with ``directory``'s tokenizer: each pair's prompt length and its
    chosen and rejected sequences."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model),
                         processing_class=transformers.AutoTokenizer.from_pretrained(directory),
                         args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None),
                         train_dataset=datasets.Dataset.from_list(rows))
    return [(len(r["prompt_ids"]), r["prompt_ids"] + r["chosen_ids"], r["prompt_ids"] + r["rejected_ids"])
            for r in trainer.train_dataset]


def trident_ids(data: PreferenceDataModule) -> list[tuple[int, list[int], list[int]]]:
    pairs = data.pairs["train"]
    return [(int(pairs.arrays["prompt_lengths"][i]), pairs.sequence("chosen", i).tolist(),
             pairs.sequence("rejected", i).tolist()) for i in range(len(pairs))]


def data_from_source(tmp_path: Path, source: Path, rows: list[dict[str, Any]]) -> PreferenceDataModule:
    """data=preference as train.py builds it with ``init_from=<source>``: the source fixes data.tokenizer (and stages
    what its record holds) before the data module is made."""
    from tests.conftest import compose_config
    from trident.runs.pipeline import configured_task_class
    from trident.weights.init_from import source_for_run

    files = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = compose_config(["task=lm", "data=preference", "data.source=files", f"data.files={{train:{files},validation:{files},test:{files}}}",
                          "objective=dpo",
                          f"init_from={source}", "finetune=lora", f"paths.cache_dir={tmp_path / 'cache'}"],
                         output_dir=tmp_path / "run")
    source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, False)
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(cfg.data, resolve=True)
    options = {k: v for k, v in settings.items() if k not in ("_target_", "name", "max_seq_len")}
    data = PreferenceDataModule(**options)
    data.prepare_data()
    data.setup()
    return data


def test_init_from_a_directory_renders_conversations_with_its_chat_template_as_trl(tmp_path: Path,
                                                                                   llama: Path) -> None:  # noqa: F811
    """The source's chat template (not trident's default) renders the conversations: TRL's ids; the run records it."""
    data = data_from_source(tmp_path, llama, CONVERSATIONS)
    assert data.template is not None and data.template.text == CHAT_TEMPLATE
    assert data.tokenizer_settings()["chat_template"] == CHAT_TEMPLATE
    assert trident_ids(data) == trl_ids(tmp_path, llama, CONVERSATIONS)


def test_standard_pairs_of_a_base_model_end_in_its_eos_as_trl(tmp_path: Path, base_llama: Path) -> None:
    """A base model (its tokenizer names eos, no chat template) and standard rows: each answer ends in eos, as TRL
    appends it, whether the directory is the data's tokenizer or the run's init_from source."""
    expected = trl_ids(tmp_path, base_llama, ROWS)
    assert all(chosen[-1] == rejected[-1] == 2 for _, chosen, rejected in expected)  # </s>
    (tmp_path / "direct").mkdir()
    files = write_jsonl(tmp_path / "direct" / "pairs.jsonl", ROWS)
    direct = PreferenceDataModule(source="files", files=str(files), tokenizer=str(base_llama), split=(0.5, 0.25, 0.25),
                                  cache_dir=str(tmp_path / "direct" / "cache"))
    direct.prepare_data()
    direct.setup()
    assert trident_ids(direct) == expected[:2]
    (tmp_path / "run").mkdir()
    assert trident_ids(data_from_source(tmp_path / "run", base_llama, ROWS)) == expected


def test_conversations_with_a_base_models_tokenizer_and_no_template_are_one_line(tmp_path: Path,
                                                                                base_llama: Path) -> None:
    files = write_jsonl(tmp_path / "pairs.jsonl", CONVERSATIONS)
    data = PreferenceDataModule(source="files", files=str(files), tokenizer=str(base_llama), split=(0.34, 0.33, 0.33),
                                cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"pairs.jsonl row 1 is a conversation, and .* has no chat template: give "
                                        r"data.template="):
        data.prepare_data()


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_early_stopping_may_monitor_the_held_out_reward_accuracy(tmp_path: Path, objective: str) -> None:
    """callbacks=early_stopping on val/rewards/accuracies (and the checkpoint's task.monitor with it): the check
    before any work takes the metrics the objective logs at validation; a metric nothing logs is still one line."""
    from tests.conftest import compose_config
    from trident.errors import ConfigError
    from trident.runs.pipeline import check_config

    files = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    run = ["task=lm", "data=preference", "data.source=files", f"data.files=[{files}]", f"objective={objective}",
           "init_from=somewhere", "callbacks=early_stopping", "task.monitor_mode=max"]
    check_config(compose_config([*run, "task.monitor=val/rewards/accuracies"], output_dir=tmp_path / "run"))
    with pytest.raises(ConfigError, match="callbacks.early_stopping.monitor=val/rewards/accuracy is not a metric "
                                          "task=lm logs at validation: choose among val/loss, val/ppl, val/rewards/chosen"):
        check_config(compose_config([*run, "task.monitor=val/rewards/accuracy"], output_dir=tmp_path / "run"))


@pytest.mark.parametrize("objective", [{"name": "dpo"}, {"name": "orpo"}, {"name": "dpo", "disable_dropout": False}])
def test_the_policy_trains_without_dropout_as_trls(llama: Path, objective: dict[str, Any]) -> None:  # noqa: F811
    """TRL's disable_dropout (its default): from training's start the policy (model.dropout 0.1, LoRA's 0.05 here)
    scores a batch as the reference does, so DPO's first loss is log 2 and its rewards 0; kept where turned off."""
    import math
    from types import SimpleNamespace

    import torch

    from trident.data.preference import PreferenceBatch
    from trident.objectives.preference import OddsRatioPreference
    from trident.tasks.lm import LanguageModelTask
    from trident.tasks.networks import convert_networks, converting_later, load_companions
    from trident.weights import read_pretrained

    weights = read_pretrained(llama)
    backbone = dict(weights.model, pos_encoding=weights.pos_encoding, pos_encoding_options=weights.pos_encoding_options,
                    dropout=0.1, max_seq_len=64)
    with converting_later():
        task = LanguageModelTask(backbone, weights.vocab_size, {"name": "adamw", "lr": 1e-3}, {"name": "constant"},
                                 **weights.task_options, objective=objective,
                                 lora={"targets": ["q", "v"], "rank": 2, "alpha": 2.0, "dropout": 0.05})
    task.net.load_state_dict(weights.state_dict, strict=False)
    load_companions(task, started=True)
    convert_networks(task)
    task._trainer = SimpleNamespace(ckpt_path=None, datamodule=None)
    task.on_fit_start()
    task.train()
    torch.manual_seed(0)
    inputs = torch.randint(3, weights.vocab_size, (4, 12))
    targets = torch.full_like(inputs, -100)
    targets[:, 4:11] = inputs[:, 5:12]
    batch = PreferenceBatch(inputs, targets, torch.zeros(0))
    first, second = (task.objective(task, batch, "train")[0] for _ in range(2))
    dropped = not objective.get("disable_dropout", True)
    assert torch.equal(first.summed, second.summed) != dropped
    if not dropped and not isinstance(task.objective, OddsRatioPreference):
        assert float(first.summed) / 2 == pytest.approx(math.log(2), abs=1e-6)
        assert float(first.parts["rewards/margins"][0]) == 0.0


@pytest.mark.parametrize(("metric", "best"), [("test/rewards/accuracies", "0.5"), ("test/rewards/rejected", "0.5"),
                                              ("test/rewards/margins", "0.5"), ("test/loss", "0.5")])
def test_the_sweep_report_ranks_a_beta_sweep_by_the_rewards(tmp_path: Path, metric: str, best: str) -> None:
    """trident-report --metric test/rewards/...: higher is better for the accuracy and the margin, lower for the
    rejected answers' reward (beta=0.5 pushed them down further here) and the loss."""
    from trident.report import main

    jobs = {"0.1": (0.60, -0.10, 0.20, 0.65), "0.5": (0.80, -0.40, 0.70, 0.55)}
    number = 0
    for beta, (accuracy, rejected, margin, loss) in jobs.items():
        for seed in range(2):
            job = tmp_path / "sweep" / f"{number}_job"
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "overrides.yaml").write_text(f"- task.objective.beta={beta}\n- seed={seed}\n")
            (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
            metrics = {"best/val/loss": loss, "test/loss": loss + seed / 100, "test/rewards/accuracies": accuracy + seed / 100,
                       "test/rewards/rejected": rejected + seed / 100, "test/rewards/margins": margin + seed / 100}
            (job / "status.json").write_text(json.dumps({"status": "completed", "metrics": metrics,
                                                         "monitor": "val/loss", "monitor_mode": "min"}))
            (job / "metrics.jsonl").write_text(json.dumps({"step": 2, "stage": "validate", "val/loss": loss}) + "\n")
            number += 1
    main([str(tmp_path / "sweep"), "--metric", metric, "--out", str(tmp_path / "report")])
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"against the best setting by mean, `task.objective.beta={best}`." in report


def test_a_reference_file_given_to_a_new_run_is_one_line_and_left_as_it_was(tmp_path: Path, llama: Path,  # noqa: F811
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """+task.reference=<another network's weights> (e.g. of another vocabulary): a full fine-tuning DPO run's reference
    is its initial weights, copied to that path: refused in one line, before the copy overwrote the file."""
    from tests.entry_points import run_in_process

    files = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"weights of another vocabulary")
    result = run_in_process("train.py", ["task=lm", "data=preference", "data.source=files",
                                         f"data.files={{train:{files},validation:{files},test:{files}}}",
                                         "objective=dpo", f"init_from={llama}", f"+task.reference={other}",
                                         "data.max_length=32", "data.batch_size=2", "trainer.max_steps=1", "test=false", "logger=none",
                                         f"hydra.run.dir={tmp_path / 'run'}"],
                            tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.last_line.startswith(f"error: task.reference={other} is where a run keeps its copy of its initial "
                                       "weights"), result.last_line
    assert other.read_bytes() == b"weights of another vocabulary"


def test_precomputed_reference_log_probabilities_are_scored_in_the_steps_precision(tmp_path: Path,
                                                                                   llama: Path) -> None:  # noqa: F811
    """precision=bf16 (bf16-mixed): the reference precomputed at training's start is what the steps would score with
    the adapters off, under the same autocast (TRL precomputes under its accelerator's autocast), so that the first
    step's rewards are 0, not bf16's rounding of a float32 reference."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tests.test_preference import preference_data, trident_task

    data = preference_data(tmp_path, llama, ROWS, batch_size=2)
    task = trident_task(llama, {"name": "dpo", "precompute_ref": True},
                        lora={"targets": ["q", "v"], "rank": 2, "alpha": 2.0, "dropout": 0.0}).float()
    plugin = MixedPrecision("bf16-mixed", "cpu")
    task._trainer = SimpleNamespace(datamodule=data, ckpt_path=None, precision_plugin=plugin)
    task.objective.start(task)
    for batch in data.split_loader("train", train=False):
        with plugin.forward_context():
            scored = task.objective.reference_logps(task, batch._replace(reference=torch.zeros(0)))
        torch.testing.assert_close(batch.reference, scored, rtol=0, atol=0)
