"""A finetune=lora run out of trident (issue 41): ``--format hf`` merges its adapters (transformers gives
the run's logits), ``--format peft`` writes them for peft on the base's hf export (the same logits, merged
or not) for every family the hf export writes (Llama, GPT-2's fused c_attn, BERT, ViT), and ``init_from`` a
LoRA run takes the merged weights."""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import trident
from trident.backbone import is_lora_parameter, merge_lora
from trident.commands.export import FORMATS, main
from trident.errors import ConfigError
from trident.runs.pipeline import train
from trident.tasks.base import TridentTask
from trident.tasks.classify import SequenceClassificationTask
from trident.tasks.lm import LanguageModelTask
from trident.tasks.mlm import MaskedLanguageModelTask
from trident.tasks.vit import ImageClassificationTask
from trident.weights.adapters import llama_style
from trident.weights.adapters.peft_export import LAYOUTS, NO_LAYOUT, write_peft
from trident.weights.adapters.registry import ADAPTERS
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


def _adapted(model: Any) -> set[str]:
    """The modules of a PeftModel that carry a LoRA adapter."""
    from peft.tuners.lora import LoraLayer

    return {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def _stored(adapter: Path) -> set[str]:
    """The modules an exported adapter file holds LoRA weights for."""
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as file:
        names = file.keys()  # safe_open is not iterable
    return {key.removesuffix(".lora_A.weight") for key in names if key.endswith(".lora_A.weight")}


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
    assert {name.rsplit(".", 1)[-1] for name in _adapted(model)} == {"down_proj", "gate_proj", "k_proj", "o_proj",
                                                                      "q_proj", "up_proj", "v_proj"}
    assert _adapted(model) == _stored(tmp_path / "adapter")
    # A base trained by trident: its hf export, wherever written, is the base; the adapter names none.
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    tuned = trident.load(runs[1])
    ids = _ids(tuned.net.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tuned.net(ids), rtol=1e-5, atol=1e-5)


def test_the_peft_export_refuses_a_run_without_adapters_and_a_model_without_hf_export(tmp_path: Path) -> None:
    lora = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q"]}
    with pytest.raises(ConfigError, match="this run has none: export it with --format hf"):
        write_peft(LanguageModelTask(GPT2, 11, OPTIMIZER, SCHEDULER), tmp_path)
    classify = SequenceClassificationTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, class_names=["a", "b"],
                                          majority_accuracy={"validation": 0.5, "test": 0.5}, lora=lora)
    with pytest.raises(ConfigError, match="a SequenceClassifier has no Hugging Face equivalent"):
        write_peft(classify, tmp_path)


# trident's own GPT-2-style LM (fused c_attn, Conv1D), BERT (task=mlm) and ViT (task=vit), two blocks each.
GPT2 = {**BACKBONE, "n_layers": 2, "max_seq_len": 16, "activation": "gelu_tanh"}
BERT = {**BACKBONE, "n_layers": 2, "max_seq_len": 16, "norm_first": False, "embedding_norm": True}
IMAGES = {"num_classes": 3, "image_size": 8, "in_channels": 1, "patch_size": 4, "class_names": ["a", "b", "c"],
          "mean": [0.5], "std": [0.5]}
VIT = {**BACKBONE, "n_layers": 2, **ImageClassificationTask.backbone_geometry({"image_size": 8, "patch_size": 4}, {})}
FAMILIES: dict[str, tuple[Callable[..., TridentTask], Callable[[], torch.Tensor]]] = {
    "gpt2": (partial(LanguageModelTask, GPT2, 11, OPTIMIZER, SCHEDULER), lambda: _ids(11)),
    "bert": (partial(MaskedLanguageModelTask, BERT, 11, OPTIMIZER, SCHEDULER, mask_id=9, pad_id=10, num_regular_tokens=9),
             lambda: _ids(11)),
    "vit": (partial(ImageClassificationTask, VIT, OPTIMIZER, SCHEDULER, **IMAGES),
            lambda: torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))),
}
AUTO = {"gpt2": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM", "vit": "AutoModelForImageClassification"}


def _base_and_tuned(family: str, targets: list[str]) -> tuple[TridentTask, TridentTask]:
    """A base and a LoRA task on its weights whose adapters and head are random (B not zero: the adapters count)."""
    build = FAMILIES[family][0]
    torch.manual_seed(0)
    base, tuned = build().eval(), build(lora={"rank": 2, "alpha": 3.0, "dropout": 0.0, "targets": targets}).eval()
    missing, unexpected = tuned.net.load_state_dict(base.net.state_dict(), strict=False)
    assert not unexpected and all(is_lora_parameter(name) for name in missing)
    with torch.no_grad():
        for param in tuned.net.parameters():
            if param.requires_grad:
                param.copy_(torch.randn_like(param) / 2)
    return base, tuned


@pytest.mark.parametrize(("family", "targets"), [
    ("gpt2", ["q"]), ("gpt2", ["q", "v"]), ("gpt2", ["q", "k", "v", "o", "mlp"]), ("gpt2", ["k", "mlp"]),
    ("bert", ["q", "v"]), ("bert", ["q", "k", "v", "o", "mlp"]), ("bert", ["mlp"]),
    ("vit", ["q", "v"]), ("vit", ["q", "k", "v", "o", "mlp"]),
])
def test_peft_loads_each_familys_adapter_on_its_hf_base_with_the_same_logits_merged_or_not(
    family: str, targets: list[str], tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft")
    base, tuned = _base_and_tuned(family, targets)
    FORMATS["hf"](base, tmp_path / "base")
    (tmp_path / "adapter").mkdir()
    write_peft(tuned, tmp_path / "adapter")
    auto = getattr(transformers, AUTO[family])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(auto.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], "peft takes the config as written"
    assert _adapted(model) == _stored(tmp_path / "adapter"), "peft adapts the modules the file holds, no other"
    inputs = FAMILIES[family][1]()
    with torch.no_grad():
        expected = tuned.net(inputs)
        assert not torch.allclose(base.net(inputs), expected, atol=1e-3), "the adapters change the model"
        torch.testing.assert_close(model(inputs).logits, expected, rtol=1e-5, atol=1e-5)
        with model.disable_adapter():  # the adapter (the head included) is peft's, the base stays the base
            torch.testing.assert_close(model(inputs).logits, base.net(inputs), rtol=1e-5, atol=1e-5)
        FORMATS["hf"](tuned, tmp_path / "merged")  # the adapters folded into the weights
        merged = auto.from_pretrained(tmp_path / "merged").eval()
        unloaded = model.merge_and_unload()
        torch.testing.assert_close(unloaded(inputs).logits, merged(inputs).logits, rtol=1e-5, atol=1e-5)
    assert unloaded.state_dict().keys() == merged.state_dict().keys()
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(unloaded.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_init_from_a_lora_run_takes_its_merged_weights(runs: tuple[Path, Path]) -> None:
    source = read_init_source(str(runs[1]))
    assert not any(is_lora_parameter(name) for name in source.state_dict)
    tuned = trident.load(runs[1])
    merge_lora(tuned.net)
    merged = tuned.net.state_dict()
    assert source.state_dict.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(source.state_dict[name], tensor, rtol=0, atol=0, msg=name)


def test_every_family_the_hf_export_writes_has_a_peft_layout() -> None:
    families = [adapter for adapter in ADAPTERS if not isinstance(adapter, llama_style.Family)]
    assert sorted([*LAYOUTS, *NO_LAYOUT]) == sorted(adapter.FORMAT for adapter in families)


def test_a_vit_whose_module_names_no_layout_knows_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, tuned = _base_and_tuned("vit", ["q"])
    unknown = replace(LAYOUTS["hf-vit"][0], blocks="nowhere")
    monkeypatch.setitem(LAYOUTS, "hf-vit", (unknown, unknown))
    with pytest.raises(ConfigError, match="ViTForImageClassification's modules as no layout of trident's peft export"):
        write_peft(tuned, tmp_path)


@pytest.mark.slow
def test_the_peft_export_of_a_run_from_a_hugging_face_directory_names_it_as_its_base(tmp_path: Path) -> None:
    """peft writes the path of the base it loaded as base_model_name_or_path: the adapters of a LoRA run from a
    Hugging Face directory name that directory, and peft loads them on the model read from there with the run's
    logits (a run from a trident run names none: its base is that run's hf export, wherever it is written)."""
    peft = pytest.importorskip("peft")
    from tests.test_convert_llama_family import CORPUS, bpe_tokenizer, hf_model

    tokenizer = bpe_tokenizer()
    source, corpus, run = tmp_path / "llama", tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text(CORPUS)
    hf_model("llama", source, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(source / "tokenizer.json"))
    train(compose_config([*QUIET, "data.block_size=32", "data.batch_size=4", "finetune=lora", f"init_from={source}",
                          "finetune.targets=[q,v]", "finetune.rank=2", "optimizer.lr=0.01", "data=text_files",
                          f"data.files=[{corpus}]"], output_dir=run))
    main([str(run), "--format", "peft", "--out", str(tmp_path / "adapter")])
    named = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str(source.resolve())
    base = transformers.AutoModelForCausalLM.from_pretrained(named).eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert model.peft_config["default"].base_model_name_or_path == named
    tuned = trident.load(run)
    ids = _ids(tuned.net.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tuned.net(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["hf_albert", "hf_roberta", "hf_electra"])
def test_the_peft_export_of_a_family_without_a_layout_is_one_line_naming_the_hf_export(family: str) -> None:
    from trident.weights.adapters.peft_export import layout_for

    adapter = importlib.import_module(f"trident.weights.adapters.{family}").ADAPTER  # as registered
    with pytest.raises(ConfigError, match=r"^--format peft .*: export it with --format hf \(the adapters merged\)$"):
        layout_for(adapter, torch.nn.Linear(1, 1))
