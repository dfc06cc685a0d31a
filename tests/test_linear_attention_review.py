"""Review of model.attention=performer | linformer (issue 55): what the first version got wrong, each pinned by a
test that failed on it."""

from __future__ import annotations

import pytest
import torch

from trident.backbone import TransformerConfig
from trident.models import CausalLM
from trident.models.seq2seq import EncoderDecoder
from trident.models.vit import VisionTransformer, vit_geometry
from trident.training.flops import causal_lm_flops, encoder_decoder_flops, self_attention_flops, vit_flops

from .test_flops_mfu import counted_training_flops

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny(**extra: object) -> TransformerConfig:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 48, "max_seq_len": 160, "dropout": 0.0, **extra}
    return TransformerConfig(**options)


# --------------------------------------------------------------------------------------------
# FLOPs: each attention's own work, not softmax's (T, T) scores (MFU, budget=equal_compute)


def test_performer_self_attention_flops_are_the_hand_count() -> None:
    """4 heads of width 8, m = 16 features, e = 9 (values + the denominator's column), 20 positions."""
    cfg = tiny(attention="performer", performer={"features": 16})
    features = 2 * 2 * 16 * 32 * (20 + 20)  # queries' and keys' features: forward + input gradient
    bidirectional = 3 * 2 * 4 * 16 * 9 * (20 + 20)  # phi(K)^T [V 1], phi(Q) of it
    assert self_attention_flops(cfg, 20, 20, causal=False) == features + bidirectional
    # Causal: one chunk of 128 (20 queries padded): its (C, C) block against m and e, the state in; the state out
    # (which no later chunk reads: forward only).
    causal = 3 * 2 * 4 * 128 * (128 * 16 + 128 * 9 + 16 * 9) + 2 * 4 * 128 * 16 * 9
    assert self_attention_flops(cfg, 20, 20, causal=True) == features + causal


def test_linformer_self_attention_flops_are_the_hand_count() -> None:
    cfg = tiny(attention="linformer", linformer={"k": 8})
    projections = 3 * 2 * 2 * 8 * 32 * 20  # E K and F V: k rows of each of the 20 keys, all heads' width
    scores = 3 * 2 * 2 * 32 * 20 * 8  # QK^T and AV over the 8 projected rows
    assert self_attention_flops(cfg, 20, 20, causal=False) == projections + scores


@pytest.mark.parametrize("length", [16, 150], ids=["one-chunk", "two-chunks"])
def test_performer_lm_flops_equal_the_flop_counter(length: int) -> None:
    cfg = tiny(attention="performer", performer={"features": 12})
    model, ids = CausalLM(cfg, 50), torch.randint(0, 50, (2, length))
    assert causal_lm_flops(cfg, 50, 2, length) == counted_training_flops(lambda: model(ids))


def test_performer_translation_flops_equal_the_flop_counter() -> None:
    """The encoder's bidirectional and the decoder's causal Performer; cross-attention stays softmax."""
    cfg = tiny(attention="performer", performer={"features": 12})
    model = EncoderDecoder(cfg, 50, tie_embeddings="none")
    src, tgt = torch.randint(1, 50, (3, 12)), torch.randint(1, 50, (3, 9))
    # Within 0.1%: the counter finds 0.07% more here, outside the self-attention modules (which match exactly).
    assert encoder_decoder_flops(cfg, 50, 3, 12, 9) == pytest.approx(counted_training_flops(lambda: model(src, tgt)),
                                                                     rel=1e-3)


@pytest.mark.parametrize(("attention", "extra"), [("performer", {"performer": {"features": 12}}),
                                                  ("linformer", {"linformer": {"k": 8}, "attn_impl": "explicit"})])
def test_vit_flops_of_linear_attention_equal_the_flop_counter(attention: str, extra: dict[str, object]) -> None:
    cfg = tiny(attention=attention, pos_encoding="learned", **{**vit_geometry(16, 4, "cls"), **extra})
    model = VisionTransformer(cfg, patch_size=4, in_channels=3, num_classes=10, pool="cls")
    images = torch.randn(3, 3, 16, 16)
    expected = vit_flops(cfg, batch=3, patch_size=4, in_channels=3, num_classes=10)
    assert expected == counted_training_flops(lambda: model(images))
