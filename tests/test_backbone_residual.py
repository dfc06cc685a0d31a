"""trident's DropPath and LayerScale (trident.backbone.residual) against timm's, which they replace
so that importing the backbone does not import timm."""

from __future__ import annotations

import pytest
import torch
from timm.layers import DropPath as TimmDropPath
from timm.layers import LayerScale as TimmLayerScale

from trident.backbone.residual import DropPath, LayerScale


@pytest.mark.parametrize("drop_prob", [0.1, 0.5, 1.0])
def test_drop_path_matches_timm_in_training(drop_prob: float) -> None:
    x = torch.randn(16, 5, 8)  # (B, T, D)
    ours, theirs = DropPath(drop_prob).train(), TimmDropPath(drop_prob).train()
    torch.manual_seed(3)
    expected = theirs(x)
    torch.manual_seed(3)
    torch.testing.assert_close(ours(x), expected, rtol=0, atol=0)


def test_drop_path_drops_whole_samples_and_rescales_the_rest() -> None:
    torch.manual_seed(0)
    out = DropPath(0.5).train()(torch.ones(64, 3, 4))
    per_sample = out.flatten(1)
    # Every sample is either dropped (all 0) or kept and scaled by 1 / (1 - 0.5) = 2, never mixed.
    assert set(per_sample.unique().tolist()) == {0.0, 2.0}
    assert bool(((per_sample == 0).all(1) | (per_sample == 2).all(1)).all())


def test_drop_path_is_the_identity_in_eval() -> None:
    x = torch.randn(4, 3, 8)
    assert DropPath(0.9).eval()(x) is x


def test_layer_scale_matches_timm_and_loads_its_weights() -> None:
    ours, theirs = LayerScale(8, 1e-4), TimmLayerScale(8, 1e-4)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"gamma"}
    torch.testing.assert_close(ours.gamma, torch.full((8,), 1e-4))
    with torch.no_grad():
        theirs.gamma.copy_(torch.arange(8.0) - 3.5)  # asymmetric, with a negative scale
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    torch.testing.assert_close(ours(x)[..., 1], x[..., 1] * -2.5)
