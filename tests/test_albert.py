"""ALBERT (issue 55, item 2): ``model.share_layers`` and ``model.embedding_dim`` on the backbone, and Hugging Face
ALBERT in and out: AlbertForMaskedLM read from a random-weight directory (every parameter randomised) gives its logits
with padding, the export loads back in transformers with the same logits and reads back exact, and the run's
tokenizer from the directory (AlbertTokenizer's Unigram) gives transformers' ids."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.convert_helpers import assert_hf_round_trip, net_from, randomise
from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models import MaskedLM
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers

transformers = pytest.importorskip("transformers")

VOCAB = 53
ALBERT = {"vocab_size": VOCAB, "embedding_size": 12, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 48,
          "max_position_embeddings": 24}


def save_albert(path: Path, architecture: str = "AlbertForMaskedLM", **settings: object) -> torch.nn.Module:
    config = transformers.AlbertConfig(**(ALBERT | {"num_hidden_layers": 4} | settings))
    # Every parameter drawn far from its initial value (std 0.3): the token-type vectors, the projection, the
    # norms and biases all matter.
    model = randomise(getattr(transformers, architecture)(config), seed=0, std=0.3).eval()
    model.save_pretrained(path)
    return model


def padded_batch(length: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of ``length``, 11 and 4 real tokens, right-padded: (ids, attention mask True at real tokens)."""
    ids = torch.randint(5, VOCAB, (3, length), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(length)[None, :] < torch.tensor([length, 11, 4])[:, None]
    return ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("settings", [{}, {"num_hidden_groups": 2, "hidden_act": "gelu"},
                                      {"num_hidden_groups": 4, "hidden_act": "relu"}])
def test_albert_logits_equal_those_of_transformers_with_padding(tmp_path: Path, settings: dict[str, object]) -> None:
    reference = save_albert(tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.model["family"]) == ("hf-albert", "mlm", "albert")
    groups = settings.get("num_hidden_groups", 1)
    assert weights.model["share_layers"] == {1: True, 2: 2, 4: False}[groups]  # type: ignore[index]
    assert weights.model["embedding_dim"] == 12
    net = net_from(weights)
    assert len(net.encoder.blocks) == groups
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        ours = net(ids, key_padding_mask=~mask)
        torch.testing.assert_close(ours[mask], expected[mask], atol=1e-5, rtol=1e-5)
        unpadded = reference(ids).logits
    assert not torch.allclose(unpadded[1, :11], expected[1, :11], atol=1e-3), "the mask changed something"


def test_albert_model_without_head_gives_the_encoder(tmp_path: Path) -> None:
    reference = save_albert(tmp_path, "AlbertModel")
    weights = read_pretrained(tmp_path)
    assert not any(name.startswith(("transform.", "head.")) for name in weights.state_dict)
    cfg = TransformerConfig(**weights.model, pos_encoding="learned", dropout=0.0, max_seq_len=24)
    net = MaskedLM(cfg, VOCAB).eval()
    missing, unexpected = net.load_state_dict(weights.state_dict, strict=False)
    assert not unexpected and all(name.startswith(("transform.", "head.")) for name in missing)
    ids, mask = padded_batch(9)
    with torch.no_grad():
        ours = net.encoder(net.embed(ids), key_padding_mask=~mask)
        torch.testing.assert_close(ours[mask], reference(ids, attention_mask=mask.long()).last_hidden_state[mask],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("settings", "named"), [
    ({"inner_group_num": 2}, "inner_group_num=2 (several distinct layers per shared group)"),
    ({"num_hidden_groups": 3}, "num_hidden_groups=3 not dividing num_hidden_layers=4"),
])
def test_albert_trident_cannot_reproduce_is_one_line(tmp_path: Path, settings: dict[str, object], named: str) -> None:
    save_albert(tmp_path, **settings)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}: {named}, which trident cannot reproduce exactly")):
        read_pretrained(tmp_path)


def trident_albert(**settings: object) -> MaskedLM:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 4, "d_ff": 40, "dropout": 0.0, "norm_first": False,
               "embedding_norm": True, "norm_eps": 1e-3, "pos_encoding": "learned", "max_seq_len": 20,
               "share_layers": True, "embedding_dim": 12, "activation": "gelu_tanh", "family": "albert"}
    net = MaskedLM(TransformerConfig(**(options | settings)), VOCAB).eval()
    return randomise(net, seed=1)  # type: ignore[return-value]


@pytest.mark.parametrize("settings", [{}, {"share_layers": 2, "activation": "gelu"}, {"share_layers": False},
                                      {"family": None}])
def test_trident_albert_to_transformers_and_back_is_exact(tmp_path: Path, settings: dict[str, object]) -> None:
    net = trident_albert(**settings)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_hf_round_trip(net, ids, tmp_path)
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)).__name__ == "AlbertForMaskedLM"


@pytest.mark.parametrize(("settings", "named"), [
    ({"embedding_dim": None}, "model.embedding_dim=None has no ALBERT"),
    ({"norm_first": True}, "model.norm_first=True has no ALBERT"),
])
def test_a_setting_albert_lacks_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        to_transformers(trident_albert(**settings))


@pytest.mark.parametrize(("settings", "named"), [
    ({"share_layers": True, "family": "bert"}, "model.share_layers=True has no BERT"),
    ({"embedding_dim": 12, "family": "bert"}, "model.embedding_dim=12 has no BERT"),
])
def test_bert_names_albert_switches(settings: dict[str, object], named: str) -> None:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "norm_first": False,
               "embedding_norm": True, "pos_encoding": "learned", "max_seq_len": 20}
    with pytest.raises(ConfigError, match=f"^{named}"):
        to_transformers(MaskedLM(TransformerConfig(**(options | settings)), VOCAB))


def test_sharing_layers_divides_the_block_parameters() -> None:
    def parameters(**settings: object) -> int:
        return sum(p.numel() for p in trident_albert(**settings).parameters())

    block = sum(p.numel() for p in trident_albert().encoder.blocks[0].parameters())
    assert parameters(share_layers=False) - parameters() == 3 * block, "four layers, one set of weights"
    assert parameters(share_layers=False) - parameters(share_layers=2) == 2 * block
    factorised = parameters(share_layers=False)
    full = sum(p.numel() for p in MaskedLM(TransformerConfig(d_model=32, n_heads=4, n_layers=4, d_ff=40, norm_first=False,
                                                             embedding_norm=True, pos_encoding="learned",
                                                             max_seq_len=20), VOCAB).parameters())
    # Embedding V x 32 + positions 20 x 32 + norm + head transform 32 x 32 + norm, against V x 12 + 20 x 12 + norm,
    # the projection 12 x 32 + 32, the transform 32 x 12 + 12 and its norm.
    assert full - factorised == (VOCAB + 20) * 20 + 2 * 20 + (32 * 32 + 32 + 2 * 32) - (2 * 32 * 12 + 32 + 12 + 2 * 12)


@pytest.mark.parametrize(("settings", "message"), [
    ({"share_layers": 3}, "model.share_layers must be true, false or a number of groups dividing model.n_layers=4"),
    ({"share_layers": "yes"}, "model.share_layers must be true, false or a number of groups"),
    ({"embedding_dim": 0}, "model.embedding_dim must be a positive integer or null"),
])
def test_bad_albert_switches_are_one_line(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        TransformerConfig(n_layers=4, **settings)  # type: ignore[arg-type]


def test_a_factorised_embedding_is_refused_in_a_decoder() -> None:
    from trident.models import CausalLM

    with pytest.raises(ConfigError, match=r"^model.embedding_dim \(ALBERT's factorised embedding\) is for an encoder"):
        CausalLM(TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=40, embedding_dim=8), VOCAB)


def test_shared_layers_run_one_block_and_train_it_as_one() -> None:
    """The layers that share weights are the same module: one gradient, the sum of every layer's."""
    net = trident_albert().train()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    net(ids).sum().backward()
    assert len(net.encoder.blocks) == 1 and net.encoder.block_of_layer == [0, 0, 0, 0]
    assert net.encoder.blocks[0].ffn.fc_in.weight.grad is not None


def test_albert_tokenizer_reads_as_transformers_reads_it(tmp_path: Path) -> None:
    """AlbertTokenizer's Unigram (SentencePiece) saved as tokenizer.json: the run's tokenizer read from the directory
    gives transformers' ids ([CLS] ... [SEP], lower-cased, the metaspace prefix, <unk> for unknown pieces)."""
    save_albert(tmp_path)
    pieces = ["▁the", "▁cat", "s", "▁sat", "▁on", "▁mat", "▁", "a", "t", "m", "c", ",", "!"]
    vocab = [("<pad>", 0.0), ("<unk>", 0.0), ("[CLS]", 0.0), ("[SEP]", 0.0), ("[MASK]", 0.0),
             *((piece, -1.0 - i / 10) for i, piece in enumerate(pieces))]
    transformers.AlbertTokenizer(vocab=vocab).save_pretrained(tmp_path)
    tokenizer = read_pretrained(tmp_path).tokenizer
    assert tokenizer is not None
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("The cats sat on the MAT, dog!", "a cat", "Ünïcode mät"):
        assert tokenizer.encode(text).ids == reference(text)["input_ids"], text
    assert tokenizer.encode("The cats!").tokens[:2] == ["[CLS]", "▁the"]


def classifier_from(weights: object, classes: int) -> torch.nn.Module:
    """The trident classifier the weights of a Hugging Face sequence classifier fit, loaded strictly."""
    from trident.models import SequenceClassifier

    assert weights.task_options["pooler"] is True and weights.task_options["pool"] == "cls"  # type: ignore[attr-defined]
    cfg = TransformerConfig(**weights.model, pos_encoding="learned", dropout=0.0,  # type: ignore[attr-defined]
                            max_seq_len=weights.data_options["max_seq_len"])  # type: ignore[attr-defined]
    net = SequenceClassifier(cfg, VOCAB, classes, pool="cls", class_token_in_text=True, pooler=True)
    net.load_state_dict(weights.state_dict, strict=True)  # type: ignore[attr-defined]
    return net.eval()


@pytest.mark.parametrize("groups", [1, 2])
def test_albert_classifier_logits_equal_those_of_transformers_and_export_back(tmp_path: Path, groups: int) -> None:
    reference = save_albert(tmp_path / "hf", "AlbertForSequenceClassification", num_labels=3, num_hidden_groups=groups)
    weights = read_pretrained(tmp_path / "hf")
    assert (weights.format, weights.task, weights.classes) == ("hf-albert", "classify", 3)
    net = classifier_from(weights, 3)
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids, key_padding_mask=~mask), expected, atol=1e-5, rtol=1e-5)
        hf = to_transformers(net)
        assert type(hf).__name__ == "AlbertForSequenceClassification"
        torch.testing.assert_close(hf(ids, attention_mask=mask.long()).logits, expected, atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path / "back")
    back = read_pretrained(tmp_path / "back")
    own = net.state_dict()
    assert back.state_dict.keys() == own.keys()
    assert all(torch.equal(back.state_dict[name], tensor) for name, tensor in own.items())


def test_a_classifier_albert_cannot_write_is_one_line() -> None:
    from trident.models import SequenceClassifier

    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=40, norm_first=False, embedding_norm=True,
                            pos_encoding="learned", max_seq_len=20, embedding_dim=8, family="albert")
    with pytest.raises(ConfigError, match=r"^task.pooler=False has no ALBERT sequence classifier \(hf export\) "):
        to_transformers(SequenceClassifier(cfg, VOCAB, 3, class_token_in_text=True))
    with pytest.raises(ConfigError, match=r"^a learned class vector=before the text has no ALBERT sequence classifier"):
        to_transformers(SequenceClassifier(cfg, VOCAB, 3, pooler=True))
