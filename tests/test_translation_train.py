"""task=translation end to end on CPU: each precision, a short run's checkpoints and logs, eval.py,
the translate command, checkpoint averaging, and one-line errors for bad input."""

from __future__ import annotations

import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from trident.commands import average_checkpoints, translate
from trident.commands.evaluate import evaluate
from trident.errors import ConfigError, DataError, find_user_error, run_with_clear_errors
from trident.runs.pipeline import train

from .conftest import ROOT, compose_config, one_step

pytestmark = pytest.mark.usefixtures("single_thread")

# The nano model on the Bible with a small BPE, small batches and short decodes.
SMALL_MT = [
    "task=translation",
    "model=nano",
    "data.vocab_size=400",
    "data.max_len=64",
    "data.max_tokens=256",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.num_sanity_val_steps=0",
    "task.beam_size=2",
    "task.max_len_a=0.5",
    "task.max_len_b=4",
    "task.num_examples=2",
    "print_config=false",
    "callbacks.progress_bar=null",
    "callbacks.model_summary=null",
]


def mt_config(tmp_path: Path, *overrides: str) -> DictConfig:
    return compose_config([*SMALL_MT, *overrides], output_dir=tmp_path / "run")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """Four steps that write every checkpoint kind: best (by val/bleu), last, one per step."""
    tmp_path = tmp_path_factory.mktemp("mt")
    cfg = mt_config(tmp_path, "logger=csv", "callbacks.throughput.window=1",
                    "callbacks.periodic_checkpoint.every_n_train_steps=1")
    train(cfg)
    return tmp_path / "run"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_step_in_each_precision(precision: str, tmp_path: Path) -> None:
    metrics = one_step(mt_config(tmp_path, f"precision={precision}"))
    assert torch.isfinite(torch.tensor([metrics["train/loss"], metrics["val/ppl"]])).all()
    assert {"val/bleu", "val/chrf"} <= set(metrics)


def test_short_run_keeps_checkpoints_config_and_metrics(short_run: Path) -> None:
    checkpoints = short_run / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file() and list(checkpoints.glob("best-step*.ckpt"))
    assert sorted(p.name for p in (checkpoints / "periodic").glob("*.ckpt")) == [f"step{i}.ckpt" for i in range(1, 5)]
    resolved = (short_run / "config_resolved.yaml").read_text()
    assert "name: translation" in resolved and "monitor: val/bleu" in resolved
    assert '"<pad>"' in (short_run / "tokenizer.json").read_text()
    header = next(short_run.rglob("metrics.csv")).read_text().split("\n")[0]
    for key in ("train/loss", "train/padding_fraction", "val/bleu", "val/chrf", "val/ppl", "test/bleu",
                "test/bleu_greedy", "test/chrf", "test/ppl", "throughput/tokens_per_sec"):
        assert key in header, key


def test_eval_script_scores_a_checkpoint_of_the_run(short_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python eval.py ckpt_path=... task.beam_size=1 task.test_greedy=false` (run in this process)."""
    ckpt = short_run / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(sys, "argv", ["eval.py", f"ckpt_path={ckpt}", "task.beam_size=1", "task.test_greedy=false"])
    runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")
    saved = json.loads((short_run / "eval" / "last.json").read_text())
    assert {"test/bleu", "test/chrf", "test/loss"} <= set(saved["metrics"])
    assert "test/bleu_greedy" not in saved["metrics"], "the override task.test_greedy=false applies"


def test_eval_script_works_for_the_language_model_too(tmp_path: Path) -> None:
    from .conftest import SMALL

    train(compose_config([*SMALL, "logger=none", "test=false"], output_dir=tmp_path / "run"))
    metrics = evaluate([f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}"])
    assert torch.isfinite(torch.tensor(metrics["test/loss"])) and "test/ppl" in metrics
    # A run saved before the optimizer was chosen by name (optimizer._target_) is scored the same.
    config = tmp_path / "run" / "config_resolved.yaml"
    assert config.read_text().count("name: adamw") == 1
    config.write_text(config.read_text().replace("name: adamw", "_target_: torch.optim.AdamW"))
    again = evaluate([f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}"])
    assert again["test/loss"] == pytest.approx(metrics["test/loss"])


def test_eval_script_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="eval.py needs ckpt_path="):
        evaluate(["task.beam_size=1"])
    with pytest.raises(DataError, match="checkpoint '.*nope.ckpt' not found: fix ckpt_path"):
        evaluate([f"ckpt_path={tmp_path / 'nope.ckpt'}"])
    stray = tmp_path / "stray.ckpt"
    stray.write_bytes(b"")
    with pytest.raises(DataError, match="no config_resolved.yaml above"):
        evaluate([f"ckpt_path={stray}"])


def test_translate_command_takes_arguments_and_stdin(short_run: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = str(short_run / "checkpoints" / "last.ckpt")
    task = translate.load_translation_checkpoint(Path(ckpt))
    sentences = ["In the beginning was the Word.", "And God said, Let there be light."]
    translate.main([ckpt, *sentences, "--beam-size", "2"])
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 3 and lines[2] == ""
    assert lines[:2] == task.translate(sentences, beam_size=2)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{sentences[0]}\n\n{sentences[1]}\n"))
    translate.main([ckpt, "--beam-size", "1", "--no-cache"])
    lines = capsys.readouterr().out.split("\n")
    assert lines[:3] == [task.translate(sentences[:1], beam_size=1)[0], "", task.translate(sentences[1:], beam_size=1)[0]]


def test_average_checkpoints_is_the_mean_of_the_state_dicts(short_run: Path, tmp_path: Path) -> None:
    periodic = sorted((short_run / "checkpoints" / "periodic").glob("*.ckpt"))
    states = [torch.load(p, map_location="cpu", weights_only=False)["state_dict"] for p in periodic[:3]]
    assert not torch.equal(states[0]["net.src_embed.weight"], states[2]["net.src_embed.weight"]), "weights changed"
    out = tmp_path / "avg.ckpt"
    average_checkpoints.average_checkpoints(periodic[:3], out)
    averaged = torch.load(out, map_location="cpu", weights_only=False)
    assert "optimizer_states" not in averaged and averaged["tokenizer_json"]
    for key, value in averaged["state_dict"].items():
        expected = torch.stack([s[key].double() for s in states]).mean(0).to(value.dtype)
        assert torch.allclose(value, expected, atol=1e-7), key
    # The last N of a run directory: the highest steps, each step once (last.ckpt = step 4 too).
    last_two = average_checkpoints.last_checkpoints(short_run, 2)
    assert [torch.load(p, weights_only=True)["global_step"] for p in last_two] == [3, 4]
    average_checkpoints.main([str(short_run), "--last", "2", "-o", str(tmp_path / "last2.ckpt")])
    task = translate.load_translation_checkpoint(tmp_path / "last2.ckpt")
    assert len(task.translate(["In the beginning"], beam_size=1)) == 1


def test_unknown_language_is_one_line_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = mt_config(tmp_path, "data.src_lang=xx", "logger=none")
    with pytest.raises(Exception) as raised:  # Hydra's instantiate wraps the data module's error
        train(cfg)
    assert isinstance(find_user_error(raised.value), ConfigError)
    assert not (tmp_path / "run" / "checkpoints").exists(), "fails before any work"
    with pytest.raises(SystemExit) as exit_info:
        run_with_clear_errors(lambda: train(cfg))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: unknown Bible language 'xx': set data.src_lang / data.tgt_lang to a language code"
    )


def test_missing_parallel_file_through_the_pipeline(tmp_path: Path) -> None:
    cfg = mt_config(tmp_path, "data=parallel_files", f"data.files=[{tmp_path}/missing.tsv]", "logger=none")
    with pytest.raises(DataError, match="data file '.*missing.tsv' not found: fix data.files"):
        train(cfg)
    cfg = mt_config(tmp_path, "data=parallel_files", "logger=none")
    with pytest.raises(ConfigError, match="data.source=files needs data.files"):
        train(cfg)


def test_training_pairs_all_held_out_are_one_line(tmp_path: Path) -> None:
    """Every training pair repeats a validation or test sentence (left out of training): one line, not a traceback."""
    rows = "".join(f"{src}\t{tgt}\n" for src, tgt in [("the word", "das wort"), ("the light", "das licht")])
    files = [tmp_path / f"{name}.tsv" for name in ("train", "validation", "test")]
    for path in files:
        path.write_text(rows)
    cfg = mt_config(tmp_path, "data=parallel_files", "logger=none",
                    "data.files={" + ",".join(f"{path.stem}:{path}" for path in files) + "}")
    with pytest.raises(DataError, match="every training pair of data.source=files shares a sentence with the validation"):
        train(cfg)
    assert not (tmp_path / "run" / "config_resolved.yaml").exists()


def test_a_bleu_tokenizer_sacrebleu_lacks_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """task.bleu_tokenize reaches the task through the pipeline, with data.tgt_lang beside it."""
    cfg = mt_config(tmp_path, "task.bleu_tokenize=zhh", "logger=none")
    with pytest.raises(SystemExit) as exit_info:
        run_with_clear_errors(lambda: train(cfg))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: task.bleu_tokenize=zhh is not a sacreBLEU tokenizer: choose auto or one of none, zh, 13a"
    )
    assert not (tmp_path / "run" / "checkpoints").exists(), "fails before any work"


@pytest.mark.slow
def test_padding_fraction_counts_a_decoder_start_that_is_the_padding_token_as_real(tmp_path: Path) -> None:
    """data.decoder_start=<pad> (T5's start token is its padding id): the same batches as with <s>, the same padding
    fraction (the start position was counted as padding)."""
    fractions = [one_step(mt_config(tmp_path / name, f"data.decoder_start='{start}'"))["train/padding_fraction"]
                 for name, start in (("bos", "<s>"), ("pad", "<pad>"))]
    assert fractions[1] == pytest.approx(fractions[0], abs=1e-6)
