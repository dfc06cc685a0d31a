"""ViT from transformers and from timm (random weights) -> trident's VisionTransformer: the same
logits; trident -> both and back: the same tensors (issue #24)."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from tests.convert_helpers import net_from
from trident.backbone import TransformerConfig
from trident.convert import read_pretrained
from trident.convert.hf_export import to_transformers
from trident.convert.timm_vit import trident_to_timm
from trident.errors import ConfigError, DataError
from trident.models.vit import VisionTransformer, vit_geometry

transformers = pytest.importorskip("transformers")


def randomise(model: torch.nn.Module) -> None:
    """Weights far from the initial ones (norms at 1, biases at 0), so every misplaced tensor shows."""
    torch.manual_seed(2)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.normal_(std=0.2)


def test_hf_vit_logits_equal_those_of_transformers(tmp_path: Path) -> None:
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                                    image_size=24, patch_size=6, num_channels=3, num_labels=7)
    reference = transformers.ViTForImageClassification(config).eval()
    randomise(reference)
    reference.save_pretrained(tmp_path)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.num_classes) == ("hf-vit", "vit", 7)
    assert weights.data_options == {"image_size": 24, "patch_size": 6, "in_channels": 3}
    net = net_from(weights)
    images = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(images).logits, atol=1e-5, rtol=1e-5)


def timm_vit(**settings: object) -> torch.nn.Module:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=128,
                              depth=2, num_heads=2, num_classes=5, **settings).eval()
    randomise(model)
    return model


@pytest.mark.parametrize(("suffix", "settings"), [(".safetensors", {}), (".pth", {"init_values": 1e-5})])
def test_timm_vit_logits_equal_those_of_timm(tmp_path: Path, suffix: str, settings: dict[str, object]) -> None:
    reference = timm_vit(**settings)
    path = tmp_path / f"vit{suffix}"
    if suffix == ".safetensors":
        save_file(reference.state_dict(), str(path))
    else:
        torch.save(reference.state_dict(), path)
    weights = read_pretrained(path)
    assert (weights.format, weights.num_classes) == ("timm-vit", 5)
    assert weights.data_options == {"image_size": 32, "patch_size": 8, "in_channels": 3}
    assert (weights.model["n_heads"], weights.model["layer_scale_init"] is not None) == (2, bool(settings))
    net = net_from(weights)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(images), atol=1e-5, rtol=1e-5)


def trident_vit(pool: str = "cls", **settings: object) -> VisionTransformer:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 40, "dropout": 0.0, "pos_encoding": "learned"}
    cfg = TransformerConfig(**(options | settings), **vit_geometry(24, 6, pool))  # type: ignore[arg-type]
    net = VisionTransformer(cfg, patch_size=6, in_channels=3, num_classes=7, pool=pool).eval()
    randomise(net)
    return net


def test_trident_vit_to_hf_and_back_is_exact(tmp_path: Path) -> None:
    net = trident_vit(norm_eps=1e-12)
    hf = to_transformers(net)
    images = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(hf(images).logits, net(images), atol=1e-5, rtol=1e-5)
    hf.save_pretrained(tmp_path)
    back = read_pretrained(tmp_path)
    own = net.state_dict()
    assert back.state_dict.keys() == own.keys()
    for name, tensor in own.items():
        assert torch.equal(back.state_dict[name], tensor), name


def test_trident_vit_to_timm_is_exact() -> None:
    net = trident_vit(norm_eps=1e-6)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=24, patch_size=6, embed_dim=32,
                                  depth=2, num_heads=4, mlp_ratio=40 / 32, num_classes=7).eval()
    reference.load_state_dict(trident_to_timm(net.state_dict()), strict=True)
    images = torch.randn(2, 3, 24, 24)
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
