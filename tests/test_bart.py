"""BART (issue 55, item 4): BartForConditionalGeneration read from a random-weight directory (every parameter and
final_logits_bias randomised, the position tables included) gives its logits with padding in source and target; the
export loads back in transformers with equal logits and reads back exact; greedy and beam (4 beams) decoding of
task=translation equal transformers' ``generate`` token for token (decoder start </s>, forced <s> first, forced </s>
at the length limit, length ** alpha, early_stopping="never", no n-gram ban); what trident cannot hold is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.convert_helpers import assert_state_equal, randomise
from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models import EncoderDecoder
from trident.tasks.translation import TranslationTask
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import to_transformers, write_hf
from trident.weights.pretrained import PretrainedWeights

transformers = pytest.importorskip("transformers")

VOCAB, PAD, BOS, EOS = 61, 1, 0, 2
BART = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 48,
        "decoder_ffn_dim": 48, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "max_position_embeddings": 40, "dropout": 0.0}


def save_bart(path: Path, seed: int = 0, **settings: object) -> torch.nn.Module:
    """A random BART whose outputs depend on its input: every parameter drawn anew, the LayerNorms' gains around 1 and
    their biases small (a post-norm stack's last norm would otherwise outweigh what the tokens say)."""
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(**(BART | settings)))
    randomise(model, seed=seed, std=0.3)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.mul_(0.3).add_(1.0 if name.endswith("weight") else 0.0)
        # a buffer, which randomise (parameters) leaves at zero
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=generator) * 0.3)
        model.final_logits_bias[0, EOS] += 5.0  # some sentences end before the length limit, others at it
    model.eval().save_pretrained(path)
    return model


def trident_bart(decoder_start_id: int | None = None) -> EncoderDecoder:
    """A random trident network declared BART (trident's convention: no decoder start of its own, by default)."""
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=48, dropout=0.0, norm_first=False, embedding_norm=True,
                            pos_encoding="learned", max_seq_len=20, family="bart")
    net = EncoderDecoder(cfg, VOCAB, pad_id=PAD, scale_embeddings=False, logits_bias=True,
                         decoder_start_id=decoder_start_id)
    randomise(net, seed=2)
    assert net.logits_bias is not None
    net.logits_bias.copy_(torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)))
    return net.eval()


def task_from(weights: PretrainedWeights, **decoding: object) -> TranslationTask:
    """task=translation as init_from builds it from ``weights`` (dropout off), the weights loaded strictly."""
    backbone = dict(weights.model, pos_encoding=weights.pos_encoding, dropout=0.0,
                    max_seq_len=weights.data_options["max_seq_len"])
    task = TranslationTask(backbone, weights.vocab_size, {}, {}, pad_id=PAD, bos_id=BOS, eos_id=EOS,
                           **weights.task_options, **decoding)  # type: ignore[arg-type]
    task.net.load_state_dict(weights.state_dict, strict=True)
    return task.eval()


def padded(lengths: list[int], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``lengths`` real tokens (never a special id) right-padded with PAD to ``width``, and the mask of them."""
    ids = torch.randint(4, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, PAD), mask


@pytest.mark.parametrize("settings", [{}, {"scale_embedding": True}])
def test_bart_logits_equal_those_of_transformers_with_padding_in_source_and_target(
        tmp_path: Path, settings: dict[str, object]) -> None:
    reference = save_bart(tmp_path, **settings)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.model["family"]) == ("hf-bart", "translation", "bart")
    assert weights.task_options == {"tie_embeddings": "all", "scale_embeddings": bool(settings), "logits_bias": True,
                                    "decoder_start_id": EOS}
    # BART reads `<s> tokens </s>`: its data sets data.source_bos (what it writes: test_translation_init_from.py).
    assert weights.data_options == {"max_seq_len": 40, "source_bos": True}, "the rows past BART's offset of 2"
    net = task_from(weights).net
    src, src_mask = padded([15, 9, 4], 15, seed=1)
    tgt, tgt_mask = padded([12, 7, 3], 12, seed=2)
    tgt[:, 0] = EOS  # the decoder's start
    with torch.no_grad():
        expected = reference(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                             decoder_attention_mask=tgt_mask.long()).logits
        torch.testing.assert_close(net(src, tgt)[tgt_mask], expected[tgt_mask], atol=1e-5, rtol=1e-5)
        full, _ = padded([40, 40], 40, seed=3)  # every position of both tables
        torch.testing.assert_close(net(full, full), reference(input_ids=full, decoder_input_ids=full).logits,
                                   atol=1e-5, rtol=1e-5)


def test_a_headless_bart_model_reads_without_a_logits_bias(tmp_path: Path) -> None:
    model = transformers.BartModel(transformers.BartConfig(**BART))
    randomise(model, seed=1, std=0.3).eval().save_pretrained(tmp_path)
    weights = read_pretrained(tmp_path)
    assert weights.task_options["logits_bias"] is False
    net = task_from(weights).net
    src, tgt = padded([7], 7, seed=2)[0], padded([5], 5, seed=3)[0]
    with torch.no_grad():
        hidden = model(input_ids=src, decoder_input_ids=tgt).last_hidden_state  # (1, 5, D)
        torch.testing.assert_close(net(src, tgt), hidden @ model.shared.weight.T, atol=1e-5, rtol=1e-5)


def test_the_export_loads_back_in_transformers_with_equal_logits_and_reads_back_exact(tmp_path: Path) -> None:
    save_bart(tmp_path / "source", seed=4, scale_embedding=True)
    net = task_from(read_pretrained(tmp_path / "source")).net
    hf = to_transformers(net, {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD})
    src, _ = padded([10, 10], 10, seed=5)
    tgt, _ = padded([6, 6], 6, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, decoder_input_ids=tgt).logits, net(src, tgt), atol=1e-5, rtol=1e-5)
    write_hf(net, None, None, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["architectures"], config["decoder_start_token_id"], config["scale_embedding"]) == (
        ["BartForConditionalGeneration"], EOS, True)
    back = read_pretrained(tmp_path / "export")
    assert_state_equal(back.state_dict, net)
    assert type(transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "export")).__name__ == \
        "BartForConditionalGeneration"


@pytest.mark.parametrize("beams", [1, 4])
def test_translation_decoding_equals_transformers_generate_token_for_token(tmp_path: Path, beams: int) -> None:
    """Sentences of several lengths decoded together; the length limit is reached by some (forced </s>, scored 0)."""
    reference = save_bart(tmp_path, seed=8)
    task = task_from(read_pretrained(tmp_path), beam_size=beams, length_penalty=1.3, max_len_a=0.0, max_len_b=9)
    src, src_mask = padded([13, 8, 5, 3], 13, seed=9)
    src[torch.arange(4), src_mask.sum(1) - 1] = EOS  # each source ends in </s>, as the data writes it
    with torch.no_grad():
        hypotheses = task.decode_ids(src, beam_size=beams)
        expected = reference.generate(
            input_ids=src, attention_mask=src_mask.long(), num_beams=beams, do_sample=False, max_length=9 + 1,
            min_length=0, decoder_start_token_id=EOS, forced_bos_token_id=BOS, forced_eos_token_id=EOS,
            bad_words_ids=[[PAD], [BOS]], length_penalty=1.3, early_stopping="never", no_repeat_ngram_size=0,
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    produced = [[EOS, *h.tokens, EOS] for h in hypotheses]  # the decoder's start, <s> forced first, the tokens, </s>
    assert produced == [[t for t in row.tolist() if t != PAD] for row in expected]
    assert all(h.tokens[0] == BOS for h in hypotheses)
    assert [h.tokens for h in task.decode_ids(src, beam_size=beams, use_cache=False)] == [h.tokens for h in hypotheses]
    assert {len(row) for row in produced} == {3, 10}, "one sentence ends at once, the others at the limit"


def test_a_network_of_trident_s_own_convention_exports_its_bos_as_the_decoder_start(tmp_path: Path) -> None:
    """No decoder start of its own: transformers starts from the run's <s> and forces nothing first."""
    net = trident_bart()
    write_hf(net, None, None, tmp_path)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert (hf.generation_config.decoder_start_token_id, hf.generation_config.forced_bos_token_id) == (BOS, None)
    src, _ = padded([9, 9], 9, seed=7)
    tgt, _ = padded([5, 5], 5, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, decoder_input_ids=tgt).logits, net(src, tgt), atol=1e-5, rtol=1e-5)


def test_beam_scoring_follows_the_decoder_start_unless_chosen(tmp_path: Path) -> None:
    save_bart(tmp_path)
    weights = read_pretrained(tmp_path)
    assert task_from(weights).scoring == "transformers", "BART's convention decodes as generate"
    assert task_from(weights, scoring="gnmt").scoring == "gnmt", "a choice of the run, not the source's"
    assert TranslationTask({"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16}, 11, {}, {}).scoring == "gnmt"
    with pytest.raises(ConfigError, match=r"^task.scoring=fairseq is not a beam scoring: choose auto or one of gnmt, "):
        task_from(weights, scoring="fairseq")


def test_a_bart_trident_cannot_hold_is_one_line_naming_the_key(tmp_path: Path) -> None:
    for settings, key in [({"decoder_layers": 3}, "decoder_layers=3"), ({"normalize_before": True}, "normalize_before"),
                          ({"add_bias_logits": True}, "add_bias_logits"), ({"decoder_ffn_dim": 40}, "decoder_ffn_dim=40")]:
        directory = tmp_path / key
        save_bart(directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(config | settings))
        with pytest.raises(DataError, match=rf"^{directory}: .*{key}.*, which trident cannot reproduce exactly$"):
            read_pretrained(directory)


def test_a_network_bart_cannot_hold_is_one_line() -> None:
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=48, norm_first=False, embedding_norm=True,
                            pos_encoding="learned", max_seq_len=16, family="bart")
    with pytest.raises(ConfigError, match=r"^task.tie_embeddings=none has no BART \(hf export\) equivalent"):
        to_transformers(EncoderDecoder(cfg, VOCAB, pad_id=PAD, tie_embeddings="none"))
    pre_norm = TransformerConfig(**(vars(cfg) | {"norm_first": True}))
    with pytest.raises(ConfigError, match=r"^model.norm_first=True has no BART \(hf export\) equivalent"):
        to_transformers(EncoderDecoder(pre_norm, VOCAB, pad_id=PAD))


def test_trident_s_own_convention_still_decodes_with_gnmt_scores_under_auto() -> None:
    """No decoder start (trident's own runs): scoring=auto ranks by GNMT's ((5 + L) / 6) ** alpha, and a hypothesis's
    score is its tokens' and EOS's log-probabilities under teacher forcing, EOS forced at the limit included."""
    task = TranslationTask({"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 48, "dropout": 0.0, "max_seq_len": 30},
                           VOCAB, {}, {}, pad_id=PAD, bos_id=BOS, eos_id=EOS, beam_size=4, length_penalty=0.6,
                           max_len_a=0.0, max_len_b=6).eval()
    assert task.scoring == "gnmt"
    randomise(task.net, seed=4, std=0.3)
    src, src_mask = padded([9, 6, 3], 9, seed=5)
    src[torch.arange(3), src_mask.sum(1) - 1] = EOS
    with torch.no_grad():
        hypotheses = task.decode_ids(src, beam_size=4)
        for row, hypothesis in zip(src, hypotheses, strict=True):
            ids = torch.tensor([[BOS, *hypothesis.tokens, EOS]])
            log_probs = task.net(row[None], ids[:, :-1]).log_softmax(-1)  # (1, L, V)
            score = float(log_probs[0].gather(1, ids[0, 1:, None]).sum())
            length = len(hypothesis.tokens) + 1
            assert hypothesis.score == pytest.approx(score, abs=1e-4)
            assert hypothesis.normalized_score == pytest.approx(hypothesis.score / ((5 + length) / 6) ** 0.6, rel=1e-6)


def test_a_decoder_start_counts_in_the_flops_of_a_step(tmp_path: Path) -> None:
    """The decoder reads `</s> <s> tokens`: one position more than the data's decoder input, in the model FLOPs (MFU)."""
    from trident.training.flops import encoder_decoder_flops

    save_bart(tmp_path)
    task = task_from(read_pretrained(tmp_path))
    batch = {"src": padded([9, 4], 9, seed=1)[0], "tgt_in": padded([6, 2], 6, seed=2)[0],
             "tgt_out": padded([6, 2], 6, seed=3)[0], "src_text": ["", ""], "tgt_text": ["", ""]}
    assert task.flops_per_batch(batch) == encoder_decoder_flops(task.net.cfg, VOCAB, 2, 9, 7)  # type: ignore[arg-type]
