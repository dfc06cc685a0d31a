"""Label-smoothed cross entropy against a hand computation; sacreBLEU / chrF as the task scores them."""

from __future__ import annotations

import math

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from trident.tasks.translation import TranslationTask, corpus_scores
from trident.training.losses import label_smoothed_cross_entropy

PAD = 0

# Tiny tensors: intra-op threads only contend for the shared cores.
pytestmark = pytest.mark.usefixtures("single_thread")


def test_label_smoothed_loss_equals_hand_computed_value() -> None:
    # Two real tokens and one padding position; V = 3, eps = 0.1, q = 0.9 * one_hot + 0.1 / 3.
    probs = [[0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]
    logits = torch.tensor(probs).log().view(1, 3, 3)  # softmax(log p) = p
    targets = torch.tensor([[1, 2, PAD]])  # the last position is padding and must count for nothing
    # Written out: loss_i = 0.9 * -log p(target) + 0.1 * mean_v -log p(v).
    first = 0.9 * -math.log(0.25) + 0.1 * -(math.log(0.5) + math.log(0.25) + math.log(0.25)) / 3
    second = 0.9 * -math.log(0.6) + 0.1 * -(math.log(0.2) + math.log(0.2) + math.log(0.6)) / 3
    loss, nll, n_tokens = label_smoothed_cross_entropy(logits, targets, epsilon=0.1, ignore_index=PAD)
    assert int(n_tokens) == 2
    assert float(loss) == pytest.approx((first + second) / 2, abs=1e-6)  # 0.97363...
    assert float(nll) == pytest.approx((-math.log(0.25) - math.log(0.6)) / 2, abs=1e-6)


def test_label_smoothing_matches_pytorch_and_zero_is_plain_cross_entropy() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 11, generator=generator)
    targets = torch.randint(1, 11, (4, 7), generator=generator)
    targets[0, 5:] = PAD
    targets[3, 2:] = PAD
    loss, nll, _ = label_smoothed_cross_entropy(logits, targets, epsilon=0.1, ignore_index=PAD)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, label_smoothing=0.1)
    assert float(loss) == pytest.approx(float(expected), abs=1e-5)
    plain, _, _ = label_smoothed_cross_entropy(logits, targets, epsilon=0.0, ignore_index=PAD)
    assert float(plain) == pytest.approx(float(nll), abs=1e-6)
    assert float(plain) == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)), abs=1e-5)


def test_smoothing_penalises_overconfidence() -> None:
    """With eps > 0 a one-hot prediction is no longer optimal: the loss has a finite minimum."""
    confident = torch.tensor([[[20.0, 0.0, 0.0]]])
    hedged = torch.tensor([[[math.log(0.9 / 0.05), 0.0, 0.0]]])  # p = (0.9, 0.05, 0.05)
    target = torch.tensor([[0]])
    assert label_smoothed_cross_entropy(hedged, target)[0] < label_smoothed_cross_entropy(confident, target)[0]


def test_bleu_and_chrf_of_references_against_themselves_are_100() -> None:
    references = ["Im Anfang schuf Gott die Himmel und die Erde.", "Und Gott sprach: Es werde Licht! und es ward Licht."]
    scores = corpus_scores(references, references)
    assert scores["bleu"] == pytest.approx(100.0)
    assert scores["chrf"] == pytest.approx(100.0)
    partial = corpus_scores(["Im Anfang schuf Gott den Himmel.", "Und Gott sprach: Licht!"], references)
    assert 0.0 < partial["bleu"] < 100.0 and 0.0 < partial["chrf"] < 100.0
    assert corpus_scores(["", ""], references)["bleu"] == 0.0


class FixedLogits(torch.nn.Module):
    """Stands in for a task's network: the same logits whatever the inputs."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_perplexity_is_exp_of_the_plain_nll_not_of_the_smoothed_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same probabilities as the hand computation above: perplexity = exp(mean -log p(target)) over the
    # real tokens, whatever the label smoothing the training loss uses.
    probs = [[0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]
    backbone = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "dropout": 0.0, "max_seq_len": 8}
    task = TranslationTask(backbone, vocab_size=3, optimizer={}, scheduler={}, label_smoothing=0.3)
    task.net = FixedLogits(torch.tensor(probs).log().view(1, 3, 3))
    logged: dict[str, float] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **_: logged.__setitem__(name, float(value)))
    monkeypatch.setattr(task, "_decoders", lambda stage: {})  # perplexity alone: nothing to decode
    batch = {"src": torch.tensor([[1, 2, 2]]), "tgt_in": torch.tensor([[1, 1, 2]]), "tgt_out": torch.tensor([[1, 2, PAD]]),
             "src_text": ["a"], "tgt_text": ["b"]}
    task.on_test_epoch_start()
    task.test_step(batch, 0)
    task.on_test_epoch_end()
    assert logged["test/ppl"] == pytest.approx(math.exp((-math.log(0.25) - math.log(0.6)) / 2), rel=1e-6)  # 2.5820


def test_bleu_takes_hypotheses_first_and_references_second() -> None:
    # Asymmetric: every n-gram of the 6-word hypothesis is in the 9-word reference, so BLEU is the brevity
    # penalty alone, 100 * exp(1 - 9/6); swapped, the precisions fall and no penalty applies.
    hypotheses, references = ["the cat sat on the mat"], ["the cat sat on the mat in the sun"]
    scores = corpus_scores(hypotheses, references)
    assert scores["bleu"] == pytest.approx(100 * math.exp(1 - 9 / 6), abs=1e-4)  # 60.65
    assert sacrebleu.corpus_bleu(references, [hypotheses]).score < 60.0
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
    assert scores["chrf"] != pytest.approx(sacrebleu.corpus_chrf(references, [hypotheses]).score, abs=1.0)
