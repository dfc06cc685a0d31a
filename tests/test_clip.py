"""task=clip and data=image_text (issue 54 items 1-2): the default offline pairs (MNIST digits captioned from their
class names by templates, two classes held out of training), pairs read from JSONL / CSV / parquet files or a folder,
bad inputs in one line, each tower's own settings, the metrics (retrieval recall@k, zero-shot accuracy), and
``python train.py task=clip`` end to end with the network of the loaded run giving its features, as its hf export
does."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import trident
from trident.data.image_text import ImageTextDataModule, caption_ids
from trident.errors import ConfigError, DataError
from trident.runs.pipeline import check_config
from trident.tasks.clip import ContrastiveImageTextTask, recall_at

from .conftest import compose_config
from .entry_points import run_in_process

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def test_the_default_pairs_caption_digits_by_templates_and_hold_out_the_zero_shot_classes() -> None:
    cfg = compose_config(["task=clip"])
    data = ImageTextDataModule(**{k: v for k, v in cfg.data.items() if k not in ("_target_", "name", "max_seq_len")})
    data.setup("fit")
    train, validation = data.datasets["train"], data.datasets["validation"]
    held_out = {DIGITS.index("eight"), DIGITS.index("nine")}
    # MNIST's images come first, then the 1,797 digits of data.name_source (every class: tests/test_image_text_names.py).
    assert not held_out & set(train.pairs.labels[:-1797]), "MNIST's images of the zero-shot classes never train"
    assert held_out <= set(validation.pairs.labels)
    image, ids, label = train[0]
    assert image.shape == (1, 28, 28) and ids.shape == (16,)
    assert train.pairs.captions[0] == cfg.data.templates[0].format(DIGITS[label])
    assert data.tokenizer is not None
    eos = data.tokenizer.token_to_id("<|endoftext|>")
    words = [i for i in ids.tolist() if i != eos]
    assert data.tokenizer.decode(words) == train.pairs.captions[0].replace(".", " .")
    assert ids[len(words):].eq(eos).all(), "each caption ends in <|endoftext|> and is padded with it"
    inputs = data.task_inputs()
    assert inputs["eos_id"] == eos and inputs["zero_shot_classes"] == ["eight", "nine"]


def _images(folder: Path, count: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        Image.fromarray(np.full((8, 8), i * 20, dtype=np.uint8)).save(folder / f"{i}.png")
        names.append(f"images/{i}.png")
    return names


def _module(source: Path, **options: object) -> ImageTextDataModule:
    return ImageTextDataModule(source=str(source), image_size=8, patch_size=4, validation_size=2, test_size=2,
                               batch_size=2, **options)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "folder"])
def test_pairs_are_read_from_a_table_or_a_folder_with_a_captions_file(kind: str, tmp_path: Path) -> None:
    images = _images(tmp_path / "images", 8)
    rows = [{"image": name, "caption": f"a grey square number {i}"} for i, name in enumerate(images)]
    table = tmp_path / f"captions.{'jsonl' if kind == 'folder' else kind}"
    if table.suffix == ".jsonl":
        table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif table.suffix == ".csv":
        with table.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, ["image", "caption"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), table)
    data = _module(tmp_path if kind == "folder" else table)
    data.setup("fit")
    assert {split: len(dataset) for split, dataset in data.datasets.items()} == {"train": 4, "validation": 2, "test": 2}
    images_batch, ids, labels = next(iter(data.split_loader("validation", train=False)))
    assert images_batch.shape == (2, 1, 8, 8) and ids.shape == (2, 16) and labels.tolist() == [-1, -1]
    assert data.task_inputs()["class_names"] == []


def test_an_image_path_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    _images(tmp_path / "images", 1)
    table = tmp_path / "pairs.jsonl"
    table.write_text(json.dumps({"image": "images/0.png", "caption": "a"}) + "\n"
                     + json.dumps({"image": "images/missing.png", "caption": "b"}) + "\n")
    with pytest.raises(DataError, match=r"pairs.jsonl: the image '.*images/missing.png' does not exist: fix the path"):
        _module(table).setup("fit")


def test_a_caption_column_missing_is_one_line(tmp_path: Path) -> None:
    _images(tmp_path / "images", 1)
    table = tmp_path / "pairs.csv"
    table.write_text("image,text\nimages/0.png,a grey square\n")
    with pytest.raises(DataError, match=r"pairs.csv has no column 'caption' \(data.caption_column\): its columns are "
                                        r"image, text; set data.caption_column"):
        _module(table).setup("fit")


def test_train_py_names_a_missing_image_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "pairs.jsonl"
    table.write_text(json.dumps({"image": "nowhere.png", "caption": "a"}) + "\n")
    result = run_in_process("train.py", ["task=clip", f"data.source={table}", "logger=none"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.last_line.startswith(f"error: {table}: the image {str(tmp_path / 'nowhere.png')!r} does not exist")


def test_each_tower_takes_its_own_settings_and_an_unknown_one_is_one_line(tmp_path: Path) -> None:
    cfg = compose_config(["task=clip", "+task.text.n_layers=1", "+task.image.d_model=32", "+task.image.n_heads=2",
                          "+task.text.pos_encoding=rope"], output_dir=tmp_path)
    backbone = check_config(cfg)
    task = ContrastiveImageTextTask(
        vars(backbone), {"name": "adamw", "lr": 1e-3}, {"name": "constant"}, vocab_size=11, eos_id=1, image_size=8,
        in_channels=1, patch_size=4, mean=[0.5], std=[0.5], embed_dim=16, text=dict(cfg.task.text),
        image=dict(cfg.task.image))
    text, image = task.net.text.decoder.cfg, task.net.image.encoder.cfg
    assert (text.n_layers, text.d_model, text.pos_encoding, text.embedding_norm) == (1, 64, "rope", False)
    assert (image.n_layers, image.d_model, image.n_heads, image.head_dim, image.pos_encoding, image.embedding_norm) == (
        2, 32, 2, 16, "learned", True)
    with pytest.raises(ConfigError, match=r"task.image.d_modle is not a model setting of the image tower \(did you mean "
                                          r"task.image.d_model\?\): remove it"):
        check_config(compose_config(["task=clip", "+task.image.d_modle=32"], output_dir=tmp_path))


def test_recall_at_k_counts_the_queries_whose_match_is_among_their_k_best() -> None:
    similarity = torch.tensor([[0.9, 0.1, 0.0], [0.8, 0.5, 0.1], [0.7, 0.6, 0.2]])  # row i's match: column i
    assert recall_at(similarity, 1) == pytest.approx(1 / 3)  # row 0 only
    assert recall_at(similarity, 2) == pytest.approx(2 / 3)  # rows 0 and 1
    assert recall_at(similarity, 10) == 1.0


@pytest.mark.slow
def test_train_py_trains_clip_and_the_loaded_network_gives_its_features(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    result = run_in_process("train.py", ["task=clip", "logger=none", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
                                         "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
                                         f"paths.output_dir={run}"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((run / "status.json").read_text())["metrics"]
    assert {*ContrastiveImageTextTask.VALIDATION_METRICS, "test/zero_shot_acc", "test/zero_shot_chance",
            "test/all_classes_acc", "test/text_to_image_r10"} <= set(metrics)
    task = trident.load(run)
    images, ids = torch.randn(3, 1, 28, 28), torch.randint(0, task.net.text.vocab_size, (2, 16))
    with torch.no_grad():
        assert task.net.encode_image(images).shape == (3, 64) and task.net.encode_text(ids).shape == (2, 64)
        assert task.net(images, ids).shape == (3, 2)
    # trident-export --format hf of the run: a CLIPModel with the run's features, and its caption tokenizer.
    transformers = pytest.importorskip("transformers")
    from trident.commands.export import main as export

    export([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    exported = transformers.CLIPModel.from_pretrained(tmp_path / "hf").eval()
    captions = ["a photo of the digit two.", "the number eight."]
    hf_ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(captions, padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = (exported.get_image_features(pixel_values=images), exported.get_text_features(input_ids=hf_ids.input_ids))
        ours = (task.net.encode_image(images), task.net.encode_text(caption_ids(task.tokenizer, captions, 16)))
    for mine, reference in zip(ours, theirs, strict=True):
        reference = reference if isinstance(reference, torch.Tensor) else reference.pooler_output
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)


def tiny_clip() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A CLIP of width 8 (random weights, eval mode), 2 grey 8x8 images and 3 texts of 6 tokens."""
    from trident.backbone import TransformerConfig
    from trident.tasks.network_builders import clip

    torch.manual_seed(0)
    backbone = TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, max_seq_len=6, pos_encoding="learned")
    net = clip(backbone, vocab_size=11, eos_id=10, embed_dim=4, text=None, image={"embedding_norm": True}, image_size=8,
               patch_size=4, in_channels=1).eval()
    return net, torch.randn(2, 1, 8, 8), torch.randint(0, 11, (3, 6))


def test_fsdp_gathers_the_weights_around_encode_image_and_encode_text(tmp_path: Path) -> None:
    """FSDP2 gathers a root's weights around ``forward`` only: CLIP's other entry points (``encode_image``,
    ``encode_text``, ``normalised``: the task's loss and metrics run them) met the sharded patch projection as a
    DTensor. ``parallelize`` registers them, and sharded they give the unsharded features."""
    from torch.distributed.device_mesh import init_device_mesh

    from trident.parallel.fsdp import DATA_PARALLEL, parallelize

    from .sharding_helpers import one_rank_process_group

    net, images, ids = tiny_clip()
    with torch.no_grad():
        whole = (net.encode_image(images), net.encode_text(ids), *net.normalised(images, ids[:2]))
    with one_rank_process_group(tmp_path):
        parallelize(net, init_device_mesh("cpu", (1,), mesh_dim_names=(DATA_PARALLEL,)), "32-true")
        with torch.no_grad():
            sharded = (net.encode_image(images), net.encode_text(ids), *net.normalised(images, ids[:2]))
    for ours, theirs in zip(sharded, whole, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_the_temperature_scales_the_logits_by_at_most_100() -> None:
    """CLIP clamps ``logit_scale`` at log(100) in the forward (and in place after each step): a learned scale of 1000
    still scales the cosine similarities by 100; one below the clamp by itself; the task clamps the parameter."""
    import math

    net, images, ids = tiny_clip()
    with torch.no_grad():
        image, text = net.normalised(images, ids)
        cosines = image @ text.T  # (2, 3)
        for scale, expected in ((1000.0, 100.0), (20.0, 20.0)):
            net.logit_scale.fill_(math.log(scale))
            torch.testing.assert_close(net(images, ids), expected * cosines)
    # After each training batch the task clamps the parameter itself into [0, log 100], as open_clip does.
    for learned, kept in ((math.log(1000.0), math.log(100.0)), (-1.0, 0.0), (2.0, 2.0)):
        net.logit_scale.data.fill_(learned)
        ContrastiveImageTextTask.on_train_batch_end(SimpleNamespace(net=net), None, None, 0)
        assert float(net.logit_scale) == pytest.approx(kept)
