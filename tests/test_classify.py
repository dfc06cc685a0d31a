"""task=classify: pooling under padding, freezing, layer-wise decay, metrics against scikit-learn,
the split by play, and bad input as one line with exit status 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from trident.backbone import TransformerConfig
from trident.data.text_classification import plays_by_split, shakespeare_genres
from trident.models import SequenceClassifier
from trident.runs.pipeline import train
from trident.tasks.classify import SequenceClassificationTask
from trident.training.finetuning import layerwise_groups

from .conftest import compose_config
from .entry_points import run_in_process

pytestmark = pytest.mark.usefixtures("single_thread")

# The nano model, short sequences, a few batches of everything.
CLASSIFY_SMALL = [
    "task=classify", "model=nano", "data.max_length=32", "data.batch_size=4", "trainer.max_steps=4",
    "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=1", "trainer.num_sanity_val_steps=0", "print_config=false",
    "callbacks.progress_bar=null", "callbacks.model_summary=null", "logger=none",
]
PAD = 0


def backbone(**options: object) -> TransformerConfig:
    return TransformerConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16, dropout=0.0,
                             pos_encoding=str(options.pop("pos_encoding", "rope")), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(("stack", "pool", "pos_encoding"),
                         [("encoder", "cls", "rope"), ("encoder", "mean", "learned"), ("decoder", "last", "alibi"),
                          ("decoder", "mean", "rope")])
def test_padding_does_not_change_the_logits(stack: str, pool: str, pos_encoding: str) -> None:
    torch.manual_seed(0)
    net = SequenceClassifier(backbone(pos_encoding=pos_encoding), vocab_size=20, num_classes=3, stack=stack, pool=pool).eval()
    text = torch.tensor([[5, 7, 3, 9, 11, 4]])
    padded = torch.cat([text, torch.full((1, 5), PAD)], dim=1)  # (1, 11): right padding
    # A second, longer row, so the padded row shares its batch with real tokens at those positions.
    other = torch.randint(1, 20, (1, 11))
    batch = torch.cat([padded, other])
    alone = net(text)
    together = net(batch, key_padding_mask=batch == PAD)
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
    # The padding mask matters: without it the padded copy's logits differ.
    assert not torch.allclose(net(padded)[0], alone[0], atol=1e-4)


def test_mean_pool_is_the_mean_of_the_real_positions() -> None:
    torch.manual_seed(0)
    net = SequenceClassifier(backbone(), vocab_size=20, num_classes=3, stack="encoder", pool="mean").eval()
    ids = torch.tensor([[5, 7, 3, PAD, PAD]])
    mask = ids == PAD
    hidden = net.encoder(net.embed(ids), key_padding_mask=mask)
    expected = net.head(hidden[0, :3].mean(dim=0))
    torch.testing.assert_close(net(ids, key_padding_mask=mask)[0], expected)


def make_task(tmp_path: Path, **options: object) -> SequenceClassificationTask:
    cfg = backbone()
    return SequenceClassificationTask(
        backbone=vars(cfg), vocab_size=20, optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        scheduler={"name": "constant"}, class_names=["a", "b", "c"],
        majority_accuracy={"validation": 0.5, "test": 0.5}, **options,  # type: ignore[arg-type]
    )


def fit_steps(task: SequenceClassificationTask, steps: int, tmp_path: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (32, 8), generator=generator)
    labels = torch.randint(0, 3, (32,), generator=generator)
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path, accelerator="cpu")
    padding = torch.zeros_like(ids, dtype=torch.bool)
    trainer.fit(task, DataLoader(TensorDataset(ids, padding, labels), batch_size=8))


def snapshot(task: SequenceClassificationTask) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in task.net.named_parameters()}


def changed(before: dict[str, torch.Tensor], task: SequenceClassificationTask) -> set[str]:
    return {name for name, p in task.net.named_parameters() if not torch.equal(before[name], p.detach())}


def test_a_backbone_frozen_for_good_never_changes(tmp_path: Path) -> None:
    task = make_task(tmp_path, freeze_backbone_steps=-1)
    before = snapshot(task)
    fit_steps(task, 3, tmp_path)
    assert changed(before, task) == {"head.weight", "head.bias"}


def test_a_backbone_frozen_for_n_steps_trains_after_them(tmp_path: Path) -> None:
    task = make_task(tmp_path, freeze_backbone_steps=2)
    before = snapshot(task)
    fit_steps(task, 2, tmp_path)
    assert changed(before, task) == {"head.weight", "head.bias"}, "frozen during steps 0 and 1"
    after_freeze = snapshot(task)
    fit_steps(task, 3, tmp_path)  # a new trainer counts from 0 again: steps 0, 1 frozen, step 2 trains all
    moved = changed(after_freeze, task)
    assert any(name.startswith("encoder.blocks.") for name in moved) and "embed.weight" in moved


def test_layer_decay_and_head_lr_give_the_learning_rates_by_hand() -> None:
    torch.manual_seed(0)
    net = SequenceClassifier(backbone(pos_encoding="learned"), vocab_size=20, num_classes=3)
    groups = layerwise_groups(net, net.layer_of, 3, lr=1.0, weight_decay=0.1, layer_decay=0.5, head_lr=7.0,
                              no_decay_names={"encoder.pos_encoding.table.weight"})
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    params = dict(net.named_parameters())
    # Two blocks: embedding depth 0 -> 0.5^3, block 0 -> 0.5^2, block 1 -> 0.5, final norm 1, head its own.
    expected = {"embed.weight": 0.125, "encoder.blocks.0.ffn.fc_in.weight": 0.25, "encoder.blocks.1.ffn.fc_in.weight": 0.5,
                "encoder.final_norm.weight": 1.0, "head.weight": 7.0, "head.bias": 7.0}
    for name, lr in expected.items():
        assert name in params, sorted(params)
        assert lr_of[id(params[name])] == pytest.approx(lr), name
    assert decay_of[id(params["encoder.blocks.0.ffn.fc_in.weight"])] == 0.1
    assert decay_of[id(params["encoder.final_norm.weight"])] == 0.0
    positional = [n for n in params if ".pos_encoding." in f".{n}"]
    assert positional and all(lr_of[id(params[n])] == pytest.approx(0.125) for n in positional)
    assert sum(len(g["params"]) for g in groups) == len(params), "every parameter in exactly one group"


def test_accuracy_and_macro_f1_match_scikit_learn() -> None:
    truth = [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
    predicted = [0, 0, 1, 2, 1, 1, 2, 0, 2, 2]
    acc = MulticlassAccuracy(3, average="micro")(torch.tensor(predicted), torch.tensor(truth))
    f1 = MulticlassF1Score(3, average="macro")(torch.tensor(predicted), torch.tensor(truth))
    assert float(acc) == pytest.approx(accuracy_score(truth, predicted)) == pytest.approx(0.7)
    assert float(f1) == pytest.approx(f1_score(truth, predicted, average="macro"))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_split_is_by_play_and_every_genre_is_in_every_split(seed: int) -> None:
    dealt = plays_by_split(seed)
    names = {split: [p.name for p in plays] for split, plays in dealt.items()}
    assert len(set(names["train"]) | set(names["validation"]) | set(names["test"])) == 38
    assert sum(len(v) for v in names.values()) == 38, "no play in two splits"
    for split, plays in dealt.items():
        assert {p.genre for p in plays} == {"comedies", "histories", "problems", "roman", "romances", "tragedies"}, split
    assert plays_by_split(seed) == dealt, "a function of the seed"
    assert plays_by_split(seed + 2) != dealt or plays_by_split(seed + 3) != dealt


def test_passages_keep_their_plays_split() -> None:
    corpus = shakespeare_genres(0, 400)
    train_text = set(corpus["train"]["text"])
    assert not train_text & set(corpus["test"]["text"])
    assert set(corpus["test"]["label"]) == set(corpus["train"]["label"])


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


GOOD = [{"text": "a fine day", "label": "pos"}, {"text": "a dark night", "label": "neg"}] * 4


@pytest.mark.parametrize(
    ("name", "splits", "expected"),
    [
        ("missing label column", {"train": [{"text": "x", "category": "a"}] * 4}, "has no column 'label' (its columns: text, category)"),
        ("one class", {"train": [{"text": "x", "label": "a"}] * 4}, "one class only"),
        ("unseen label", {"validation": [*GOOD, {"text": "y", "label": "meh"}]}, "labels not in the train split: ['meh']"),
        ("empty text", {"test": [*GOOD, {"text": "  ", "label": "pos"}]},
         "row 8 of the test split ({test}) has an empty text (data.text_column=text)"),
        # JSON lines keep each label's type: numbers and strings do not sort, and 1 and "1" would print alike.
        ("numbers and strings", {"train": [*GOOD, {"text": "z", "label": 0}]},
         "data.label_column=label holds numbers and strings (0 in the train split, 'pos' in the train split)"),
        ("number labels, string labels", {"train": [{"text": f"t{i}", "label": i % 2} for i in range(8)],
                                          "validation": [{"text": "u", "label": "1"}], "test": [{"text": "v", "label": 0}]},
         "(0 in the train split, '1' in the validation split): write every label as a string or every label as a number"),
    ],
)
def test_bad_labelled_data_is_one_line_with_status_2(name: str, splits: dict[str, list[dict[str, object]]],
                                                     expected: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    files = {split: write_jsonl(tmp_path / f"{split}.jsonl", splits.get(split, GOOD)) for split in ("train", "validation", "test")}
    spec = "{" + ",".join(f"{k}:{v}" for k, v in files.items()) + "}"
    result = run_in_process("train.py", [*CLASSIFY_SMALL, "data.source=files", f"data.files={spec}",
                                         f"paths.cache_dir={tmp_path / 'cache'}"], tmp_path, monkeypatch)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.last_line.startswith("error: ")
    assert expected.format(**files) in result.last_line


def test_cls_pool_on_a_decoder_is_one_line_with_status_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_in_process("train.py", [*CLASSIFY_SMALL, "task.stack=decoder", "task.pool=cls"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.last_line.startswith("error: task.pool=cls does not work with task.stack=decoder"), result.last_line
    assert "choose one of last, mean" in result.last_line


def test_a_saved_dataset_with_integer_labels_trains_end_to_end(tmp_path: Path) -> None:
    rows = {"sentence": ["one two", "three four", "five six", "seven"] * 6, "y": [3, 10, 3, 10] * 6}
    datasets.DatasetDict({s: datasets.Dataset.from_dict(rows) for s in ("train", "validation", "test")}).save_to_disk(tmp_path / "ds")
    cfg = compose_config([*CLASSIFY_SMALL, "data.source=files", f"data.files={tmp_path / 'ds'}", "data.text_column=sentence",
                          "data.label_column=y"], output_dir=tmp_path / "run")
    metrics = train(cfg)
    assert {"test/acc", "test/macro_f1", "test/majority_acc"} <= set(metrics)
    assert metrics["test/majority_acc"] == pytest.approx(0.5)
    assert (tmp_path / "run" / "figures" / "test_confusion_matrix.png").is_file()


def test_the_default_runs_end_to_end_on_shakespeare(tmp_path: Path) -> None:
    metrics = train(compose_config(CLASSIFY_SMALL, output_dir=tmp_path / "run"))
    assert all(math.isfinite(metrics[key]) for key in ("test/loss", "test/acc", "test/macro_f1"))
    assert 0 < metrics["test/majority_acc"] < 0.5
