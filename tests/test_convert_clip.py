"""CLIP weights both ways (issue 54 item 3): transformers' ``CLIPModel`` with every parameter randomised, saved by
``save_pretrained``, read into trident's ``CLIP`` (task=clip's network) gives the same image and text embeddings
(``get_image_features`` / ``get_text_features``) and logits within 1e-5, and is written back to the same tensors; an
open_clip model built by open_clip from its config, random weights, read in gives the same features."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models.clip import CLIP
from trident.tasks.network_builders import clip
from trident.weights.adapters import hf_clip
from trident.weights.adapters.hf_files import read_config, read_state_dict
from trident.weights.adapters.outside_network import as_source
from trident.weights.pretrained import PretrainedWeights

from .convert_helpers import randomise
from .open_clip_reference import import_open_clip

transformers = pytest.importorskip("transformers")

VOCAB, CONTEXT, EOS = 50, 12, 49
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": CONTEXT, "eos_token_id": EOS, "hidden_act": "quick_gelu"}
VISION = {"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 2,
          "image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_act": "quick_gelu"}


def _reference(tmp_path: Path, text: dict[str, Any] | None = None) -> tuple[Any, Path]:
    config = transformers.CLIPConfig(text_config={**TEXT, **(text or {})}, vision_config=VISION, projection_dim=20)
    torch.manual_seed(0)
    model = randomise(transformers.CLIPModel(config), seed=1).eval()
    with torch.no_grad():  # a temperature below CLIP's clamp (log 100), as trained models have it
        model.logit_scale.fill_(2.5)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def _read(directory: Path) -> tuple[PretrainedWeights, CLIP]:
    return _net(as_source(hf_clip.to_trident(read_config(directory), read_state_dict(directory), None, str(directory))))


def _net(weights: PretrainedWeights) -> tuple[PretrainedWeights, CLIP]:
    """trident's CLIP of ``weights``' settings, loaded strictly, in eval mode."""
    backbone = TransformerConfig(**weights.model, pos_encoding=weights.pos_encoding, dropout=0.0,
                                 max_seq_len=weights.data_options["max_length"])
    options, data = weights.task_options, weights.data_options
    net = clip(backbone, vocab_size=weights.vocab_size or 0, eos_id=options["eos_id"], embed_dim=options["embed_dim"],
               text=options["text"], image=options["image"], image_size=data["image_size"],
               patch_size=data["patch_size"], in_channels=data["in_channels"])
    net.load_state_dict(weights.state_dict, strict=True)
    return weights, net.eval()


def _inputs(eos: int | None) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    images = torch.randn(3, 3, 16, 16, generator=generator)
    ids = torch.randint(0, VOCAB - 1, (4, CONTEXT), generator=generator)
    ends = [CONTEXT - 1, 5, 1, 8]  # each row's end of text, padded after it with the end-of-text id as CLIP pads
    for row, end in enumerate(ends):
        ids[row, end:] = VOCAB - 1 if eos is None else eos
    return images, ids


def _projected(features: Any) -> Tensor:
    """transformers 5 returns the projected features as an output's ``pooler_output``, 4 as the tensor itself."""
    return features if isinstance(features, Tensor) else features.pooler_output


@pytest.mark.parametrize("eos", [EOS, None], ids=["eos_token_id", "legacy_argmax"])
def test_clipmodel_reads_in_with_equal_embeddings_and_logits_and_writes_back_exact(eos: int | None,
                                                                                  tmp_path: Path) -> None:
    """``eos`` None: a config of the legacy ``eos_token_id=2``, pooled at each row's largest id."""
    reference, directory = _reference(tmp_path, None if eos is not None else {"eos_token_id": 2})
    net = _read(directory)[1]
    assert net.text.eos_id == eos
    images, ids = _inputs(eos)
    with torch.no_grad():
        theirs = reference(input_ids=ids, pixel_values=images)
        image_features = _projected(reference.get_image_features(pixel_values=images))
        torch.testing.assert_close(net.encode_image(images), image_features, rtol=0, atol=1e-5)
        torch.testing.assert_close(net.encode_text(ids), _projected(reference.get_text_features(input_ids=ids)),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(net(images, ids), theirs.logits_per_image, rtol=0, atol=1e-5)
    # Back: the same architecture, settings and tensors, bit for bit.
    architecture, config, state = hf_clip.from_trident(net)
    assert architecture == "CLIPModel"
    back = transformers.CLIPModel(transformers.CLIPConfig(**config))
    missing, unexpected = back.load_state_dict(state, strict=False)
    assert not unexpected and not [key for key in missing if not key.endswith("position_ids")]
    original = reference.state_dict()
    assert {k for k in original if not k.endswith("position_ids")} == set(state)
    for key, tensor in state.items():
        assert torch.equal(tensor, original[key]), key
    for tower in ("text_config", "vision_config"):
        ours, theirs_config = getattr(back.config, tower).to_dict(), getattr(reference.config, tower).to_dict()
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
                    "layer_norm_eps", *(("vocab_size", "max_position_embeddings", "eos_token_id") if tower == "text_config"
                                        else ("image_size", "patch_size", "num_channels"))):
            assert ours[key] == theirs_config[key], (tower, key)
    assert back.config.projection_dim == reference.config.projection_dim


def test_an_image_tower_without_clips_pre_norm_is_refused_in_one_line(tmp_path: Path) -> None:
    backbone = TransformerConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=8, pos_encoding="learned")
    net = clip(backbone, vocab_size=11, eos_id=1, embed_dim=8, text=None, image=None, image_size=8, patch_size=4,
               in_channels=1)
    with pytest.raises(ConfigError, match=r"model.embedding_norm=False has no CLIP \(hf export\) equivalent"):
        hf_clip.from_trident(net)


OPEN_CLIP_CONFIG = {"embed_dim": 20, "quick_gelu": True,
                    "vision_cfg": {"layers": 2, "width": 24, "head_width": 12, "mlp_ratio": 2.0, "patch_size": 4,
                                   "image_size": 16},
                    "text_cfg": {"context_length": CONTEXT, "vocab_size": VOCAB, "width": 32, "heads": 4, "layers": 2,
                                 "mlp_ratio": 1.5}}


def test_an_open_clip_model_reads_in_with_equal_features(tmp_path: Path) -> None:
    """open_clip pools the text at its largest id (OpenAI's end-of-text token, the last of the vocabulary)."""
    import json

    from safetensors.torch import save_file

    from trident.weights.adapters import open_clip_files

    open_clip = import_open_clip()
    torch.manual_seed(0)
    model = randomise(open_clip.model.CLIP(**OPEN_CLIP_CONFIG), seed=3).eval()
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    directory = tmp_path / "open_clip"
    directory.mkdir()
    (directory / open_clip_files.CONFIG).write_text(json.dumps({"model_cfg": OPEN_CLIP_CONFIG}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / open_clip_files.WEIGHTS[0]))
    assert open_clip_files.recognises(directory)
    weights, net = _net(as_source(open_clip_files.read(directory, str(directory), None)))
    images, ids = _inputs(None)
    with torch.no_grad():
        torch.testing.assert_close(net.encode_image(images), model.encode_image(images), rtol=0, atol=1e-5)
        torch.testing.assert_close(net.encode_text(ids), model.encode_text(ids), rtol=0, atol=1e-5)
        image, text, scale = model(images, ids)[:3]
        torch.testing.assert_close(net(images, ids), scale * image @ text.T, rtol=0, atol=1e-5)
    # Every tensor of open_clip's was read (but its causal mask, a buffer trident builds itself).
    assert len(weights.state_dict) == len(net.state_dict())


def test_an_open_clip_setting_trident_cannot_reproduce_is_one_line(tmp_path: Path) -> None:
    import json

    from trident.errors import DataError
    from trident.weights.adapters import open_clip_files

    directory = tmp_path / "open_clip"
    directory.mkdir()
    config = {**OPEN_CLIP_CONFIG, "vision_cfg": {**OPEN_CLIP_CONFIG["vision_cfg"], "ls_init_value": 0.1}}
    (directory / open_clip_files.CONFIG).write_text(json.dumps({"model_cfg": config}))
    (directory / open_clip_files.WEIGHTS[0]).write_bytes(b"")
    with pytest.raises(DataError, match="open_clip's vision_cfg.ls_init_value=0.1 setting, which trident cannot reproduce"):
        open_clip_files.read(directory, str(directory), None)


def trident_clip() -> CLIP:
    """A trident CLIP as task=clip builds it (quick GELU, the image tower's pre-norm), every parameter randomised, in eval
    mode, with a temperature below CLIP's clamp."""
    backbone = TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=48, max_seq_len=CONTEXT, pos_encoding="learned",
                                 activation="quick_gelu", norm_eps=1e-5, dropout=0.0)
    net = clip(backbone, vocab_size=VOCAB, eos_id=EOS, embed_dim=20, text=None,
               image={"d_model": 24, "n_heads": 2, "n_layers": 3, "d_ff": 40, "embedding_norm": True}, image_size=16,
               patch_size=4, in_channels=3)
    randomise(net, seed=4)
    with torch.no_grad():
        net.logit_scale.fill_(2.5)
    return net.eval()
