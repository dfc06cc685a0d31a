"""A peft LoRA adapter directory as ``init_from`` (issue 50, also found): read onto the base its
``base_model_name_or_path`` names with the adapters merged in (peft's own logits, plain or rank-stabilised, with a
GPT-2's transposed Conv1D; the MLP, the embedding and the head, rank and alpha patterns, a tied base's head trained as
its own copy, the adapter of a trident export); what a merge cannot express, a base that is not local and the adapter given as
``finetune.adapter`` are one line naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.convert_helpers import net_from, randomise
from tests.test_convert_llama_family import VOCAB, hf_model
from trident.errors import DataError
from trident.weights.adapters.hf_export import write_hf
from trident.weights.init_from import read_init_source
from trident.weights.lora_adapter import load_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def peft_adapter(base: torch.nn.Module, base_dir: Path, directory: Path, **settings: object) -> torch.nn.Module:
    """``base`` with a peft LoRA of ``settings`` whose every adapter tensor is drawn anew (B too: peft starts it at
    zero), saved in ``directory`` naming ``base_dir`` as its base; returns the peft model (eval)."""
    model = peft.get_peft_model(base, peft.LoraConfig(**{"r": 2, "lora_alpha": 3} | settings))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "lora_" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    model.save_pretrained(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": str(base_dir)}))
    return model.eval()


@pytest.mark.parametrize("rslora", [False, True])
def test_init_from_a_peft_adapter_reads_its_base_with_the_adapter_merged(tmp_path: Path, rslora: bool) -> None:
    base = hf_model("llama", tmp_path / "base")
    tuned = peft_adapter(base, tmp_path / "base", tmp_path / "adapter", use_rslora=rslora,
                         target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    weights = read_init_source(str(tmp_path / "adapter"))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = tuned(input_ids=ids).logits
        torch.testing.assert_close(net_from(weights)(ids), expected, atol=1e-5, rtol=1e-5)
        tuned.base_model.disable_adapter_layers()  # the adapters change the logits: the test sees them
        assert not torch.allclose(tuned(input_ids=ids).logits, expected, atol=1e-3)


def test_a_gpt2_peft_adapter_merges_into_its_transposed_conv1d(tmp_path: Path) -> None:
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=32)
    base = randomise(transformers.GPT2LMHeadModel(config), seed=2).eval()
    base.save_pretrained(tmp_path / "base")
    tuned = peft_adapter(base, tmp_path / "base", tmp_path / "adapter", target_modules=["c_attn", "c_fc"],
                         fan_in_fan_out=True)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(net_from(read_init_source(str(tmp_path / "adapter")))(ids), tuned(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting", [{"lora_bias": True}, {"trainable_token_indices": [1, 2]}, {"layer_replication": [[0, 2], [1, 2]]}])
def test_a_peft_adapter_a_plain_merge_misreads_is_one_line(tmp_path: Path, setting: dict[str, object]) -> None:
    """lora_B's biases were dropped without a word (logits 0.2 away from peft's); the others named tensors the base lacks."""
    base = hf_model("llama", tmp_path / "base")
    peft_adapter(base, tmp_path / "base", tmp_path / "adapter", target_modules=["q_proj"], **setting)
    with pytest.raises(DataError, match=rf"^\S+ is a peft adapter with {next(iter(setting))}, which trident does not merge"):
        read_init_source(str(tmp_path / "adapter"))


def test_a_peft_adapter_trident_cannot_merge_or_place_is_one_line(tmp_path: Path) -> None:
    base = hf_model("llama", tmp_path / "base")
    peft_adapter(base, tmp_path / "base", tmp_path / "dora", use_dora=True, target_modules=["q_proj"])
    with pytest.raises(DataError, match=r"^\S+ is a peft adapter with use_dora, which trident does not merge: merge it "
                                        r"onto its base with peft \(PeftModel.from_pretrained"):
        read_init_source(str(tmp_path / "dora"))
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "org/llama"}))
    with pytest.raises(DataError, match=r"is a peft adapter whose base \(org/llama\) is not a local model directory: set "
                                        r"base_model_name_or_path in its adapter_config.json to the base's directory, or"):
        read_init_source(str(tmp_path / "dora"))
    with pytest.raises(DataError, match=r"^finetune.adapter=\S+ is a peft adapter: pass it as init_from=\S+ \(trident "
                                        r"merges it onto the base its adapter_config.json names\)"):
        load_adapter(torch.nn.Linear(1, 1), str(tmp_path / "dora"), {}, str(tmp_path / "base"))


# Adapters peft saves beyond q/v: the MLP, a LoRA on the embedding (lora_embedding_A/B, with the base_layer peft saves
# beside it) and on the head, per-module ranks and alphas, and a tied base whose head peft trains as its own copy.
ADAPTERS = {
    "mlp_embedding_and_head": ({}, {"target_modules": ["gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]}),
    "rank_and_alpha_patterns": ({}, {"target_modules": ["q_proj", "v_proj", "up_proj"], "rank_pattern": {"v_proj": 4},
                                     "alpha_pattern": {"layers.1.self_attn.v_proj": 7, "up_proj": 0.5}}),
    "tied_base_head_to_save": ({"tie_word_embeddings": True}, {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}),
}


@pytest.mark.parametrize("name", ADAPTERS)
def test_init_from_a_peft_adapter_equals_peft_on_every_kind_of_adapted_module(tmp_path: Path, name: str) -> None:
    base_settings, settings = ADAPTERS[name]
    base = hf_model("llama", tmp_path / "base", **base_settings)
    tuned = peft_adapter(base, tmp_path / "base", tmp_path / "adapter", **settings)
    with torch.no_grad():  # modules_to_save start as the base's copy: move them, so the test sees where they land
        for module, tensor in tuned.named_parameters():
            if "modules_to_save" in module:
                tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(6)) * 0.3)
    tuned.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": str(tmp_path / "base")}))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(net_from(read_init_source(str(tmp_path / "adapter")))(ids), tuned(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_a_peft_adapter_of_a_trident_export_reads_onto_it(tmp_path: Path) -> None:
    """The loop a user runs: trident-export --format hf, a LoRA trained with peft on the export, init_from=<adapter>."""
    source = hf_model("qwen3", tmp_path / "source")
    write_hf(net_from(read_init_source(str(tmp_path / "source"))), None, None, tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tuned = peft_adapter(exported, tmp_path / "export", tmp_path / "adapter", target_modules="all-linear")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.allclose(tuned(input_ids=ids).logits, source(input_ids=ids).logits, atol=1e-3)
        torch.testing.assert_close(net_from(read_init_source(str(tmp_path / "adapter")))(ids), tuned(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
