"""trident-export: checkpoints of trained runs -> a Hugging Face directory that transformers reads
with the same logits (and tokenizer), safetensors with the tie handled, ONNX that onnxruntime runs
with the same logits; bad input in one line, exit 2, nothing written (issue #24)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model

import trident
from trident.convert import read_pretrained
from trident.export import main
from trident.runs.pipeline import train

from .conftest import SMALL, compose_config
from .convert_helpers import assert_state_equal

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

QUIET = ["logger=none", "test=false", "trainer.max_steps=2", "trainer.max_epochs=1"]
TEXT = [o for o in SMALL if not o.startswith("task.sampling")]
# name -> overrides of a two-step run whose architecture has a Hugging Face equivalent (or, rope, none).
RUNS = {
    "gpt2": [*SMALL, "pos_encoding=learned", "model.activation=gelu_tanh"],
    "bert": ["task=mlm", *TEXT, "pos_encoding=learned", "model.norm_first=false", "model.embedding_norm=true"],
    "vit": ["task=vit", "model=nano", "data.patch_size=7", "data.batch_size=16", "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "print_config=false",
            "callbacks.progress_bar=null", "callbacks.model_summary=null"],
    "rope": [*SMALL],
}


class Runs(dict[str, Path]):
    """Run directories of RUNS, each trained the first time a test asks for it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, name: str) -> Path:
        out = self.factory.mktemp(name) / "run"
        train(compose_config([*RUNS[name], *QUIET], output_dir=out))
        self[name] = out
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


def exported(run: Path, fmt: str, out: Path) -> L.LightningModule:
    main([str(run), "--format", fmt, "--out", str(out)])
    return trident.load(run)


@pytest.mark.slow
def test_hf_export_of_each_task_loads_in_transformers_with_the_same_logits(runs: Runs, tmp_path: Path) -> None:
    for name, auto in (("gpt2", "AutoModelForCausalLM"), ("bert", "AutoModelForMaskedLM"),
                       ("vit", "AutoModelForImageClassification")):
        out = tmp_path / name
        task = exported(runs[name], "hf", out)
        model = getattr(transformers, auto).from_pretrained(out).eval()
        if name == "vit":
            inputs = torch.randn(3, 1, 28, 28)
        else:
            inputs = torch.randint(0, task.hparams.vocab_size, (3, 16))
            tokenizer = transformers.AutoTokenizer.from_pretrained(out)
            text = "First Citizen: speak, speak."
            assert tokenizer(text)["input_ids"] == task.tokenizer.encode(text).ids
        with torch.no_grad():
            torch.testing.assert_close(model(inputs).logits, task.net(inputs), atol=1e-5, rtol=1e-5)
        assert_state_equal(read_pretrained(out).state_dict, task.net)


def test_safetensors_export_stores_the_tie_once_and_rebuilds_the_model(runs: Runs, tmp_path: Path) -> None:
    task = exported(runs["gpt2"], "safetensors", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["task"] == "lm"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as file:
        names = set(file.keys())
    assert len({"embed.weight", "head.weight"} & names) == 1  # tied: one tensor on disk
    rebuilt = type(task)(**config["hyper_parameters"]).eval()
    load_model(rebuilt.net, str(tmp_path / "out" / "model.safetensors"))
    assert rebuilt.net.head.weight is rebuilt.net.embed.weight
    ids = torch.randint(0, task.hparams.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.net(ids), task.net(ids), atol=0, rtol=0)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", "vit"])
def test_onnx_export_runs_in_onnxruntime_with_the_same_logits(runs: Runs, tmp_path: Path, name: str) -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    task = exported(runs[name], "onnx", tmp_path / "out")
    session = onnxruntime.InferenceSession(str(tmp_path / "out" / "model.onnx"))
    # Another batch size and length than the export traced with: both are dynamic.
    inputs = torch.randn(3, 1, 28, 28) if name == "vit" else torch.randint(0, task.hparams.vocab_size, (3, 13))
    (logits,) = session.run(None, {session.get_inputs()[0].name: inputs.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), task.net(inputs), atol=1e-4, rtol=1e-4)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_bad_exports_are_one_line_and_write_nothing(runs: Runs, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert "--format='gguf' is not supported: choose one of hf, safetensors, onnx" in refused(
        [str(runs["gpt2"]), "--format", "gguf", "--out", str(out)], capsys)
    assert "not found" in refused([str(tmp_path / "missing.ckpt"), "--format", "hf", "--out", str(out)], capsys)
    err = refused([str(runs["rope"]), "--format", "hf", "--out", str(out)], capsys)
    assert "pos_encoding=rope has no GPT-2 (hf export) equivalent" in err
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory left behind
    out.mkdir()
    (out / "earlier.txt").write_text("keep me")
    assert "is not an empty directory" in refused([str(runs["gpt2"]), "--format", "hf", "--out", str(out)], capsys)
    assert [p.name for p in out.iterdir()] == ["earlier.txt"] and len(list(tmp_path.iterdir())) == 1
