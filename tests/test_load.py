"""``trident.load``: a checkpoint or run directory of any task -> that task, its weights and
tokenizer, on CPU in eval mode; checkpoints of earlier versions; bad paths in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import trident
from trident.errors import DataError
from trident.runs.pipeline import train
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.weights.checkpoints import checkpoint_of

from .conftest import SMALL, compose_config
from .entry_points import run_in_process

pytestmark = pytest.mark.usefixtures("single_thread")

QUIET = ["logger=none", "test=false", "trainer.max_steps=2", "trainer.max_epochs=1"]
# task= -> (overrides of a two-step run, the class the checkpoint must come back as)
RUNS = {
    "lm": ([*SMALL], "LanguageModelTask"),
    "mlm": (["task=mlm", *(o for o in SMALL if not o.startswith("task.sampling"))], "MaskedLanguageModelTask"),
    "translation": (["task=translation", "model=nano", "data.vocab_size=400", "data.max_len=64", "data.max_tokens=256",
                     "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
                     "task.max_len_b=4", "task.num_examples=1", "print_config=false", "callbacks.progress_bar=null",
                     "callbacks.model_summary=null"], "TranslationTask"),
    "vit": (["task=vit", "model=nano", "data.patch_size=7", "data.batch_size=16", "trainer.limit_train_batches=2",
             "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "print_config=false",
             "callbacks.progress_bar=null", "callbacks.model_summary=null"], "ImageClassificationTask"),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    overrides, _ = RUNS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "run"
    train(compose_config([*overrides, *QUIET], output_dir=out))
    return out


def _saved_net(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")}


def test_a_run_directory_loads_as_the_task_that_wrote_it(run_dir: Path) -> None:
    task_name = run_dir.parent.name.rstrip("0123456789")
    task = trident.load(run_dir)
    assert type(task).__name__ == RUNS[task_name][1]
    assert not task.training and all(p.device.type == "cpu" for p in task.parameters())
    best = next((run_dir / "checkpoints").glob("best-*.ckpt"))
    saved = _saved_net(best)
    assert saved.keys() == task.net.state_dict().keys()
    for name, tensor in task.net.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    if task_name != "vit":
        assert task.tokenizer is not None and task.tokenizer.get_vocab_size() == task.hparams.vocab_size


def test_a_checkpoint_names_its_task_and_one_from_before_that_still_loads(run_dir: Path, tmp_path: Path) -> None:
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    expected = RUNS[run_dir.parent.name.rstrip("0123456789")][1]
    assert checkpoint[TASK_KEY].rsplit(".", 1)[-1] == expected
    # Written before the task was recorded, and moved out of its run: the settings tell the task.
    del checkpoint[TASK_KEY]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert type(trident.load(tmp_path / "old.ckpt")).__name__ == expected
    # Inside a copy of its run directory: the run's config tells it.
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    torch.save(checkpoint, copy / "checkpoints" / "last.ckpt")
    assert type(trident.load(copy / "checkpoints" / "last.ckpt")).__name__ == expected


def test_a_legacy_vit_checkpoint_with_the_retired_pretrained_setting_loads(tmp_path: Path) -> None:
    overrides, _ = RUNS["vit"]
    train(compose_config([*overrides, *QUIET], output_dir=tmp_path / "run"))
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    del checkpoint[TASK_KEY]
    checkpoint["hyper_parameters"]["pretrained"] = "/gone/vit.pth"  # what task=vit saved before init_from
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert type(trident.load(tmp_path / "old.ckpt")).__name__ == "ImageClassificationTask"


# task= -> the command that uses a checkpoint of that task, with its other arguments.
COMMANDS = {
    "lm": ("trident.commands.sample", ["--prompt", "ROMEO:", "--max-new-tokens", "4"]),
    "mlm": ("trident.commands.fill_mask", ["To be or not to [MASK]"]),
    "translation": ("trident.commands.translate", ["In the beginning", "--beam-size", "1"]),
    "vit": None,
}


def test_the_commands_take_a_run_directory_as_trident_load_does(run_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command reads the run directory's best checkpoint, the one trident.load reads."""
    best = next((run_dir / "checkpoints").glob("best-*.ckpt"))
    command = COMMANDS[run_dir.parent.name.rstrip("0123456789")]
    if command is not None:
        entry, args = command
        result = run_in_process(entry, [str(run_dir), *args], tmp_path, monkeypatch)
        assert result.returncode == 0, result.stderr
        assert result.stdout == run_in_process(entry, [str(best), *args], tmp_path, monkeypatch).stdout != ""
    result = run_in_process("eval.py", [f"ckpt_path={run_dir}", "trainer.limit_test_batches=1"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "eval" / f"{best.stem}.json").read_text())["ckpt_path"] == str(best)


@pytest.mark.parametrize("kind", ["missing", "empty dir", "not a checkpoint", "no weights"])
def test_bad_paths_are_one_line(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "x"
    if kind == "empty dir":
        path.mkdir()
    elif kind == "not a checkpoint":
        path.write_text("hello")
    elif kind == "no weights":
        torch.save({"epoch": 1}, path)
    with pytest.raises(DataError) as caught:
        trident.load(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert {"missing": "not found", "empty dir": "holds no checkpoint", "not a checkpoint": "cannot read checkpoint",
            "no weights": "holds no model weights"}[kind] in message


def fake_checkpoint(path: Path, recorded_best: str | None = None) -> None:
    """A checkpoint file with no weights; ``recorded_best``: the best checkpoint its ModelCheckpoint state names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"best_model_path": f"/where/it/ran/checkpoints/{recorded_best}"} if recorded_best else {}
    torch.save({"state_dict": {}, "callbacks": {"ModelCheckpoint{'monitor': 'val/loss'}": state}}, path)


@pytest.mark.parametrize(
    ("files", "recorded_best", "expected"),
    [
        (["checkpoints/last.ckpt"], None, "checkpoints/last.ckpt"),
        (["checkpoints/best-step4.ckpt", "checkpoints/last.ckpt"], None, "checkpoints/best-step4.ckpt"),
        # save_top_k > 1: the one last.ckpt's ModelCheckpoint calls best, not the first or last name
        ([f"checkpoints/best-step{s}.ckpt" for s in (10, 8, 9)] + ["checkpoints/last.ckpt"], "best-step8.ckpt",
         "checkpoints/best-step8.ckpt"),
        (["checkpoints/best-step2.ckpt", "checkpoints/best-step3.ckpt"], None, "checkpoints/best-step3.ckpt"),
        (["last.ckpt"], None, "last.ckpt"),  # a folder of checkpoints
    ],
)
def test_a_run_directory_reads_its_best_checkpoint_else_its_last(files: list[str], recorded_best: str | None,
                                                               expected: str, tmp_path: Path) -> None:
    for name in files:
        fake_checkpoint(tmp_path / name, recorded_best if name.endswith("last.ckpt") else None)
    assert checkpoint_of(tmp_path) == tmp_path / expected
    assert checkpoint_of(tmp_path / expected) == tmp_path / expected


def test_a_checkpoint_with_another_tasks_settings_names_the_task_it_claims(tmp_path: Path) -> None:
    # The task's name in the line is its task= option (the class's NAME), whatever module it lives in.
    torch.save({"state_dict": {}, TASK_KEY: "trident.tasks.mlm.MaskedLanguageModelTask",
                "hyper_parameters": {"tie_embeddings": True}}, tmp_path / "mixed.ckpt")
    with pytest.raises(DataError, match=r"is not a trident mlm checkpoint \(it has the setting 'tie_embeddings'\): "
                                        r"use a checkpoint of a task=mlm run"):
        trident.load(tmp_path / "mixed.ckpt")


@pytest.mark.slow
def test_import_trident_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, trident; assert 'torch' not in sys.modules and 'lightning' not in sys.modules; print(trident.load.__name__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "load"
