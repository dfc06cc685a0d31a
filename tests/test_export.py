"""trident-export: checkpoints of trained runs -> a Hugging Face directory that transformers reads
with the same logits (and tokenizer), safetensors with the tie handled, ONNX that onnxruntime runs
with the same logits; bad input in one line, exit 2, nothing written (issue #24)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_model

import trident
from trident.commands.export import main
from trident.data.tokenization import END_OF_TEXT, every_character
from trident.runs.pipeline import train
from trident.weights import read_pretrained

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
    "rope": [*SMALL],  # rope with LayerNorm and GELU: the Llama family's, which names what it lacks
    "llama": [*SMALL, "model.norm=rmsnorm", "model.activation=swiglu"],  # biases on: attention_bias and mlp_bias
    # A byte-level BPE of 300 tokens on the user's files: <|endoftext|> is its id 0, not GPT-2's 50256.
    "gpt2-bpe": [*SMALL, "pos_encoding=learned", "model.activation=gelu_tanh", "data=text_files",
                 "data.files=[{corpus}]", "data.tokenizer=bpe", "data.vocab_size=300"],
    # Classes named by their folders, in an order that is not the folders' creation order.
    "vit-folders": ["task=vit", "model=nano", "data=imagefolder", "data.data_dir={images}", "data.image_size=28",
                    "data.in_channels=1", "data.mean=[0.5]", "data.std=[0.5]", "data.patch_size=7",
                    "data.batch_size=8", "data.validation_size=3", "data.test_size=3", "trainer.limit_train_batches=2",
                    "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "print_config=false",
                    "callbacks.progress_bar=null", "callbacks.model_summary=null"],
}
# Networks built untrained (the export does not care) on a context of 16.
BACKBONE = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 16, "pos_encoding": "learned"}
OPTIMIZER = {"name": "adamw", "lr": 1.0e-3}
SCHEDULER = {"name": "constant"}
CORPUS = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, and then it rests.\n" for i in range(300))
FOLDERS = ("zebra", "ant", "moth")


class Runs(dict[str, Path]):
    """Run directories of RUNS, each trained the first time a test asks for it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, name: str) -> Path:
        inputs = self.factory.mktemp(f"{name}-inputs")
        (inputs / "corpus.txt").write_text(CORPUS)
        image_folder(inputs / "images", FOLDERS, per_class=8)
        out = self.factory.mktemp(name) / "run"
        overrides = [o.format(corpus=inputs / "corpus.txt", images=inputs / "images") for o in RUNS[name]]
        train(compose_config([*overrides, *QUIET], output_dir=out))
        self[name] = out
        return out


def image_folder(root: Path, classes: tuple[str, ...], per_class: int) -> None:
    rng = np.random.default_rng(0)
    for number, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = (rng.random((28, 28)) * 255 / (number + 1)).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(root / name / f"{i}.png")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


def exported(run: Path, fmt: str, out: Path) -> L.LightningModule:
    main([str(run), "--format", fmt, "--out", str(out)])
    return trident.load(run)


@pytest.mark.slow
def test_hf_export_of_each_task_loads_in_transformers_with_the_same_logits(runs: Runs, tmp_path: Path) -> None:
    for name, auto in (("gpt2", "AutoModelForCausalLM"), ("llama", "AutoModelForCausalLM"), ("bert", "AutoModelForMaskedLM"),
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
@pytest.mark.parametrize("name", ["rope"])  # every task's default network: tests/test_export_defaults.py
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
    assert "--format='tflite' is not supported: choose one of hf, gguf, safetensors, onnx, peft" in refused(
        [str(runs["gpt2"]), "--format", "tflite", "--out", str(out)], capsys)
    assert "not found" in refused([str(tmp_path / "missing.ckpt"), "--format", "hf", "--out", str(out)], capsys)
    err = refused([str(runs["rope"]), "--format", "hf", "--out", str(out)], capsys)
    assert "model.norm=layernorm has no Llama (hf export) equivalent: it uses RMSNorm" in err
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory left behind
    out.mkdir()
    (out / "earlier.txt").write_text("keep me")
    assert "is not an empty directory" in refused([str(runs["gpt2"]), "--format", "hf", "--out", str(out)], capsys)
    assert [p.name for p in out.iterdir()] == ["earlier.txt"] and len(list(tmp_path.iterdir())) == 1


def special_ids(directory: Path) -> dict[str, dict[str, int | None]]:
    """The bos / eos / pad ids of an hf export's config.json and generation_config.json."""
    return {name: {key: json.loads((directory / name).read_text()).get(key)
                   for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
            for name in ("config.json", "generation_config.json")}


def ends_every_text(directory: Path, token_id: int) -> None:
    """Rewrite an exported GPT-2 so that ``token_id`` is always its most likely next token: the final
    norm's gain 0 and bias along that token's (tied) embedding row, every other row small."""
    path = directory / "model.safetensors"
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    direction = torch.zeros(state["transformer.wte.weight"].shape[1])
    direction[0] = 1.0
    state["transformer.wte.weight"][token_id] = 10 * direction
    state["transformer.ln_f.weight"].zero_()
    state["transformer.ln_f.bias"].copy_(direction)
    save_file(state, str(path), metadata={"format": "pt"})


def test_hf_export_of_a_bpe_lm_names_its_own_end_of_text_and_generate_stops_there(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "out"
    task = exported(runs["gpt2-bpe"], "hf", out)
    vocab_size = task.hparams.vocab_size
    end = task.tokenizer.token_to_id(END_OF_TEXT)
    assert vocab_size == 300 and end is not None
    assert special_ids(out) == {name: {"bos_token_id": end, "eos_token_id": end, "pad_token_id": None}
                                for name in ("config.json", "generation_config.json")}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token_id) == (END_OF_TEXT, end, end)
    ends_every_text(out, end)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([tokenizer("the quick")["input_ids"]])
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated[0, prompt.shape[1]:].tolist() == [end], "generation stops at the first end of text"


def test_hf_export_of_a_vocabulary_without_end_of_text_writes_no_special_ids(runs: Runs, tmp_path: Path) -> None:
    task = exported(runs["gpt2"], "hf", tmp_path / "out")
    assert task.tokenizer.token_to_id(END_OF_TEXT) is None  # Shakespeare's characters, one text
    assert special_ids(tmp_path / "out") == {name: {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
                                             for name in ("config.json", "generation_config.json")}
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def gpt2_directory(directory: Path) -> None:
    """A Hugging Face GPT-2 directory whose tokenizer really has <|endoftext|> at 50256, as GPT-2's own:
    one token per character, unused tokens up to 50256, then <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models

    characters = sorted(set(CORPUS))
    vocab = {"<unk>": 0} | {c: i + 1 for i, c in enumerate(characters)}
    vocab |= {f"<unused{i}>": i for i in range(len(vocab), 50256)} | {END_OF_TEXT: 50256}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = every_character()
    tokenizer.decoder = decoders.Fuse()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=len(vocab))
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))


def test_hf_export_of_a_gpt2_fine_tune_keeps_gpt2s_own_end_of_text(tmp_path: Path) -> None:
    gpt2_directory(tmp_path / "gpt2")
    (tmp_path / "corpus.txt").write_text(CORPUS)
    run = tmp_path / "run"
    overrides = [o for o in SMALL if o != "model=nano"]
    train(compose_config([*overrides, *QUIET, f"init_from={tmp_path / 'gpt2'}", "data=text_files",
                          f"data.files=[{tmp_path / 'corpus.txt'}]"], output_dir=run))
    exported(run, "hf", tmp_path / "out")
    assert special_ids(tmp_path / "out") == {name: {"bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None}
                                             for name in ("config.json", "generation_config.json")}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 50257


def test_hf_export_of_a_bert_names_its_own_padding(runs: Runs, tmp_path: Path) -> None:
    task = exported(runs["bert"], "hf", tmp_path / "out")
    pad = task.tokenizer.token_to_id("[PAD]")
    assert pad == task.hparams.pad_id and pad != 0  # trident appends [PAD]: BERT's default 0 is a character here
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["pad_token_id"], config.get("bos_token_id"), config.get("eos_token_id")) == (pad, None, None)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").pad_token_id == pad


def test_hf_export_of_a_vit_names_its_classes(runs: Runs, tmp_path: Path) -> None:
    task = exported(runs["vit-folders"], "hf", tmp_path / "out")
    assert task.hparams.class_names == sorted(FOLDERS)
    model = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "out")
    assert model.config.id2label == dict(enumerate(sorted(FOLDERS)))
    assert model.config.label2id == {name: i for i, name in enumerate(sorted(FOLDERS))}


@contextmanager
def umask(mask: int) -> Iterator[None]:
    earlier = os.umask(mask)
    try:
        yield
    finally:
        os.umask(earlier)


@pytest.mark.parametrize("mask", [0o022, 0o077])
@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_exported_files_have_the_users_permissions(runs: Runs, tmp_path: Path, fmt: str, mask: int) -> None:
    """As any file the user writes (0644 / 0755 under umask 022), with the output still renamed into place."""
    run = runs["gpt2"]
    with umask(mask):
        main([str(run), "--format", fmt, "--out", str(tmp_path / "deep" / "out")])
    written = [tmp_path / "deep", tmp_path / "deep" / "out", *(tmp_path / "deep" / "out").iterdir()]
    assert len(written) > 3
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in written}
    assert modes == {path.name: oct((0o777 if path.is_dir() else 0o666) & ~mask) for path in written}
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["out"], "no temporary directory left beside it"
