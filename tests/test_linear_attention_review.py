"""Review of model.attention=performer | linformer (issue 55): what the first version got wrong, each pinned by a
test that failed on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from omegaconf import DictConfig

from trident.backbone import Decoder, TransformerConfig
from trident.backbone.linear_attention import CHUNK, PerformerFeatures
from trident.models import CausalLM
from trident.models.seq2seq import EncoderDecoder
from trident.models.vit import VisionTransformer, vit_geometry
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config
from trident.training.flops import causal_lm_flops, encoder_decoder_flops, self_attention_flops, vit_flops

from .backbone_helpers import D_MODEL, make_cfg, perturb_
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
    # Within 0.1%: cross-attention runs on SDPA (Performer takes no attn_impl=explicit), whose backward the counter
    # counts a little above 2 forwards (a softmax model on SDPA differs alike); the self-attention matches exactly.
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


# --------------------------------------------------------------------------------------------
# Checked and found right: guards for what the first tests left out


def test_left_padded_performer_decodes_past_a_chunk_as_a_full_pass() -> None:
    """A batch with a left-padded row (key padding in the causal form): a 100-token prefill, then one token at a time
    to 150, past the first chunk of CHUNK positions, equals the full pass at every real position."""
    torch.manual_seed(0)
    decoder = perturb_(Decoder(make_cfg(max_seq_len=320, attention="performer", pos_encoding="rope"))).eval()
    length = CHUNK + 22
    x = torch.randn(2, length, D_MODEL, generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[0, :7] = True
    positions = (torch.arange(length)[None] - padding.sum(dim=1, keepdim=True)).clamp(min=0)  # (B, T)
    with torch.no_grad():
        full = decoder(x, key_padding_mask=padding, positions=positions)
        cache, outputs = decoder.new_cache(length), []
        for start, stop in [(0, 100), *((t, t + 1) for t in range(100, length))]:
            outputs.append(decoder(x[:, start:stop], key_padding_mask=padding[:, :stop],
                                   positions=positions[:, start:stop], cache=cache))
        alone = decoder(x[:1, 7:])  # the padded row's real tokens, without the padding
    torch.testing.assert_close(torch.cat(outputs, dim=1)[~padding], full[~padding], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(full[0, 7:], alone[0], rtol=1e-4, atol=1e-5)


class DrawsSeen(L.Callback):
    """Each training micro-batch's (optimizer step, draw of the first Performer layer); validation's draws."""

    def __init__(self) -> None:
        self.train: list[tuple[int, int]] = []
        self.validation: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        # Callbacks run before the task's own hook: the draw the task leaves is read at the batch's end.
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.train.append((self.step, int(_first_layer(pl_module).draw)))

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self.validation.append(int(_first_layer(pl_module).draw))


def _first_layer(module: torch.nn.Module) -> PerformerFeatures:
    return next(m for m in module.modules() if isinstance(m, PerformerFeatures))


def test_redraws_follow_the_optimizer_step_under_gradient_accumulation(make_config: Callable[..., DictConfig]) -> None:
    """accumulate_grad_batches=2, redraw_interval=1: both micro-batches of a step see that step's draw; a validation
    redraws nothing; the directions are buffers, never handed to the optimizer."""
    cfg: DictConfig = make_config("model.attention=performer", "model.performer.redraw_interval=1")
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    seen = DrawsSeen()
    trainer = build_trainer(cfg.trainer, max_steps=3, max_epochs=-1, limit_val_batches=1, val_check_interval=2,
                            num_sanity_val_steps=0, accumulate_grad_batches=2, logger=False,
                            enable_checkpointing=False, callbacks=[seen], enable_progress_bar=False,
                            enable_model_summary=False)
    trainer.fit(task, datamodule=datamodule)
    assert seen.train == [(0, 0), (0, 0), (1, 1), (1, 1), (2, 2), (2, 2)]
    assert seen.validation == [1]  # after the 4th micro-batch (step 1), before step 2's redraw
    assert not any("mixer" in name for name, _ in task.named_parameters())
    trained = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not any(id(buffer) in trained for buffer in task.buffers())
