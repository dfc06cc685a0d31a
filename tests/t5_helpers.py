"""Random-weight T5 directories (v1.0 and v1.1, every parameter randomised), their SentencePiece-style tokenizer, and the
trident network a read of one builds, as a run would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tests.convert_helpers import randomise
from trident.backbone import TransformerConfig
from trident.models.seq2seq import EncoderDecoder
from trident.weights import PretrainedWeights

WORDS = ("the", "light", "word", "was", "and", "god", "said", "let", "there", "be", "in", "beginning", "es", "werde",
         "licht", "und", "gott", "sprach", "am", "anfang", "war", "das", "wort", "translate", "english", "to", "german")
EOS_ID = 1
# T5's tiny shapes: d_kv (8) times the heads (4) is not d_model (24), as in T5 v1.1's own sizes.
SIZES = {"d_model": 24, "d_kv": 8, "d_ff": 40, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
         "relative_attention_max_distance": 20, "layer_norm_epsilon": 1e-3, "dropout_rate": 0.0}
VERSIONS = {"v1.0": {"feed_forward_proj": "relu", "tie_word_embeddings": True},
            "v1.1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
            "mt5": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}}  # MT5ForConditionalGeneration


def t5_tokenizer() -> Tokenizer:
    """A Unigram tokenizer laid out as T5's SentencePiece one (<pad> 0, </s> 1, <unk> 2, pieces after a ▁ metaspace,
    </s> appended by its post-processor)."""
    letters = sorted({c for word in WORDS for c in word})
    pieces = [(f"▁{word}", -2.0) for word in WORDS] + [("▁", -3.0)] + [(c, -5.0) for c in letters]
    tokenizer = Tokenizer(models.Unigram([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces], unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS_ID)])
    return tokenizer


def save_t5(path: Path, version: str, *, seed: int = 0, eos_boost: float = 0.0, **settings: Any) -> torch.nn.Module:
    """A T5ForConditionalGeneration of ``version`` (``mt5``: an MT5ForConditionalGeneration) with every parameter
    randomised, saved at ``path`` with its tokenizer, as transformers loads it back (eval mode). v1.1's and mT5's output
    layer is its own ``lm_head`` (the hub's files: a config with tie_word_embeddings false and the tensor), which
    transformers 5 does not build from a config alone.
    ``eos_boost``: added to the EOS row of the output layer, so that decoding ends at various lengths."""
    import transformers

    tokenizer = t5_tokenizer()
    options = SIZES | VERSIONS[version] | {"vocab_size": tokenizer.get_vocab_size(), "decoder_start_token_id": 0} | settings
    family = "MT5" if version == "mt5" else "T5"
    config_class, model_class = (getattr(transformers, f"{family}{kind}") for kind in ("Config", "ForConditionalGeneration"))
    model = randomise(model_class(config_class(**options)), seed=seed, std=0.3)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    state = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    if not options["tie_word_embeddings"]:
        state["lm_head.weight"] = torch.randn(state["shared.weight"].shape, generator=generator) * 0.3
        config = json.loads((path / "config.json").read_text())
        config.pop("scale_decoder_outputs", None)
        (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    head = "lm_head.weight" if "lm_head.weight" in state else "shared.weight"
    state[head][EOS_ID] += eos_boost * state[head].std() * torch.sign(torch.randn(state[head].size(1), generator=generator))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model_class.from_pretrained(path).eval()


def t5_net(weights: PretrainedWeights, max_seq_len: int = 64) -> EncoderDecoder:
    """The trident EncoderDecoder ``weights`` fill (dropout off), loaded strictly, in eval mode."""
    cfg = TransformerConfig(**(weights.model | {"dropout": 0.0}), pos_encoding=weights.pos_encoding,
                            pos_encoding_options=weights.pos_encoding_options, max_seq_len=max_seq_len)
    assert weights.vocab_size is not None
    net = EncoderDecoder(cfg, weights.vocab_size, pad_id=0, **weights.task_options)
    net.load_state_dict(weights.state_dict, strict=True)
    return net.eval()


def padded_pairs(vocab: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sources of 13, 8 and 3 tokens (the last EOS) right-padded with 0, and decoder inputs of 9, 5 and 2 tokens
    (starting at 0, T5's decoder start) right-padded with 0; their masks, True at real tokens."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab, (3, 13), generator=generator)
    src_mask = torch.arange(13)[None, :] < torch.tensor([13, 8, 3])[:, None]
    src[torch.arange(3), torch.tensor([12, 7, 2])] = EOS_ID
    tgt = torch.randint(2, vocab, (3, 9), generator=generator)
    tgt[:, 0] = 0
    tgt_mask = torch.arange(9)[None, :] < torch.tensor([9, 5, 2])[:, None]
    return src.masked_fill(~src_mask, 0), src_mask, tgt.masked_fill(~tgt_mask, 0), tgt_mask


def padded_sources(vocab: int, lengths: tuple[int, ...], seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of ``lengths`` tokens (the last EOS) right-padded with 0, and their mask (True at real tokens)."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=generator)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    src[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = EOS_ID
    return src.masked_fill(~mask, 0), mask
