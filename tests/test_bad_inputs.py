"""Bad input, table-driven: each case exits non-zero with ONE clear line naming the problem and
the fix, prints no traceback, and leaves earlier outputs untouched.

Most cases run ``train.py`` / ``eval.py`` / ``python -m trident.sample`` in this process
(``tests/entry_points.py``); ``test_in_process_matches_the_command_line`` checks that a real
subprocess gives the same result.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from trident.runs.compose import compose_train_config
from trident.runs.jobs import discard_failed_run_dir
from trident.runs.pipeline import train

from .conftest import SMALL
from .entry_points import run_in_process, run_subprocess

# A small corpus for the earlier run and the vocabulary cases (fast to prepare).
CORPUS = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200))
OTHER_CORPUS = "".join(f"{i} ZYXW VUTS RQPO NMLK {i * 7}\n" for i in range(400))
PREVIOUS_RUN = "runs/2000-01-01/00-00-00_previous"


def snapshot(outputs: Path) -> dict[str, str]:
    """Every file under ``outputs`` with its hash, and every run directory (``runs/<date>/<run>``)."""
    files = {str(p.relative_to(outputs)): hashlib.sha256(p.read_bytes()).hexdigest() for p in outputs.rglob("*") if p.is_file()}
    runs = {str(p.relative_to(outputs)): "run dir" for p in outputs.glob("runs/*/*")}
    return files | runs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding corpora, a corrupt checkpoint, and ``outputs/`` with an earlier run
    (trained on the small corpus: resolved config, tokenizer, checkpoints)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "corpus.txt").write_text(CORPUS)
    (root / "other.txt").write_text(OTHER_CORPUS)
    (root / "empty.txt").write_text("")
    (root / "corrupt.ckpt").write_bytes(b"not a checkpoint" * 64)
    previous = root / "outputs" / PREVIOUS_RUN
    train(compose_train_config(
        [*SMALL, "data=text_files", f"data.files=[{root / 'corpus.txt'}]", "data.tokenizer=char",
         "logger=none", "test=false", "trainer.max_steps=2"],
        output_dir=previous,
    ))
    # An earlier run directory whose checkpoint was damaged (e.g. a copy cut short).
    damaged = root / "outputs" / "runs/2000-01-01/00-00-01_damaged"
    (damaged / "checkpoints").mkdir(parents=True)
    shutil.copy(previous / "config_resolved.yaml", damaged)
    last = (previous / "checkpoints" / "last.ckpt").read_bytes()
    (damaged / "checkpoints" / "last.ckpt").write_bytes(last[: len(last) // 2])
    write_classify_files(root)
    return root


def write_classify_files(root: Path) -> None:
    """``classify/``: labelled CSV files for task=classify, files with a bad row or encoding, and
    ``learned/``, a one-step LM run with a 32-row learned position table to start from (init_from)."""
    folder = root / "classify"
    folder.mkdir()
    rows = [{"text": f"passage {i} of the {kind} kind", "label": kind} for i in range(24) for kind in ("comic", "tragic")]

    def write_csv(name: str, table: list[dict[str, object]], encoding: str = "utf-8") -> None:
        with (folder / name).open("w", newline="", encoding=encoding) as handle:
            writer = csv.DictWriter(handle, ["text", "label"])
            writer.writeheader()
            writer.writerows(table)

    def write_jsonl(name: str, table: list[dict[str, object]], encoding: str = "utf-8") -> None:
        (folder / name).write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in table).encode(encoding))

    for name in ("train", "validation", "test"):
        write_csv(f"{name}.csv", rows)
    write_csv("empty_label.csv", [*rows[:5], {"text": "a passage with no label", "label": ""}, *rows[5:]])
    write_jsonl("null_label.jsonl", [*rows[:7], {"text": "a passage with a null label", "label": None}, *rows[7:]])
    write_jsonl("missing_label.jsonl", [*rows[:3], {"text": "a passage without the key"}, *rows[3:]])
    accented = [*rows[:9], {"text": "a café passage", "label": "comic"}, *rows[9:]]
    write_csv("latin1.csv", accented, encoding="latin-1")
    write_jsonl("latin1.jsonl", accented, encoding="latin-1")
    train(compose_train_config(
        [*SMALL, "pos_encoding=learned", "data=text_files", f"data.files=[{root / 'corpus.txt'}]", "data.tokenizer=char",
         "logger=none", "test=false", "trainer.max_steps=1"],
        output_dir=root / "learned",
    ))


LAST = f"outputs/{PREVIOUS_RUN}/checkpoints/last.ckpt"
DAMAGED = "outputs/runs/2000-01-01/00-00-01_damaged/checkpoints/last.ckpt"
TEXT = ["data=text_files", "data.files=[corpus.txt]", "data.tokenizer=char"]


def classify_files(train: str, validation: str = "validation.csv", test: str = "test.csv") -> list[str]:
    """task=classify on files of the workspace's ``classify/`` folder."""
    return ["task=classify", "data.source=files",
            f"data.files={{train: classify/{train}, validation: classify/{validation}, test: classify/{test}}}"]


# (case id, entry point, arguments, words the error line must contain)
CASES: list[tuple[str, str, list[str], list[str]]] = [
    # Wrong types and impossible sizes
    ("layers-not-a-number", "train.py", ["model.n_layers=abc"], ["model.n_layers", "positive integer", "'abc'"]),
    ("layers-fraction", "train.py", ["model.n_layers=2.5"], ["model.n_layers", "positive integer"]),
    ("width-zero", "train.py", ["model.d_model=0"], ["model.d_model", "positive integer"]),
    ("heads-negative", "train.py", ["model.n_heads=-4"], ["model.n_heads", "positive integer"]),
    ("context-zero", "train.py", ["data.max_seq_len=0"], ["max_seq_len", "positive integer"]),
    ("heads-not-dividing-width", "train.py", ["model=nano", "model.n_heads=5"], ["d_model=64 is not divisible by model.n_heads=5", "divisors"]),
    ("dropout-above-one", "train.py", ["model.dropout=1.5"], ["model.dropout", "[0, 1)"]),
    ("unknown-activation", "train.py", ["model.activation=swish"], ["model.activation='swish'", "gelu"]),
    ("unknown-norm", "train.py", ["model.norm=batchnorm"], ["model.norm='batchnorm'", "rmsnorm"]),
    ("block-longer-than-table", "train.py", ["pos_encoding=learned", "data.block_size=64", "data.max_seq_len=32"], ["block_size=64 is longer than data.max_seq_len=32", "raise data.max_seq_len"]),
    ("batch-size-zero", "train.py", ["data.batch_size=0"], ["data.batch_size", "positive"]),
    # Typos and unknown options
    ("typo-in-key", "train.py", ["model.d_modle=64"], ["model.d_modle", "model.d_model"]),
    ("unknown-model-setting", "train.py", ["+model.d_modle=64"], ["d_modle", "model.d_model"]),
    ("unknown-data-setting", "train.py", ["+data.batchsize=8"], ["data.batchsize", "data.batch_size"]),
    ("unknown-task-setting", "train.py", ["+task.tie_embedding=false"], ["task.tie_embedding", "task.tie_embeddings"]),
    ("unknown-group-option", "train.py", ["pos_encoding=rotary"], ["pos_encoding=rotary does not exist", "rope"]),
    ("unknown-option-in-sweep", "train.py", ["-m", "pos_encoding=rope,rotary"], ["pos_encoding=rotary does not exist"]),
    ("unknown-dataset", "train.py", ["data=imagenet21k"], ["data=imagenet21k does not exist", "shakespeare"]),
    ("bad-precision", "train.py", ["precision=fp64"], ["precision=fp64 does not exist", "bf16"]),
    # Lightning checks the trainer settings when the trainer is built, after the data is prepared.
    ("bad-trainer-precision", "train.py", [*TEXT, "trainer.precision=64-banana"], ["trainer settings are invalid", "64-banana"]),
    ("trainer-negative-steps", "train.py", [*TEXT, "trainer.max_steps=-5"], ["trainer.max_steps", ">= -1", "-5"]),
    # Seed and trainer values that Lightning lets through to a crash, or checks only after the data is prepared
    ("seed-not-a-number", "train.py", ["seed=abc"], ["seed", "integer", "'abc'"]),
    ("seed-negative", "train.py", ["seed=-1"], ["seed", "[0, 2**32)"]),
    ("seed-too-large", "train.py", ["seed=5000000000"], ["seed", "[0, 2**32)"]),
    ("accumulate-zero", "train.py", ["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches", ">= 1"]),
    ("accumulate-fraction", "train.py", ["trainer.accumulate_grad_batches=1.5"], ["trainer.accumulate_grad_batches", "1.5"]),
    ("val-interval-zero", "train.py", ["trainer.val_check_interval=0"], ["trainer.val_check_interval", "(0, 1]"]),
    ("val-interval-above-one-epoch", "train.py", ["trainer.val_check_interval=1.5"], ["trainer.val_check_interval", "1.5"]),
    ("val-every-zero-epochs", "train.py", ["trainer.check_val_every_n_epoch=0"], ["trainer.check_val_every_n_epoch", ">= 1"]),
    ("devices-zero", "train.py", ["trainer.devices=0"], ["trainer.devices", "auto"]),
    ("max-epochs-negative", "train.py", ["trainer.max_epochs=-5"], ["trainer.max_epochs", ">= -1"]),
    ("max-steps-text", "train.py", ["trainer.max_steps=many"], ["trainer.max_steps", "'many'"]),
    ("limit-val-negative", "train.py", ["trainer.limit_val_batches=-1"], ["trainer.limit_val_batches", "[0, 1]"]),
    ("log-every-zero", "train.py", ["trainer.log_every_n_steps=0"], ["trainer.log_every_n_steps", ">= 1"]),
    ("clip-negative", "train.py", ["trainer.gradient_clip_val=-1"], ["trainer.gradient_clip_val", ">= 0"]),
    ("sanity-steps-below-minus-one", "train.py", ["trainer.num_sanity_val_steps=-2"], ["trainer.num_sanity_val_steps", ">= -1"]),
    ("sampling-top-k-negative", "train.py", ["task.sampling.top_k=-5"], ["top_k", ">= 0"]),
    ("sampling-top-k-fraction", "train.py", ["task.sampling.top_k=2.5"], ["top_k", "integer", "2.5"]),
    ("sampling-top-k-not-a-number", "train.py", ["task.sampling.top_k=abc"], ["top_k", "integer", "'abc'"]),
    ("sampling-top-p-not-a-number", "train.py", ["task.sampling.top_p=abc"], ["top_p", "number", "'abc'"]),
    ("sample-top-p-above-one", "trident.sample", [LAST, "--top-p", "1.5"], ["top_p", "[0, 1]"]),
    ("unknown-scheduler", "train.py", ["scheduler.name=linear"], ["scheduler.name", "cosine"]),
    # Optimisation
    ("negative-learning-rate", "train.py", ["optimizer.lr=-0.001"], ["optimizer.lr", "positive"]),
    ("negative-weight-decay", "train.py", ["optimizer.weight_decay=-0.1"], ["optimizer.weight_decay", ">= 0"]),
    ("negative-warmup", "train.py", ["scheduler.warmup_steps=-10"], ["scheduler.warmup_steps", ">= 0"]),
    # Data that does not fit the task, or is not there
    ("image-data-for-lm", "train.py", ["task=lm", "data=mnist"], ["data=mnist", "task=lm"]),
    ("patch-not-dividing-image", "train.py", ["task=vit", "data.patch_size=5"], ["patch size 5 does not divide image size 28", "data.patch_size"]),
    ("alibi-on-images", "train.py", ["task=vit", "pos_encoding=alibi"], ["pos_encoding=alibi", "learned"]),
    ("unknown-pooling", "train.py", ["task=vit", "task.pool=max"], ["task.pool='max'", "cls"]),
    ("missing-corpus-file", "train.py", ["data=text_files", "data.files=[missing.txt]"], ["missing.txt", "not found", "data.files"]),
    ("empty-corpus", "train.py", ["data=text_files", "data.files=[empty.txt]"], ["empty.txt is empty", "data.files"]),
    ("unknown-tokenizer", "train.py", [*TEXT, "data.tokenizer=word"], ["data.tokenizer", "bpe"]),
    # About 10,900 characters, 90 % for training: 307 blocks of 32, fewer than one batch of 400
    ("train-split-smaller-than-a-batch", "train.py", [*TEXT, "model=nano", "data.block_size=32", "data.batch_size=400"],
     ["no training batch", "307 training examples", "data.batch_size=400", "at most 307"]),
    ("train-batches-limited-to-none", "train.py", [*TEXT, "model=nano", "data.block_size=32", "data.batch_size=200",
                                                   "trainer.limit_train_batches=0.1"], ["no training batch", "limit_train_batches"]),
    # Checkpoints
    ("resume-missing-checkpoint", "train.py", [*TEXT, "ckpt_path=nowhere.ckpt"], ["nowhere.ckpt", "not found", "ckpt_path"]),
    ("resume-corrupt-checkpoint", "train.py", [*TEXT, "ckpt_path=corrupt.ckpt"], ["corrupt.ckpt", "corrupt"]),
    ("resume-other-model-size", "train.py", [*TEXT, "model=nano", "model.d_model=128", f"ckpt_path={LAST}"], ["does not fit", "128"]),
    ("resume-other-vocabulary", "train.py", [*TEXT, "model=nano", "data.files=[other.txt]", f"ckpt_path={LAST}"], ["init_from=", "other"]),
    ("eval-other-model-size", "eval.py", [f"ckpt_path={LAST}", "model.d_model=128"], ["does not fit", "128"]),
    ("eval-truncated-checkpoint", "eval.py", [f"ckpt_path={DAMAGED}"], ["corrupt", "last.ckpt"]),
    ("eval-missing-checkpoint", "eval.py", ["ckpt_path=nowhere.ckpt"], ["nowhere.ckpt", "not found"]),
    ("eval-without-checkpoint", "eval.py", ["task.beam_size=1"], ["ckpt_path="]),
    ("sample-corrupt-checkpoint", "trident.sample", ["corrupt.ckpt"], ["corrupt.ckpt", "corrupt"]),
    # Masked language modelling
    ("mlm-mask-rate-zero", "train.py", ["task=mlm", "task.mask_rate=0"], ["task.mask_rate", "(0, 1)", "0.15"]),
    ("mlm-mask-rate-above-one", "train.py", ["task=mlm", "task.mask_rate=1.2"], ["task.mask_rate", "(0, 1)"]),
    ("mlm-no-room-for-context", "train.py", ["task=mlm", "task.mask_rate=0.8", "data.block_size=2"], ["selects 2 of the 2 tokens", "data.block_size"]),
    ("mlm-fractions-above-one", "train.py", ["task=mlm", "task.random_token_fraction=0.5"], ["exceeds 1", "task.mask_token_fraction"]),
    ("mlm-block-size-not-a-number", "train.py", ["task=mlm", "data.block_size=abc"], ["data.block_size", "integer", "'abc'"]),
    ("mlm-seed-not-a-number", "train.py", ["task=mlm", "task.seed=abc"], ["task.seed", "integer", "'abc'"]),
    ("mlm-num-examples-not-a-number", "train.py", ["task=mlm", "task.num_examples=abc"], ["task.num_examples", "integer", "'abc'"]),
    ("mlm-image-data", "train.py", ["task=mlm", "data=mnist"], ["data=mnist is not text data for task=mlm", "shakespeare"]),
    ("task-target-not-a-task", "train.py", ["task._target_=trident.data.lm.LMDataModule"],
     ["task._target_=trident.data.lm.LMDataModule is not a trident task", "TridentTask"]),
    ("mlm-corpus-smaller-than-a-block", "train.py", ["task=mlm", *TEXT, "data.block_size=4000"], ["fewer than one block", "data.block_size"]),
    ("fill-mask-corrupt-checkpoint", "trident.fill_mask", ["corrupt.ckpt", "To be or not to [MASK]"], ["corrupt.ckpt", "corrupt"]),
    ("fill-mask-lm-checkpoint", "trident.fill_mask", [LAST, "To be or not to [MASK]"], ["is not a trident mlm checkpoint", "'sample_prompts'", "task=mlm"]),
    # Issue 38: exports and commands
    ("sample-directory-not-a-run", "trident.sample", ["outputs"], ["'outputs' holds no checkpoint", "train.py run"]),
    ("fill-mask-directory-not-a-run", "trident.fill_mask", ["outputs", "To be or not to [MASK]"], ["'outputs' holds no checkpoint", "train.py run"]),
    ("translate-directory-not-a-run", "trident.translate", ["outputs", "Hello."], ["'outputs' holds no checkpoint", "train.py run"]),
    ("eval-directory-not-a-run", "eval.py", ["ckpt_path=outputs"], ["'outputs' holds no checkpoint", "train.py run"]),
    ("eval-damaged-run-directory", "eval.py", ["ckpt_path=outputs/runs/2000-01-01/00-00-01_damaged"], ["corrupt", "last.ckpt"]),
    ("export-directory-not-a-run", "trident.export", ["outputs", "--format", "hf", "--out", "exported"], ["'outputs' holds no checkpoint", "train.py run"]),
    # Issue 38: classify files
    ("classify-empty-label-csv", "train.py", classify_files("empty_label.csv"),
     ["row 5 of the train split", "classify/empty_label.csv", "no label", "data.label_column=label"]),
    ("classify-null-label-jsonl", "train.py", classify_files("train.csv", validation="null_label.jsonl"),
     ["row 7 of the validation split", "null_label.jsonl", "no label", "data.label_column=label"]),
    ("classify-missing-label-key-jsonl", "train.py", classify_files("train.csv", test="missing_label.jsonl"),
     ["row 3 of the test split", "missing_label.jsonl", "no label", "data.label_column=label"]),
    ("classify-latin1-csv", "train.py", classify_files("latin1.csv"), ["latin1.csv is not UTF-8 text", "convert it to UTF-8"]),
    ("classify-latin1-jsonl", "train.py", classify_files("latin1.jsonl"), ["latin1.jsonl is not UTF-8 text", "convert it to UTF-8"]),
    ("classify-max-length-longer-than-table", "train.py",
     [*classify_files("train.csv"), "pos_encoding=learned", "data.max_length=64", "data.max_seq_len=32"],
     ["data.max_length=64 is longer than data.max_seq_len=32", "raise data.max_seq_len or lower data.max_length"]),
    ("classify-init-from-max-length-longer-than-its-table", "train.py",
     [*classify_files("train.csv"), "init_from=learned", "task.stack=decoder", "task.pool=last", "data.max_length=64"],
     ["data.max_length=64 is longer than data.max_seq_len=32", "init_from=learned fixes", "lower data.max_length to at most 32"]),
    ("init-from-block-longer-than-its-table", "train.py", ["data=text_files", "data.files=[corpus.txt]", "init_from=learned",
                                                          "data.block_size=64"],
     ["data.block_size=64 is longer than data.max_seq_len=32", "init_from=learned fixes", "lower data.block_size to at most 32"]),
    # A rope source fixes no table length: data.max_seq_len stays the user's to raise.
    ("init-from-rope-block-longer-than-context", "train.py", ["data=text_files", "data.files=[corpus.txt]",
                                                             f"init_from=outputs/{PREVIOUS_RUN}", "data.block_size=64", "data.max_seq_len=32"],
     ["data.block_size=64 is longer than data.max_seq_len=32 (the configured context): raise data.max_seq_len or lower"]),
    # The context and the sequence length are data settings (model.max_seq_len is not a key).
    ("classify-max-length-not-a-number", "train.py", ["task=classify", "data.max_length=abc"],
     ["data.max_length must be a positive integer, got 'abc'", "set e.g. data.max_length="]),
    ("lm-block-size-not-a-number", "train.py", ["data.block_size=abc"],
     ["data.block_size must be a positive integer, got 'abc'", "set e.g. data.block_size="]),
    ("context-negative", "train.py", ["data.max_seq_len=-3"], ["data.max_seq_len must be a positive integer", "set e.g. data.max_seq_len="]),
]


@pytest.mark.parametrize(("entry", "args", "keywords"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_line(
    entry: str, args: list[str], keywords: list[str], workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = workspace / "outputs"
    before = snapshot(outputs)
    result = run_in_process(entry, [*args, "paths.output_root=outputs"] if entry == "train.py" else args, workspace, monkeypatch)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.last_line.startswith("error: "), result.stderr
    assert ": " in result.last_line[len("error: "):], "the line names the problem, then the fix"
    for keyword in keywords:
        assert keyword in result.last_line
    assert snapshot(outputs) == before, "earlier outputs changed, or the failure left a run directory behind"


def test_the_table_is_large_and_unique() -> None:
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES) and len({(c[1], *c[2]) for c in CASES}) == len(CASES)


@pytest.mark.slow
def test_in_process_matches_the_command_line(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One case through Hydra's run directory, data preparation and the model (a real subprocess costs ~5 s of imports)."""
    entry, args = next((c[1], [*c[2], "paths.output_root=outputs"]) for c in CASES if c[0] == "resume-other-model-size")
    expected = run_in_process(entry, args, workspace, monkeypatch)
    result = run_subprocess(entry, args, workspace)
    assert (result.returncode, result.last_line) == (expected.returncode, expected.last_line)
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_full_error_shows_the_traceback(workspace: Path) -> None:
    result = run_subprocess("train.py", ["model.d_model=0", "paths.output_root=outputs"], workspace, HYDRA_FULL_ERROR="1")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError: model.d_model must be a positive integer" in result.stderr


def test_a_refused_resume_leaves_the_run_as_it_was(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``resume=<run> data.files=[other.txt]`` is refused before Hydra rewrites the run's ``.hydra/``
    (or its train.log): the same ``resume=<run>`` without the change is not refused afterwards."""
    run_dir = workspace / "outputs" / "runs/2000-01-01/00-00-02_resumable"
    shutil.copytree(workspace / "outputs" / PREVIOUS_RUN, run_dir)
    saved = [*SMALL, "data=text_files", f"data.files=[{workspace / 'corpus.txt'}]", "data.tokenizer=char",
             "logger=none", "test=false", "trainer.max_steps=2"]
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in saved))
    before = snapshot(run_dir)
    refused = run_in_process("train.py", [f"resume={run_dir}", "data.files=[other.txt]"], workspace, monkeypatch)
    assert refused.returncode == 2 and refused.last_line.startswith("error: "), refused.stderr
    assert snapshot(run_dir) == before, "the refused command changed the run directory"
    again = run_in_process("train.py", [f"resume={run_dir}", "print_config=false"], workspace, monkeypatch)
    assert again.returncode == 0, again.stderr
    shutil.rmtree(run_dir)


def test_a_refused_first_run_of_the_day_leaves_no_empty_run_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra makes <output_root>/runs/<date>/ for the run: a refused first run leaves neither behind."""
    (tmp_path / "empty.txt").write_text("")
    result = run_in_process("train.py", ["data=text_files", "data.files=[empty.txt]", "paths.output_root=outputs"], tmp_path, monkeypatch)
    assert result.returncode == 2 and result.last_line.startswith("error: "), result.stderr
    assert not (tmp_path / "outputs" / "runs").exists()


def test_a_failed_run_directory_outside_hydras_layout_leaves_its_parent(tmp_path: Path) -> None:
    """Only Hydra's <output_root>/runs/<date>/ goes with the run: a folder the user named stays, empty or not."""
    run_dir = tmp_path / "mine" / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    discard_failed_run_dir(run_dir)
    assert not run_dir.exists() and (tmp_path / "mine").is_dir()
