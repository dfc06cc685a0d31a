"""``init_from=`` and ``data.tokenizer=<file>`` for task=translation: a new run (step 0, fresh optimizer)
on another parallel corpus from a short pre-training run's weights and tokenizer; a given tokenizer
used as it is; ``data.test_on_validation``; bad input in one line, nothing written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import trident
from trident.data.translation import TranslationDataModule
from trident.errors import ConfigError, DataError, run_with_clear_errors
from trident.runs.pipeline import build_data_and_task, check_config, train
from trident.tasks.translation import TranslationTask

from .conftest import SMALL, compose_config, one_step
from .test_init_from import FROZEN, _first_val_batch, _history, _nano_block_parameters, _table
from .test_translation_train import SMALL_MT

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = [("the", "die"), ("cat", "Katze"), ("dog", "Hund"), ("sees", "sieht"), ("eats", "isst"), ("a", "eine"),
         ("bird", "Vogel"), ("fish", "Fisch"), ("small", "kleine"), ("red", "rote"), ("house", "Haus"), ("runs", "rennt")]
NUMBERS = [("one", "eins"), ("two", "zwei"), ("three", "drei"), ("four", "vier"), ("five", "fünf"), ("six", "sechs")]


def sentences(words: list[tuple[str, str]], count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` distinct word-for-word sentence pairs of four to seven words."""
    generator = torch.Generator().manual_seed(seed)
    pairs: dict[str, str] = {}
    while len(pairs) < count:
        length = int(torch.randint(4, 8, (1,), generator=generator))
        chosen = [words[int(i)] for i in torch.randint(len(words), (length,), generator=generator)]
        pairs[" ".join(en for en, _ in chosen)] = " ".join(de for _, de in chosen)
    return list(pairs.items())


def write_tsv(path: Path, pairs: list[tuple[str, str]]) -> str:
    path.write_text("".join(f"{src}\t{tgt}\n" for src, tgt in pairs))
    return str(path)


def parallel_files(folder: Path, words: list[tuple[str, str]], seed: int, test: bool = True) -> list[str]:
    """``data=parallel_files`` on train / validation (/ test) TSV files written under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    pairs = sentences(words, 240, seed)
    splits = {"train": pairs[:200], "validation": pairs[200:220], **({"test": pairs[220:]} if test else {})}
    files = ",".join(f"{name}:{write_tsv(folder / f'{name}.tsv', rows)}" for name, rows in splits.items())
    return ["data=parallel_files", f"data.files={{{files}}}"]


@pytest.fixture(scope="module")
def mt_source(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """Three steps of the nano translation model on one small corpus (its own BPE)."""
    folder = tmp_path_factory.mktemp("mt_source")
    train(compose_config([*SMALL_MT, *parallel_files(folder / "corpus", WORDS, seed=0), "logger=none", "test=false",
                          "trainer.max_steps=3"], output_dir=folder / "run"))
    return folder / "run"


def test_translation_fine_tunes_on_another_corpus_from_step_0_with_the_loaded_model(mt_source: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # No model= choice: the architecture (nano) comes from the source, not from train.yaml's default (tiny).
    overrides = [o for o in SMALL_MT if o != "model=nano"]
    train(compose_config([*overrides, *FROZEN, *parallel_files(tmp_path / "corpus", WORDS[:6] + NUMBERS, seed=1),
                          f"init_from={mt_source}"], output_dir=run))
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2, "a new run counts its own steps from 0 (the source ran 3)"
    assert {int(s["step"]) for s in saved["optimizer_states"][0]["state"].values()} == {2}, "a fresh optimizer"
    config = OmegaConf.load(run / "config_resolved.yaml")
    assert (config.model.d_model, config.model.n_layers) == (64, 2)
    # The tokenizer file the source fixed (staged under the data cache), holding the run's copy of the source's.
    assert json.loads(Path(config.data.tokenizer).read_text()) == json.loads((run / "init" / "tokenizer.json").read_text())

    # The source's BPE, never one trained on the new corpus: the run's token ids are the source tokenizer's.
    source = trident.load(mt_source)
    assert trident.load(run).tokenizer.get_vocab() == source.tokenizer.get_vocab()
    batch = _first_val_batch(run)
    eos = source.tokenizer.token_to_id("</s>")
    for text, row in zip(batch["src_text"], batch["src"]):
        expected_ids = [*source.tokenizer.encode(text).ids, eos]
        assert row[: len(expected_ids)].tolist() == expected_ids, text

    # The first validation loss is the loaded model's on that batch, computed here by torch's label smoothing.
    def loss_of(net: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = net(batch["src"], batch["tgt_in"])  # (B, T, V)
            return F.cross_entropy(logits.flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=source.pad_id,
                                   label_smoothing=config.task.label_smoothing).item()

    expected = loss_of(source.net)
    # The run is self-contained: <run>/init holds the source's weights (and tokenizer, above) and says what they are.
    copied = torch.load(run / "init" / "weights.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(copied[name], tensor) for name, tensor in source.net.state_dict().items())
    assert json.loads((run / "init" / "source.json").read_text())["task"] == "translation"
    torch.manual_seed(0)
    for p in source.net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    first_val = next(r["val/loss"] for r in _history(run) if "val/loss" in r)
    assert first_val == pytest.approx(expected, rel=1e-5)
    assert abs(first_val - loss_of(source.net)) > 1e-3 * first_val, "a random model's loss is told apart"

    rows = {(r["outcome"], r["group"]): r for r in _table(run)}
    assert {outcome for outcome, _ in rows} == {"loaded"}, "same architecture: nothing new, nothing dropped"
    assert int(rows[("loaded", "encoder.blocks")]["parameters"]) == 2 * _nano_block_parameters()
    assert int(rows[("loaded", "src_embed")]["parameters"]) == source.tokenizer.get_vocab_size() * 64


def _odd_tokenizer(path: Path, words: list[tuple[str, str]]) -> dict[str, int]:
    """A word-level tokenizer.json whose special tokens are NOT ids 0, 1, 2, with a post-processor that
    would add <s> ... </s> if it were applied; returns its vocabulary."""
    vocab = {"<unk>": 0} | {w: i + 1 for i, w in enumerate(sorted({w for pair in words for w in pair}))}
    vocab |= {token: len(vocab) + i for i, token in enumerate(["</s>", "<s>", "<pad>"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
    tokenizer.save(str(path))
    return vocab


def test_resuming_on_another_parallel_corpus_is_refused_and_names_init_from(mt_source: Path, tmp_path: Path) -> None:
    """Resume is resume: another corpus (its own BPE) under the checkpoint's weights is one line naming init_from."""
    last = mt_source / "checkpoints" / "last.ckpt"
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as caught:
        train(compose_config([*SMALL_MT, *parallel_files(tmp_path / "numbers", NUMBERS, seed=1), "logger=none",
                              "trainer.max_steps=5", f"ckpt_path={last}"], output_dir=run))
    message = str(caught.value)
    assert f"init_from={last}" in message and "\n" not in message
    assert "another tokenizer" in message or "other data" in message


def test_data_tokenizer_file_is_used_as_it_is(tmp_path: Path) -> None:
    vocab = _odd_tokenizer(tmp_path / "tokenizer.json", WORDS)
    files = {name: str(tmp_path / "corpus" / f"{name}.tsv") for name in ("train", "validation", "test")}
    parallel_files(tmp_path / "corpus", WORDS, seed=0)
    module = TranslationDataModule(source="files", files=files, tokenizer=str(tmp_path / "tokenizer.json"), max_len=16,
                                   max_tokens=64, cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup("fit")
    assert module.tokenizer is not None and module.tokenizer.get_vocab() == vocab, "never retrained"
    inputs = module.task_inputs()
    assert (inputs["vocab_size"], inputs["pad_id"], inputs["bos_id"], inputs["eos_id"]) == (
        len(vocab), vocab["<pad>"], vocab["<s>"], vocab["</s>"])
    # Two pairs of different lengths, batched by the loader's own collate function: the shorter one is padded.
    train_pairs = module.datasets["train"]
    lengths = [len(src) for src, *_ in train_pairs]
    batch = module.train_dataloader().collate_fn([train_pairs[lengths.index(min(lengths))], train_pairs[lengths.index(max(lengths))]])
    for text, target, src, tgt_in in zip(batch["src_text"], batch["tgt_text"], batch["src"], batch["tgt_in"]):
        ids = [vocab[w] for w in text.split()] + [vocab["</s>"]]  # looked up by hand: no post-processor's <s>
        assert src.tolist() == ids + [vocab["<pad>"]] * (len(src) - len(ids)), "padded with the file's <pad>"
        assert tgt_in.tolist()[: len(target.split()) + 1] == [vocab["<s>"], *(vocab[w] for w in target.split())]


@pytest.mark.parametrize("source_bos", [True, False])
def test_data_source_bos_writes_sources_as_bart_s_tokenizer_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  source_bos: bool) -> None:
    """data.source_bos (a BART source sets it): every source the data module writes, and every free text the task
    translates, is `<s> tokens </s>` as a tokenizer whose post-processor follows BART's convention encodes it; without
    it `tokens </s>`. A fast check of what only the slow tests/test_bart_run.py covered (a bug dropping the <s> had
    slipped the fast tests)."""
    vocab = _odd_tokenizer(tmp_path / "tokenizer.json", WORDS)  # its post-processor: <s> $A </s>
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    parallel_files(tmp_path / "corpus", WORDS, seed=0)
    files = {name: str(tmp_path / "corpus" / f"{name}.tsv") for name in ("train", "validation", "test")}
    module = TranslationDataModule(source="files", files=files, tokenizer=str(tmp_path / "tokenizer.json"), max_len=16,
                                   max_tokens=64, cache_dir=str(tmp_path / "cache"), source_bos=source_bos)
    module.prepare_data()
    module.setup("fit")

    def expected(text: str) -> list[int]:
        ids = reference.encode(text).ids  # [<s>, tokens, </s>]
        return ids if source_bos else ids[1:]

    for split in ("train", "validation"):
        batch = next(iter(module.split_loader(split, train=split == "train")))
        for text, row in zip(batch["src_text"], batch["src"].tolist(), strict=True):
            assert row[: row.index(vocab["</s>"]) + 1] == expected(text), (split, text)
    inputs = module.task_inputs()
    assert inputs["source_bos"] is source_bos
    backbone = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 16, "pos_encoding": "learned"}
    task = TranslationTask(backbone, optimizer={}, scheduler={}, **inputs)
    seen: list[list[int]] = []
    monkeypatch.setattr(task, "decode_ids", lambda src, **_: seen.extend(src.tolist()) or [])
    task.translate(["the cat sees a dog"])
    assert seen == [expected("the cat sees a dog")]


def test_a_run_with_a_tokenizer_directory_trains_on_its_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    vocab = _odd_tokenizer(tmp_path / "hf" / "tokenizer.json", WORDS)
    cfg = compose_config([*SMALL_MT, *parallel_files(tmp_path / "corpus", WORDS, seed=0), f"data.tokenizer={tmp_path / 'hf'}"],
                         output_dir=tmp_path / "run")
    metrics = one_step(cfg)
    assert torch.isfinite(torch.tensor([metrics["train/loss"], metrics["val/loss"]])).all()
    _, task = build_data_and_task(cfg, check_config(cfg), "fit")
    assert task.tokenizer.get_vocab() == vocab and task.hparams.vocab_size == len(vocab)
    assert (task.pad_id, task.bos_id, task.eos_id) == (vocab["<pad>"], vocab["<s>"], vocab["</s>"])
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["model"]["vocab"] == vocab, "the file is untouched"


def test_test_on_validation_is_asked_for_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    parallel_files(tmp_path / "corpus", WORDS, seed=0, test=False)
    files = {name: str(tmp_path / "corpus" / f"{name}.tsv") for name in ("train", "validation")}
    validation = [line.split("\t")[0] for line in Path(files["validation"]).read_text().splitlines()]

    def prepared(**options: object) -> TranslationDataModule:
        module = TranslationDataModule(source="files", files=files, max_len=16, max_tokens=64, vocab_size=300,
                                       split=(0.8, 0.1, 0.1), cache_dir=str(tmp_path / "cache"), **options)  # type: ignore[arg-type]
        module.prepare_data()
        with caplog.at_level(logging.INFO, logger="trident.data.translation"):
            module.setup("fit")
        return module

    cut = prepared()
    assert "test cut from train by a hash of the source sentence" in caplog.text
    assert 0 < len(cut.datasets["test"]) < 60 and set(cut.datasets["test"].src_text).isdisjoint(validation)
    caplog.clear()
    asked = prepared(test_on_validation=True)
    assert "test the validation split (data.test_on_validation=true)" in caplog.text
    assert asked.datasets["test"].src_text == asked.datasets["validation"].src_text == validation
    assert len(asked.datasets["train"]) > len(cut.datasets["train"]), "nothing cut from train"


def _saved_transformers_model(folder: Path, kind: str) -> Path:
    """A tiny random Marian, or a T5 of more decoder than encoder layers, saved with save_pretrained (offline)."""
    transformers = pytest.importorskip("transformers")
    if kind == "marian":
        config = transformers.MarianConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                           decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0, eos_token_id=2,
                                           decoder_start_token_id=0)
        model = transformers.MarianMTModel(config)
    else:
        config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=2,
                                       num_heads=2)
        model = transformers.T5ForConditionalGeneration(config)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["lm run", "into lm", "marian", "t5", "tokenizer without <s>", "char tokenizer",
                                  "both tokenizers", "contradicting model", "vocabulary", "test_on_validation with a test split",
                                  "test_on_validation on the Bible"])
def test_bad_translation_input_is_one_line_and_writes_nothing(case: str, mt_source: Path, lm_reference_run: tuple[Path, dict],
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = parallel_files(tmp_path / "corpus", WORDS, seed=0)
    (tmp_path / "plain.json").write_text(Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>")).to_str())
    checkpoint = mt_source / "checkpoints" / "last.ckpt"
    if case == "vocabulary":  # a source whose tokenizer has more tokens than its embedding has rows
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
        bigger = Tokenizer.from_str(saved["tokenizer_json"])
        bigger.add_tokens([f"extra{i}" for i in range(5)])
        saved["tokenizer_json"] = bigger.to_str()
        checkpoint = tmp_path / "bigger.ckpt"
        torch.save(saved, checkpoint)
    mt = [*SMALL_MT, *corpus]
    hf_dir = _saved_transformers_model(tmp_path / case, case) if case in ("marian", "t5") else None
    loaded = [o for o in mt if o != "model=nano"]  # init_from: the sizes come from the source
    cases = {
        "lm run": ([*loaded, f"init_from={lm_reference_run[0]}"], ConfigError,
                   "holds a task=lm model; task=translation starts only from a trident translation checkpoint"),
        "into lm": ([*(o for o in SMALL if o != "model=nano"), f"init_from={mt_source}"], ConfigError,
                    "holds a task=translation model, which task=lm cannot"),
        "marian": ([*loaded, f"init_from={hf_dir}"], DataError,
                   "holds a marian (MarianMTModel), which the backbone cannot express exactly (it lacks Marian's sinusoidal"),
        "t5": ([*loaded, f"init_from={hf_dir}"], DataError,
               "num_decoder_layers=2 beside num_layers=1 (trident's encoder and decoder have one model.n_layers)"),
        "tokenizer without <s>": ([*mt, f"data.tokenizer={tmp_path / 'plain.json'}"], DataError,
                                  "plain.json has no <s> token, which translation needs (<pad>, <s>, </s>)"),
        "char tokenizer": ([*mt, "data.tokenizer=char"], ConfigError,
                           "data.tokenizer=char is not a translation tokenizer: choose bpe"),
        "both tokenizers": ([*loaded, f"init_from={mt_source}", f"data.tokenizer={mt_source / 'tokenizer.json'}"],
                            ConfigError, "both name a tokenizer"),
        "contradicting model": ([*loaded, f"init_from={mt_source}", "model.d_model=128"], ConfigError,
                                f"model.d_model=128 contradicts init_from={mt_source}, which has model.d_model=64"),
        "vocabulary": ([*loaded, f"init_from={checkpoint}"], ConfigError, "has a vocabulary of"),
        "test_on_validation with a test split": ([*mt, "data.test_on_validation=true"], ConfigError,
                                                 "data.test_on_validation=true needs a given validation split and no test split"),
        "test_on_validation on the Bible": ([*SMALL_MT, "data.test_on_validation=true"], ConfigError,
                                            "the Bible is cut into all three by chapter"),
    }
    arguments, error, message = cases[case]
    run = tmp_path / "run"
    with pytest.raises(error) as caught:
        train(compose_config([*arguments, "logger=none"], output_dir=run))
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert not (run / "config_resolved.yaml").exists() and not (run / "init").exists()
    if case == "marian":  # as train.py ends: exit status 2, one line, no traceback
        with pytest.raises(SystemExit) as exit_info:
            run_with_clear_errors(lambda: train(compose_config([*arguments, "logger=none"], output_dir=run)))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ") and message in err
        assert not (run / "config_resolved.yaml").exists()
