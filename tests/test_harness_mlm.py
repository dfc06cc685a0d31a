"""trident-harness on a masked LM (issue 52, item 1): pseudo-log-likelihood scoring (Salazar et al. 2020) equals a
hand computation with transformers' ``BertForMaskedLM`` on the same BERT directory; generation is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.convert_helpers import randomise
from trident.errors import DataError

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "ran", "to", "a", "red", "big", "small", "house", "tree", "and",
         "then", "it", "slept", "under", "over", "quick", "brown", "fox", "jumps", "lazy", "river", "by", "rests",
         "##s", "##ed", "##ing", ",", ".", "!"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
POSITIONS = 24  # BERT's max_position_embeddings: 22 text tokens beside [CLS] and [SEP]
REQUESTS = [
    ("the quick brown", " fox"),
    ("the cat sat on the", " mat"),
    ("the cat sat on the", " red mats"),
    ("", " the lazy dog rests by the river"),  # an empty context: the continuation alone between [CLS] and [SEP]
    ("the dog ran to the", " big red house and then it slept under a tree"),
    # 25 tokens: the context keeps its last 22 - 3 tokens
    ("the quick brown fox jumps over the lazy dog and then it rests by the river , the cat sat on the", " small mat ."),
]


def save_bert(path: Path) -> torch.nn.Module:
    """A BertForMaskedLM with every parameter drawn anew (far from uniform scores), saved with its vocab.txt."""
    config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=POSITIONS)
    model = randomise(transformers.BertForMaskedLM(config), seed=0, std=0.3).eval()
    model.save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return model


def by_hand(model: torch.nn.Module, tokenizer: object, context: str, continuation: str) -> tuple[float, bool]:
    """Salazar et al.'s pseudo-log-likelihood of ``continuation`` after ``context``, one masked copy at a time through
    transformers: [CLS] context continuation [SEP], each continuation token replaced by [MASK] in turn."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]

    whole, before = ids(context + continuation), ids(context) if context else []
    text = whole[max(0, len(whole) - (POSITIONS - 2)):]
    first = len(text) - (len(whole) - len(before))
    sequence = [tokenizer.cls_token_id, *text, tokenizer.sep_token_id]  # type: ignore[attr-defined]
    total, greedy = 0.0, True
    for position in range(first + 1, len(sequence) - 1):
        masked = list(sequence)
        masked[position] = tokenizer.mask_token_id  # type: ignore[attr-defined]
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([masked])).logits[0, position].double(), -1)
        total += float(log_probs[sequence[position]])
        greedy = greedy and int(log_probs.argmax()) == sequence[position]
    return total, greedy


def test_pseudo_log_likelihood_equals_a_hand_computation_with_transformers(tmp_path: Path) -> None:
    from lm_eval.api.instance import Instance

    from trident.runs.harness import harness_model
    from trident.runs.harness_mlm import MaskedTridentLM

    reference = save_bert(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    model = harness_model(tmp_path, batch_size=4, chat=False)  # 4 masked copies a batch: rows of several lengths
    assert isinstance(model, MaskedTridentLM) and (model.start, model.end) == ([2], [3])
    expected = [by_hand(reference, tokenizer, *request) for request in REQUESTS]
    ours = model.loglikelihood([Instance("loglikelihood", {}, request, i) for i, request in enumerate(REQUESTS)])
    torch.testing.assert_close(torch.tensor([s for s, _ in ours], dtype=torch.float64),
                               torch.tensor([s for s, _ in expected], dtype=torch.float64), atol=1e-4, rtol=0)
    assert [g for _, g in ours] == [g for _, g in expected]
    assert len({round(s, 2) for s, _ in ours}) == len(REQUESTS), "scores too uniform to compare"
    one_at_a_time = harness_model(tmp_path, batch_size=1, chat=False)
    alone = one_at_a_time.loglikelihood([Instance("loglikelihood", {}, request, 0) for request in REQUESTS])
    torch.testing.assert_close(torch.tensor([s for s, _ in alone]), torch.tensor([s for s, _ in ours]),
                               atol=1e-4, rtol=0)

    # Rolling: every token of the text masked once; a text longer than 22 tokens in two windows, the second filled up
    # with the tokens before it.
    short, long = REQUESTS[1][0], REQUESTS[-1][0] + REQUESTS[-1][1]
    words = long.split()
    assert len(tokenizer(long, add_special_tokens=False)["input_ids"]) == len(words) == 25
    split = " ".join(words[:22])
    rolled = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0) for text in (short, long)])
    windows = by_hand(reference, tokenizer, "", " " + split)[0] + by_hand(reference, tokenizer, split,
                                                                        " " + " ".join(words[22:]))[0]
    assert rolled == pytest.approx([by_hand(reference, tokenizer, "", short)[0], windows], abs=1e-4)

    with pytest.raises(DataError, match=r"is a masked language model, which does not generate text: run tasks it "):
        model.generate_until([Instance("generate_until", {}, ("the cat", {"until": ["."]}), 0)])
    with pytest.raises(DataError, match="which has no chat template: run trident-harness without --apply_chat"):
        harness_model(tmp_path, batch_size=1, chat=True)
