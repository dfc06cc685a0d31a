"""DPO under tensor parallelism (issue 53, item 5: "tensor parallel ... work as for any run"): full fine-tuning from a
Llama directory, its frozen reference a companion on the same mesh, 2 tensor-parallel ranks train step for step like
one process. (LoRA under tensor parallelism is refused for every objective alike: tests/test_tensor_parallel.py.)"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entry_points import run_in_process
from tests.test_preference import llama, write_jsonl

from .conftest import ROOT

__all__ = ["llama"]  # the module's fixture, used here

pytestmark = pytest.mark.slow


def _losses(run: Path) -> dict[int, float]:
    with next(run.rglob("metrics.csv")).open() as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}


def test_two_tensor_parallel_ranks_train_dpo_like_one_process(tmp_path: Path, llama: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"Line {i}: the quick"}],
             "chosen": [{"role": "assistant", "content": "brown fox jumps"}],
             "rejected": [{"role": "assistant", "content": "lazy dog rests" + " then" * (i % 3)}]} for i in range(24)]
    files = write_jsonl(tmp_path / "pairs.jsonl", rows)
    common = ["task=lm", "data=preference", "objective=dpo", f"init_from={llama}", "data.source=files",
              f"data.files=[{files}]", "data.batch_size=4", "data.max_length=32", "trainer.max_steps=3",
              "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "logger=csv",
              "test=false", "print_config=false"]
    # The one-process reference in this process (no second start-up); the two ranks as train.py starts them.
    one = run_in_process("train.py", [*common, f"hydra.run.dir={tmp_path / 'one'}"], tmp_path, monkeypatch)
    assert one.returncode == 0, one.stderr[-3000:]
    tensor_parallel = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *common, "trainer=fsdp_cpu", "trainer.devices=2",
         "trainer.strategy.tensor_parallel_size=2", f"hydra.run.dir={tmp_path / 'tp'}"],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=900)
    assert tensor_parallel.returncode == 0, tensor_parallel.stderr[-3000:]
    expected, split = _losses(tmp_path / "one"), _losses(tmp_path / "tp")
    assert list(split) == list(expected) == [0, 1, 2]
    assert expected[0] == pytest.approx(0.6931471805599453, abs=1e-6)  # log 2: the policy starts as its reference
    assert list(split.values()) == pytest.approx(list(expected.values()), abs=1e-5)
