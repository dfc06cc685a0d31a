"""model.attention=performer | linformer (issue 55): FAVOR+ approaches softmax attention as the features grow, its
causal form sees no later position, its redraws are reproducible across a resume; Linformer serves encoders only;
both train through the pipeline and refuse what they cannot compose with in one line."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from trident.backbone import Decoder, Encoder, TransformerConfig
from trident.backbone.linear_attention import (
    CHUNK,
    PerformerFeatures,
    default_features,
    favor,
    orthogonal_gaussian,
    redraw_features,
)
from trident.errors import ConfigError
from trident.models import CausalLM, MaskedLM
from trident.runs.pipeline import build_data_and_task, build_trainer, check_config
from trident.weights.adapters.hf_export import to_transformers

from .backbone_helpers import D_MODEL, make_cfg, perturb_
from .conftest import SMALL, compose_config, one_step

pytestmark = pytest.mark.usefixtures("single_thread")

UNCHANGED = {"rtol": 0.0, "atol": 0.0}


def favor_error(features: int, *, causal: bool, draws: int = 6) -> float:
    """Mean absolute difference between FAVOR+ and exact softmax attention (float64), averaged over ``draws`` draws."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=generator, dtype=torch.float64) for _ in range(3))
    q, k = 0.7 * q, 0.7 * k  # scores of the size a trained layer has, not a near-uniform attention
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    errors = []
    for draw in range(draws):
        projection = orthogonal_gaussian(features, 16, torch.Generator().manual_seed(100 + draw)).double()
        approx = favor(q, k, v, projection, None, causal=causal, scale_dim=16)
        errors.append((approx - exact).abs().mean().item())
    return sum(errors) / draws


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_performer_approaches_softmax_attention_as_the_features_grow(causal: bool) -> None:
    errors = [favor_error(features, causal=causal) for features in (8, 32, 128, 512, 2048)]
    assert all(later < earlier for earlier, later in pairwise(errors)), errors
    # The estimator's error falls as 1/sqrt(features): 256 times the features, several times smaller.
    assert errors[-1] < errors[0] / 3, errors


def test_orthogonal_features_are_unbiased() -> None:
    """QR's sign convention, left in, biases the directions; the kernel estimate's mean over draws must not drift."""
    generator = torch.Generator().manual_seed(1)
    x, y = (0.7 * torch.randn(32, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    exact = torch.exp(x @ y.T / 4)
    projection = orthogonal_gaussian(1 << 15, 16, torch.Generator().manual_seed(2)).double()

    def features(z: torch.Tensor) -> torch.Tensor:
        z = z / 2  # 16 ** (-1/4)
        return torch.exp(z @ projection.T - (z * z).sum(-1, keepdim=True) / 2)

    estimate = features(x) @ features(y).T / projection.size(0)
    assert ((estimate - exact) / exact).mean().abs() < 0.01


def test_default_features_are_d_log_d() -> None:
    assert default_features(16) == 44 and default_features(64) == 266


# --------------------------------------------------------------------------------------------
# Information flow through the stacks


def build(stack: Callable[..., torch.nn.Module], **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return perturb_(stack(make_cfg(max_seq_len=320, **overrides))).eval()


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "rope"])
def test_causal_performer_sees_no_later_position(pos_encoding: str) -> None:
    """Exactly equal earlier outputs, also inside the perturbed position's chunk and across chunks."""
    decoder = build(Decoder, attention="performer", pos_encoding=pos_encoding)
    length = 2 * CHUNK + 40
    x = torch.randn(2, length, D_MODEL, generator=torch.Generator().manual_seed(1))
    out = decoder(x)
    for t in (5, CHUNK + 20, 2 * CHUNK + 1):
        changed = x.clone()
        changed[:, t:] = 5 * torch.randn(2, length - t, D_MODEL)
        out_changed = decoder(changed)
        torch.testing.assert_close(out_changed[:, :t], out[:, :t], **UNCHANGED)
        assert (out_changed[:, t:] - out[:, t:]).abs().amax(dim=-1).min() > 1e-4  # later positions see it


def test_causal_performer_decodes_with_the_kv_cache_as_a_full_pass() -> None:
    decoder = build(Decoder, attention="performer", pos_encoding="rope")
    x = torch.randn(2, 11, D_MODEL, generator=torch.Generator().manual_seed(2))
    full = decoder(x)
    cache, outputs = decoder.new_cache(16), []
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 11)):
        outputs.append(decoder(x[:, start:stop], cache=cache))
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["performer", "linformer"])
def test_padding_changes_no_real_position(attention: str) -> None:
    encoder = build(Encoder, attention=attention)
    x = torch.randn(2, 20, D_MODEL, generator=torch.Generator().manual_seed(3))
    padding = torch.zeros(2, 20, dtype=torch.bool)
    padding[0, 14:] = True
    out = encoder(x, key_padding_mask=padding)
    changed = x.clone()
    changed[padding] = 10 * torch.randn(int(padding.sum()), D_MODEL)
    torch.testing.assert_close(encoder(changed, key_padding_mask=padding)[~padding], out[~padding],
                               rtol=1e-5, atol=1e-6)
    # And the padded row's real tokens see what the 14 tokens alone show them.
    torch.testing.assert_close(encoder(x[:1, :14])[0], out[0, :14], rtol=1e-5, atol=1e-6)


def test_performer_under_bf16_autocast_stays_close_to_fp32() -> None:
    encoder = build(Encoder, attention="performer")
    x = torch.randn(2, 64, D_MODEL, generator=torch.Generator().manual_seed(4)) * 3
    reference = encoder(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = encoder(x)
    assert torch.isfinite(low).all()
    assert (low.float() - reference).abs().mean() < 0.05 * reference.abs().mean()
    whole = encoder.to(torch.bfloat16)(x.to(torch.bfloat16))  # precision=bf16-true: the directions cast too
    assert (whole.float() - reference).abs().mean() < 0.05 * reference.abs().mean()


def test_linformer_attends_through_k_projected_rows() -> None:
    encoder = build(Encoder, attention="linformer", linformer={"k": 8, "sharing": "kv"})
    _, weights = encoder.forward_with_attention(torch.randn(1, 30, D_MODEL))
    assert weights[0].shape == (1, 4, 30, 8)
    block = encoder.blocks[0].self_attn.mixer
    assert block.value_projection is None and block.key_projection.shape == (8, 320)


# --------------------------------------------------------------------------------------------
# Redraws


def test_performer_redraws_reproducibly_across_a_resume() -> None:
    """Straight through 10 steps, or 5 steps, a state dict, a layer built from another seed that loads it, and 5
    more: the same directions at every step, redrawn every 3."""
    torch.manual_seed(0)
    straight = PerformerFeatures(16, 32, 3, causal=True, scale_dim=16)
    drawn = []
    for step in range(10):
        straight.redraw(step)
        drawn.append(straight.projection.clone())
    assert not torch.equal(drawn[2], drawn[3]) and torch.equal(drawn[3], drawn[5])
    torch.manual_seed(0)
    first = PerformerFeatures(16, 32, 3, causal=True, scale_dim=16)
    for step in range(5):
        first.redraw(step)
    torch.manual_seed(123)  # the resumed run builds its layers from another state of the RNG
    resumed = PerformerFeatures(16, 32, 3, causal=True, scale_dim=16)
    resumed.load_state_dict(first.state_dict())
    for step in range(5, 10):
        resumed.redraw(step)
        torch.testing.assert_close(resumed.projection, drawn[step], **UNCHANGED)


def test_redraw_interval_null_never_redraws() -> None:
    layer = PerformerFeatures(8, 16, None, causal=False, scale_dim=8)
    before = layer.projection.clone()
    redraw_features(layer, 10_000)
    assert torch.equal(layer.projection, before)


# --------------------------------------------------------------------------------------------
# Through the pipeline


def test_lm_trains_a_step_with_performer(make_config: Callable[..., DictConfig]) -> None:
    metrics = one_step(make_config("model.attention=performer", "model.performer.features=32"))
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_mlm_trains_a_step_with_linformer(tmp_path: Path) -> None:
    small_mlm = ["task=mlm", *(o for o in SMALL if not o.startswith("task.sampling"))]
    cfg = compose_config([*small_mlm, "model.attention=linformer", "model.linformer.k=8"], output_dir=tmp_path / "run")
    metrics = one_step(cfg)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_training_redraws_the_features_at_each_interval(make_config: Callable[..., DictConfig]) -> None:
    """The task hands every training batch's optimizer step to the Performer layers: 3 steps with an interval of 1."""
    cfg = make_config("model.attention=performer", "model.performer.redraw_interval=1")
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    trainer = build_trainer(cfg.trainer, max_steps=3, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0,
                            logger=False, enable_checkpointing=False, callbacks=[], enable_progress_bar=False,
                            enable_model_summary=False)
    trainer.fit(task, datamodule=datamodule)
    layers = [m for m in task.modules() if isinstance(m, PerformerFeatures)]
    assert layers and all(int(layer.draw) == 2 for layer in layers)  # the third step, global_step 2


def test_a_resumed_run_draws_the_features_of_the_straight_run(make_config: Callable[..., DictConfig],
                                                              tmp_path: Path) -> None:
    """4 steps straight, or 2 steps, a checkpoint, and 2 more in a task built from another RNG state: the same
    directions in every layer at the end (redrawn at every step)."""
    cfg = make_config("model.attention=performer", "model.performer.redraw_interval=1")

    def fit(max_steps: int, seed: int, ckpt_path: Path | None = None) -> torch.nn.Module:
        torch.manual_seed(seed)
        datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
        trainer = build_trainer(cfg.trainer, max_steps=max_steps, max_epochs=-1, limit_val_batches=0,
                                num_sanity_val_steps=0, logger=False, enable_checkpointing=False, callbacks=[],
                                enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
        if ckpt_path is None and max_steps == 2:
            trainer.save_checkpoint(tmp_path / "two.ckpt")
        return task

    def directions(task: torch.nn.Module) -> list[torch.Tensor]:
        return [m.projection for m in task.modules() if isinstance(m, PerformerFeatures)]

    straight = directions(fit(4, seed=0))
    fit(2, seed=0)
    resumed = directions(fit(4, seed=123, ckpt_path=tmp_path / "two.ckpt"))
    assert len(resumed) == len(straight) == 2
    for ours, theirs in zip(resumed, straight, strict=True):
        torch.testing.assert_close(ours, theirs, **UNCHANGED)


# --------------------------------------------------------------------------------------------
# Refusals


def test_linformer_is_refused_for_causal_stacks(make_config: Callable[..., DictConfig]) -> None:
    for stack in (Decoder, lambda cfg: Decoder(cfg, cross_attention=True)):
        with pytest.raises(ConfigError, match=r"model.attention=linformer .* serves encoders only"):
            stack(make_cfg(attention="linformer"))
    cfg = make_config("model.attention=linformer")  # task=lm
    with pytest.raises(ConfigError, match=r"serves encoders only .*task=lm"):
        build_data_and_task(cfg, check_config(cfg), "fit")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"attention": "performr"}, r"model.attention='performr' is not supported \(did you mean performer"),
    ({"attention": "performer", "performer": {"features": 0}}, r"model.performer.features must be a positive"),
    ({"attention": "performer", "performer": {"feature": 8}}, r"model.performer.feature is not a performer option"),
    ({"attention": "performer", "pos_encoding": "alibi"}, r"forms no attention scores for pos_encoding=alibi"),
    ({"attention": "linformer", "pos_encoding": "relative"}, r"forms no attention scores for pos_encoding=relative"),
    ({"attention": "performer", "attention_window": 8}, r"takes no sliding window"),
    ({"attention": "linformer", "attn_softcap": 30.0}, r"forms no attention scores to soft-cap"),
    ({"attention": "performer", "attn_dropout": 0.1}, r"forms no attention weights to drop out"),
    ({"attention": "performer", "attn_impl": "explicit"}, r"drop model.attn_impl=explicit"),
    ({"attention": "linformer", "linformer": {"k": 64}}, r"model.linformer.k must be a positive integer below"),
    ({"attention": "linformer", "linformer": {"sharing": "layerwise"}}, r"model.linformer.sharing='layerwise'"),
])
def test_what_does_not_compose_is_one_line(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_cfg(**overrides)


def test_performer_refuses_packed_documents() -> None:
    decoder = build(Decoder, attention="performer")
    with pytest.raises(ConfigError, match="cannot keep the documents of packed rows apart"):
        decoder(torch.randn(1, 6, D_MODEL), documents=torch.tensor([[0, 0, 0, 1, 1, 1]]))


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_the_hf_export_refuses_what_transformers_would_run_as_softmax(family: str) -> None:
    if family == "bert":
        net: torch.nn.Module = MaskedLM(TransformerConfig(
            d_model=32, n_heads=4, n_layers=1, d_ff=40, norm_first=False, embedding_norm=True, pos_encoding="learned",
            max_seq_len=20, attention="linformer"), 50)
    else:
        net = CausalLM(TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=48, activation="swiglu",
                                         norm="rmsnorm", bias=False, pos_encoding="rope", max_seq_len=32,
                                         attention="performer", family=family), 50, tie_embeddings=False)
    with pytest.raises(ConfigError, match=r"^model.attention=.* has no .* equivalent: it computes softmax attention"):
        to_transformers(net)


def test_the_architecture_defaults_are_softmax(tmp_path: Path) -> None:
    cfg = compose_config(["model=nano"], output_dir=tmp_path / "run")
    assert cfg.model.attention == "softmax" and cfg.model.performer.redraw_interval == 1000
