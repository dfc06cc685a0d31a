"""A Hugging Face source whose token table has more rows than its tokenizer has tokens (the hub's t5-small: 32128 rows,
32100 tokens; Qwen2: 151936 rows, 151665 tokens) is read by ``init_from`` (it was refused as "another vocabulary"):
the network keeps every row as the source has it (``task.embedding_rows``), so that the run's logits are those of
transformers over all rows, and the export writes them back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trident.errors import ConfigError

transformers = pytest.importorskip("transformers")

EXTRA = 6  # rows past the tokenizer's tokens


def _exported_logits_agree(run: Path, out: Path, tokens: int, translation: bool) -> None:
    """The run loads with ``tokens + EXTRA`` rows, its export states that vocab_size and transformers computes the
    run's logits from it."""
    import trident
    from trident.commands.export import export_hf

    task = trident.load(run)
    assert (task.net.vocab_size, task.tokenizer.get_vocab_size()) == (tokens + EXTRA, tokens)
    export_hf(task, out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == tokens + EXTRA
    ids = torch.randint(3, tokens, (2, 9), generator=torch.Generator().manual_seed(0))
    net = task.net.eval()
    with torch.no_grad():
        if translation:
            start = torch.zeros(2, 1, dtype=torch.long)
            theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()(input_ids=ids, decoder_input_ids=start)
            torch.testing.assert_close(theirs.logits, net(ids, start), atol=1e-5, rtol=1e-5)
        else:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids)
            torch.testing.assert_close(theirs.logits, net(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_init_from_a_qwen2_directory_padded_past_its_tokenizer_fine_tunes_resumes_and_exports_every_row(
        tmp_path: Path) -> None:
    from tests.conftest import compose_config
    from tests.test_convert_llama_family import CORPUS, bpe_tokenizer, hf_model
    from trident.runs.pipeline import train

    tokenizer = bpe_tokenizer()
    tokens, hf_dir, corpus, run = tokenizer.get_vocab_size(), tmp_path / "qwen2", tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text(CORPUS)
    hf_model("qwen2", hf_dir, vocab_size=tokens + EXTRA)
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    overrides = ["logger=none", "test=false", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                 "data.block_size=32", "data.batch_size=4", "print_config=false", f"init_from={hf_dir}",
                 "data=text_files", f"data.files=[{corpus}]"]
    train(compose_config([*overrides, "trainer.max_steps=2"], output_dir=run))
    train(compose_config([*overrides, "trainer.max_steps=3", f"resume={run}"], output_dir=run))  # extended after it ended
    _exported_logits_agree(run, tmp_path / "hf", tokens, translation=False)


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_init_from_a_hub_shaped_t5_directory_fine_tunes_and_exports_every_row(tmp_path: Path) -> None:
    """As google/t5-v1_1-small: spiece.model alone, a token table padded past the tokenizer transformers converts."""
    from tests.conftest import compose_config
    from tests.test_t5 import SENTENCES
    from tests.test_translation_init_from import write_tsv
    from tests.test_translation_train import SMALL_MT
    from trident.runs.pipeline import train

    _spiece_t5(tmp_path / "t5", EXTRA)
    held_out = [("the light was god", "das licht war gott")]
    splits = {name: write_tsv(tmp_path / f"{name}.tsv", SENTENCES * 8 if name == "train" else held_out)
              for name in ("train", "validation", "test")}
    files = ",".join(f"{name}:{path}" for name, path in splits.items())
    overrides = [o for o in SMALL_MT if o != "model=nano"]
    train(compose_config([*overrides, "data=parallel_files", f"data.files={{{files}}}", f"init_from={tmp_path / 't5'}",
                          "trainer.max_steps=1", "test=false", "logger=none"], output_dir=tmp_path / "run"))
    _exported_logits_agree(tmp_path / "run", tmp_path / "hf", 128, translation=True)
    import trident

    task = trident.load(tmp_path / "run").eval()
    src = torch.tensor([[5, 9, 7, 1]])
    first = task.decode_ids(src, beam_size=1)[0].tokens[0]
    with torch.no_grad():  # every extra row scores as twice the first token's: the argmax, were it not banned
        task.net.head.weight[128:] = 2 * task.net.head.weight[first]
    for beam_size in (1, 4):
        assert all(token < 128 for token in task.decode_ids(src, beam_size=beam_size)[0].tokens)


def test_embedding_rows_below_the_tokenizer_is_one_line() -> None:
    from trident.tasks.network_builders import table_rows

    assert (table_rows(10, None), table_rows(10, 16)) == (10, 16)
    with pytest.raises(ConfigError, match=r"task.embedding_rows=8 is below the tokenizer's 10 tokens"):
        table_rows(10, 8)


def _spiece_t5(directory: Path, extra: int) -> None:
    """A T5 directory shaped as the hub's google/t5-v1_1-*: ``spiece.model`` alone (no tokenizer.json), its token
    table ``extra`` rows past the tokenizer transformers converts it to (its pieces and 100 ``<extra_id_*>``)."""
    spm = pytest.importorskip("sentencepiece")
    from tests.test_t5 import SENTENCES

    directory.mkdir()
    (directory / "corpus.txt").write_text("\n".join(text for pair in SENTENCES * 20 for text in pair))
    spm.SentencePieceTrainer.train(input=str(directory / "corpus.txt"), model_prefix=str(directory / "spiece"),
                                   vocab_size=28, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   minloglevel=2)
    (directory / "corpus.txt").unlink()
    config = transformers.T5Config(vocab_size=28 + 100 + extra, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(directory)


def test_a_t5_directory_with_spiece_model_alone_reads_the_tokenizer_transformers_converts(tmp_path: Path) -> None:
    from trident.weights import read_pretrained

    _spiece_t5(tmp_path / "t5", EXTRA)
    read = read_pretrained(tmp_path / "t5")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "t5")
    assert read.tokenizer is not None and read.tokenizer.get_vocab_size() == len(theirs) == 128
    text = "god said let there be light <extra_id_0> das wort"
    assert read.tokenizer.encode(text).ids == theirs(text).input_ids
    assert read.vocab_size == 128 + EXTRA


def test_a_sentencepiece_model_without_its_converters_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from trident.weights.adapters.hf_files import read_tokenizer

    (tmp_path / "spiece.model").write_bytes(b"")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece" else found(name, *a))
    with pytest.raises(ConfigError, match=r"SentencePiece model alone.*\(sentencepiece not installed\): pip install "
                                          r"'trident\[sentencepiece\]'"):
        read_tokenizer(tmp_path)


def test_auto_scoring_follows_a_hugging_face_decoder_start_and_decoding_never_emits_padded_rows() -> None:
    """task.scoring=auto: GNMT for trident's own convention, transformers' for a T5 start (<pad> in place of <s>) or
    a BART start (before <s>); a table padded past the tokenizer (task.embedding_rows) never decodes its extra rows,
    even where they score highest."""
    from trident.tasks.translation import TranslationTask

    from .test_task_contract import BACKBONE, OPTIMIZER, SCHEDULER

    assert TranslationTask(BACKBONE, 11, OPTIMIZER, SCHEDULER).scoring == "gnmt"
    assert TranslationTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, decoder_start="<pad>").scoring == "transformers"
    assert TranslationTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, decoder_start_id=2).scoring == "transformers"
    torch.manual_seed(0)
    task = TranslationTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, embedding_rows=14, logits_bias=True).eval()
    assert task.net.vocab_size == 14 and task.padded_rows == (11, 12, 13)
    with torch.no_grad():
        task.net.logits_bias[11:] = 100.0  # the extra rows would win every step
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    for beam_size in (1, 3):
        tokens = [t for h in task.decode_ids(src, beam_size=beam_size) for t in h.tokens]
        assert tokens and max(tokens) < 11, (beam_size, tokens)
