"""BERT (transformers, random weights) -> trident's masked LM: the same logits, with and without
padding; the WordPiece tokenizer from vocab.txt; trident -> BERT and back: the same tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.convert_helpers import assert_hf_round_trip, drop_default_settings, net_from, randomise
from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models import MaskedLM
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers

transformers = pytest.importorskip("transformers")

VOCAB = 53


def save_bert(path: Path, architecture: str = "BertForMaskedLM", defaults_dropped: bool = False,
              **settings: object) -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=24, **settings)
    # Weights larger than BERT's initial ones (std 0.02), so that attention, the token-type vector, the
    # LayerNorms and the biases all matter.
    model = randomise(getattr(transformers, architecture)(config), seed=0, std=0.3).eval()
    model.save_pretrained(path)
    if defaults_dropped:
        assert {"layer_norm_eps", "hidden_act", "tie_word_embeddings"} <= drop_default_settings(path, transformers.BertConfig)
    return model


@pytest.mark.parametrize("settings", [{}, {"defaults_dropped": True}, {"layer_norm_eps": 1e-3}])
def test_bert_logits_equal_those_of_transformers_with_padding(tmp_path: Path, settings: dict[str, object]) -> None:
    reference = save_bert(tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task) == ("hf-bert", "mlm")
    assert weights.model["norm_first"] is False and weights.model["embedding_norm"] is True
    assert weights.model["norm_eps"] == reference.config.layer_norm_eps
    net = net_from(weights)
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([19, 11, 4])
    attention = torch.arange(19)[None, :] < lengths[:, None]  # (B, T) True at real tokens
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(net(ids), expected, atol=1e-5, rtol=1e-5)
        padded = reference(ids, attention_mask=attention.long()).logits
        ours = net(ids, key_padding_mask=~attention)
    # Real tokens agree; padded positions are undefined in both models.
    torch.testing.assert_close(ours[attention], padded[attention], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(padded[1, :11], expected[1, :11], atol=1e-3)  # the mask did change something


@pytest.mark.parametrize("weights_file", ["pytorch_model.bin", "model.safetensors"])
def test_original_bert_names_read_as_transformers_reads_them(tmp_path: Path, weights_file: str) -> None:
    """bert-base-uncased's layout: BertForPreTraining (bert. prefixes, cls.predictions with its decoder,
    the NSP head and pooler trident has no use for) with Google's LayerNorm.gamma / LayerNorm.beta names."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=24, layer_norm_eps=1e-7)
    model = randomise(transformers.BertForPreTraining(config), seed=5, std=0.3).eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): tensor.clone()
             for name, tensor in model.state_dict().items()}
    assert "bert.embeddings.LayerNorm.gamma" in state and "cls.predictions.transform.LayerNorm.beta" in state
    if weights_file == "model.safetensors":
        save_file(state, str(tmp_path / weights_file))
    else:
        torch.save(state, tmp_path / weights_file)
    reference = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()  # transformers' own reading
    net = net_from(read_pretrained(tmp_path))
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), reference(ids).prediction_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(net(ids), model(ids).prediction_logits, atol=1e-5, rtol=1e-5)


def test_weights_of_no_known_layout_name_what_was_expected(tmp_path: Path) -> None:
    save_bert(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({f"model.{name}": tensor for name, tensor in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DataError) as caught:
        read_pretrained(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path} lacks 'embeddings.word_embeddings.weight' that a bert (BertForMaskedLM, BertModel) has: its "
        "weights (model.bert.embeddings.LayerNorm.bias, model.bert.embeddings.LayerNorm.weight, ...) match no layout "
        "trident reads (Hugging Face's, with or without the model's prefix; original BERT's LayerNorm.gamma/beta): "
        "save the model again with transformers")


def test_bert_model_without_head_gives_the_encoder(tmp_path: Path) -> None:
    reference = save_bert(tmp_path, "BertModel")
    weights = read_pretrained(tmp_path)
    assert not any(name.startswith(("transform.", "head.")) for name in weights.state_dict)
    net = net_from_encoder(weights)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(net.encoder(net.embed(ids)), reference(ids).last_hidden_state, atol=1e-5, rtol=1e-5)


def net_from_encoder(weights: object) -> MaskedLM:
    cfg = TransformerConfig(**weights.model, pos_encoding="learned", dropout=0.0, max_seq_len=24)  # type: ignore[attr-defined]
    net = MaskedLM(cfg, VOCAB)
    missing, unexpected = net.load_state_dict(weights.state_dict, strict=False)  # type: ignore[attr-defined]
    assert not unexpected and all(name.startswith(("transform.", "head.")) for name in missing)
    return net.eval()


def test_bert_tokenizer_is_built_from_vocab_txt(tmp_path: Path) -> None:
    save_bert(tmp_path)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "##s", "on", "mat", ",", "!"]
    (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n")
    tokenizer = read_pretrained(tmp_path).tokenizer
    assert tokenizer is not None
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)  # BERT's own reading of vocab.txt
    text = "The cats sat on the MAT, dog!"
    assert tokenizer.encode(text).ids == reference(text)["input_ids"]
    assert tokenizer.encode(text).tokens == ["[CLS]", "the", "cat", "##s", "sat", "on", "the", "mat", ",", "[UNK]", "!", "[SEP]"]


def trident_bert(**settings: object) -> MaskedLM:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "norm_first": False,
               "embedding_norm": True, "norm_eps": 1e-3, "pos_encoding": "learned", "max_seq_len": 20}
    net = MaskedLM(TransformerConfig(**(options | settings)), VOCAB).eval()
    return randomise(net, seed=1)  # type: ignore[return-value]


def test_trident_mlm_to_bert_and_back_is_exact(tmp_path: Path) -> None:
    net = trident_bert()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_hf_round_trip(net, ids, tmp_path)


@pytest.mark.parametrize(("settings", "named"), [
    ({"norm_first": True}, "model.norm_first=True"),
    ({"embedding_norm": False}, "model.embedding_norm=False"),
    ({"pos_encoding": "rope"}, "pos_encoding=rope"),
    ({"activation": "relu"}, "model.activation=relu"),
])
def test_a_setting_bert_lacks_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named} has no BERT"):
        to_transformers(trident_bert(**settings))
