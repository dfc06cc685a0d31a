"""``init_from=``: a new run (step 0, fresh optimizer) on new data from the weights and tokenizer of a
short pre-training run; the loaded / new / dropped table; the copy in the run; bad input in one line;
resume that is not resume refused; ``data.tokenizer=<file>``."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image

import trident
from trident.errors import ConfigError, DataError, TridentError
from trident.runs.pipeline import configured_task_class, constructor_args, instantiate, train
from trident.tracking.wandb_files import wait_for_offline_runs
from trident.weights.init_from import read_init_source, settings_fixed_by, source_for_run

from .conftest import SMALL, compose_config
from .convert_helpers import randomise
from .entry_points import run_in_process

pytestmark = pytest.mark.usefixtures("single_thread")

PRETRAIN = ["logger=none", "test=false", "trainer.max_steps=3"]
# A fine-tuning run whose weights do not move (an update of 1e-30 is below float32 resolution):
# its validation loss is the loaded model's.
FROZEN = ["logger=none", "test=false", "trainer.max_steps=2", "optimizer.lr=1e-30", "scheduler=constant"]
SMALL_MLM = ["task=mlm", *(o for o in SMALL if not o.startswith("task.sampling"))]
VIT = ["task=vit", "model=nano", "data.batch_size=8", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
       "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "print_config=false",
       "callbacks.progress_bar=null", "callbacks.model_summary=null", "augment=none"]
POSITIONS = "encoder.pos_encoding.embedding.weight"
NEW_TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, and then it rests.\n" for i in range(400))


@pytest.fixture(scope="module")
def lm_source(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """A three-step LM pre-training run on Shakespeare (character tokenizer)."""
    out = tmp_path_factory.mktemp("lm_source") / "run"
    train(compose_config([*SMALL, *PRETRAIN], output_dir=out))
    return out


@pytest.fixture(scope="module")
def new_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "new.txt"
    path.write_text(NEW_TEXT)
    return path


def _history(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _first_val_batch(run_dir: Path) -> Any:
    """The first validation batch of a finished run, rebuilt from its saved config."""
    cfg = OmegaConf.load(run_dir / "config_resolved.yaml")
    datamodule = instantiate(constructor_args(cfg, "data"), _convert_="all")
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.val_dataloader()))


def _table(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "init" / "weights.csv").open() as file:
        return list(csv.DictReader(file))


def _nano_block_parameters(d: int = 64, ff: int = 256) -> int:
    """One pre-norm block of the nano model: qkv, out projection, two norms, two FFN layers (with biases)."""
    return (3 * d * d + 3 * d) + (d * d + d) + 2 * (2 * d) + (d * ff + ff) + (ff * d + d)


def test_lm_fine_tunes_on_a_new_corpus_from_step_0_with_the_loaded_model(lm_source: Path, new_corpus: Path,
                                                                          tmp_path: Path) -> None:
    run = tmp_path / "run"
    # No model= choice: the architecture (nano) comes from the source, not from train.yaml's default (tiny).
    overrides = [o for o in SMALL if o != "model=nano"]
    train(compose_config([*overrides, *FROZEN, f"init_from={lm_source}", "data=text_files", f"data.files=[{new_corpus}]"],
                         output_dir=run))
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2, "a new run counts its own steps from 0 (the source ran 3)"
    adam_steps = {int(s["step"]) for s in saved["optimizer_states"][0]["state"].values()}
    assert adam_steps == {2}, "a fresh optimizer: two updates, none inherited"
    config = OmegaConf.load(run / "config_resolved.yaml")
    assert (config.model.d_model, config.model.n_layers) == (64, 2)
    # The source's character tokenizer, not a BPE trained on the new corpus (data=text_files's default).
    source_vocab = json.loads((lm_source / "tokenizer.json").read_text())["model"]["vocab"]
    assert json.loads((run / "init" / "tokenizer.json").read_text())["model"]["vocab"] == source_vocab
    # The weights room writes the config once, before it is checked: the saved config names the tokenizer file the
    # source fixed (content-addressed under the data cache), never rewritten afterwards; the run keeps its own copy.
    fixed = settings_fixed_by(config, read_init_source(str(run / "init")), [])
    assert config.data.tokenizer == fixed["data.tokenizer"] != str(run / "init" / "tokenizer.json")
    assert json.loads(Path(config.data.tokenizer).read_text()) == json.loads((run / "init" / "tokenizer.json").read_text())

    # The first validation loss is the loaded model's on that batch, computed here by hand.
    source = trident.load(lm_source)
    inputs, targets = _first_val_batch(run)
    with torch.no_grad():
        expected = F.cross_entropy(source.net(inputs).flatten(0, 1), targets.flatten()).item()
        torch.manual_seed(0)
        random = trident.load(lm_source)
        for p in random.net.parameters():
            torch.nn.init.normal_(p, std=0.02)
        random_loss = F.cross_entropy(random.net(inputs).flatten(0, 1), targets.flatten()).item()
    first_val = next(r["val/loss"] for r in _history(run) if "val/loss" in r)
    assert first_val == pytest.approx(expected, rel=1e-5)
    assert abs(first_val - random_loss) > 100 * 1e-5 * first_val, "a random model's loss is told apart"

    rows = {(r["outcome"], r["group"]): r for r in _table(run)}
    assert {outcome for outcome, _ in rows} == {"loaded"}, "same architecture: nothing new, nothing dropped"
    blocks = rows[("loaded", "decoder.blocks")]
    assert (int(blocks["tensors"]), int(blocks["parameters"])) == (2 * 12, 2 * _nano_block_parameters())
    assert int(rows[("loaded", "embed")]["parameters"]) == len(source_vocab) * 64


def test_the_run_is_self_contained_when_the_source_moves(lm_source: Path, new_corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(lm_source, source)
    run = tmp_path / "run"
    train(compose_config([*SMALL, *FROZEN, f"init_from={source}", "data=text_files", f"data.files=[{new_corpus}]"],
                         output_dir=run))
    shutil.rmtree(source)
    Path(OmegaConf.load(run / "config_resolved.yaml").data.tokenizer).unlink()  # the data cache's copy, cleaned away
    # Resuming the run continues its own training from the copy (the source and its staged tokenizer are gone).
    train(compose_config([*SMALL, *FROZEN, f"init_from={source}", "data=text_files", f"data.files=[{new_corpus}]",
                          f"resume={run}", "trainer.max_steps=3"], output_dir=run))
    resumed = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 3
    assert {int(s["step"]) for s in resumed["optimizer_states"][0]["state"].values()} == {3}, "the optimizer continued"
    task = trident.load(run)
    assert task.tokenizer.get_vocab() == trident.load(lm_source).tokenizer.get_vocab()
    from trident.commands.evaluate import evaluate

    Path(OmegaConf.load(run / "config_resolved.yaml").data.tokenizer).unlink()  # eval.py stages it again too
    metrics = evaluate([f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.limit_test_batches=1"])
    assert np.isfinite(metrics["test/loss"])
    weights = torch.load(run / "init" / "weights.pt", map_location="cpu", weights_only=True)
    assert torch.equal(weights["embed.weight"], task.net.embed.weight), "unmoved: the run's weights are the copied source's"


def test_mlm_fine_tunes_from_an_mlm_run_with_its_tokenizer(new_corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    train(compose_config([*SMALL_MLM, *PRETRAIN], output_dir=source))
    run = tmp_path / "run"
    train(compose_config([*SMALL_MLM, *FROZEN, f"init_from={source}", "data=text_files", f"data.files=[{new_corpus}]"],
                         output_dir=run))
    before, after = trident.load(source), trident.load(run)
    assert after.tokenizer.get_vocab() == before.tokenizer.get_vocab(), "[MASK] and [PAD] keep their ids"
    assert after.mask_id == before.mask_id and after.num_regular_tokens == before.num_regular_tokens
    for name, tensor in before.net.state_dict().items():
        assert torch.equal(after.net.state_dict()[name], tensor), name
    assert {r["outcome"] for r in _table(run)} == {"loaded"}


def _image_folder(root: Path, classes: int, per_class: int, size: int = 28) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = (rng.random((size, size)) * 255 / (c + 1)).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(root / f"class{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def vit_source(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """Two steps of a ViT on MNIST (10 classes, 7x7 patches)."""
    out = tmp_path_factory.mktemp("vit_source") / "run"
    train(compose_config([*VIT, "data.patch_size=7", "logger=none", "test=false"], output_dir=out))
    return out


def _image_run(folder: Path) -> list[str]:
    return ["data=imagefolder", f"data.data_dir={folder}", "data.image_size=28", "data.in_channels=1", "data.mean=[0.5]",
            "data.std=[0.5]", "data.validation_size=6", "data.test_size=6"]


def test_vit_fine_tunes_on_three_classes_with_a_rebuilt_head(vit_source: Path, tmp_path: Path) -> None:
    folder = _image_folder(tmp_path / "images", classes=3, per_class=10)
    run = tmp_path / "run"
    # data.patch_size is imagefolder's 4 unless the source says 7: it does.
    train(compose_config([*VIT, *FROZEN, *_image_run(folder), f"init_from={vit_source}", "logger=wandb"], output_dir=run))
    source, tuned = trident.load(vit_source), trident.load(run)
    assert tuned.hparams.patch_size == 7 and tuned.hparams.num_classes == 3
    # data.mean / data.std set on the command line win over the source's statistics (MNIST's).
    assert (tuned.hparams.mean, tuned.hparams.std) == ([0.5], [0.5]) != (source.hparams.mean, source.hparams.std)
    for name, tensor in source.net.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(tuned.net.state_dict()[name], tensor), name
    assert tuned.net.head.weight.shape == (3, 64)
    rows = {(r["outcome"], r["group"]): r for r in _table(run)}
    assert rows[("new", "head")]["note"] == "rebuilt: 10 outputs there, 3 here"
    assert int(rows[("new", "head")]["parameters"]) == 3 * 64 + 3
    assert int(rows[("loaded", "encoder.blocks")]["parameters"]) == 2 * _nano_block_parameters()
    assert ("dropped", "head") not in rows
    wait_for_offline_runs(run)
    (table,) = run.rglob("media/table/init_from/weights_*.table.json")
    assert "rebuilt: 10 outputs there, 3 here" in table.read_text(), "the same table in W&B"
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2


def test_vit_from_a_trident_run_normalises_its_images_as_the_run_did(vit_source: Path, tmp_path: Path) -> None:
    """data=imagefolder's statistics (0.5) give way to the source run's: MNIST's mean and std, which its network
    was trained on."""
    folder = _image_folder(tmp_path / "images", classes=3, per_class=10)
    cfg = compose_config([*VIT, *FROZEN, "data=imagefolder", f"data.data_dir={folder}", "data.image_size=28",
                          "data.in_channels=1", f"init_from={vit_source}"], output_dir=tmp_path / "run")
    source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, False)
    assert (list(cfg.data.mean), list(cfg.data.std)) == ([0.1307], [0.3081])


def _timm_file(path: Path, width: int, heads: int) -> torch.nn.Module:
    """A timm ViT of 28x28 grey images in 7x7 patches, every parameter random, saved as a bare state dict
    (which records no head count)."""
    import timm
    from safetensors.torch import save_file

    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                                  embed_dim=width, depth=2, num_heads=heads, num_classes=3)
    randomise(reference, seed=5)
    save_file(reference.state_dict(), str(path))
    return reference.eval()


def test_model_n_heads_states_the_heads_of_a_timm_file(tmp_path: Path) -> None:
    reference = _timm_file(tmp_path / "vit.safetensors", width=96, heads=3)  # heads of 32: 64-wide ones do not fit
    run = tmp_path / "run"
    overrides = [o for o in VIT if o != "model=nano"]
    train(compose_config([*overrides, *FROZEN, *_image_run(_image_folder(tmp_path / "images", 3, 10)),
                          f"init_from={tmp_path / 'vit.safetensors'}", "model.n_heads=3"], output_dir=run))
    net = trident.load(run).net
    images = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(net(images), reference(images), atol=1e-5, rtol=1e-5)
    rows = {(r["outcome"], r["group"]): r for r in _table(run)}
    assert rows[("loaded", "encoder.blocks")]["note"] == "heads: 3 (as given; the file does not record them)"


@pytest.mark.parametrize("kind", ["timm", "hf", "run"])
def test_a_vit_fine_tunes_at_another_image_size_with_its_positions_resampled(kind: str, vit_source: Path,
                                                                              tmp_path: Path) -> None:
    from timm.layers import resample_abs_pos_embed

    source = {"timm": tmp_path / "vit.safetensors", "hf": tmp_path / "hf_vit", "run": vit_source}[kind]
    if kind == "timm":
        _timm_file(source, width=64, heads=1)
    elif kind == "hf":
        transformers = pytest.importorskip("transformers")
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                                        image_size=28, patch_size=7, num_channels=1, num_labels=3)
        randomise(transformers.ViTForImageClassification(config), seed=6).save_pretrained(source)
    run = tmp_path / "run"
    overrides = [o for o in VIT if o != "model=nano"]
    # 56x56 images in 7x7 patches: an 8x8 grid where the source has 4x4 (all three were trained at 28x28).
    train(compose_config([*overrides, *FROZEN, *_image_run(_image_folder(tmp_path / "images", 3, 10)), "data.image_size=56",
                          f"init_from={source}"], output_dir=run))
    rows = {(r["outcome"], r["group"]): r for r in _table(run)}
    assert rows[("loaded", "encoder.pos_encoding.embedding")]["note"] == "resampled 4x4 -> 8x8"
    table = torch.load(run / "init" / "weights.pt", map_location="cpu", weights_only=True)[POSITIONS]  # the source's (17, D)
    net = trident.load(run).net
    torch.testing.assert_close(net.state_dict()[POSITIONS], resample_abs_pos_embed(table[None], new_size=[8, 8])[0])
    if kind == "timm":  # timm itself at 56x56, loaded by its own pretrained loader (which resamples the same way)
        import timm

        assert rows[("loaded", "encoder.blocks")]["note"] == ("heads: 1 (assumed 64 channels each; set model.n_heads= if "
                                                              "the source differs)")

        timm_at_56 = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=56, patch_size=7, in_chans=1,
                                       embed_dim=64, depth=2, num_heads=1, num_classes=3,
                                       pretrained_cfg_overlay={"file": str(source), "num_classes": 3}).eval()
        images = torch.randn(2, 1, 56, 56, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(net(images), timm_at_56(images), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["missing", "not a model", "contradicting model", "contradicting group", "both tokenizers",
                                  "shapes", "with ckpt_path"])
def test_bad_init_from_is_one_line_and_writes_nothing(case: str, lm_source: Path, vit_source: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    overrides = {
        "missing": ([*SMALL, f"init_from={tmp_path / 'nope'}"], DataError, "not found"),
        "not a model": ([*SMALL, f"init_from={empty}"], DataError, "holds no model"),
        "contradicting model": ([*SMALL, f"init_from={lm_source}", "model.d_model=128"], ConfigError,
                                f"model.d_model=128 contradicts init_from={lm_source}, which has model.d_model=64"),
        "contradicting group": ([*SMALL, f"init_from={lm_source}", "pos_encoding=alibi"], ConfigError,
                                "pos_encoding=alibi contradicts"),
        "both tokenizers": ([*SMALL, f"init_from={lm_source}", f"data.tokenizer={lm_source / 'tokenizer.json'}"],
                            ConfigError, "both name a tokenizer"),
        "shapes": ([*VIT, *_image_run(_image_folder(tmp_path / "images", 2, 10)), "data.in_channels=3",
                    "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]", f"init_from={vit_source}"], ConfigError,
                   "does not fit this model: net.patch_embed.proj.weight is (64, 1, 7, 7) there, (64, 3, 7, 7) here"),
        "with ckpt_path": ([*SMALL, f"init_from={lm_source}", f"ckpt_path={lm_source / 'checkpoints' / 'last.ckpt'}"],
                           ConfigError, "drop one of them"),
    }
    arguments, error, message = overrides[case]
    run = tmp_path / "run"
    with pytest.raises(error) as caught:
        train(compose_config([*arguments, "logger=none"], output_dir=run))
    assert message.replace("net.", "") in str(caught.value) and "\n" not in str(caught.value)
    assert not (run / "config_resolved.yaml").exists() and not (run / "init").exists()


def test_a_vocabulary_that_does_not_fit_is_one_line(lm_source: Path, tmp_path: Path) -> None:
    # An LM's tokenizer lacks [MASK] and [PAD]: the masked LM's data adds two tokens, the embedding has none
    # (init_only=embeddings: a decoder's weights into an encoder are refused otherwise).
    with pytest.raises(ConfigError, match="has a vocabulary of .* tokens") as caught:
        train(compose_config([*SMALL_MLM, "logger=none", f"init_from={lm_source}", "init_only=embeddings"],
                             output_dir=tmp_path / "run"))
    assert "\n" not in str(caught.value)


def test_train_py_exits_2_on_a_missing_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_in_process("train.py", [f"init_from={tmp_path / 'nope'}", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"],
                            tmp_path, monkeypatch)
    assert result.returncode == 2
    assert result.last_line.startswith("error: init_from=") and "Traceback" not in result.stderr


def test_resume_on_other_data_is_refused_and_names_init_from(lm_source: Path, new_corpus: Path, tmp_path: Path) -> None:
    last = lm_source / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError) as caught:
        train(compose_config([*SMALL, "logger=none", "trainer.max_steps=5", f"ckpt_path={last}", "data=text_files",
                              f"data.files=[{new_corpus}]", "data.tokenizer=char"], output_dir=tmp_path / "run"))
    message = str(caught.value)
    assert f"init_from={last}" in message and "\n" not in message
    assert "another tokenizer" in message or "other data" in message


def test_resume_auto_finds_a_run_whose_source_fixed_its_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source has learned positions, the command line's default is rope: the run directory is
    named with the command line's run_name, the run's config with the source's; resume=auto finds it."""
    source = tmp_path / "source"
    train(compose_config([*SMALL, *PRETRAIN, "pos_encoding=learned"], output_dir=source))
    args = [*SMALL, "logger=none", "test=false", "trainer.max_steps=2", f"init_from={source}", "paths.output_root=outputs"]
    first = run_in_process("train.py", args, tmp_path, monkeypatch)
    assert first.returncode == 0, first.stderr
    runs = list((tmp_path / "outputs").glob("runs/*/*"))
    assert len(runs) == 1 and "-rope-" in runs[0].name
    assert "-learned-" in OmegaConf.load(runs[0] / "config_resolved.yaml").run_name
    again = run_in_process("train.py", [*args, "resume=auto"], tmp_path, monkeypatch)
    assert again.returncode == 0, again.stderr
    assert f"resume=auto: continuing outputs/runs/{runs[0].parent.name}/{runs[0].name}" in again.stdout
    assert list((tmp_path / "outputs").glob("runs/*/*")) == runs
    other = run_in_process("train.py", [*args, "seed=7", "trainer.max_steps=0", "resume=auto"], tmp_path, monkeypatch)
    assert "resume=auto: no run of lm-shakespeare-source-rope-seed7 under outputs/runs: starting a new run" in other.stdout


def test_data_tokenizer_takes_a_tokenizer_file(lm_source: Path, new_corpus: Path, tmp_path: Path) -> None:
    tokenizer = lm_source / "tokenizer.json"
    run = tmp_path / "run"
    train(compose_config([*SMALL, *PRETRAIN, "data=text_files", f"data.files=[{new_corpus}]", f"data.tokenizer={tokenizer}"],
                         output_dir=run))
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    task = trident.load(run)
    assert task.tokenizer.get_vocab() == vocab and task.hparams.vocab_size == len(vocab)
    # A directory holding tokenizer.json (Hugging Face's layout) works the same.
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(tokenizer, folder / "tokenizer.json")
    train(compose_config([*SMALL, *PRETRAIN, f"data.tokenizer={folder}"], output_dir=tmp_path / "run2"))
    assert trident.load(tmp_path / "run2").tokenizer.get_vocab() == vocab
    with pytest.raises(TridentError, match="is neither one of char, bpe nor a tokenizer.json") as caught:
        train(compose_config([*SMALL, f"data.tokenizer={tmp_path / 'nope.json'}"], output_dir=tmp_path / "run3"))
    assert "\n" not in str(caught.value) and not (tmp_path / "run3").exists()


def _fine_tune_from_hf(reference: torch.nn.Module, tokenizer: Any, hf_dir: Path, base: list[str], corpus: Path) -> Path:
    """Save a transformers model with its tokenizer.json, then fine-tune from it on ``corpus`` (weights unmoved)."""
    reference.save_pretrained(hf_dir)
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    run = hf_dir.parent / "run"
    overrides = [o for o in base if o != "model=nano"]  # the sizes come from config.json
    train(compose_config([*overrides, *FROZEN, f"init_from={hf_dir}", "data=text_files", f"data.files=[{corpus}]"],
                         output_dir=run))
    return run


def test_hf_gpt2_directory_fine_tunes_from_its_own_loss(new_corpus: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from trident.data.tokenization import train_tokenizer

    hf_dir = tmp_path / "gpt2"
    tokenizer = train_tokenizer("bpe", [NEW_TEXT], vocab_size=300)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=tokenizer.get_vocab_size())
    reference = transformers.GPT2LMHeadModel(config).eval()
    run = _fine_tune_from_hf(reference, tokenizer, hf_dir, SMALL, new_corpus)
    config_used = OmegaConf.load(run / "config_resolved.yaml")
    assert (config_used.model.d_model, config_used.pos_encoding.name, config_used.data.max_seq_len) == (32, "learned", 64)
    inputs, targets = _first_val_batch(run)
    with torch.no_grad():
        expected = F.cross_entropy(reference(inputs).logits.flatten(0, 1), targets.flatten()).item()
    first_val = next(r["val/loss"] for r in _history(run) if "val/loss" in r)
    assert first_val == pytest.approx(expected, rel=1e-5)
    assert json.loads((run / "init" / "source.json").read_text())["format"] == "hf-gpt2"


def test_hf_bert_directory_fine_tunes_a_masked_lm_from_its_own_loss(new_corpus: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf_dir = tmp_path / "bert"
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator([NEW_TEXT], trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    reference = transformers.BertForMaskedLM(config).eval()
    run = _fine_tune_from_hf(reference, tokenizer, hf_dir, SMALL_MLM, new_corpus)
    task = trident.load(run)
    assert task.tokenizer.get_vocab() == tokenizer.get_vocab(), "BERT's [MASK] and [PAD] are used, none added"
    batch = _first_val_batch(run)
    inputs, targets = task.mask(batch, "val", 0)  # the run's masks of its first validation batch
    select = targets != -100
    with torch.no_grad():
        expected = F.cross_entropy(reference(inputs).logits[select], targets[select]).item()
    first_val = next(r["val/loss"] for r in _history(run) if "val/loss" in r)
    assert first_val == pytest.approx(expected, rel=1e-5)


def test_a_trident_source_fixes_its_position_encodings_options(tmp_path: Path) -> None:
    """The options of the source's position encoding (rope's base, its scaling) are part of what it computes: a run
    from it takes them, and its copy in <run>/init keeps them."""
    from trident.weights.init_from import source_for_run

    source = tmp_path / "source"
    train(compose_config([*SMALL, *PRETRAIN, "pos_encoding=rope", "pos_encoding.options.base=500.0",
                          "pos_encoding.options.scaling={type:linear,factor:2}"], output_dir=source))
    cfg = compose_config([*SMALL, f"init_from={source}"], output_dir=tmp_path / "run")
    assert cfg.pos_encoding.options.base != 500.0  # the run's own default, before the source is asked
    weights = source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, False)
    assert weights is not None and (cfg.pos_encoding.name, cfg.pos_encoding.options.base) == ("rope", 500.0)
    assert cfg.pos_encoding.options.scaling == {"type": "linear", "factor": 2}
    assert read_init_source(str(source)).pos_encoding_options == {"base": 500.0, "scaling": {"type": "linear", "factor": 2}}


def test_an_attention_tensor_that_does_not_fit_names_the_attention_settings() -> None:
    """A source of other key/value heads (a Llama config.json read with other heads than its weights have) is named
    by the settings that shape attention, not by image sizes."""
    from trident.backbone import TransformerConfig
    from trident.models import CausalLM
    from trident.weights.transfer import transfer_weights

    shape = {"d_model": 16, "n_heads": 4, "n_layers": 1, "d_ff": 32, "pos_encoding": "rope", "max_seq_len": 8}
    source = CausalLM(TransformerConfig(**shape, n_kv_heads=2), 11).state_dict()
    with pytest.raises(ConfigError, match=r"self_attn.qkv_proj.weight is \(32, 16\) there, \(48, 16\) here; use a source "
                                          r"of the same architecture \(its heads, key/value heads and head size: "
                                          r"model.n_heads, model.n_kv_heads, model.head_dim\)$"):
        transfer_weights(CausalLM(TransformerConfig(**shape), 11), source, "llama")
