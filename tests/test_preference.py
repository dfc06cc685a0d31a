"""Preference tuning (issue 53): objective=dpo's losses, metrics and gradients equal TRL's DPOTrainer on one batch,
the reference policy (LoRA adapters off, a frozen copy, precomputed), data=preference's reading and truncation."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.convert_helpers import randomise
from tests.test_convert_llama_family import bpe_tokenizer, hf_model
from trident.data.preference import PreferenceBatch, PreferenceDataModule
from trident.data.preference_rows import fit_pair
from trident.errors import ConfigError, DataError
from trident.objectives.preference import METRICS
from trident.tasks.lm import LanguageModelTask
from trident.tasks.networks import convert_networks, converting_later, load_companions
from trident.weights import read_pretrained
from trident.weights.adapters.registry import adapter_for_network

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROWS = [
    {"prompt": "Line 1: the quick brown", "chosen": " fox jumps over", "rejected": " dog rests"},
    {"prompt": "Line 22: the lazy", "chosen": " dog, and then it rests.", "rejected": " fox"},
    {"prompt": "Line 3:", "chosen": " the quick brown fox jumps over the lazy dog", "rejected": " and then"},
    {"prompt": "Line 40: and then it", "chosen": " rests.", "rejected": " jumps over the quick fox."},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama directory with a byte-level BPE tokenizer, its chat template and </s> as eos."""
    directory = tmp_path_factory.mktemp("llama")
    tokenizer = bpe_tokenizer()
    hf_model("llama", directory, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>", "chat_template": CHAT_TEMPLATE}))
    return directory


def preference_data(tmp_path: Path, llama: Path, rows: list[dict[str, Any]], **options: Any) -> PreferenceDataModule:
    files = write_jsonl(tmp_path / "pairs.jsonl", rows)
    data = PreferenceDataModule(source="files", files={"train": str(files), "validation": str(files), "test": str(files)},
                                tokenizer=str(llama), cache_dir=str(tmp_path / "cache"), **options)
    data.prepare_data()
    data.setup()
    return data


def copy_adapters_into_peft(adapters: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """trident's LoRA factors (``decoder.blocks.0.self_attn.qkv_proj.lora_A.q``) into the peft model's parameters ->
    the peft parameter of each trident name."""
    def peft_name(name: str) -> str:
        _, _, block, _, _, matrix, part = name.split(".")
        return f"base_model.model.model.layers.{block}.self_attn.{part}_proj.{matrix}.default.weight"

    peft_params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in adapters.items():
            peft_params[peft_name(name)].copy_(param)
    return {name: peft_params[peft_name(name)] for name in adapters}


def trident_task(llama: Path, objective: dict[str, Any], lora: dict[str, Any] | None = None,
                 reference: Path | None = None) -> LanguageModelTask:
    """task=lm on the Llama directory's weights, in float64 (sums reordered by another library agree to 1e-12), built
    as a run builds it: the weights first, then the companions (``reference``: DPO's frozen copy of them in full
    fine-tuning, its file named there) and the converters."""
    weights = read_pretrained(llama)
    backbone = dict(weights.model, pos_encoding=weights.pos_encoding, pos_encoding_options=weights.pos_encoding_options,
                    dropout=0.0, max_seq_len=64)
    with converting_later():
        task = LanguageModelTask(backbone, weights.vocab_size, {"name": "adamw", "lr": 1e-3}, {"name": "constant"},
                                 **weights.task_options, objective=objective, lora=lora,
                                 reference=None if reference is None else str(reference))
    task.net.load_state_dict(weights.state_dict, strict=False)
    load_companions(task, started=True)
    convert_networks(task)
    return task.double()


class ExactHead:
    """TRL's fused LM head (``add_fused_lm_head``) computed in the model's dtype, float64 here: TRL's chunked kernel
    accumulates its softmax in float32, whose rounding on sums of log-probabilities of random weights (hundreds)
    exceeds 1e-5. The same outputs: each label's log-probability, the entropy, log sum p^2, the mean logit, top-1."""

    @staticmethod
    def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
              temperature: float, chunk: int, softcap: float | None, logit_scale: float,
              outputs: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        assert softcap is None
        logits = (hidden @ weight.T + (0 if bias is None else bias)) * logit_scale / temperature  # (N, V)
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, labels[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return (chosen, entropy.detach(), torch.logsumexp(2 * logp, -1).detach(), logits.mean(-1).detach(),
                logits.argmax(-1) == labels)


def trl_trainer(tmp_path: Path, llama: Path, policy: torch.nn.Module, reference: torch.nn.Module | None,
                peft_config: Any = None, **settings: Any) -> Any:
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, per_device_train_batch_size=len(ROWS),
                     max_length=None, disable_dropout=True, **settings)
    return DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                      train_dataset=datasets.Dataset.from_list(ROWS), peft_config=peft_config)


@pytest.mark.parametrize(("loss_type", "label_smoothing"), [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.2)])
def test_the_loss_every_metric_and_the_gradient_equal_trl(tmp_path: Path, llama: Path, loss_type: str,
                                                          label_smoothing: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch of 4 pairs through trident's objective=dpo and TRL's DPOTrainer from the same reference and policy
    weights (the policy the reference moved by a random draw): the same tokens, loss, metrics and gradients."""
    import transformers
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactHead)
    data = preference_data(tmp_path, llama, ROWS)
    reference_hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    policy_hf = randomise(copy.deepcopy(reference_hf), seed=7, std=0.05)
    beta = 0.3
    trainer = trl_trainer(tmp_path, llama, policy_hf, reference_hf, beta=beta, loss_type=[loss_type],
                          label_smoothing=label_smoothing)
    pairs = data.pairs["train"]
    for i, row in enumerate(trainer.train_dataset):  # tokenised as TRL tokenises (standard rows: eos appended)
        prompt = int(pairs.arrays["prompt_lengths"][i])
        assert pairs.sequence("chosen", i).tolist() == row["prompt_ids"] + row["chosen_ids"]
        assert pairs.sequence("rejected", i).tolist() == row["prompt_ids"] + row["rejected_ids"]
        assert prompt == len(row["prompt_ids"])

    task = trident_task(llama, {"name": "dpo", "loss_type": loss_type, "beta": beta, "label_smoothing": label_smoothing},
                        reference=tmp_path / "reference.safetensors")
    assert set(task.companions) == {"reference"}
    task.net.load_state_dict(read_state(policy_hf, tmp_path / "policy"), strict=True)
    task.train()
    batch = pairs.collate([(i,) for i in range(len(ROWS))])
    loss, _ = task.objective(task, batch, "train")
    mean = loss.summed / loss.count
    mean.backward()

    policy_hf.train()
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_loss.backward()
    torch.testing.assert_close(mean, trl_loss.to(mean.dtype), atol=1e-5, rtol=1e-5)
    assert int(loss.count) == len(ROWS)
    for name in METRICS:
        assert float(loss.parts[name][0]) == pytest.approx(trainer._metrics["train"][name][-1], abs=1e-5), name

    assert_gradients_equal(task, trainer.model)


def assert_gradients_equal(task: LanguageModelTask, model: torch.nn.Module) -> None:
    """Each gradient of the Hugging Face ``model`` equals the task network's, written in that model's names (1e-5)."""
    grads = copy.deepcopy(task.net)
    for param, source in zip(grads.parameters(), task.net.parameters(), strict=True):
        param.data = source.grad.detach().clone()
    _, _, as_hf = adapter_for_network(grads).from_trident(grads)
    hf_grads = {name: p.grad for name, p in model.named_parameters()}
    assert hf_grads.keys() <= as_hf.keys() | {"lm_head.weight"}
    for name, grad in hf_grads.items():
        torch.testing.assert_close(as_hf[name].to(grad.dtype), grad, atol=1e-5, rtol=1e-5, msg=name)


def read_state(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """A transformers model's weights as trident names them (saved and read as init_from reads them)."""
    model.save_pretrained(directory)
    return {k: v.double() for k, v in read_pretrained(directory).state_dict.items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_with_lora_the_loss_metrics_and_adapter_gradients_equal_trl_with_a_peft_model(
        tmp_path: Path, llama: Path, loss_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """finetune=lora against TRL with peft's LoRA on the same modules (q_proj, v_proj) holding the same adapter
    weights (moved away from zero): both take the base network, adapters off, as the reference policy."""
    import peft
    import transformers
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactHead)
    data = preference_data(tmp_path, llama, ROWS)
    lora = {"targets": ["q", "v"], "rank": 4, "alpha": 8.0, "dropout": 0.0}
    task = trident_task(llama, {"name": "dpo", "loss_type": loss_type, "beta": 0.5}, lora=lora)
    generator = torch.Generator().manual_seed(5)
    adapters = {name: p for name, p in task.net.named_parameters() if "lora_" in name}
    with torch.no_grad():
        for param in adapters.values():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM")
    trainer = trl_trainer(tmp_path, llama, model, None, beta=0.5, loss_type=[loss_type], peft_config=config)

    peft_params = copy_adapters_into_peft(adapters, trainer.model)
    task.train()
    batch = data.pairs["train"].collate([(i,) for i in range(len(ROWS))])
    loss, _ = task.objective(task, batch, "train")
    (loss.summed / loss.count).backward()
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))]))
    trl_loss.backward()
    torch.testing.assert_close(loss.summed / loss.count, trl_loss.to(torch.float64), atol=1e-5, rtol=1e-5)
    for metric in METRICS:
        assert float(loss.parts[metric][0]) == pytest.approx(trainer._metrics["train"][metric][-1], abs=1e-5), metric
    for name, param in adapters.items():
        torch.testing.assert_close(param.grad, peft_params[name].grad.to(torch.float64), atol=1e-5,
                                   rtol=1e-5, msg=name)


def test_a_lora_policys_reference_is_the_same_network_with_its_adapters_off(tmp_path: Path, llama: Path) -> None:
    """finetune=lora: the reference log-probabilities are the base network's (adapters moved away from zero do not
    reach them), from the policy's own modules (no frozen copy is held)."""
    data = preference_data(tmp_path, llama, ROWS)
    batch = data.pairs["train"].collate([(i,) for i in range(len(ROWS))])
    lora = {"targets": ["q", "v", "mlp"], "rank": 4, "alpha": 8.0, "dropout": 0.0}
    policy, base = trident_task(llama, {"name": "dpo"}, lora=lora), trident_task(llama, {"name": "dpo"})
    randomise(policy.net, seed=3, std=0.05)
    policy.net.load_state_dict(base.net.state_dict(), strict=False)  # the base weights back; the adapters stay moved
    assert not policy.companions
    reference = policy.objective.reference_logps(policy, batch)
    from trident.objectives.preference import answer_logps

    with torch.no_grad():
        expected = answer_logps(base.net(batch.inputs), batch.targets)[0]
        moved = answer_logps(policy.net(batch.inputs), batch.targets)[0]
    torch.testing.assert_close(reference, expected, atol=1e-9, rtol=1e-9)
    assert (moved - expected).abs().min() > 1e-3, "the adapters change the policy"
    loss, _ = policy.objective(policy, batch, "train")
    loss.summed.backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in policy.net.named_parameters()), "only adapters train"


def test_precomputed_reference_log_probabilities_are_served_with_each_batch(tmp_path: Path, llama: Path) -> None:
    """precompute_ref=true: at the start of training the policy's log-probabilities of every pair of every split are
    computed once and ride with the batches; no frozen copy is kept; they equal a frozen copy's."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import Precision

    data = preference_data(tmp_path, llama, ROWS, batch_size=3)
    task = trident_task(llama, {"name": "dpo", "precompute_ref": True})
    # What start() reads of the trainer.
    task._trainer = SimpleNamespace(datamodule=data, ckpt_path=None, precision_plugin=Precision())
    task.objective.start(task)
    assert not task.companions
    copy_task = trident_task(llama, {"name": "dpo"}, reference=tmp_path / "reference.safetensors")
    for split in ("train", "validation", "test"):
        batch = data.pairs[split].collate([(i,) for i in (3, 0, 2)])
        assert batch.reference.shape == (6,)
        torch.testing.assert_close(batch.reference.double(), copy_task.objective.reference_logps(copy_task, batch),
                                   atol=1e-9, rtol=1e-9)


def test_conversational_rows_with_implicit_prompts_are_tokenised_as_trl_does(tmp_path: Path, llama: Path) -> None:
    """Conversations (the prompt the answers' common turns, through the directory's chat template): TRL's ids."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    rows = [{"chosen": [{"role": "user", "content": f"Line {i}: the quick"},
                        {"role": "assistant", "content": "brown fox jumps"}],
             "rejected": [{"role": "user", "content": f"Line {i}: the quick"},
                          {"role": "assistant", "content": "lazy dog" * (i + 1)}]} for i in range(3)]
    data = preference_data(tmp_path, llama, rows)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=transformers.AutoTokenizer.from_pretrained(llama),
                         args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None),
                         train_dataset=datasets.Dataset.from_list(rows))
    pairs = data.pairs["train"]
    for i, row in enumerate(trainer.train_dataset):
        assert pairs.sequence("chosen", i).tolist() == row["prompt_ids"] + row["chosen_ids"]
        assert pairs.sequence("rejected", i).tolist() == row["prompt_ids"] + row["rejected_ids"]
        assert int(pairs.arrays["prompt_lengths"][i]) == len(row["prompt_ids"])
    batch = pairs.collate([(0,), (2,)])
    assert isinstance(batch, PreferenceBatch) and batch.inputs.shape[0] == 4
    # Only answer tokens are targets: the chosen row's targets are its answer's tokens, in order.
    answer = pairs.sequence("chosen", 0)[int(pairs.arrays["prompt_lengths"][0]):].tolist()
    assert [t for t in batch.targets[0].tolist() if t != -100] == answer


@pytest.mark.parametrize(("prompt", "chosen", "rejected", "limits", "fitted", "cut"), [
    ([1, 2, 3], [4, 5], [6], (None, 8), ([1, 2, 3], [4, 5], [6]), False),
    ([1, 2, 3, 4, 5], [6, 7], [8], (2, 8), ([4, 5], [6, 7], [8]), True),  # the prompt keeps its end
    ([1, 2, 3, 4, 5], [6, 7, 8], [9], (None, 6), ([3, 4, 5], [6, 7, 8], [9]), True),  # room made for the answer
    ([1, 2], [6, 7, 8, 9], [6, 7, 8, 0], (None, 3), None, True),  # answers cut to the same tokens: dropped
    ([1, 2], [3, 4, 5, 6], [7], (None, 3), ([2], [3, 4], [7]), True),  # an answer alone too long loses its end
])
def test_truncation_cuts_the_prompts_start_and_keeps_the_answers(prompt: list[int], chosen: list[int],
                                                                 rejected: list[int], limits: tuple[int | None, int],
                                                                 fitted: Any, cut: bool) -> None:
    assert fit_pair(prompt, chosen, rejected, *limits) == (fitted, cut)


def test_pairs_cut_and_dropped_are_counted_in_one_warning(tmp_path: Path, llama: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    rows = [*ROWS, {"prompt": "Line 5", "chosen": " the quick brown fox jumps", "rejected": " the quick brown fox rests"}]
    with caplog.at_level("WARNING"):
        data = preference_data(tmp_path, llama, rows, max_length=6, max_prompt_length=2)
    warning = next(r.getMessage() for r in caplog.records if "data.max_length=6" in r.getMessage())
    assert data.pairs["train"].arrays["prompt_lengths"].max() <= 2
    assert max(len(data.pairs["train"].sequence(f, i)) for f in ("chosen", "rejected")
               for i in range(len(data.pairs["train"]))) <= 6
    assert "were dropped" in warning and "lost their prompt's start" in warning


@pytest.mark.parametrize(("row", "named"), [
    ({"prompt": "Line", "chosen": " fox"}, "has no 'rejected' answer"),
    ({"prompt": "Line", "chosen": " fox", "rejected": " fox"}, "are the same answer"),
    ({"prompt": "Line", "chosen": " fox", "rejected": "   "}, "the 'rejected' answer is empty"),
])
def test_a_bad_row_is_one_line_naming_it(tmp_path: Path, llama: Path, row: dict[str, Any], named: str) -> None:
    with pytest.raises(DataError, match=rf"pairs.jsonl row 5.*{named}"):
        preference_data(tmp_path, llama, [*ROWS, row])


def test_a_prompt_limit_that_leaves_no_room_for_an_answer_is_one_line(tmp_path: Path, llama: Path) -> None:
    with pytest.raises(ConfigError, match="max_prompt_length=8 leaves no room for an answer in data.max_length=8"):
        preference_data(tmp_path, llama, ROWS, max_length=8, max_prompt_length=8)


def test_files_given_to_the_shipped_source_are_one_line_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.files is read with data.source=files, not data.source=shakespeare"):
        PreferenceDataModule(files=[str(write_jsonl(tmp_path / "pairs.jsonl", ROWS))], cache_dir=str(tmp_path))


@pytest.mark.parametrize(("overrides", "named"), [
    (["data=preference", "data.files=[x.jsonl]", "objective=dpo"], "objective=dpo starts from trained weights"),
    (["objective=dpo", "init_from=somewhere"], "not data=shakespeare: use data=preference"),
    (["data=preference", "data.files=[x.jsonl]"], "add objective=dpo or objective=orpo"),
    (["objective=orpo"], "objective=orpo trains on pairs of chosen and rejected answers, not data=shakespeare"),
    (["data=preference", "objective=dpo", "init_from=x", "task.objective.loss_type=kto"], "not a DPO loss"),
    (["data=preference", "objective=dpo", "init_from=x", "finetune=lora", "finetune.adapter=y"],
     r"finetune.adapter=<a LoRA run> would take the base without that adapter"),
])
def test_a_preference_run_that_cannot_work_is_one_line_before_any_work(overrides: list[str], named: str) -> None:
    from tests.conftest import compose_config
    from trident.objectives import build_objective

    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=named):
        LanguageModelTask.validate_config(cfg)
        build_objective(cfg.task.objective, "lm", LanguageModelTask.TRAINS_WITH)


def test_train_py_refuses_dpo_without_init_from_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.entry_points import run_in_process

    files = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    result = run_in_process("train.py", ["data=preference", "data.source=files", f"data.files=[{files}]", "objective=dpo",
                                         "logger=none"],
                            tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.last_line.startswith("error: objective=dpo starts from trained weights, its reference policy: give init_from=")


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_a_lora_dpo_run_from_a_llama_directory_trains_and_logs_trls_metrics(tmp_path: Path, llama: Path, objective: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """python train.py task=lm data=preference objective=dpo (or kto: the pairs split into their answers)
    init_from=<Llama directory> finetune=lora: three steps of conversational pairs; the rewards and
    log-probabilities logged per split under TRL's names."""
    import csv

    from tests.entry_points import run_in_process
    from trident.objectives import kto

    rows = [{"prompt": [{"role": "user", "content": f"Line {i}: the quick"}],
             "chosen": [{"role": "assistant", "content": "brown fox jumps"}],
             "rejected": [{"role": "assistant", "content": "lazy dog rests" + " then" * (i % 3)}]} for i in range(24)]
    files = write_jsonl(tmp_path / "pairs.jsonl", rows)
    result = run_in_process("train.py", [
        "task=lm", "data=preference", f"objective={objective}", f"init_from={llama}", "finetune=lora", "data.source=files",
        f"data.files=[{files}]",
        "data.batch_size=4", "data.max_length=32", "trainer.max_steps=3", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "logger=csv", "test=false", "print_config=false",
        f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr[-3000:]
    with next((tmp_path / "run").rglob("metrics.csv")).open() as handle:
        logged = list(csv.DictReader(handle))
    names = {name for row in logged for name, value in row.items() if value}
    metrics = kto.METRICS if objective == "kto" else METRICS
    assert {f"{split}/{metric}" for split in ("train", "val") for metric in metrics} <= names
    assert (tmp_path / "run" / "adapter").is_dir()


@pytest.mark.parametrize("kind", ["json", "parquet", "csv", "saved", "implicit"])
def test_pairs_read_from_every_file_kind_are_the_jsonl_ones(tmp_path: Path, llama: Path, kind: str) -> None:
    """JSON, parquet, CSV and save_to_disk rows give the pairs JSONL rows give; so do implicit prompts (the prompt
    the answers' common start: "Line 1: the quick brown" + " fox jumps over")."""
    import datasets

    (tmp_path / "jsonl").mkdir()
    expected = preference_data(tmp_path / "jsonl", llama, ROWS).pairs["train"].arrays
    table = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"pairs.{kind}"
    if kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        table.to_parquet(str(path))
    elif kind == "csv":
        table.to_csv(str(path), index=False)
    elif kind == "saved":
        table.save_to_disk(str(path))
    else:
        implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in ROWS]
        path = write_jsonl(tmp_path / "implicit.jsonl", implicit)
    data = PreferenceDataModule(source="files", files={split: str(path) for split in ("train", "validation", "test")},
                                tokenizer=str(llama), cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup()
    for name, array in data.pairs["train"].arrays.items():
        assert array.tolist() == expected[name].tolist(), name


def random_pairs(count: int, seed: int) -> PreferenceBatch:
    """``count`` pairs of random tokens (prompt 3, answers 5) of tests/test_token_loss.py's small model."""
    from tests.test_token_loss import VOCAB

    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (2 * count, 8), generator=generator)
    targets = torch.full_like(inputs, -100)
    targets[:, 2:7] = inputs[:, 3:8]
    return PreferenceBatch(inputs, targets, torch.zeros(0))


def joined(*batches: PreferenceBatch) -> PreferenceBatch:
    """Batches as one: the chosen rows of all, then the rejected rows of all."""
    halves = [torch.cat([part for b in batches for part in getattr(b, f).chunk(2)[i:i + 1]]) for f in ("inputs", "targets")
              for i in (0, 1)]
    return PreferenceBatch(torch.cat(halves[:2]), torch.cat(halves[2:]), torch.zeros(0))


def full_dpo_step_of_four_pairs(tmp_path: Path) -> tuple[Any, PreferenceBatch, PreferenceBatch, dict[str, Any]]:
    """A full fine-tuning DPO task (SGD, lr 1) built as a run builds it (the frozen reference copies the initial
    weights), batches of 1 and 3 pairs, and one step on the 4 pairs together (test_token_loss.one_step's record)."""
    from tests.test_token_loss import BACKBONE, VOCAB, SGDLanguageModel, one_step

    torch.manual_seed(0)
    with converting_later():
        task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"}, objective={"name": "dpo", "beta": 2.0},
                                reference=str(tmp_path / "reference.safetensors"))
    load_companions(task, started=True)
    convert_networks(task)
    small, large = random_pairs(1, seed=1), random_pairs(3, seed=2)
    return task, small, large, one_step(copy.deepcopy(task), [joined(small, large)], 1)


def test_an_accumulated_step_is_the_mean_over_the_pairs_of_its_global_batch(tmp_path: Path) -> None:
    """Micro-batches of 1 and 3 pairs, accumulated, step as one batch of the 4 pairs (a mean per micro-batch would
    weigh the single pair 3 times); full fine-tuning's frozen reference copies the weights the task was built with."""
    from tests.test_token_loss import one_step

    task, small, large, expected = full_dpo_step_of_four_pairs(tmp_path)
    accumulated = one_step(copy.deepcopy(task), [small, large], 2)
    assert accumulated["train/loss"] == pytest.approx(float(expected["train/loss"]), rel=1e-5)
    start = task.net.state_dict()
    for name, value in start.items():
        step = expected[name] - value
        torch.testing.assert_close(accumulated[name] - value, step, rtol=1e-4, atol=1e-6 * float(step.abs().max()) + 1e-12)
    assert any(not torch.equal(expected[name], value) for name, value in start.items()), "the step moved the weights"


@pytest.mark.slow
def test_two_ddp_ranks_of_1_and_3_pairs_step_like_one_process_on_the_4(tmp_path: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.test_token_loss import RankBatches

    task, small, large, expected = full_dpo_step_of_four_pairs(tmp_path)
    ranks = copy.deepcopy(task)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=2,
                        strategy="ddp_spawn", use_distributed_sampler=False)
    trainer.fit(ranks, DataLoader(RankBatches([[small], [large]]), batch_size=None, shuffle=False))
    start = task.net.state_dict()
    for name, value in ranks.net.state_dict().items():  # ddp_spawn hands rank 0's weights back
        step = expected[name] - start[name]
        torch.testing.assert_close(value - start[name], step, rtol=1e-4, atol=1e-6 * float(step.abs().max()) + 1e-12)


def test_resuming_full_fine_tuning_with_precomputed_reference_is_refused_in_one_line(llama: Path, tmp_path: Path) -> None:
    """A resumed full fine-tuning run starts at trained weights, of which precompute_ref would compute its reference:
    refused; a frozen copy's (read again from the run) and a LoRA run's reference (adapters off) survive a resume."""
    from types import SimpleNamespace

    task = trident_task(llama, {"name": "dpo", "precompute_ref": True})
    task._trainer = SimpleNamespace(datamodule=None, ckpt_path="last.ckpt")
    with pytest.raises(ConfigError, match="resuming a full fine-tuning DPO run with task.objective.precompute_ref=true"):
        task.objective.start(task)
    for resumed in (trident_task(llama, {"name": "dpo"}, reference=tmp_path / "reference.safetensors"),
                    trident_task(llama, {"name": "dpo"}, lora={"targets": ["q"], "rank": 2, "alpha": 2.0, "dropout": 0.0})):
        resumed._trainer = SimpleNamespace(datamodule=None, ckpt_path="last.ckpt")
        resumed.objective.start(resumed)


def test_orpo_loss_and_every_metric_equal_trls_orpo_trainer(tmp_path: Path, llama: Path) -> None:
    """objective=orpo on one batch of 4 pairs against TRL's (experimental) ORPOTrainer on the same tokens: the loss,
    its metrics (rewards, mean per-token log-probabilities, nll_loss, log odds) and the gradient."""
    import datasets
    import transformers
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    data = preference_data(tmp_path, llama, ROWS)
    model = randomise(transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64), seed=7, std=0.05)
    trainer = ORPOTrainer(model=model, args=ORPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                                                       beta=0.3), processing_class=transformers.AutoTokenizer.from_pretrained(llama),
                          train_dataset=datasets.Dataset.from_list(ROWS))
    task = trident_task(llama, {"name": "orpo", "beta": 0.3})
    task.net.load_state_dict(read_state(model, tmp_path / "policy"), strict=True)
    pairs = data.pairs["train"]
    batch = pairs.collate([(i,) for i in range(len(ROWS))])
    loss, _ = task.objective(task, batch, "train")
    (loss.summed / loss.count).backward()

    # TRL's batch of the same tokens: labels -100 on the prompt and the padding.
    trl_batch: dict[str, torch.Tensor] = {}
    for half, field in enumerate(("chosen", "rejected")):
        inputs, targets = batch.inputs.chunk(2)[half], batch.targets.chunk(2)[half]
        lengths = torch.tensor([len(pairs.sequence(field, i)) for i in range(len(ROWS))])
        mask = torch.arange(inputs.size(1)) < lengths[:, None]
        trl_batch[f"{field}_input_ids"] = inputs
        trl_batch[f"{field}_attention_mask"] = mask.long()
        trl_batch[f"{field}_labels"] = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)
    model.train()
    trl_loss, metrics = trainer.get_batch_loss_metrics(model, trl_batch)
    trl_loss.backward()
    torch.testing.assert_close(loss.summed / loss.count, trl_loss.to(torch.float64), atol=1e-5, rtol=1e-5)
    for name in (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"):
        assert float(loss.parts[name][0]) == pytest.approx(metrics[name], abs=1e-5), name
    embedding = dict(model.named_parameters())["model.embed_tokens.weight"].grad
    torch.testing.assert_close(task.net.embed.weight.grad, embedding.to(torch.float64), atol=1e-5, rtol=1e-5)


def test_the_shipped_set_prefers_a_speechs_true_continuation_to_another_speechs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.source=shakespeare (the default): data=chat's shipped conversations, each answered by its own next lines
    (chosen) and by another speech's (rejected), through the default template and a char tokenizer (a slice of the
    plays here: the whole set takes half a minute to prepare)."""
    from trident.data import preference
    from trident.data.chat import shakespeare_conversations

    conversations = shakespeare_conversations()[:40]
    monkeypatch.setattr(preference, "shakespeare_conversations", lambda: conversations)
    pairs = preference.shakespeare_pairs(conversations)
    assert 35 <= len(pairs) <= 40
    for pair in pairs:
        assert pair["chosen"] != pair["rejected"] and pair["prompt"][0]["content"].startswith("Continue ")
        assert any(pair["chosen"] == [c[1]] and pair["prompt"] == [c[0]] for c in conversations)
    data = PreferenceDataModule(cache_dir=str(tmp_path), split=(0.8, 0.1, 0.1))
    data.prepare_data()
    data.setup()
    train = data.pairs["train"]
    prompt = int(train.arrays["prompt_lengths"][0])
    text = data.tokenizer.decode(train.sequence("chosen", 0)[:prompt].tolist())
    assert text.startswith("USER:\nContinue ") and text.endswith("ASSISTANT:\n")
    assert sum(len(p) for p in data.pairs.values()) == len(pairs)
