"""RoBERTa (issue 55, item 3): RobertaForMaskedLM read from a random-weight directory (every parameter randomised,
its position table included) gives its logits on right-padded rows, whose positions start past the padding id; the
export loads back in transformers with the same logits (with the run's padding id, whatever it is) and reads back
exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.convert_helpers import assert_hf_round_trip, net_from, randomise
from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import MaskedLM
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import run_settings, to_transformers, write_hf

transformers = pytest.importorskip("transformers")

VOCAB = 53
ROBERTA = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 48, "max_position_embeddings": 26, "type_vocab_size": 1}


def save_roberta(path: Path, architecture: str = "RobertaForMaskedLM", **settings: object) -> torch.nn.Module:
    config = transformers.RobertaConfig(**(ROBERTA | settings))
    model = randomise(getattr(transformers, architecture)(config), seed=0, std=0.3).eval()
    model.save_pretrained(path)
    return model


def padded_batch(pad_id: int, length: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of ``length``, 11 and 4 real tokens (never ``pad_id``), right-padded with ``pad_id``."""
    ids = torch.randint(3, VOCAB, (3, length), generator=torch.Generator().manual_seed(1))
    ids = ids.masked_fill(ids == pad_id, 4)
    mask = torch.arange(length)[None, :] < torch.tensor([length, 11, 4])[:, None]
    return ids.masked_fill(~mask, pad_id), mask


@pytest.mark.parametrize("settings", [{}, {"pad_token_id": 5, "layer_norm_eps": 1e-3}])
def test_roberta_logits_equal_those_of_transformers_with_right_padding(tmp_path: Path, settings: dict[str, object]) -> None:
    reference = save_roberta(tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.model["family"]) == ("hf-roberta", "mlm", "roberta")
    pad_id = int(settings.get("pad_token_id", 1))  # type: ignore[call-overload]
    assert weights.data_options["max_seq_len"] == 26 - pad_id - 1, "the rows past the padding id"
    net = net_from(weights)
    ids, mask = padded_batch(pad_id)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask)[mask], expected[mask], atol=1e-5, rtol=1e-5)
        full = torch.randint(pad_id + 1, VOCAB, (2, 26 - pad_id - 1), generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(net(full), reference(full).logits, atol=1e-5, rtol=1e-5)  # the whole context


def trident_roberta(**settings: object) -> MaskedLM:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "norm_first": False,
               "embedding_norm": True, "norm_eps": 1e-3, "pos_encoding": "learned", "max_seq_len": 20,
               "family": "roberta"}
    return randomise(MaskedLM(TransformerConfig(**(options | settings)), VOCAB).eval(), seed=1)  # type: ignore[return-value]


def test_trident_mlm_to_roberta_and_back_is_exact(tmp_path: Path) -> None:
    net = trident_roberta()
    ids = torch.randint(2, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_hf_round_trip(net, ids, tmp_path)
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)).__name__ == "RobertaForMaskedLM"


def test_the_export_numbers_positions_past_the_runs_own_padding_id(tmp_path: Path) -> None:
    """A run whose tokenizer pads with id 7: the exported config says so and the table moves behind it."""
    from tokenizers import Tokenizer, models

    net = trident_roberta()
    vocabulary = {f"t{i}": i for i in range(VOCAB)} | {"[PAD]": 7}
    del vocabulary["t7"]
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="t0"))
    with torch.no_grad():
        write_hf(net, tokenizer, None, tmp_path)
    assert run_settings(net, tokenizer, None)["pad_token_id"] == 7
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert hf.config.pad_token_id == 7 and hf.config.max_position_embeddings == 20 + 8
    ids, mask = padded_batch(7, length=20)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask)[mask], expected[mask], atol=1e-5, rtol=1e-5)
    back = read_pretrained(tmp_path)
    assert torch.equal(back.state_dict["encoder.pos_encoding.embedding.weight"], net.encoder.pos_encoding.embedding.weight)


@pytest.mark.parametrize(("settings", "named"), [
    ({"activation": "relu"}, "model.activation=relu has no RoBERTa"),
    ({"share_layers": True}, "model.share_layers=True has no RoBERTa"),
])
def test_a_setting_roberta_lacks_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        to_transformers(trident_roberta(**settings))


def test_a_run_without_a_padding_token_is_not_exported_as_roberta(tmp_path: Path) -> None:
    from trident.data.tokenization import train_tokenizer

    tokenizer = train_tokenizer("char", ["First Citizen: speak."], end_of_text=True)
    with pytest.raises(ConfigError, match=r"^the run's tokenizer=without a padding token has no RoBERTa \(hf export\) "
                                          r"equivalent: RoBERTa numbers its positions past the padding id"):
        write_hf(trident_roberta(), tokenizer, None, tmp_path / "hf")


@pytest.mark.parametrize("pad_id", [1, 5])
def test_roberta_classifier_logits_equal_those_of_transformers_and_export_back(tmp_path: Path, pad_id: int) -> None:
    """The classification head (dense -> tanh -> out_proj on <s>) is trident's pooled head; right-padded rows."""
    from tests.test_albert import classifier_from

    reference = save_roberta(tmp_path / "hf", "RobertaForSequenceClassification", num_labels=4, pad_token_id=pad_id)
    weights = read_pretrained(tmp_path / "hf")
    assert (weights.format, weights.task, weights.classes) == ("hf-roberta", "classify", 4)
    net = classifier_from(weights, 4)
    ids, mask = padded_batch(pad_id)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask), expected, atol=1e-5, rtol=1e-5)
        hf = to_transformers(net, {"pad_token_id": pad_id})
        assert type(hf).__name__ == "RobertaForSequenceClassification"
        torch.testing.assert_close(hf(ids, attention_mask=mask.long()).logits, expected, atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path / "back")
    back = read_pretrained(tmp_path / "back")
    assert all(torch.equal(back.state_dict[name], tensor) for name, tensor in net.state_dict().items())
    assert back.state_dict.keys() == net.state_dict().keys()
