"""Prompts are encoded as the training text is (issue 50): no post-processor's special tokens, none of the
file's padding or truncation; a chat prompt rendered with the template's own <s> gets no second one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from trident.commands import sample
from trident.tasks.lm import LanguageModelTask

BACKBONE = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0, "max_seq_len": 32}
VOCAB = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "ROMEO": 4, ":": 5, "Ay": 6, "me": 7}


def roberta_style() -> Tokenizer:
    """A tokenizer that wraps a text in ``<s> ... </s>`` (RoBERTa's post-processor) and pads and truncates
    (both on in its file)."""
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "<pad>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tokenizer.enable_padding(pad_id=1, pad_token="<pad>", length=8)
    tokenizer.enable_truncation(max_length=3)
    return tokenizer


def task_with(tokenizer: Tokenizer, prompts: list[str]) -> LanguageModelTask:
    return LanguageModelTask(BACKBONE, vocab_size=len(VOCAB), optimizer={}, scheduler={}, sample_prompts=prompts,
                             sampling={"max_new_tokens": 1}, tokenizer_json=tokenizer.to_str())


def capture_prompts(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[list[int]]:
    fed: list[list[int]] = []

    def fake_generate(net: Any, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fed.append(ids[0].tolist())
        return ids

    monkeypatch.setattr(module, "generate", fake_generate)
    return fed


def test_trident_sample_feeds_the_prompt_without_the_wrapping_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    task = task_with(roberta_style(), [])
    monkeypatch.setattr(sample, "load_lm_checkpoint", lambda path: task)
    fed = capture_prompts(monkeypatch, sample)
    sample.main(["run.ckpt", "--prompt", "ROMEO : Ay me", "--max-new-tokens", "1"])
    assert fed == [[4, 5, 6, 7]]  # not [0, 4, 5, 2, 1, 1, 1, 1]: no <s>, no </s>, no padding, not cut to 3


def test_validation_samples_feed_the_rendered_prompt_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat prompt that starts with the template's <s> keeps one <s>; nothing is cut or padded."""
    from trident.tasks import lm

    task = task_with(roberta_style(), ["<s> ROMEO : Ay me", "ROMEO"])
    fed = capture_prompts(monkeypatch, lm)
    task.sample_texts()
    assert fed == [[0, 4, 5, 6, 7], [4]]


def test_trident_fill_mask_feeds_the_text_as_the_training_blocks_are_encoded(monkeypatch: pytest.MonkeyPatch,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """No [CLS] ... [SEP] (the blocks hold none), no padding with the file's pad id (which the attention mask would
    not hide), no truncation that cuts the [MASK] away."""
    from trident.commands import fill_mask
    from trident.tasks.mlm import MaskedLanguageModelTask

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "<pad>": 3, "to": 4, "be": 5, "or": 6, "not": 7, "[MASK]": 8, "[PAD]": 9}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["[CLS]", "[SEP]", "<pad>", "[MASK]", "[PAD]"])
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tokenizer.enable_padding(pad_id=3, pad_token="<pad>", length=12)
    tokenizer.enable_truncation(max_length=4)
    task = MaskedLanguageModelTask(BACKBONE, vocab_size=len(vocab), optimizer={}, scheduler={}, mask_id=8, pad_id=9,
                                   num_regular_tokens=8, tokenizer_json=tokenizer.to_str()).eval()
    fed: list[list[int]] = []
    forward = task.net.forward

    def recorded(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fed.extend(ids.tolist())
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(task.net, "forward", recorded)
    monkeypatch.setattr(fill_mask, "load_mlm_checkpoint", lambda path: task)
    fill_mask.main(["run.ckpt", "to be or not to [MASK]", "to [MASK]"])
    assert fed == [[4, 5, 6, 7, 4, 8], [4, 8, 9, 9, 9, 9]]  # padded with the task's [PAD], which attention hides
    assert capsys.readouterr().out.count("[MASK] 1:") == 2
