"""ELECTRA in and out (issue 55, item 3): ElectraForMaskedLM (a generator checkpoint), ElectraForPreTraining (the
discriminator) and ElectraForSequenceClassification read from random-weight directories (every parameter randomised,
an embedding narrower than the width and one as wide) give transformers' logits on right-padded rows; trident's
networks written back load in transformers with the same logits and read back exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.convert_helpers import assert_hf_round_trip, assert_state_equal, net_from, randomise
from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models import MaskedLM, ReplacedTokenDetector, SequenceClassifier
from trident.weights import PretrainedWeights, read_pretrained
from trident.weights.adapters.hf_export import to_transformers

transformers = pytest.importorskip("transformers")

VOCAB = 53
ELECTRA = {"vocab_size": VOCAB, "embedding_size": 12, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": 24}
# An embedding narrower than the width (embeddings_project: ELECTRA-Small's 128 under 256), and as wide (none).
WIDTHS = [{}, {"embedding_size": 32, "layer_norm_eps": 1e-3}]


def save_electra(path: Path, architecture: str = "ElectraForMaskedLM", **settings: object) -> torch.nn.Module:
    config = transformers.ElectraConfig(**(ELECTRA | settings))
    model = randomise(getattr(transformers, architecture)(config), seed=0, std=0.3).eval()
    model.save_pretrained(path)
    return model


def padded_batch(length: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of ``length``, 11 and 4 real tokens, right-padded: (ids, attention mask True at real tokens)."""
    ids = torch.randint(1, VOCAB, (3, length), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(length)[None, :] < torch.tensor([length, 11, 4])[:, None]
    return ids.masked_fill(~mask, 0), mask


def config_of(weights: PretrainedWeights) -> TransformerConfig:
    return TransformerConfig(**weights.model, pos_encoding="learned", dropout=0.0,
                             max_seq_len=weights.data_options["max_seq_len"])


@pytest.mark.parametrize("settings", WIDTHS)
def test_electra_masked_lm_logits_equal_those_of_transformers_with_padding(tmp_path: Path, settings: dict[str, object]) -> None:
    reference = save_electra(tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.model["family"]) == ("hf-electra", "mlm", "electra")
    assert weights.model["embedding_dim"] == (None if settings else 12)
    net = net_from(weights)
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask)[mask], expected[mask], atol=1e-5, rtol=1e-5)
        unpadded = reference(ids).logits
    assert not torch.allclose(unpadded[1, :11], expected[1, :11], atol=1e-3), "the mask changed something"


@pytest.mark.parametrize("settings", WIDTHS)
def test_electra_discriminator_logits_equal_those_of_transformers_and_export_back(tmp_path: Path,
                                                                                  settings: dict[str, object]) -> None:
    reference = save_electra(tmp_path / "hf", "ElectraForPreTraining", **settings)
    weights = read_pretrained(tmp_path / "hf")
    assert (weights.format, weights.task, weights.model["family"]) == ("hf-electra", "electra", "electra")
    net = ReplacedTokenDetector(config_of(weights), VOCAB)
    net.load_state_dict(weights.state_dict, strict=True)
    net.eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits  # (B, T)
        torch.testing.assert_close(net(ids, key_padding_mask=~mask)[mask], expected[mask], atol=1e-5, rtol=1e-5)
        hf = to_transformers(net)
        assert type(hf).__name__ == "ElectraForPreTraining"
        torch.testing.assert_close(hf(ids, attention_mask=mask.long()).logits[mask], expected[mask], atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path / "back")
    assert_state_equal(read_pretrained(tmp_path / "back").state_dict, net)


@pytest.mark.parametrize("settings", WIDTHS)
def test_electra_classifier_logits_equal_those_of_transformers_and_export_back(tmp_path: Path,
                                                                               settings: dict[str, object]) -> None:
    """The classification head (dense -> GELU -> out_proj on the first token) is trident's head of task.pooler=gelu."""
    reference = save_electra(tmp_path / "hf", "ElectraForSequenceClassification", num_labels=3, **settings)
    weights = read_pretrained(tmp_path / "hf")
    assert (weights.format, weights.task, weights.classes) == ("hf-electra", "classify", 3)
    assert weights.task_options["pooler"] == "gelu" and weights.task_options["pool"] == "cls"
    net = SequenceClassifier(config_of(weights), VOCAB, 3, pool="cls", class_token_in_text=True, pooler="gelu")
    net.load_state_dict(weights.state_dict, strict=True)
    net.eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask), expected, atol=1e-5, rtol=1e-5)
        hf = to_transformers(net)
        assert type(hf).__name__ == "ElectraForSequenceClassification"
        torch.testing.assert_close(hf(ids, attention_mask=mask.long()).logits, expected, atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path / "back")
    assert_state_equal(read_pretrained(tmp_path / "back").state_dict, net)


def electra_settings(**settings: object) -> TransformerConfig:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "norm_first": False,
               "embedding_norm": True, "norm_eps": 1e-3, "pos_encoding": "learned", "max_seq_len": 20,
               "family": "electra"}
    return TransformerConfig(**(options | settings))


@pytest.mark.parametrize("settings", [{"embedding_dim": 12}, {}])
def test_trident_mlm_to_electra_and_back_is_exact(tmp_path: Path, settings: dict[str, object]) -> None:
    net = randomise(MaskedLM(electra_settings(**settings), VOCAB).eval(), seed=1)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_hf_round_trip(net, ids, tmp_path)
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)).__name__ == "ElectraForMaskedLM"


def test_a_detector_of_no_declared_family_is_written_as_electra() -> None:
    """Only ELECTRA writes a discriminator: one of trident's own stack (model.family=null) is ELECTRA's if it fits."""
    net = randomise(ReplacedTokenDetector(electra_settings(family=None, embedding_dim=12), VOCAB).eval(), seed=1)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(to_transformers(net)(ids).logits, net(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("settings", "named"), [
    ({"activation": "relu"}, "model.activation=relu has no ELECTRA"),
    ({"share_layers": True}, "model.share_layers=True has no ELECTRA"),
    ({"embedding_dim": 32}, "model.embedding_dim=32 has no ELECTRA"),
    ({"norm_first": True}, "model.norm_first=True has no ELECTRA"),
])
def test_a_setting_electra_lacks_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        to_transformers(MaskedLM(electra_settings(**settings), VOCAB))
    with pytest.raises(ConfigError, match=f"^{named} discriminator"):
        to_transformers(ReplacedTokenDetector(electra_settings(**settings), VOCAB))


def test_a_classifier_electra_cannot_write_is_one_line() -> None:
    cfg = electra_settings()
    with pytest.raises(ConfigError, match=r"^task.pooler=True has no ELECTRA sequence classifier \(hf export\) "
                                          r"equivalent: it reads the pooled vector through a dense layer and gelu$"):
        to_transformers(SequenceClassifier(cfg, VOCAB, 3, class_token_in_text=True, pooler=True))


def test_a_projection_that_contradicts_the_widths_is_one_line(tmp_path: Path) -> None:
    save_electra(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"embedding_size": 12', '"embedding_size": 32')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(DataError, match="embedding_size=32 and hidden_size=32 with an embeddings_project, which trident cannot reproduce"):
        read_pretrained(tmp_path)


def test_a_bad_pooler_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^task.pooler must be false, true \(tanh\), tanh or gelu, got 'relu'"):
        SequenceClassifier(electra_settings(), VOCAB, 3, pooler="relu")


def trident_electra() -> MaskedLM:
    """An ELECTRA generator of trident's (a 12-wide embedding projected to the width), random: the hf writing tests'."""
    return randomise(MaskedLM(electra_settings(embedding_dim=12), VOCAB).eval(), seed=1)  # type: ignore[return-value]


def trident_discriminator() -> ReplacedTokenDetector:
    return randomise(ReplacedTokenDetector(electra_settings(embedding_dim=12), VOCAB).eval(), seed=1)  # type: ignore[return-value]


def test_a_config_without_embedding_size_reads_transformers_default_of_128(tmp_path: Path) -> None:
    """ElectraConfig's embedding_size is 128 where config.json has none (a hand-written config): the reader takes
    transformers' default, not the width, so the directory transformers loads reads with its logits."""
    import json

    save_electra(tmp_path, embedding_size=128)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["embedding_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.ElectraForMaskedLM.from_pretrained(tmp_path).eval()
    net = net_from(read_pretrained(tmp_path))
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask)[mask], expected[mask], atol=1e-5, rtol=1e-5)
