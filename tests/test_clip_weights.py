"""CLIP weights through the entry points (issue 54 item 3): task=clip ``init_from=`` a Hugging Face ``CLIPModel``
directory (the pipeline of train.py, in process) or an open_clip directory as open_clip saves it (``save_for_hf``),
the towers' sizes, the geometry, the statistics and the tokenizer taken from the source and the loaded network's
features equal the source's; ``trident-export --format hf`` writes a ``CLIPModel`` directory transformers reads with
equal features and the source's tensors bit for bit, and a tokenizer that ends each text where the text tower pools;
bad sources and contradicting settings in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import Tensor

import trident
from trident.data.image_text import caption_ids, word_tokenizer
from trident.errors import ConfigError, DataError
from trident.runs.lifecycle import prepare_networks
from trident.runs.pipeline import build_data_and_task, check_config, configured_task_class, train
from trident.tasks.base import TridentTask
from trident.tasks.networks import converting_later
from trident.weights.adapters.hf_writing import write_json
from trident.weights.adapters.open_clip_files import CONFIG, WEIGHTS
from trident.weights.init_from import source_for_run

from .conftest import compose_config
from .convert_helpers import randomise
from .open_clip_reference import import_open_clip
from .test_convert_clip import CONTEXT, EOS, OPEN_CLIP_CONFIG, VOCAB, _inputs, _projected, _reference, trident_clip

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

# A run that moves no weight (lr 1e-30): what it loaded is what it saves and exports. The digits are data.source, so
# no name source (the default's is the digits) and no zero-shot class (its name would train in no caption).
FROZEN = ["task=clip", "logger=none", "test=false", "data.source=digits", "data.name_source=null",
          "data.zero_shot_classes=[]", "data.validation_size=32", "data.test_size=32", "data.batch_size=16",
          "trainer.max_steps=2", "trainer.max_epochs=1", "trainer.limit_val_batches=1",
          "trainer.num_sanity_val_steps=0", "optimizer.lr=1e-30", "scheduler=constant", "print_config=false",
          "callbacks.progress_bar=null", "callbacks.model_summary=null"]
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.3, 0.25]  # a processor's statistics, not OpenAI's
WORDS = ["a", "photo", "of", "the", "digit", "handwritten", "number", "picture", ".", "zero", "one", "two", "three",
         "four", "five", "six", "seven", "eight", "nine"]


def clip_tokenizer() -> Tokenizer:
    """A word-level tokenizer of CLIP's shape over the digits' captions: ``VOCAB`` ids, <|startoftext|> before each text,
    <|endoftext|> (``EOS``, the last id, where CLIP's is) after it."""
    vocabulary = {"<unk>": 0} | {word: i + 1 for i, word in enumerate(WORDS)}
    vocabulary |= {f"unused{i}": i for i in range(len(vocabulary), EOS - 1)} | {"<|startoftext|>": EOS - 1,
                                                                              "<|endoftext|>": EOS}
    assert len(vocabulary) == VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", EOS - 1), ("<|endoftext|>", EOS)])
    return tokenizer


@pytest.fixture(scope="module")
def hf_clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """transformers' CLIPModel, every parameter randomised, saved with its tokenizer and its processor's statistics."""
    model, directory = _reference(tmp_path_factory.mktemp("source"))
    clip_tokenizer().save(str(directory / "tokenizer.json"))
    write_json(directory / "preprocessor_config.json", {"image_mean": MEAN, "image_std": STD})
    return model, directory


def _features(net: Any, images: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``net``'s projected image and text features, trident's ``encode_*`` or transformers' ``get_*_features``."""
    if hasattr(net, "encode_image"):
        return net.encode_image(images), net.encode_text(ids)
    return _projected(net.get_image_features(pixel_values=images)), _projected(net.get_text_features(input_ids=ids))


def assert_same_features(ours: Any, theirs: Any) -> None:
    images, ids = _inputs(EOS)
    with torch.no_grad():
        for mine, reference in zip(_features(ours, images, ids), _features(theirs, images, ids), strict=True):
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)


def test_init_from_a_clipmodel_directory_trains_and_exports_back_exactly(hf_clip: tuple[Any, Path],
                                                                        tmp_path: Path) -> None:
    """The pipeline of ``python train.py task=clip init_from=<CLIPModel dir>``: the sizes of both towers, the
    projection, the image geometry and statistics, the context and the tokenizer come from the directory; the run's
    network gives transformers' features and logits; ``trident-export --format hf`` writes the same tensors back."""
    from trident.commands.export import main as export

    reference, directory = hf_clip
    run = tmp_path / "run"
    train(compose_config([*FROZEN, f"init_from={directory}"], output_dir=run))
    used = OmegaConf.to_container(OmegaConf.load(run / "config_resolved.yaml"))
    assert isinstance(used, dict)
    assert (used["model"]["d_model"], used["model"]["n_layers"], used["model"]["family"]) == (32, 2, "clip")
    assert {k: used["task"]["image"][k] for k in ("d_model", "n_heads", "n_layers", "d_ff", "embedding_norm")} == {
        "d_model": 24, "n_heads": 2, "n_layers": 3, "d_ff": 40, "embedding_norm": True}
    data = used["data"]
    assert (used["task"]["embed_dim"], data["image_size"], data["patch_size"], data["in_channels"], data["max_length"]) == (
        20, 16, 4, 3, 12)
    assert (data["mean"], data["std"]) == (MEAN, STD)
    task = trident.load(run)
    assert task.tokenizer.get_vocab() == clip_tokenizer().get_vocab(), "the source's tokenizer, not one of the captions"
    assert_same_features(task.net.eval(), reference)
    images, ids = _inputs(EOS)
    with torch.no_grad():
        torch.testing.assert_close(task.net(images, ids), reference(input_ids=ids, pixel_values=images).logits_per_image,
                                   rtol=0, atol=1e-5)

    export([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    back = transformers.CLIPModel.from_pretrained(tmp_path / "hf").eval()
    assert_same_features(back, reference)
    original, written = reference.state_dict(), back.state_dict()
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "a photo of the digit two ."
    assert tokenizer(text).input_ids == clip_tokenizer().encode(text).ids
    # The run itself, as a source: it fixes what its source fixed.
    again = compose_config([*FROZEN, f"init_from={run}"], output_dir=tmp_path / "again")
    source_for_run(configured_task_class(again), again, tmp_path / "again", None, False)
    assert (again.task.embed_dim, again.task.image.n_layers, again.model.d_model, again.data.max_length) == (20, 3, 32, 12)
    assert (again.data.image_size, again.data.in_channels, list(again.data.mean)) == (16, 3, MEAN)


def built_from(overrides: list[str], run: Path) -> TridentTask:
    """The task of ``python train.py <overrides>`` with its ``init_from`` source's weights loaded, as the pipeline builds
    it before training (nothing trains)."""
    cfg = compose_config([*FROZEN, *overrides], output_dir=run)
    source = source_for_run(configured_task_class(cfg), cfg, run, None, False)
    backbone = check_config(cfg)
    with converting_later():
        _, task = build_data_and_task(cfg, backbone, "fit")
    prepare_networks(task, cfg, source, None, False, False, False)
    return task


def open_clip_directory(tmp_path: Path) -> tuple[Any, Path]:
    """An open_clip CLIP built by open_clip from its config, every parameter randomised, saved as open_clip saves a
    model for the Hub (``save_for_hf``: open_clip_config.json, the weights, the tokenizer)."""
    open_clip = import_open_clip()
    from open_clip.push_to_hf_hub import save_for_hf

    torch.manual_seed(0)
    model = randomise(open_clip.model.CLIP(**OPEN_CLIP_CONFIG), seed=3).eval()
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    # What open_clip's create_model sets: the statistics save_for_hf writes as its preprocess_cfg.
    open_clip.model.set_model_preprocess_cfg(model, {"size": 16, "mean": MEAN, "std": STD})
    transformers.PreTrainedTokenizerFast(tokenizer_object=clip_tokenizer(), bos_token="<|startoftext|>",
                                         eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    save_for_hf(model, open_clip.tokenizer.HFTokenizer(str(tmp_path / "tok")), OPEN_CLIP_CONFIG, str(tmp_path / "open_clip"))
    return model, tmp_path / "open_clip"


def test_init_from_an_open_clip_directory_gives_open_clips_features(tmp_path: Path) -> None:
    """The directory open_clip writes (and reads back itself: ``create_model("local-dir:...")``) starts a task=clip run
    with open_clip's tokenizer and features; open_clip pools the text at its largest id, the run at its tokenizer's
    <|endoftext|>, the last id."""
    open_clip = import_open_clip()
    model, directory = open_clip_directory(tmp_path)
    assert (directory / CONFIG).is_file() and (directory / WEIGHTS[0]).is_file()
    reread = open_clip.create_model(f"local-dir:{directory}").eval()
    assert all(torch.equal(reread.state_dict()[k], v) for k, v in model.state_dict().items())
    task = built_from([f"init_from={directory}"], tmp_path / "run")
    assert (task.hparams.mean, task.hparams.std, task.hparams.image_size, task.hparams.in_channels) == (MEAN, STD, 16, 3)
    assert task.tokenizer is not None and task.tokenizer.get_vocab() == clip_tokenizer().get_vocab()
    net = task.net.eval()
    images, ids = _inputs(None)
    with torch.no_grad():
        torch.testing.assert_close(net.encode_image(images), model.encode_image(images), rtol=0, atol=1e-5)
        torch.testing.assert_close(net.encode_text(ids), model.encode_text(ids), rtol=0, atol=1e-5)
        image, text, scale = model(images, ids)[:3]
        torch.testing.assert_close(net(images, ids), scale * image @ text.T, rtol=0, atol=1e-5)


def test_an_exported_run_tokenizes_as_it_trained(tmp_path: Path) -> None:
    """A run's own caption tokenizer (data.tokenizer=null) goes with its hf export: transformers' tokenizer read from the
    directory ends each text in <|endoftext|> and pads with it, so ``get_text_features`` of its ids are the run's
    features of the captions as it encoded them."""
    from trident.weights.adapters.hf_export import write_hf

    captions = ["a photo of the digit two.", "a handwritten nine.", "seven"]
    tokenizer = word_tokenizer(captions)
    net = trident_clip()
    net.text.vocab_size, net.text.eos_id = VOCAB, tokenizer.token_to_id("<|endoftext|>")
    with torch.no_grad():
        write_hf(net, tokenizer, None, tmp_path / "hf")
        ours = net.encode_text(caption_ids(tokenizer, captions, CONTEXT))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = hf_tokenizer(captions, padding=True, return_tensors="pt").input_ids
    assert (ids == net.text.eos_id).any(dim=1).all(), "each text ends in <|endoftext|>"
    with torch.no_grad():
        theirs = _projected(transformers.CLIPModel.from_pretrained(tmp_path / "hf").eval().get_text_features(input_ids=ids))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("task", ["vit", "lm"])
def test_a_clip_directory_given_to_another_task_names_task_clip(task: str, hf_clip: tuple[Any, Path],
                                                                tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"holds a task=clip model, which reads images and text; task={task} reads "
                                          rf".*: run it with task=clip, or pass the weights of") as caught:
        train(compose_config([f"task={task}", "model=nano", "logger=none", f"init_from={hf_clip[1]}"],
                             output_dir=tmp_path / "run"))
    assert "\n" not in str(caught.value) and "clip" not in str(caught.value).partition("pass the weights of")[2]


@pytest.mark.parametrize(("override", "message"), [
    ("+task.image.n_layers=5", "task.image.n_layers=5 contradicts init_from=.*, which has task.image.n_layers=3"),
    ("+task.text.d_model=64", "task.text.d_model=64 contradicts init_from=.*, which has task.text.d_model=32"),
    ("model.d_model=64", "model.d_model=64 contradicts init_from=.*, which has model.d_model=32"),
    ("task.embed_dim=8", "task.embed_dim=8 contradicts init_from=.*, which has task.embed_dim=20"),
    ("data.image_size=32", "data.image_size=32 contradicts init_from=.*, which has data.image_size=16"),
    ("data.max_length=16", "data.max_length=16 contradicts init_from=.*, which has data.max_length=12"),
])
def test_a_setting_the_clip_source_states_otherwise_is_one_line(override: str, message: str, hf_clip: tuple[Any, Path],
                                                                tmp_path: Path) -> None:
    cfg = compose_config([*FROZEN, f"init_from={hf_clip[1]}", override], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"^{message}: drop that override \(the architecture comes from the weights\)$"):
        source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, False)


def test_a_towers_training_setting_and_other_statistics_are_kept(hf_clip: tuple[Any, Path], tmp_path: Path) -> None:
    cfg = compose_config([*FROZEN, f"init_from={hf_clip[1]}", "+task.image.dropout=0.1", "+task.text.dropout=0.2",
                          "data.mean=[0.5,0.5,0.5]"], output_dir=tmp_path / "run")
    source_for_run(configured_task_class(cfg), cfg, tmp_path / "run", None, False)
    assert (cfg.task.image.dropout, cfg.task.image.n_layers, cfg.task.text.dropout) == (0.1, 3, 0.2)
    assert (list(cfg.data.mean), list(cfg.data.std)) == ([0.5] * 3, STD)


@pytest.mark.parametrize(("model_cfg", "what"), [
    ({"vision_cfg": {"layers": [1, 1, 1, 1], "width": 16, "image_size": 16}}, r"ResNet image tower \(vision_cfg.layers="),
    ({"vision_cfg": {"attentional_pool": True}}, "vision_cfg.attentional_pool=True setting"),
    ({"vision_cfg": {"timm_model_name": "vit_tiny_patch16_224"}}, "vision_cfg.timm_model_name='vit_tiny_patch16_224'"),
    ({"text_cfg": {"hf_model_name": "roberta-base"}}, "text_cfg.hf_model_name='roberta-base' setting"),
    ({"text_cfg": {"no_causal_mask": True, "pool_type": "last"}}, "text_cfg.no_causal_mask=True setting"),
    ({"custom_text": True}, "custom_text=True setting"),
])
def test_an_open_clip_architecture_trident_cannot_hold_is_one_line(model_cfg: dict[str, Any], what: str,
                                                                  tmp_path: Path) -> None:
    """What open_clip builds that trident's CLIP cannot (a ResNet or timm image tower, an attentional pooler, a Hugging
    Face text tower, a text tower without its causal mask, CustomTextCLIP's layout) is refused as init_from reads it."""
    directory = tmp_path / "open_clip"
    directory.mkdir()
    config = {**OPEN_CLIP_CONFIG, **model_cfg}
    for tower in ("vision_cfg", "text_cfg"):
        config[tower] = {**OPEN_CLIP_CONFIG[tower], **model_cfg.get(tower, {})}
    write_json(directory / CONFIG, {"model_cfg": config})
    (directory / WEIGHTS[0]).write_bytes(b"")
    with pytest.raises(DataError, match=rf"open_clip's {what}.*, which trident cannot reproduce exactly$") as caught:
        train(compose_config([*FROZEN, f"init_from={directory}"], output_dir=tmp_path / "run"))
    assert "\n" not in str(caught.value)


def test_the_peft_export_of_a_clip_is_one_line() -> None:
    """trident's peft export places the adapters of one stack; CLIP's two towers are exported merged (--format hf)."""
    from trident.weights.adapters import hf_clip
    from trident.weights.adapters.peft_export import layout_for

    with pytest.raises(ConfigError, match=r"^--format peft writes the adapters of one stack and a CLIPModel has two: "
                                          r"export it with --format hf \(the adapters merged\)$"):
        layout_for(hf_clip, trident_clip())


def test_a_clip_directory_without_its_tokenizer_is_one_line(tmp_path: Path) -> None:
    """Without a tokenizer.json the run tokenizes its captions with its own vocabulary, which the embedding does not fit:
    one line naming the fix (the tokenizer the weights were trained with)."""
    _, directory = _reference(tmp_path)
    with pytest.raises(ConfigError, match=rf"^init_from={directory} has a vocabulary of {VOCAB} tokens \(text.embed.weight\), "
                                          r"this run's tokenizer \d+: .* give it the tokenizer the weights were trained "
                                          r"with$"):
        built_from([f"init_from={directory}"], tmp_path / "run")
