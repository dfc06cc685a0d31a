"""Review of knowledge distillation (``distill=kd``, docs/distillation.md): the defects found, each through the
public entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from .test_distill_tasks import built, lm_config, lm_teacher  # noqa: F401  # lm_teacher: the shared fixture


def test_trident_load_of_a_distilled_run_builds_the_student_alone(tmp_path: Path, lm_teacher: Path) -> None:  # noqa: F811
    """``trident.load`` reads a distilled student's checkpoint for evaluation and export, and eval.py tests it: the
    student alone, without building its teacher or reading the teacher's copy (``<run>/init/teacher.*``), so a
    checkpoint copied out of its run loads too (it was refused for the missing teacher files), its logits the
    student's."""
    import lightning
    from omegaconf import OmegaConf

    import trident
    from trident.commands.evaluate import evaluate

    cfg = lm_config(tmp_path, lm_teacher)
    task = built(cfg, tmp_path / "run")
    (tmp_path / "run" / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as train.py writes it
    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                  "pytorch-lightning_version": lightning.__version__}
    task.on_save_checkpoint(checkpoint)
    (tmp_path / "run" / "checkpoints").mkdir()
    torch.save(checkpoint, tmp_path / "run" / "checkpoints" / "last.ckpt")
    (tmp_path / "alone").mkdir()
    shutil.copy(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "alone" / "last.ckpt")
    ids = torch.randint(0, task.net.vocab_size, (2, 8))
    for source in (tmp_path / "run", tmp_path / "alone" / "last.ckpt"):
        loaded = trident.load(source)
        assert loaded.companions == {} and loaded.hparams.distill is None
        torch.testing.assert_close(loaded.net(ids), task.net.eval()(ids), rtol=0, atol=0)
    for copy in (tmp_path / "run" / "init").glob("teacher.*"):
        copy.unlink()
    assert "test/loss" in evaluate([f"ckpt_path={tmp_path / 'run'}", "trainer.limit_test_batches=1"], write=False)


def test_a_teacher_whose_embedding_is_padded_past_the_shared_tokenizer_distils(tmp_path: Path) -> None:
    """The docs' command with a Hugging Face teacher whose embedding has more rows than its tokenizer has tokens
    (Qwen2: 151936 rows, 151665 tokens), the student trained on that tokenizer.json: accepted (it was refused with
    "train the student on the teacher's tokenizer", which it was), the extra rows left out of the teacher's term."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .conftest import SMALL, compose_config
    from .test_distill_tasks import train_steps

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator(["First Citizen: before we proceed any further, hear me speak."] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokens = tokenizer.get_vocab_size()
    config = transformers.GPT2Config(vocab_size=tokens + 4, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(6)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save(str(tmp_path / "gpt2" / "tokenizer.json"))
    cfg = compose_config([*SMALL, "distill=kd", f"distill.teacher={tmp_path / 'gpt2'}",
                          f"data.tokenizer={tmp_path / 'gpt2' / 'tokenizer.json'}"], output_dir=tmp_path / "run")
    task, metrics, _ = train_steps(cfg, tmp_path / "run", steps=1)
    assert task.net.vocab_size == tokens and task.companions["teacher"].vocab_size == tokens + 4
    assert metrics["train/loss"] == pytest.approx(0.5 * metrics["train/label_loss"] + 0.5 * metrics["train/distill_loss"],
                                                  rel=1e-5)
