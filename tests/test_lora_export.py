"""A finetune=lora run out of trident (issue 41): ``--format hf`` merges its adapters (transformers gives
the run's logits), ``--format peft`` writes them for peft on the base's hf export (the same logits), a
GPT-2-shaped run is refused by the peft export in one line, and ``init_from`` a LoRA run takes the
merged weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trident
from trident.backbone import is_lora_parameter, merge_lora
from trident.commands.export import main
from trident.errors import ConfigError
from trident.runs.pipeline import train
from trident.tasks.lm import LanguageModelTask
from trident.weights.adapters.peft_export import write_peft
from trident.weights.init_from import read_init_source

from .conftest import SMALL, compose_config
from .test_task_contract import BACKBONE, OPTIMIZER, SCHEDULER

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

QUIET = ["logger=none", "test=false", "trainer.max_steps=2"]
# The Llama family (rope, rmsnorm, swiglu, biases off) with grouped-query attention.
LLAMA = [*SMALL, *QUIET, "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false", "model.n_kv_heads=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Llama-family base run and a LoRA run on it with adapters on every part (lr high: the adapters move)."""
    base, tuned = tmp_path_factory.mktemp("base") / "run", tmp_path_factory.mktemp("lora") / "run"
    train(compose_config(LLAMA, output_dir=base))
    train(compose_config([*LLAMA, "finetune=lora", f"init_from={base}", "finetune.targets=[q,k,v,o,mlp]",
                          "finetune.rank=4", "optimizer.lr=0.01"], output_dir=tuned))
    return base, tuned


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def test_the_hf_export_of_a_lora_run_merges_its_adapters(runs: tuple[Path, Path], tmp_path: Path) -> None:
    tuned = trident.load(runs[1])
    main([str(runs[1]), "--format", "hf", "--out", str(tmp_path / "hf")])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = _ids(tuned.net.vocab_size)
    with torch.no_grad():
        expected = tuned.net(ids)
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(trident.load(runs[0]).net(ids), expected, atol=1e-4), "the adapters changed the model"


def test_peft_loads_the_exported_adapter_on_the_exported_base_with_the_same_logits(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft")
    main([str(runs[0]), "--format", "hf", "--out", str(tmp_path / "base")])
    main([str(runs[1]), "--format", "peft", "--out", str(tmp_path / "adapter")])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert sorted(model.peft_config["default"].target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                                   "q_proj", "up_proj", "v_proj"]
    tuned = trident.load(runs[1])
    ids = _ids(tuned.net.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tuned.net(ids), rtol=1e-5, atol=1e-5)


def test_the_peft_export_refuses_a_gpt2_and_a_run_without_adapters(tmp_path: Path) -> None:
    gpt2 = {**BACKBONE, "activation": "gelu_tanh"}
    lora = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q"]}
    with pytest.raises(ConfigError, match="exports as GPT2LMHeadModel, whose fused projections peft cannot adapt"):
        write_peft(LanguageModelTask(gpt2, 11, OPTIMIZER, SCHEDULER, lora=lora), tmp_path)
    with pytest.raises(ConfigError, match="this run has none: export it with --format hf"):
        write_peft(LanguageModelTask(gpt2, 11, OPTIMIZER, SCHEDULER), tmp_path)


def test_init_from_a_lora_run_takes_its_merged_weights(runs: tuple[Path, Path]) -> None:
    source = read_init_source(str(runs[1]))
    assert not any(is_lora_parameter(name) for name in source.state_dict)
    tuned = trident.load(runs[1])
    merge_lora(tuned.net)
    merged = tuned.net.state_dict()
    assert source.state_dict.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(source.state_dict[name], tensor, rtol=0, atol=0, msg=name)
