"""task=classify piece by piece, without training: the task's padding mask, metrics, baseline,
confusion matrix, token count, FLOPs and learning-rate depths; the data's length cut, padding,
class order, label mapping, offsets and majority baseline (each one a bug a mutation audit planted)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score
from tokenizers import Tokenizer, models, pre_tokenizers

from trident.data.text_classification import LabelledSequences, TextClassificationDataModule, pad_batch
from trident.data.translation import split_of
from trident.errors import DataError
from trident.tasks.classify import SequenceClassificationTask
from trident.training.flops import stack_flops

from .test_classify import backbone

pytestmark = pytest.mark.usefixtures("single_thread")

MAJORITY = {"validation": 0.25, "test": 0.75}
# Unbalanced truth and predictions: macro and micro averages differ, and so would a transposed matrix.
TRUTH = [0, 0, 0, 0, 0, 0, 1, 1, 2, 2]
PREDICTED = [0, 0, 0, 0, 0, 1, 1, 2, 0, 2]


def make_task(**options: object) -> SequenceClassificationTask:
    torch.manual_seed(0)
    return SequenceClassificationTask(
        backbone=vars(backbone()), vocab_size=20, optimizer={"name": "adamw", "lr": 1.0, "weight_decay": 0.1},
        scheduler={"name": "constant"}, class_names=["a", "b", "c"], majority_accuracy=MAJORITY,
        **options,  # type: ignore[arg-type]
    ).eval()


def logged_by(task: SequenceClassificationTask) -> dict[str, object]:
    """What the task logs, without a trainer."""
    logged: dict[str, object] = {}
    task.log = lambda name, value, **_: logged.__setitem__(name, value)  # type: ignore[method-assign]
    return logged


def batch_predicting(predicted: list[int], truth: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose logits (forward replaced) predict ``predicted``."""
    ids = torch.ones((len(truth), 4), dtype=torch.long)
    return ids, torch.zeros_like(ids, dtype=torch.bool), torch.tensor(truth)


def with_predictions(task: SequenceClassificationTask, predicted: list[int]) -> None:
    logits = torch.nn.functional.one_hot(torch.tensor(predicted), 3).float() * 5.0  # (B, C)
    task.forward = lambda ids, padding: logits  # type: ignore[method-assign]


def test_the_task_masks_padding_in_its_forward() -> None:
    task = make_task()
    text = torch.tensor([[5, 7, 3, 9, 11, 4]])
    ids = torch.cat([torch.cat([text, torch.zeros((1, 3), dtype=torch.long)], dim=1), torch.randint(1, 20, (1, 9))])
    padding = torch.zeros_like(ids, dtype=torch.bool)
    padding[0, 6:] = True
    with torch.no_grad():
        alone = task(text, torch.zeros_like(text, dtype=torch.bool))
        together = task(ids, padding)
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)


def test_the_task_logs_macro_f1_micro_accuracy_and_its_splits_baseline() -> None:
    task = make_task()
    logged = logged_by(task)
    with_predictions(task, PREDICTED)
    for stage, acc, f1 in (("val", task.val_acc, task.val_f1), ("test", task.test_acc, task.test_f1)):
        task._evaluate(batch_predicting(PREDICTED, TRUTH), stage, acc, f1)
        assert float(acc.compute()) == pytest.approx(accuracy_score(TRUTH, PREDICTED))
        assert float(f1.compute()) == pytest.approx(f1_score(TRUTH, PREDICTED, average="macro"))
        assert f1_score(TRUTH, PREDICTED, average="macro") != pytest.approx(f1_score(TRUTH, PREDICTED, average="micro"))
    assert logged["val/majority_acc"] == MAJORITY["validation"] and logged["test/majority_acc"] == MAJORITY["test"]


def test_the_confusion_matrix_has_a_row_per_true_class() -> None:
    task = make_task()
    logged_by(task)
    with_predictions(task, PREDICTED)
    task.test_step(batch_predicting(PREDICTED, TRUTH), 0)
    expected = confusion_matrix(TRUTH, PREDICTED)  # rows: truth, columns: predicted
    assert task.test_confusion.compute().tolist() == expected.tolist() != expected.T.tolist()


def test_throughput_counts_real_tokens_and_flops_count_every_row() -> None:
    task = make_task()
    ids = torch.ones((3, 5), dtype=torch.long)
    padding = torch.tensor([[False] * 5, [False] * 2 + [True] * 3, [False] * 4 + [True]])
    batch = (ids, padding, torch.zeros(3, dtype=torch.long))
    assert task.throughput_units(batch) == {"tokens": 5 + 2 + 4, "samples": 3}
    head = 3 * 2 * 32 * 3 * 3  # forward and backward (3) x 2 x d_model x classes x rows
    # task.pool=cls: the network prepends its learned [CLS] vector, one more position in every layer.
    assert task.net.prepends_cls
    assert task.flops_per_batch(batch) == stack_flops(task.net.cfg, 3, 5 + 1, causal=False) + head


def test_the_tasks_groups_decay_from_the_head_down_to_the_embedding() -> None:
    task = make_task(layer_decay=0.5, head_lr=7.0)
    lr_of = {id(p): group["lr"] for group in task.parameter_groups(0.1) for p in group["params"]}
    params = dict(task.net.named_parameters())
    # Two blocks: the embedding at depth 0 (0.5^3), blocks 1 and 2, the final norm at 3 (1.0).
    expected = {"embed.weight": 0.125, "cls_token": 0.125, "encoder.blocks.0.ffn.fc_in.weight": 0.25,
                "encoder.blocks.1.ffn.fc_in.weight": 0.5, "encoder.final_norm.weight": 1.0, "head.weight": 7.0}
    assert {name: lr_of[id(params[name])] for name in expected} == pytest.approx(expected)


def test_an_example_is_cut_to_its_length_keeping_the_tokens_that_close_it() -> None:
    ids = np.arange(1, 21)
    examples = LabelledSequences(ids, np.array([0, 12, 15, 20]), np.array([2, 0, 1]), length=7, closing=0)
    tokens, label = examples[0]
    assert tokens.tolist() == list(range(1, 8)) and label == 2
    assert examples[1][0].tolist() == [13, 14, 15] and examples[2][0].tolist() == [16, 17, 18, 19, 20]
    closed = LabelledSequences(ids, np.array([0, 12, 15, 20]), np.array([2, 0, 1]), length=5, closing=2)
    assert closed[0][0].tolist() == [1, 2, 3, 11, 12], "the beginning, then the last two ([SEP] and the like)"
    assert closed[2][0].tolist() == [16, 17, 18, 19, 20], "as long as the length: kept whole"


def test_a_batch_is_right_padded_with_its_mask() -> None:
    ids, padding, labels = pad_batch([(torch.tensor([4, 5, 6]), 1), (torch.tensor([7]), 0), (torch.tensor([8, 9]), 2)])
    assert ids.tolist() == [[4, 5, 6], [7, 0, 0], [8, 9, 0]]
    assert padding.tolist() == [[False, False, False], [False, True, True], [False, False, True]]
    assert labels.tolist() == [1, 0, 2]


def labelled(tmp_path: Path, rows: dict[str, list[tuple[str, object]]], tokenizer: str = "char") -> TextClassificationDataModule:
    files = {}
    for split, pairs in rows.items():
        files[split] = str(tmp_path / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in pairs))
    module = TextClassificationDataModule(source="files", files=files, tokenizer=tokenizer, cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup()
    return module


def test_labels_keep_their_names_in_numeric_order_through_the_cache(tmp_path: Path) -> None:
    train = [(f"text {i} {'x' * i}", [10, 3, 2][i % 3]) for i in range(9)] + [("another ten", 10)]
    rows = {"train": train, "validation": [("one", 2), ("neon", 2), ("tone", 10)], "test": [("rat", 3), ("hat", 10)]}
    module = labelled(tmp_path, rows)
    assert module.class_names == ["2", "3", "10"]  # integers in numeric order, not "10" < "2"
    assert module.tokenizer is not None
    for split, pairs in rows.items():
        examples = module.splits[split]
        assert [module.class_names[i] for i in examples.labels] == [str(y) for _, y in pairs]
        texts = [module.tokenizer.decode(examples.ids[examples.offsets[i]:examples.offsets[i + 1]].tolist())
                 for i in range(len(pairs))]
        assert texts == [t for t, _ in pairs]
    # The baseline answers the most frequent *training* class (10), not validation's (2).
    assert module.majority_accuracy() == {"validation": pytest.approx(1 / 3), "test": 0.5}


def test_texts_a_tokenizer_cannot_read_stop_naming_it(tmp_path: Path) -> None:
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "fine": 1, "day": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    good = [("a fine day", "pos"), ("a dark night", "neg")] * 4
    with pytest.raises(DataError, match=r"the train split is 67% unknown or padding ids \(16 of 24\) with "
                                        r"data.tokenizer=\S*words.json"):
        labelled(tmp_path, {"train": good, "validation": good, "test": good}, tokenizer=str(tmp_path / "words.json"))


def write_rows(path: Path, rows: list[tuple[str, object]]) -> str:
    """``rows`` as JSON lines, or as a CSV file with a header row (by ``path``'s suffix, through a ``.gz``)."""
    if ".csv" in path.suffixes:
        text = "text,label\n" + "".join(f"{t},{y}\n" for t, y in rows)
    else:
        text = "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows)
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())
    return str(path)


def module_on(tmp_path: Path, files: object) -> TextClassificationDataModule:
    module = TextClassificationDataModule(source="files", files=files, cache_dir=str(tmp_path / "cache"))  # type: ignore[arg-type]
    module.prepare_data()
    module.setup()
    return module


def decoded_texts(module: TextClassificationDataModule, split: str) -> list[str]:
    assert module.tokenizer is not None
    examples = module.splits[split]
    return [module.tokenizer.decode(examples.ids[examples.offsets[i]:examples.offsets[i + 1]].tolist())
            for i in range(len(examples))]


ROWS = [(f"text {i} {'xy'[i % 2] * (i % 5)}", "ab"[i % 2]) for i in range(200)]


def test_gzip_compressed_json_lines_and_csv_are_read(tmp_path: Path) -> None:
    files = {"train": write_rows(tmp_path / "train.jsonl.gz", ROWS[:40]),
             "validation": write_rows(tmp_path / "validation.csv.gz", ROWS[40:50]),
             "test": write_rows(tmp_path / "test.jsonl", ROWS[50:60])}
    module = module_on(tmp_path, files)
    for split, rows in (("train", ROWS[:40]), ("validation", ROWS[40:50]), ("test", ROWS[50:60])):
        assert decoded_texts(module, split) == [t for t, _ in rows]
        assert [module.class_names[i] for i in module.splits[split].labels] == [y for _, y in rows]


def save_splits(folder: Path, table: dict[str, list[tuple[str, object]]]) -> str:
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [y for _, y in rows]})
                          for s, rows in table.items()}).save_to_disk(folder)
    return str(folder)


def test_a_saved_split_of_another_name_is_left_out_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """IMDB's save_to_disk holds train, test and "unsupervised" (label -1): the last is not a split of the run."""
    files = save_splits(tmp_path / "imdb", {"train": ROWS[:180], "test": ROWS[180:], "unsupervised": [("free text", -1)] * 5})
    with caplog.at_level(logging.INFO, logger="trident.data.readers"):
        module = module_on(tmp_path, files)
    assert decoded_texts(module, "test") == [t for t, _ in ROWS[180:]] and module.class_names == ["a", "b"]
    assert "split 'unsupervised' of" in caplog.text and "is not used (not train, validation or test)" in caplog.text


def test_a_saved_dataset_without_a_train_split_is_one_line(tmp_path: Path) -> None:
    files = save_splits(tmp_path / "saved", {"validation": ROWS[:10], "test": ROWS[10:20]})
    with pytest.raises(DataError, match=r"saved has no train split \(it has validation, test\): save one with it, or "
                                        r"give data.files=\{train: ..., validation: ..., test: ...\}"):
        module_on(tmp_path, files)


@pytest.mark.parametrize("given", ["saved train and test", "train file only"])
def test_a_split_the_files_do_not_give_is_cut_from_train_by_a_hash_of_the_text(
    given: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if given == "saved train and test":
        table = {"train": ROWS[:180], "test": ROWS[180:]}
        datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [y for _, y in rows]})
                              for s, rows in table.items()}).save_to_disk(tmp_path / "saved")
        files: object = str(tmp_path / "saved")
        cut = ["validation"]
    else:
        files = {"train": write_rows(tmp_path / "train.csv", ROWS[:180])}
        cut = ["validation", "test"]
    with caplog.at_level(logging.INFO, logger="trident.data.text_classification"):
        module = module_on(tmp_path, files)
    texts = {split: decoded_texts(module, split) for split in ("train", "validation", "test")}
    expected = {split: [t for t, _ in ROWS[:180] if split_of(t, [0.9, 0.05, 0.05]) == split] for split in cut}
    assert {split: texts[split] for split in cut} == expected and all(expected.values())
    assert texts["train"] == [t for t, _ in ROWS[:180] if t not in {t for split in cut for t in texts[split]}]
    if given == "saved train and test":
        assert texts["test"] == [t for t, _ in ROWS[180:]]
    assert f"{cut[0]} cut from train by a hash of the text (data.split=[0.9, 0.05, 0.05]) ({len(expected[cut[0]])} examples)" \
        in caplog.text


def test_a_cut_that_leaves_a_split_empty_names_data_split(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"cutting validation and test from the 4 training examples \(data.split=\[0.9, 0.05, "
                                        r"0.05\]\) left .*empty: give it in data.files or raise its data.split fraction"):
        module_on(tmp_path, write_rows(tmp_path / "train.jsonl", ROWS[:4]))


def test_an_empty_cell_of_an_integer_label_column_is_a_missing_label(tmp_path: Path) -> None:
    """pandas reads an integer column with an empty cell as floats with a NaN, which `datasets` keeps as
    a missing value: one line, not a class "nan"."""
    rows = [(f"text {i}", i % 2) for i in range(6)]
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "".join(f"{t},{'' if i == 4 else y}\n" for i, (t, y) in enumerate(rows)))
    with pytest.raises(DataError, match=r"row 4 of the train split \(\S*train.csv\) has no label \(data.label_column=label\)"):
        module_on(tmp_path, {"train": str(path), "validation": str(path), "test": str(path)})


def test_another_data_split_cuts_the_files_again(tmp_path: Path) -> None:
    files = {"train": write_rows(tmp_path / "train.jsonl", ROWS)}
    sizes = []
    for split in ([0.9, 0.05, 0.05], [0.5, 0.25, 0.25]):
        module = TextClassificationDataModule(source="files", files=files, split=split, cache_dir=str(tmp_path / "cache"))  # type: ignore[arg-type]
        module.prepare_data()
        module.setup()
        sizes.append(len(module.splits["validation"]))
    assert sizes[1] > 2 * sizes[0] > 0
