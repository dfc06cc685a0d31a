"""Vision Transformer: timm parity, ViT-B/16 size, patch geometry, image positional encodings."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models.vit import PatchEmbedding, VisionTransformer, attention_rollout, vit_geometry
from trident.weights.adapters.timm_vit import timm_to_trident

pytestmark = pytest.mark.usefixtures("single_thread")


def trident_vit(image_size: int, patch: int, *, d_model: int = 64, heads: int = 4, layers: int = 2, classes: int = 10,
                channels: int = 3, pos_encoding: str = "learned", pool: str = "cls", **extra: object) -> VisionTransformer:
    cfg = TransformerConfig(
        d_model=d_model, n_heads=heads, n_layers=layers, d_ff=4 * d_model, dropout=0.0, norm_eps=1e-6,
        pos_encoding=pos_encoding, **vit_geometry(image_size, patch, pool), **extra,  # type: ignore[arg-type]
    )
    return VisionTransformer(cfg, patch_size=patch, in_channels=channels, num_classes=classes, pool=pool).eval()


def random_timm_vit(image_size: int = 32, patch: int = 4, classes: int = 10) -> TimmViT:
    torch.manual_seed(0)
    model = TimmViT(img_size=image_size, patch_size=patch, in_chans=3, num_classes=classes, embed_dim=64, depth=2,
                    num_heads=4, mlp_ratio=4.0, qkv_bias=True).eval()
    with torch.no_grad():  # move away from the init so every tensor matters in the comparison
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def test_timm_state_dict_gives_the_same_logits() -> None:
    reference = random_timm_vit()
    model = trident_vit(32, 4)
    model.load_state_dict(timm_to_trident(reference.state_dict()), strict=True)
    images = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(model(images), reference(images), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.forward_head(model.forward_features(images), pre_logits=True),
                               reference.forward_head(reference.forward_features(images), pre_logits=True),
                               rtol=1e-4, atol=1e-5)


def test_vit_b16_has_timm_parameter_count() -> None:
    with torch.device("meta"):
        reference = timm.create_model("vit_base_patch16_224", pretrained=False)
    cfg = TransformerConfig(d_model=768, n_heads=12, n_layers=12, d_ff=3072, norm_eps=1e-6, pos_encoding="learned",
                            **vit_geometry(224, 16, "cls"))  # type: ignore[arg-type]
    with torch.device("meta"):
        model = VisionTransformer(cfg, patch_size=16, in_channels=3, num_classes=1000)
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == 86_567_656


@pytest.mark.parametrize(("image_size", "patch", "channels"), [(28, 4, 1), (28, 7, 1), (32, 4, 3), (224, 16, 3), (30, 5, 2)])
def test_patch_embedding_shapes(image_size: int, patch: int, channels: int) -> None:
    embed = PatchEmbedding(patch, channels, 48)
    out = embed(torch.randn(2, channels, image_size, image_size))
    assert out.shape == (2, (image_size // patch) ** 2, 48)
    geometry = vit_geometry(image_size, patch, "cls")
    assert geometry["grid"] == (image_size // patch,) * 2 and geometry["max_seq_len"] == out.size(1) + 1
    assert vit_geometry(image_size, patch, "mean")["num_prefix_tokens"] == 0


def test_patch_size_must_divide_the_image() -> None:
    """The fix names data.image_size too: init_from fixes the patch size (a hint naming only
    data.patch_size would be refused there)."""
    with pytest.raises(ConfigError, match=r"patch size 5 does not divide image size 28: choose data.patch_size among "
                                          r"\[1, 2, 4, 7, 14, 28\], or a data.image_size that is a multiple of 5 \(init_from "
                                          r"fixes the patch size\)"):
        vit_geometry(28, 5, "cls")


@pytest.mark.parametrize("encoding", ["alibi", "relative"])
def test_one_dimensional_biases_do_not_apply_to_images(encoding: str) -> None:
    with pytest.raises(ConfigError, match="does not apply to image patches: use learned, sinusoidal, rope or none"):
        trident_vit(28, 7, channels=1, pos_encoding=encoding)


@pytest.mark.parametrize("encoding", ["learned", "sinusoidal", "rope", "none"])
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_every_image_encoding_trains(encoding: str, pool: str) -> None:
    model = trident_vit(28, 7, channels=1, pos_encoding=encoding, pool=pool, drop_path=0.1, layer_scale_init=1e-4).train()
    logits = model(torch.randn(4, 1, 28, 28))
    logits.logsumexp(-1).mean().backward()
    assert logits.shape == (4, 10) and torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_sinusoidal_2d_encodes_rows_and_columns_and_leaves_the_class_token() -> None:
    model = trident_vit(12, 4, channels=1, pos_encoding="sinusoidal")  # 3x3 grid + class token
    table = model.encoder.pos_encoding.table  # (10, 64)
    assert torch.equal(table[0], torch.zeros(64))
    rows, cols = table[1:, :32].reshape(3, 3, 32), table[1:, 32:].reshape(3, 3, 32)
    assert torch.equal(rows[0, 0], rows[0, 2]) and not torch.equal(rows[0, 0], rows[1, 0])  # first half: row
    assert torch.equal(cols[0, 1], cols[2, 1]) and not torch.equal(cols[0, 0], cols[0, 1])  # second half: column


def test_rope_2d_depends_only_on_the_row_and_column_offsets() -> None:
    model = trident_vit(20, 4, channels=1, pos_encoding="rope")  # 5x5 grid + class token
    encoding = model.encoder.pos_encoding
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        from trident.backbone.positional import apply_rotary

        cos, sin = encoding.rotary(torch.tensor([q_pos, k_pos]))
        return (apply_rotary(q, cos[:1], sin[:1]) * apply_rotary(k, cos[1:], sin[1:])).sum()

    patch = lambda r, c: 1 + 5 * r + c
    torch.testing.assert_close(score(patch(0, 0), patch(1, 2)), score(patch(2, 1), patch(3, 3)))
    assert not torch.allclose(score(patch(0, 0), patch(1, 2)), score(patch(0, 0), patch(2, 1)))
    cos, sin = encoding.rotary(torch.tensor([0]))
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))  # class token unrotated


def test_attention_rollout_rows_are_distributions() -> None:
    model = trident_vit(28, 7, channels=1)
    _, weights = model.forward_with_attention(torch.randn(2, 1, 28, 28))
    rollout = attention_rollout(weights)
    assert rollout.shape == (2, 17, 17)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 17))


def test_pool_and_prefix_must_agree() -> None:
    cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, pos_encoding="learned",
                            **vit_geometry(28, 7, "mean"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pool=cls needs the grid and prefix"):
        VisionTransformer(cfg, patch_size=7, in_channels=1, num_classes=10, pool="cls")
