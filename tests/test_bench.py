"""``python -m trident.bench --quick`` runs every row end to end and writes a well-formed table.
(Tiny shapes: this checks the command, not the timings.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trident.backbone import TransformerConfig
from trident.bench.__main__ import NOT_QUICK, ON_REQUEST, ROWS, main
from trident.bench.results import COLUMNS


def table_rows(page: str) -> list[list[str]]:
    lines = [line for line in page.splitlines() if line.startswith("|")]
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    assert set(lines[1].replace("|", "")) == {"-"}
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in lines[2:]]
    assert all(len(row) == len(COLUMNS) for row in rows), "every row has one cell per column"
    return [[cell.strip() for cell in row] for row in rows]


@pytest.mark.slow
def test_quick_run_writes_every_row(tmp_path: Path, single_thread: None) -> None:
    out = tmp_path / "docs" / "benchmarks.md"
    assert main(["--quick", "--out", str(out)]) == 0
    page = out.read_text()
    assert f"- Command: `python -m trident.bench --quick --out {out}`" in page
    assert re.search(r"- Machine: .+ \(bf16 matmul units: [^)]+\), \d+ cores, \d+ torch threads; torch \d", page)
    assert re.search(r"- Date: \d{4}-\d\d-\d\d \d\d:\d\d UTC", page)
    rows = table_rows(page)
    assert {row[0] for row in rows} == set(ROWS) - set(NOT_QUICK) - set(ON_REQUEST)
    for group, _, trident, reference, result, _, met, _ in rows:
        assert trident and reference and result, group
        assert met in {"yes", "**no**", "-"}
    vit = [row for row in rows if row[0] == "vit_small"]
    assert [row[1].split(":")[0] for row in vit] == ["ViT train step fp32", "ViT train step bf16"]
    generation = [row for row in rows if row[0] == "generation"]
    assert len(generation) == 2 and all("identical greedy tokens" in row[7] for row in generation)
    padding = next(row for row in rows if row[0] == "batching")
    bucketed, random = (float(re.search(r"([\d.]+)% padding", cell).group(1)) for cell in padding[2:4])
    assert bucketed < random  # token-budget batching wastes less on padding


def test_only_runs_the_named_rows_and_rejects_unknown_ones(tmp_path: Path, single_thread: None) -> None:
    out = tmp_path / "bench.md"
    assert main(["--quick", "--only", "fused", "checkpointing", "--out", str(out)]) == 0
    assert [row[0] for row in table_rows(out.read_text())] == ["fused", "checkpointing"]
    with pytest.raises(SystemExit):
        main(["--only", "nonsense", "--out", str(out)])


def test_mfu_rows_build_the_model_that_train_py_builds_at_model_base() -> None:
    """The GPU rows' LM is ``python train.py model=base``'s backbone: sizes and architecture switches
    from conf/model/base.yaml and the shared file it extends (their only difference: the geometry)."""
    from trident.bench.mfu import base_config
    from trident.runs.compose import compose_train_config
    from trident.runs.pipeline import backbone_options

    options = backbone_options(compose_train_config(["task=lm", "model=base"]))
    trained = TransformerConfig(**options)
    benched = base_config(False, max_seq_len=trained.max_seq_len, pos_encoding=trained.pos_encoding,
                          pos_encoding_options=trained.pos_encoding_options)
    assert (benched.d_model, benched.n_layers, benched.dropout) == (768, 12, 0.1)
    assert dataclasses.asdict(benched) == dataclasses.asdict(trained)
