"""Model families declared (issue 51, item 3): one conf/architecture/<family>.yaml per family, the stack records its
``model.family`` and the hf export writes the declared family instead of guessing it; per-layer overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import CONF_DIR, compose_config
from tests.convert_helpers import randomise
from trident.backbone import TransformerConfig
from trident.backbone.config import FAMILIES
from trident.errors import ConfigError
from trident.models import CausalLM
from trident.runs.pipeline import backbone_options
from trident.weights import read_pretrained
from trident.weights.adapters.registry import ADAPTERS

transformers = pytest.importorskip("transformers")
# Tiny models: intra-op threads cost more than they save on a shared CPU (the generation tests most).
pytestmark = pytest.mark.usefixtures("single_thread")

# family -> the task its network serves (the export's network kind).
TASKS = {"gpt2": "lm", "bert": "mlm", "vit": "vit", "llama": "lm", "mistral": "lm", "qwen2": "lm", "qwen3": "lm",
         "gemma2": "lm", "gemma3": "lm", "clip": "clip", "albert": "mlm", "roberta": "mlm",
         "electra": "mlm", "bart": "translation", "t5": "translation",
         "mt5": "translation"}


def rope_lm(**settings: object) -> CausalLM:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 48, "dropout": 0.0, "activation": "swiglu",
               "norm": "rmsnorm", "bias": False, "pos_encoding": "rope", "max_seq_len": 32}
    return randomise(CausalLM(TransformerConfig(**(options | settings)), 40, tie_embeddings=False), seed=0).eval()  # type: ignore[return-value]


def test_every_family_has_one_adapter_and_one_architecture_file_that_declares_it(tmp_path: Path) -> None:
    assert sorted(adapter.FAMILY for adapter in ADAPTERS) == sorted(FAMILIES)
    for family in FAMILIES:
        declared = OmegaConf.load(CONF_DIR / "architecture" / f"{family}.yaml")
        assert declared.model.family == family
        cfg = compose_config([f"architecture={family}", f"task={TASKS[family]}", "model=nano"], output_dir=tmp_path)
        assert TransformerConfig(**backbone_options(cfg)).family == family


def test_the_export_writes_the_declared_family_not_the_one_the_settings_suggest(tmp_path: Path) -> None:
    """A Llama block without a window reads as Llama to a guess; declared Mistral, it is written and read as Mistral."""
    from trident.weights.adapters.hf_export import to_transformers

    assert type(to_transformers(rope_lm())).__name__ == "LlamaForCausalLM"  # undeclared: the settings choose
    net = rope_lm(family="mistral")
    hf = to_transformers(net)
    assert type(hf).__name__ == "MistralForCausalLM"
    hf.save_pretrained(tmp_path)
    back = read_pretrained(tmp_path)
    assert (back.format, back.model["family"]) == ("hf-mistral", "mistral")
    with pytest.raises(ConfigError, match=r"^model.qk_norm=True has no Llama \(hf export\) equivalent"):
        to_transformers(rope_lm(qk_norm=True, family="llama"))  # a guess would have written a Qwen3


def test_a_family_of_another_network_or_an_unknown_one_is_one_line() -> None:
    from trident.weights.adapters.hf_export import to_transformers

    with pytest.raises(ConfigError, match=r"^model.family=bert is a MaskedLM \(BertForMaskedLM\), not a CausalLM"):
        to_transformers(rope_lm(family="bert"))
    with pytest.raises(ConfigError, match=r"^model.family='lama' is not supported \(did you mean llama\?\)"):
        rope_lm(family="lama")


def test_per_layer_overrides_fail_loudly_on_an_unknown_key_or_a_wrong_length() -> None:
    with pytest.raises(ConfigError, match=r"^model.layers\[1\].attention_windw is not a per-layer setting \(did "
                                          r"you mean attention_window\?\): a layer takes attention_window, rope, "):
        rope_lm(layers=[None, {"attention_windw": 4}])
    with pytest.raises(ConfigError, match=r"^model.layers must be a list of one entry per layer \(2, model.n_layers\)"):
        rope_lm(layers=[{"attention_window": 4}])
    with pytest.raises(ConfigError, match=r"^model.layers\[0\] sets rope or pos_encoding_options, which only a rope"):
        rope_lm(layers=[{"rope": False}, None], pos_encoding="learned")
    with pytest.raises(ConfigError, match=r"^model.layers\[0\].attention_window=64 is larger than the context"):
        rope_lm(layers=[{"attention_window": 64}, None])


def test_layers_that_restate_the_stack_change_nothing_and_an_override_changes_only_its_layer() -> None:
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(0))
    plain = rope_lm()
    state = plain.state_dict()
    same = rope_lm(layers=[None, {"attention_window": None, "rope": True, "pos_encoding_options": {}}])
    assert same.state_dict().keys() == state.keys()
    same.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(same(ids), plain(ids), atol=0, rtol=0)
        for layers in ([None, {"attention_window": 4}], [None, {"rope": False}], [None, {"pos_encoding_options": {"base": 50.0}}]):
            other = rope_lm(layers=layers)
            other.load_state_dict(state)
            assert not torch.allclose(other(ids), plain(ids)), layers


@pytest.mark.parametrize("layers", [[{"attention_window": 4}, None, {"attention_window": 6}],
                                    [{"pos_encoding_options": {"base": 100.0}, "attention_window": 5}, {"rope": False}, None]])
def test_per_layer_windows_and_ropes_decode_through_the_cache_as_a_full_pass_does(layers: list[object]) -> None:
    """Each layer's cache keeps its own window (rolling past it), each layer rotates with its own rope: 24 tokens decoded
    one by one give the logits of one pass over them."""
    net = rope_lm(n_layers=3, layers=layers)
    ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    cache = net.new_cache(24)
    with torch.no_grad():
        full = net(ids)
        stepped = torch.cat([net(ids[:, i : i + 1], cache=cache) for i in range(24)], dim=1)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)
    assert net.context_length == 32, "global layers keep the whole context"


@pytest.mark.parametrize(("family", "overrides"), [
    ("gemma2", ["model.layers=[{attention_window: 8},null]"]),
    ("gemma3", ["model.layers=[{attention_window: 8, pos_encoding_options: {base: 10000.0}},null]",
                "pos_encoding.options.base=1000000.0"]),
    ("qwen2", ["model.layers=[null,{attention_window: 8}]"]),
])
def test_an_architecture_composed_on_the_command_line_is_written_and_read_back_as_its_family(
        tmp_path: Path, family: str, overrides: list[str]) -> None:
    """architecture=<family> over model=nano, per-layer settings on the command line: the hf export's writer
    (trident-export --format hf) writes the declared family, which reads back with the same layers and logits."""
    from trident.runs.pipeline import check_config
    from trident.weights.adapters.hf_export import write_hf

    cfg = compose_config([f"architecture={family}", "model=nano", *overrides], output_dir=tmp_path / "run")
    backbone = check_config(cfg)
    assert backbone.family == family
    net = CausalLM(backbone, 40, tie_embeddings=cfg.task.tie_embeddings, scale_embeddings=cfg.task.scale_embeddings).eval()
    randomise(net, seed=3)
    write_hf(net, None, None, tmp_path / "hf")
    back = read_pretrained(tmp_path / "hf")
    assert (back.format, back.model["family"], back.model["layers"]) == (f"hf-{family}", family, backbone.layers)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, net(ids), atol=1e-5, rtol=1e-5)


def test_the_kv_cache_bytes_per_position_count_each_layer_as_it_stores() -> None:
    """A sliding layer's cache holds its window, a global one the prompt: per position, each layer still keeps its
    keys and values of 4 heads of 8 in fp32 (the lm test's kv_cache_bytes_per_token)."""
    from trident.models.sampling import kv_cache_bytes_per_token

    net = rope_lm(layers=[{"attention_window": 4}, None])
    assert kv_cache_bytes_per_token(net, torch.randint(0, 40, (1, 10))) == 2 * 2 * 4 * 8 * 4


def test_a_geglu_block_counts_its_gate_in_the_flops_as_swiglu_does() -> None:
    """Gemma's GeGLU has SwiGLU's three matrices (gate, up, down): the FLOP count of budget=equal_compute and MFU."""
    from trident.training.flops import block_matmul_params

    net = rope_lm(activation="geglu_tanh")
    assert block_matmul_params(net.cfg) == sum(p.numel() for name, p in net.decoder.blocks[0].named_parameters()
                                               if p.dim() == 2)


def test_an_unknown_per_layer_key_on_the_command_line_is_one_line(tmp_path: Path) -> None:
    from trident.runs.pipeline import check_config

    cfg = compose_config(["model=nano", "architecture=gemma2", "model.layers=[{window: 8},null]"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^model.layers\[0\].window is not a per-layer setting: a layer takes "
                                          r"attention_window, rope, pos_encoding_options \(docs/architecture.md\)$"):
        check_config(cfg)
