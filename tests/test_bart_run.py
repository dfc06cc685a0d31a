"""BART through the public entry points (issue 55, item 4): ``train.py task=translation init_from=<a BART directory with
its byte-level BPE>`` reads it (the architecture, BART's task settings and tokenizer fixed by the source), fine-tunes,
``trident-export --format hf`` writes a BartForConditionalGeneration that transformers loads with the run's logits and
generation settings, and ``trident-translate`` on the run prints what transformers' ``generate`` decodes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import ByteLevelBPETokenizer, processors

from trident.commands import export, translate
from trident.errors import ConfigError
from trident.runs.pipeline import build_data_and_task, check_config, configured_task_class, train
from trident.weights.init_from import source_for_run

from .conftest import compose_config
from .test_bart import BART, save_bart
from .test_init_from import FROZEN
from .test_translation_init_from import WORDS, parallel_files
from .test_translation_train import SMALL_MT

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # BART's ids 0..4


def save_bart_with_tokenizer(directory: Path) -> int:
    """A random BART and a byte-level BPE saved as BartTokenizerFast (BART's special tokens at its ids): its vocabulary
    size."""
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)  # BART's own default
    bpe.train_from_iterator([f"{en} {de}" for en, de in WORDS] * 4, vocab_size=300, special_tokens=SPECIALS,
                            show_progress=False)
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    named = dict(zip(("bos_token", "pad_token", "eos_token", "unk_token", "mask_token"), SPECIALS, strict=True))
    tokenizer = transformers.BartTokenizerFast(tokenizer_object=bpe._tokenizer, cls_token="<s>", sep_token="</s>", **named)
    tokenizer.save_pretrained(directory)
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIALS[:3]] == [0, 1, 2]
    save_bart(directory, seed=3, vocab_size=len(tokenizer), max_position_embeddings=64)
    return len(tokenizer)


def test_bart_fine_tunes_exports_and_translates_as_transformers_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_bart_with_tokenizer(tmp_path / "bart")
    run = tmp_path / "run"
    overrides = [o for o in SMALL_MT if o not in ("model=nano", "data.vocab_size=400")]
    train(compose_config([*overrides, *FROZEN[:-2], *parallel_files(tmp_path / "corpus", WORDS, seed=0),
                          f"init_from={tmp_path / 'bart'}", "data.max_len=32", "model.dropout=0.0", "task.max_len_a=0",
                          "task.max_len_b=7",
                          "task.length_penalty=1.0"], output_dir=run))
    config = OmegaConf.load(run / "config_resolved.yaml")
    assert (config.model.family, config.model.d_model, config.pos_encoding.name) == ("bart", BART["d_model"], "learned")
    assert (config.task.decoder_start_id, config.task.logits_bias, config.task.scoring) == (2, True, "auto")
    export.main([str(run), "--format", "hf", "--out", str(tmp_path / "export")])
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert {k: generation[k] for k in ("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")} == {
        "decoder_start_token_id": 2, "forced_bos_token_id": 0, "forced_eos_token_id": 2}
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    task = translate.load_translation_checkpoint(run)
    texts = ["the cat sees a dog", "a small red house runs"]
    # The export's tokenizer as transformers users call it: BART's `<s> tokens </s>`, the sources the run trained on.
    src = [tokenizer(t).input_ids for t in texts]
    assert src == [[0, *e.ids, 2] for e in task.tokenizer.encode_batch(texts, add_special_tokens=False)]
    ids = torch.tensor(src[:1])
    tgt = torch.tensor([[2, 0, 5, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, decoder_input_ids=tgt).logits, task.net(ids, tgt), atol=1e-5, rtol=1e-5)
    for beams in (1, 4):
        capsys.readouterr()
        translate.main([str(run), *texts, "--beam-size", str(beams)])
        printed = capsys.readouterr().out.splitlines()
        expected = []
        for row in src:
            with torch.no_grad():
                out = hf.generate(input_ids=torch.tensor([row]), num_beams=beams, max_length=8, min_length=0,
                                  bad_words_ids=[[1], [0]], early_stopping="never", no_repeat_ngram_size=0,
                                  length_penalty=1.0, do_sample=False)
            expected.append(tokenizer.decode(out[0], skip_special_tokens=True).strip())
        assert printed == expected


def test_a_bart_source_s_data_starts_each_source_with_bos_as_its_tokenizer_does(tmp_path: Path) -> None:
    """BART was pre-trained on `<s> tokens </s>` and its tokenizer encodes so: the run's sources are written so too."""
    save_bart_with_tokenizer(tmp_path / "bart")
    cfg = compose_config([*(o for o in SMALL_MT if o != "model=nano"), *parallel_files(tmp_path / "corpus", WORDS, seed=0),
                          f"init_from={tmp_path / 'bart'}", "data.max_len=32"], output_dir=tmp_path / "run")
    source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, False)
    assert cfg.data.source_bos is True
    data, task = build_data_and_task(cfg, check_config(cfg, source_fixes_context=True), "fit")
    assert task.source_bos is True
    batch = next(iter(data.train_dataloader()))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "bart")
    for text, row in zip(batch["src_text"], batch["src"].tolist(), strict=True):
        assert row[: row.index(2) + 1] == tokenizer(text).input_ids


def test_a_contradicting_override_of_a_bart_source_is_one_line(tmp_path: Path) -> None:
    save_bart_with_tokenizer(tmp_path / "bart")
    with pytest.raises(ConfigError, match=r"^task.scale_embeddings=True contradicts init_from=.*scale_embeddings=False"):
        train(compose_config([*(o for o in SMALL_MT if o != "model=nano"), *parallel_files(tmp_path / "corpus", WORDS, seed=0),
                              f"init_from={tmp_path / 'bart'}", "task.scale_embeddings=true"], output_dir=tmp_path / "run"))


def test_targets_as_long_as_the_position_table_leave_no_room_for_the_decoder_start_in_one_line(tmp_path: Path) -> None:
    save_bart_with_tokenizer(tmp_path / "bart")  # 64 positions, and SMALL_MT's data.max_len=64
    with pytest.raises(ConfigError, match=r"^data.max_len=64 leaves no room for the decoder's start token .*: set "
                                          r"data.max_len=63 or less$"):
        train(compose_config([*(o for o in SMALL_MT if o != "model=nano"), *parallel_files(tmp_path / "corpus", WORDS, seed=0),
                              f"init_from={tmp_path / 'bart'}"], output_dir=tmp_path / "run"))


@pytest.mark.parametrize(("overrides", "message"), [
    # trident's own run: data.max_seq_len follows data.max_len, so only a larger table makes room.
    (["task.decoder_start_id=2"], (r"^data.max_len=64 leaves no room for the decoder's start token .*: set "
                                   r"data.max_seq_len=65 or more$")),
    (["task.decoder_start_id=100000", "data.max_seq_len=65"],
     r"^task.decoder_start_id=100000 is not a token id of the vocabulary \(0 to \d+\): "),
    (["task.decoder_start_id=abc", "data.max_seq_len=65"], r"^task.decoder_start_id=abc is not a token id "),
])
def test_a_decoder_start_that_cannot_serve_is_one_line(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        train(compose_config([*SMALL_MT, *parallel_files(tmp_path / "corpus", WORDS, seed=0), *overrides],
                             output_dir=tmp_path / "run"))


OLDER_READER = """
import json, sys, torch, transformers
folder = sys.argv[1]
src, mask = torch.load(folder + "/src.pt")
model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder + "/export").eval()
found = {"version": transformers.__version__}
for beams in (1, 4):
    with torch.no_grad():
        out = model.generate(input_ids=src, attention_mask=mask.long(), num_beams=beams, max_length=10, do_sample=False,
                             bad_words_ids=[[1], [0]], length_penalty=1.0, early_stopping="never")
    found[str(beams)] = [[t for t in row.tolist() if t != 1] for row in out]
print(json.dumps(found))
"""


def test_the_oldest_allowed_transformers_generates_from_the_export_as_the_run_decodes(tmp_path: Path) -> None:
    """transformers 4 reads forced_bos_token_id from generation_config.json alone (config.json states no generation
    setting beside BartConfig's defaults, so 4.x keeps the file rather than rebuild it from config.json)."""
    from tests.test_bart import EOS, padded, task_from
    from tests.test_export_older_transformers import older_python, transformers_floor
    from trident.weights import read_pretrained
    from trident.weights.adapters.hf_export import write_hf

    python = older_python(transformers_floor())
    save_bart(tmp_path / "source", seed=8)
    task = task_from(read_pretrained(tmp_path / "source"), length_penalty=1.0, max_len_a=0.0, max_len_b=9)
    write_hf(task.net, None, None, tmp_path / "export")
    src, mask = padded([13, 8, 5, 3], 13, seed=9)
    src[torch.arange(4), mask.sum(1) - 1] = EOS
    torch.save((src, mask), tmp_path / "src.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    read = subprocess.run([str(python), "-c", OLDER_READER, str(tmp_path)], capture_output=True, text=True, timeout=600,
                          check=False, env=env)
    assert read.returncode == 0, read.stderr[-3000:]
    found = json.loads(read.stdout.strip().splitlines()[-1])
    assert found["version"].startswith(f"{transformers_floor()}.")
    for beams in (1, 4):
        assert found[str(beams)] == [[EOS, *h.tokens, EOS] for h in task.decode_ids(src, beam_size=beams)]
