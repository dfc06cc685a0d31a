"""Review of knowledge distillation (``distill=kd``, docs/distillation.md): the defects found, each through the
public entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trident.errors import TridentError

from .test_distill_tasks import built, lm_config, lm_teacher  # noqa: F401  # lm_teacher: the shared fixture


def test_a_distilled_checkpoint_away_from_its_run_names_the_missing_teacher_copy(tmp_path: Path,
                                                                                  lm_teacher: Path) -> None:  # noqa: F811
    """``trident.load`` of a distilled student's checkpoint copied out of its run (without ``<run>/init/teacher.*``)
    says in one line that the teacher's copy is missing and where it is looked for, not that the checkpoint is
    "corrupt or truncated" (the ConfigError was caught with torch.load's read errors)."""
    import trident

    task = built(lm_config(tmp_path, lm_teacher), tmp_path / "run")
    import lightning

    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                  "pytorch-lightning_version": lightning.__version__}
    task.on_save_checkpoint(checkpoint)
    (tmp_path / "run" / "checkpoints").mkdir()
    torch.save(checkpoint, tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert trident.load(tmp_path / "run").companions["teacher"] is not None  # in its run: the teacher is rebuilt
    (tmp_path / "alone").mkdir()
    shutil.copy(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "alone" / "last.ckpt")
    with pytest.raises(TridentError) as caught:
        trident.load(tmp_path / "alone" / "last.ckpt")
    message = str(caught.value)
    assert "corrupt" not in message and "teacher.json" in message and "\n" not in message


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
