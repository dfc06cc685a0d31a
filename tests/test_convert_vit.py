"""ViT from transformers and from timm (random weights) -> trident's VisionTransformer: the same
logits; trident -> both and back: the same tensors (issue #24)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models._hub import save_for_hf

from tests.convert_helpers import assert_hf_round_trip, drop_default_settings, net_from, randomise
from trident.backbone import TransformerConfig
from trident.errors import ConfigError, DataError
from trident.models.vit import VisionTransformer, vit_geometry
from trident.weights import PretrainedWeights, read_pretrained
from trident.weights.adapters.hf_export import to_transformers
from trident.weights.adapters.timm_vit import trident_to_timm
from trident.weights.transfer import transfer_weights

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("settings", "activation"), [
    ({}, "gelu"),
    ({"defaults_dropped": True}, "gelu"),  # gelu, eps 1e-12, qkv biases, 3 channels: the reader's defaults
    ({"hidden_act": "gelu_new", "layer_norm_eps": 1e-3, "num_channels": 2}, "gelu_tanh"),
    ({"hidden_act": "relu", "layer_norm_eps": 1e-2}, "relu"),
])
def test_hf_vit_logits_equal_those_of_transformers(tmp_path: Path, settings: dict[str, object], activation: str) -> None:
    settings = dict(settings)  # the parameter is shared between runs
    dropped = bool(settings.pop("defaults_dropped", False))
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                                    image_size=24, patch_size=6, num_labels=7, **settings)
    reference = randomise(transformers.ViTForImageClassification(config), seed=1).eval()
    reference.save_pretrained(tmp_path)
    if dropped:
        assert {"hidden_act", "layer_norm_eps", "qkv_bias", "num_channels"} <= drop_default_settings(
            tmp_path, transformers.ViTConfig)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.classes) == ("hf-vit", "vit", 7)
    channels = config.num_channels
    assert weights.data_options == {"image_size": 24, "patch_size": 6, "in_channels": channels}
    assert (weights.model["activation"], weights.model["norm_eps"]) == (activation, config.layer_norm_eps)
    net = net_from(weights)
    images = torch.randn(2, channels, 24, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(images).logits, atol=1e-5, rtol=1e-5)


def timm_vit(width: int = 128, heads: int = 2, architecture: str = "vit_tiny_patch16_224", depth: int = 2,
             **settings: object) -> torch.nn.Module:
    model = timm.create_model(architecture, pretrained=False, img_size=32, patch_size=8, embed_dim=width, depth=depth,
                              num_heads=heads, num_classes=5, **settings).eval()
    return randomise(model, seed=2)


def assert_same_logits_as_timm(weights: PretrainedWeights, reference: torch.nn.Module, image_size: int = 32) -> None:
    net = net_from(weights)
    images = torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(images), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("suffix", "settings"), [(".safetensors", {}), (".pth", {"init_values": 1e-5})])
def test_timm_vit_logits_equal_those_of_timm(tmp_path: Path, suffix: str, settings: dict[str, object]) -> None:
    reference = timm_vit(**settings)
    path = tmp_path / f"vit{suffix}"
    if suffix == ".safetensors":
        save_file(reference.state_dict(), str(path))
    else:
        torch.save(reference.state_dict(), path)
    weights = read_pretrained(path)
    assert (weights.format, weights.classes) == ("timm-vit", 5)
    assert weights.data_options == {"image_size": 32, "patch_size": 8, "in_channels": 3}
    assert (weights.model["n_heads"], weights.model["layer_scale_init"] is not None) == (2, bool(settings))
    # Nothing beside the file states the heads: 64 channels each is assumed, and the weights table says so.
    assert weights.notes == {"encoder.blocks": "heads: 2 (assumed 64 channels each; set model.n_heads= if the source differs)"}
    assert_same_logits_as_timm(weights, reference)


@pytest.mark.parametrize(("width", "heads", "read"), [
    (160, 2, "directory"),  # heads of 80, from the model_args of timm's config.json (save_for_hf)
    (320, 4, "file"),  # heads of 80 where 64-wide heads would give 5: config.json beside the weights file
    (96, 3, "n_heads"),  # heads of 32, nothing beside the file: stated by n_heads= (model.n_heads= with init_from)
])
def test_timm_heads_of_any_width_give_timms_logits(tmp_path: Path, width: int, heads: int, read: str) -> None:
    reference = timm_vit(width, heads)
    if read == "n_heads":
        save_file(reference.state_dict(), str(tmp_path / "vit.safetensors"))
        weights = read_pretrained(tmp_path / "vit.safetensors", n_heads=heads)
        assert weights.notes == {"encoder.blocks": f"heads: {heads} (as given; the file does not record them)"}
    else:
        save_for_hf(reference, str(tmp_path), safe_serialization=True)  # config.json + model.safetensors
        weights = read_pretrained(tmp_path if read == "directory" else tmp_path / "model.safetensors")
        assert weights.notes == {}
    assert (weights.format, weights.model["n_heads"]) == ("timm-vit", heads)
    assert_same_logits_as_timm(weights, reference)


def test_timm_heads_come_from_the_architecture_name(tmp_path: Path) -> None:
    # The Hub's config.json of an older timm names the architecture only: vit_huge is 1280 wide in 16 heads of 80.
    reference = timm_vit(1280, 16, "vit_huge_patch14_224", depth=1)
    save_file(reference.state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "vit_huge_patch14_224", "num_classes": 5}))
    weights = read_pretrained(tmp_path)
    assert weights.model["n_heads"] == 16
    assert_same_logits_as_timm(weights, reference)


def test_timm_heads_nothing_states_are_refused_or_named(tmp_path: Path) -> None:
    save_file(timm_vit(160, 2).state_dict(), str(tmp_path / "vit.safetensors"))
    with pytest.raises(DataError, match="160 wide and records no head count, which 64-channel heads do not divide: "
                                        "set model.n_heads=") as caught:
        read_pretrained(tmp_path / "vit.safetensors")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="n_heads=3 does not divide"):
        read_pretrained(tmp_path / "vit.safetensors", n_heads=3)
    save_for_hf(timm_vit(320, 4), str(tmp_path / "stated"), safe_serialization=True)
    with pytest.raises(ConfigError, match="model.n_heads=5 contradicts .*stated, which has model.n_heads=4"):
        read_pretrained(tmp_path / "stated", n_heads=5)
    (tmp_path / "stated" / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    with pytest.raises(DataError, match="names vit_tiny_patch16_224, which is 192 wide; the weights are 320 wide"):
        read_pretrained(tmp_path / "stated")
    (tmp_path / "stated" / "config.json").write_text(json.dumps({"architecture": "vit_not_in_timm"}))
    with pytest.raises(DataError, match="names vit_not_in_timm, which timm .* cannot build"):
        read_pretrained(tmp_path / "stated")


@pytest.mark.parametrize(("image_size", "grid"), [(64, "8x8"), (24, "3x3")])
def test_a_timm_vit_at_another_image_size_gives_timms_logits(tmp_path: Path, image_size: int, grid: str) -> None:
    save_file(timm_vit(160, 2).state_dict(), str(tmp_path / "vit.safetensors"))
    weights = read_pretrained(tmp_path / "vit.safetensors", n_heads=2)
    # timm's own fine-tuning at another size: its pretrained loader resamples the 4x4 table of the file.
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=image_size, patch_size=8,
                                  embed_dim=160, depth=2, num_heads=2, num_classes=5,
                                  pretrained_cfg_overlay={"file": str(tmp_path / "vit.safetensors"), "num_classes": 5}).eval()
    cfg = TransformerConfig(**weights.model, pos_encoding="learned", dropout=0.0, **vit_geometry(image_size, 8, "cls"))
    net = VisionTransformer(cfg, patch_size=8, in_channels=3, num_classes=5).eval()
    rows = transfer_weights(net, weights.state_dict, "vit.safetensors")
    notes = {r.group: r.note for r in rows if r.outcome == "loaded"}
    assert notes["encoder.pos_encoding.embedding"] == f"resampled 4x4 -> {grid}" and {r.outcome for r in rows} == {"loaded"}
    images = torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(images), atol=1e-5, rtol=1e-5)


def trident_vit(pool: str = "cls", **settings: object) -> VisionTransformer:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "pos_encoding": "learned"}
    cfg = TransformerConfig(**(options | settings), **vit_geometry(24, 6, pool))  # type: ignore[arg-type]
    net = VisionTransformer(cfg, patch_size=6, in_channels=3, num_classes=7, pool=pool).eval()
    return randomise(net, seed=4)  # type: ignore[return-value]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_trident_vit_to_hf_and_back_is_exact(tmp_path: Path, activation: str) -> None:
    net = trident_vit(norm_eps=1e-3, activation=activation)  # not Hugging Face's default eps (1e-12)
    images = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(3))
    assert_hf_round_trip(net, images, tmp_path)


def test_trident_vit_to_timm_is_exact() -> None:
    net = trident_vit(norm_eps=1e-6)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=24, patch_size=6, embed_dim=32,
                                  depth=2, num_heads=4, mlp_ratio=40 / 32, num_classes=7).eval()
    reference.load_state_dict(trident_to_timm(net.state_dict()), strict=True)
    images = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reference(images), net(images), atol=1e-5, rtol=1e-5)


def test_mean_pooling_has_no_hf_equivalent() -> None:
    with pytest.raises(ConfigError, match="^task.pool=mean has no ViT"):
        to_transformers(trident_vit(pool="mean"))


def test_a_state_dict_that_is_not_a_vit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pth"
    torch.save({"fc.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(DataError, match="not a timm ViT"):
        read_pretrained(path)
