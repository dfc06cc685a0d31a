"""task=classify from a task=mlm run (``init_from=``): the encoder and embedding load by name, the
[CLS] vector and the class head are new, the MLM head is dropped, and the log's table says so."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import trident
from trident.runs.pipeline import train

from .conftest import SMALL, compose_config
from .test_classify import CLASSIFY_SMALL

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL_MLM = ["task=mlm", *(o for o in SMALL if not o.startswith("task.sampling")), "logger=none", "test=false",
             "trainer.max_steps=3"]
D_MODEL = 64  # the nano model


def nano_block_parameters(d: int = D_MODEL, ff: int = 4 * D_MODEL) -> int:
    """One pre-norm block: qkv and out projections, two norms, two FFN layers, all with biases."""
    return (3 * d * d + 3 * d) + (d * d + d) + 2 * (2 * d) + (d * ff + ff) + (ff * d + d)


def test_init_from_an_mlm_run_loads_the_encoder_and_the_table_names_the_new_parameters(tmp_path: Path) -> None:
    source = tmp_path / "source"
    train(compose_config(SMALL_MLM, output_dir=source))
    run = tmp_path / "run"
    # lr 1e-30: the weights cannot move, so the run's checkpoint holds what was loaded.
    train(compose_config([*CLASSIFY_SMALL, f"init_from={source}", "trainer.max_steps=1", "optimizer.lr=1e-30",
                          "scheduler=constant", "test=false"], output_dir=run))
    mlm, tuned = trident.load(source), trident.load(run)
    assert tuned.tokenizer.get_vocab() == mlm.tokenizer.get_vocab(), "the source's tokenizer, nothing added"
    for name, tensor in mlm.net.state_dict().items():
        if name.startswith(("embed.", "encoder.")):
            assert torch.equal(tuned.net.state_dict()[name], tensor), name
    with (run / "init" / "weights.csv").open() as file:
        rows = {(row["outcome"], row["group"]): row for row in csv.DictReader(file)}
    assert int(rows[("loaded", "encoder.blocks")]["parameters"]) == 2 * nano_block_parameters()
    assert int(rows[("loaded", "embed")]["parameters"]) == mlm.tokenizer.get_vocab_size() * D_MODEL
    assert int(rows[("new", "cls_token")]["parameters"]) == D_MODEL
    assert int(rows[("new", "head")]["parameters"]) == 6 * D_MODEL + 6, "six genres"
    assert ("dropped", "transform") in rows, "the MLM prediction head has no place here"
