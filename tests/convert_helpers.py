"""Building the trident model that a :class:`PretrainedWeights` describes, as a run would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trident.backbone import TransformerConfig
from trident.models import CausalLM, MaskedLM, generate
from trident.models.vit import VisionTransformer, vit_geometry
from trident.weights import PretrainedWeights, read_pretrained
from trident.weights.adapters.hf_export import to_transformers
from trident.weights.adapters.registry import adapter_for_network


def randomise(model: nn.Module, seed: int, std: float = 0.2) -> nn.Module:
    """Every parameter of ``model`` (weights, biases, norm gains, position tables, class token) drawn anew
    from a seeded normal distribution, far from its initial value: a bias or gain left at its default, a
    tensor in another's place or a transposed table then changes the logits. Returns ``model``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.parameters():  # a tied tensor is listed once
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
    return model


def drop_default_settings(directory: Path, config_class: Any) -> set[str]:
    """``config.json`` without the settings at ``config_class``'s default, as the Hub's older files are
    written (openai-community/gpt2 has no tie_word_embeddings): the reader's own defaults decide them.
    Returns the settings dropped."""
    path = directory / "config.json"
    defaults = config_class().to_dict()
    written = json.loads(path.read_text())
    kept = {key: value for key, value in written.items()
            if key == "model_type" or key not in defaults or defaults[key] != value}
    path.write_text(json.dumps(kept))
    return written.keys() - kept.keys()


def net_from(weights: PretrainedWeights, *, num_classes: int | None = None) -> nn.Module:
    """The trident ``net`` the weights fit (dropout off), loaded strictly, in eval mode."""
    options = dict(weights.model, pos_encoding=weights.pos_encoding, pos_encoding_options=weights.pos_encoding_options,
                   dropout=0.0)
    if weights.task == "vit":
        data = weights.data_options
        geometry = vit_geometry(data["image_size"], data["patch_size"], "cls", weights.model.get("distillation_token", False))
        cfg = TransformerConfig(**options, **geometry)
        classes = num_classes or weights.classes or 10
        net: nn.Module = VisionTransformer(cfg, patch_size=data["patch_size"], in_channels=data["in_channels"],
                                           num_classes=classes)
    else:
        cfg = TransformerConfig(**options, max_seq_len=weights.data_options["max_seq_len"])
        model_class = CausalLM if weights.task == "lm" else MaskedLM
        assert weights.vocab_size is not None
        net = model_class(cfg, weights.vocab_size, **weights.task_options)
    net.load_state_dict(weights.state_dict, strict=True)
    return net.eval()


def assert_state_equal(state: dict[str, Tensor], net: nn.Module) -> None:
    """``state`` holds exactly ``net``'s tensors, bit for bit."""
    own = net.state_dict()
    assert state.keys() == own.keys()
    for name, tensor in own.items():
        assert torch.equal(state[name], tensor), name


def assert_hf_round_trip(net: nn.Module, inputs: Tensor, directory: Path) -> PretrainedWeights:
    """trident -> transformers gives the same logits; saved and read back, the same tensors."""
    hf = to_transformers(net)
    with torch.no_grad():
        torch.testing.assert_close(hf(inputs).logits, net(inputs), atol=1e-5, rtol=1e-5)
    if isinstance(net, CausalLM | MaskedLM):  # a tied head stays tied: fine-tuning moves both as one tensor
        tied = net.head.weight is net.embed.weight
        assert (hf.get_output_embeddings().weight is hf.get_input_embeddings().weight) is tied
    hf.save_pretrained(directory)
    back = read_pretrained(directory)
    assert_state_equal(back.state_dict, net)
    cfg = net.encoder.cfg if isinstance(net, VisionTransformer) else net.cfg
    # RMSNorm has no bias: there model.bias only stands for the projection biases left null, which construction
    # resolves (cfg.qkv_bias...) and the Llama family states each, so the resolved values are compared, not it.
    shaping = [key for key in back.model if not (key == "bias" and cfg.norm == "rmsnorm") and key != "family"]
    assert {key: getattr(cfg, key) for key in shaping} == {key: back.model[key] for key in shaping}, \
        "the settings read back are the model's"
    # Read back, the stack is declared as the family the export wrote: the one it declared, else the one it matched.
    assert back.model["family"] == adapter_for_network(net).FAMILY == (cfg.family or back.model["family"])
    return back


def assert_padded_logits_match(net: nn.Module, reference: nn.Module, vocab: int) -> None:
    """``net``'s logits equal those of the transformers model ``reference`` (within 1e-5) on three texts of 17, 11 and
    5 tokens, right-padded (a causal model's real positions never see the padding), then left-padded as a batch of
    prompts is: the padding takes the first positions (transformers numbers positions 0..T-1 whatever the mask),
    and no real token may attend to it."""
    ids = torch.randint(2, vocab, (3, 17), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([17, 11, 5])
    mask = torch.arange(17)[None, :] < lengths[:, None]  # (3, 17) True at real tokens
    ids = ids.masked_fill(~mask, 0)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(net(ids)[mask], expected[mask], atol=1e-5, rtol=1e-5)
        left = torch.stack([row.roll(int(17 - n)) for row, n in zip(ids, lengths, strict=True)])  # (3, 17)
        left_mask = mask.flip(1)
        expected = reference(left, attention_mask=left_mask.long()).logits
        produced = net(left, key_padding_mask=~left_mask)
        torch.testing.assert_close(produced[left_mask], expected[left_mask], atol=1e-5, rtol=1e-5)


def assert_left_padded_generation_matches(net: CausalLM, reference: nn.Module, vocab: int, *, lengths: tuple[int, ...],
                                          new_tokens: int, as_alone: bool = True) -> None:
    """Greedy generation from a left-padded batch of prompts of ``lengths`` tokens: trident's tokens equal
    transformers' ``generate`` on the same batch and attention mask, and (``as_alone``) each row equals its prompt
    generated alone (trident), token for token."""
    generator = torch.Generator().manual_seed(5)
    longest = max(lengths)
    prompts = [torch.randint(2, vocab, (n,), generator=generator) for n in lengths]
    ids = torch.stack([torch.cat((torch.zeros(longest - len(p), dtype=torch.long), p)) for p in prompts])  # (B, T0)
    padding = torch.arange(longest)[None, :] < torch.tensor([longest - n for n in lengths])[:, None]  # (B, T0)
    expected = reference.generate(ids, attention_mask=(~padding).long(), max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)
    with torch.no_grad():
        produced = generate(net, ids, new_tokens, temperature=0.0, padding=padding)
        alone = [generate(net, p[None], new_tokens, temperature=0.0)[0, len(p):].tolist() for p in prompts]
    if as_alone:
        assert produced[:, longest:].tolist() == alone, "a row of the batch differs from its prompt generated alone"
    assert produced.tolist() == expected.tolist()
