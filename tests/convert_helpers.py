"""Building the trident model that a :class:`PretrainedWeights` describes, as a run would."""

from __future__ import annotations

from torch import nn

from trident.backbone import TransformerConfig
from trident.convert import PretrainedWeights
from trident.models import CausalLM, MaskedLM
from trident.models.vit import VisionTransformer, vit_geometry


def net_from(weights: PretrainedWeights, *, num_classes: int | None = None) -> nn.Module:
    """The trident ``net`` the weights fit (dropout off), loaded strictly, in eval mode."""
    options = dict(weights.model, pos_encoding=weights.pos_encoding, dropout=0.0)
    if weights.task == "vit":
        data = weights.data_options
        cfg = TransformerConfig(**options, **vit_geometry(data["image_size"], data["patch_size"], "cls"))
        classes = num_classes or weights.num_classes or 10
        net: nn.Module = VisionTransformer(cfg, patch_size=data["patch_size"], in_channels=data["in_channels"],
                                           num_classes=classes)
    else:
        cfg = TransformerConfig(**options, max_seq_len=weights.data_options["max_seq_len"])
        model_class = CausalLM if weights.task == "lm" else MaskedLM
        assert weights.vocab_size is not None
        net = model_class(cfg, weights.vocab_size, **weights.task_options)
    net.load_state_dict(weights.state_dict, strict=True)
    return net.eval()
