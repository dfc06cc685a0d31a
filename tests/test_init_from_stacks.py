"""``init_from`` across stacks: a source whose network is of another kind than the task's (a decoder
into an encoder, an encoder into a decoder, images into text or text into images) is one error line
naming the fix, for every trident task and Hugging Face / timm source; ``init_only=embeddings`` asks
for the embedding alone, and the weights table says what loaded."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, open_dict

from trident.data.tokenization import train_tokenizer
from trident.errors import ConfigError
from trident.runs.pipeline import configured_task_class, train
from trident.weights.init_from import source_for_run
from trident.weights.transfer import transfer_weights

from .conftest import SMALL, compose_config
from .entry_points import run_in_process
from .test_classify import CLASSIFY_SMALL
from .test_init_from import NEW_TEXT, VIT

pytestmark = pytest.mark.usefixtures("single_thread")

ONE_STEP = ["logger=none", "test=false", "trainer.max_steps=1", "trainer.limit_val_batches=0"]
DECODER = ["task.stack=decoder", "task.pool=last"]
CLASSIFY_FROM = [o for o in CLASSIFY_SMALL if o != "model=nano"]  # the sizes come from the source
# A few labelled lines (tokenizing Shakespeare's passages with each source's tokenizer costs seconds).
LABELLED = "text,label\n" + "".join(f"{line},{i % 2}\n" for i, line in enumerate(NEW_TEXT.splitlines()[:24]))
# Each source: how to make it, and the kind of network it holds.
TRIDENT_SOURCES = {
    "lm run": ([*SMALL, *ONE_STEP], "decoder"),
    "mlm run": (["task=mlm", *(o for o in SMALL if not o.startswith("task.sampling")), *ONE_STEP], "encoder"),
    "vit run": ([*VIT, "data.patch_size=7", *ONE_STEP], "images"),
    "classify run": ([*CLASSIFY_SMALL, *ONE_STEP], "encoder"),
    "classify decoder run": ([*CLASSIFY_SMALL, *ONE_STEP, *DECODER], "decoder"),
}
OUTSIDE_SOURCES = {"GPT-2 directory": "decoder", "BERT directory": "encoder", "ViT directory": "images",
                   "timm file": "images"}
KINDS = {name: kind for name, (_, kind) in TRIDENT_SOURCES.items()} | OUTSIDE_SOURCES
TARGETS = {"lm": ["task=lm"], "mlm": ["task=mlm"], "vit": ["task=vit"], "classify": ["task=classify"],
           "classify decoder": ["task=classify", *DECODER], "translation": ["task=translation"]}
# The kind of source each target starts from, and the fix its refusal of another stack names.
ACCEPTS = {"lm": ("decoder", "fine-tune it with task=mlm or task=classify task.stack=encoder"),
           "mlm": ("encoder", "fine-tune it with task=lm or task=classify task.stack=decoder"),
           "classify": ("encoder", "set task.stack=decoder task.pool=last"),
           "classify decoder": ("decoder", "set task.stack=encoder task.pool=cls"), "vit": ("images", "")}


def _gpt2(folder: Path) -> None:
    import transformers

    tokenizer = train_tokenizer("bpe", [NEW_TEXT], vocab_size=300)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=tokenizer.get_vocab_size())
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))


def _bert(folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator([NEW_TEXT], trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))


def _vit(folder: Path) -> None:
    import transformers

    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                                    image_size=28, patch_size=7, num_channels=1, num_labels=3)
    transformers.ViTForImageClassification(config).save_pretrained(folder)


def _timm(path: Path) -> None:
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                              embed_dim=64, depth=2, num_heads=1, num_classes=3)
    torch.save(model.state_dict(), path)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """classify overrides that read a few labelled lines."""
    path = tmp_path_factory.mktemp("labelled") / "lines.csv"
    path.write_text(LABELLED)
    return ["data.source=files", f"data.files={{train: {path}, validation: {path}, test: {path}}}"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, labelled: list[str], single_thread: None) -> dict[str, Path]:
    """Every kind of source: one-step trident runs of each task, tiny random Hugging Face and timm files."""
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    made: dict[str, Path] = {}
    for name, (overrides, _) in TRIDENT_SOURCES.items():
        made[name] = root / name.replace(" ", "_")
        train(compose_config([*overrides, *(labelled if name.startswith("classify") else [])], output_dir=made[name]))
    for name, make in (("GPT-2 directory", _gpt2), ("BERT directory", _bert), ("ViT directory", _vit)):
        made[name] = root / name.split()[0].lower()
        make(made[name])
    made["timm file"] = root / "vit.pth"
    _timm(made["timm file"])
    return made


@pytest.fixture(scope="module")
def targets() -> dict[str, DictConfig]:
    return {name: compose_config(overrides) for name, overrides in TARGETS.items()}


def _start(target: DictConfig, source: Path, tmp_path: Path, embeddings_only: bool) -> DictConfig:
    """``target`` after ``init_from=source`` is read, checked and applied (what train.py does before any work)."""
    cfg = target.copy()
    with open_dict(cfg):
        cfg.init_from = str(source)
        cfg.data.cache_dir = str(tmp_path / "cache")
    source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, embeddings_only)
    return cfg


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("source", list(KINDS))
def test_a_source_of_another_stack_is_refused_unless_init_only_embeddings(
    source: str, target: str, sources: dict[str, Path], targets: dict[str, DictConfig], tmp_path: Path
) -> None:
    kind, path = KINDS[source], sources[source]
    if target == "translation":
        for embeddings_only in (False, True):
            with pytest.raises(ConfigError, match="task=translation starts only from"):
                _start(targets[target], path, tmp_path, embeddings_only)
        return
    accepted, fix = ACCEPTS[target]
    # A classify run gives a classify run its own task.stack (the architecture comes from the source).
    if kind == accepted or (source.startswith("classify") and target.startswith("classify")):
        cfg = _start(targets[target], path, tmp_path, embeddings_only=False)
        if target.startswith("classify"):
            assert cfg.task.stack == kind
        return
    with pytest.raises(ConfigError) as refused:
        _start(targets[target], path, tmp_path, embeddings_only=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"init_from={path} holds a task=")
    if "images" in (kind, accepted):  # images for text or text for images: no option lets it in
        assert "reads images" in message and "reads text" in message and "init_only" not in message
        with pytest.raises(ConfigError, match="reads images"):
            _start(targets[target], path, tmp_path, embeddings_only=True)
        return
    assert fix in message and "or add init_only=embeddings to load the embedding alone" in message
    assert f"its {sum(1 for n in _source_names(path) if n.startswith(kind + '.'))} {kind} tensors" in message
    _start(targets[target], path, tmp_path, embeddings_only=True)


def _source_names(path: Path) -> list[str]:
    from trident.weights.init_from import read_init_source

    return list(read_init_source(str(path)).state_dict)


def _table(run: Path) -> dict[tuple[str, str], dict[str, str]]:
    with (run / "init" / "weights.csv").open() as file:
        return {(row["outcome"], row["group"]): row for row in csv.DictReader(file)}


def test_gpt2_into_an_encoder_classifier_is_one_line_through_train_py(sources: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    gpt2 = sources["GPT-2 directory"]
    refused = run_in_process("train.py", [*CLASSIFY_FROM, f"init_from={gpt2}", "paths.output_root=outputs"],
                             tmp_path, monkeypatch)
    assert refused.returncode == 2, refused.stderr
    # 27: two blocks of 12 tensors, the final norm's two and the position table
    assert refused.last_line == (
        f"error: init_from={gpt2} holds a task=lm model, a decoder (causal): its 27 decoder tensors have no place in "
        "task=classify with task.stack=encoder, an encoder (bidirectional) that would train from scratch with only the "
        "embedding loaded: set task.stack=decoder task.pool=last, or add init_only=embeddings to load the embedding alone")
    assert not [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()] + list(tmp_path.glob("outputs/runs/*/*"))
    bad = run_in_process("train.py", [*CLASSIFY_FROM, f"init_from={gpt2}", "init_only=embedding"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and bad.last_line == ("error: init_only='embedding' is not supported (did you mean "
                                                     "embeddings?): choose one of null, embeddings"), bad.stderr


def test_init_only_embeddings_starts_an_encoder_from_gpt2s_embedding(sources: dict[str, Path], labelled: list[str],
                                                                    tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(compose_config([*CLASSIFY_FROM, *labelled, *ONE_STEP, f"init_from={sources['GPT-2 directory']}", "init_only=embeddings",
                          "optimizer.lr=1e-30", "scheduler=constant"], output_dir=run))
    rows = _table(run)
    source = torch.load(run / "init" / "weights.pt", map_location="cpu", weights_only=True)
    decoder = [t for n, t in source.items() if n.startswith("decoder.blocks.")]
    assert {key for key in rows if key[0] == "loaded"} == {("loaded", "embed")}
    assert int(rows[("dropped", "decoder.blocks")]["tensors"]) == len(decoder) == 24
    assert int(rows[("dropped", "decoder.blocks")]["parameters"]) == sum(t.numel() for t in decoder)
    assert ("new", "encoder.blocks") in rows
    weights = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert torch.equal(weights["net.embed.weight"], source["embed.weight"])


def test_an_lm_run_fine_tunes_a_decoder_classifier_with_its_decoder(sources: dict[str, Path], labelled: list[str],
                                                                    tmp_path: Path) -> None:
    """The README's way from a task=lm run: task.stack=decoder task.pool=last, every decoder tensor loaded."""
    run = tmp_path / "run"
    train(compose_config([*CLASSIFY_SMALL, *labelled, *ONE_STEP, *DECODER, f"init_from={sources['lm run']}"], output_dir=run))
    rows = _table(run)
    assert {group for outcome, group in rows if outcome == "loaded"} >= {"embed", "decoder.blocks"}
    assert {group for outcome, group in rows if outcome == "new"} == {"head"}
    # init_only=embeddings holds the matching decoder back: the table says so.
    embedding_only = tmp_path / "embedding_only"
    train(compose_config([*CLASSIFY_SMALL, *labelled, *ONE_STEP, *DECODER, f"init_from={sources['lm run']}",
                          "init_only=embeddings"], output_dir=embedding_only))
    rows = _table(embedding_only)
    assert {group for outcome, group in rows if outcome == "loaded"} == {"embed"}
    assert rows[("new", "decoder.blocks")]["note"] == rows[("dropped", "decoder.blocks")]["note"] == (
        "init_only=embeddings: not loaded")


class TiedLM(torch.nn.Module):
    """An LM's parts as trident names them, the output layer tied to the token table."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 4)
        self.decoder = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_init_only_embeddings_on_the_same_stack_loads_the_embedding_and_its_tied_head_alone() -> None:
    net, source = TiedLM(seed=1), TiedLM(seed=2)
    rows = {(r.outcome, r.group): r for r in transfer_weights(net, source.state_dict(), "src", embeddings_only=True)}
    assert torch.equal(net.embed.weight, source.embed.weight) and torch.equal(net.head.weight, source.embed.weight)
    assert not torch.equal(net.decoder.weight, source.decoder.weight), "the decoder keeps its own initialisation"
    assert set(rows) == {("loaded", "embed"), ("loaded", "head"), ("new", "decoder"), ("dropped", "decoder")}
    assert rows[("new", "decoder")].note == rows[("dropped", "decoder")].note == "init_only=embeddings: not loaded"
    everything = {(r.outcome, r.group) for r in transfer_weights(TiedLM(seed=3), source.state_dict(), "src")}
    assert everything == {("loaded", "embed"), ("loaded", "head"), ("loaded", "decoder")}

