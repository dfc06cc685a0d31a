"""task=classify with a tokenizer that starts every text with a class token (BERT's [CLS], RoBERTa's <s>):
the data are the tokenizer's own ids, cut as transformers cuts them; the model pools that token at the
positions of pre-training, with no learned [CLS] vector of its own: from a BERT directory the first
layer's input and the pooled vector are transformers'. trident's own tokenizers keep the learned vector."""

from __future__ import annotations

import csv
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import trident
from trident.data.text_classification import TextClassificationDataModule, pad_batch
from trident.errors import ConfigError
from trident.runs.pipeline import build_data_and_task, check_config, configured_task_class, train
from trident.weights.init_from import source_for_run
from trident.weights.transfer import transfer_weights

from .conftest import compose_config
from .convert_helpers import randomise
from .test_classify import CLASSIFY_SMALL

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "through", "green", "parks", "and", "birds",
         "flew", "over", "old", "houses"]
MAX_LENGTH = 12  # data.max_length: the longer texts below are cut to it
SIZES = {"train": 24, "validation": 7, "test": 5}


def texts_of(split: str) -> list[str]:
    """Texts of 2 to 18 words (so some are cut at MAX_LENGTH), drawn per split."""
    rng = random.Random(split)
    return [" ".join(rng.choices(WORDS, k=rng.randint(2, 18))) for _ in range(SIZES[split])]


def write_splits(folder: Path) -> dict[str, str]:
    files = {}
    for split in SIZES:
        files[split] = str(folder / f"{split}.csv")
        with open(files[split], "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["text", "label"])
            writer.writerows((text, "xyz"[i % 3]) for i, text in enumerate(texts_of(split)))
    return files


def bert_tokenizer() -> Tokenizer:
    """BERT's pipeline: BertNormalizer, BertPreTokenizer, WordPiece, [CLS] $A [SEP]."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts_of("train"), trainers.WordPieceTrainer(
        vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def bert_tokenizer_with_limits() -> Tokenizer:
    """BERT's, with padding and truncation of its own, as some Hub files have them: data.max_length
    cuts and the batch pads, not the file."""
    tokenizer = bert_tokenizer()
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=16)
    tokenizer.enable_truncation(max_length=MAX_LENGTH - 4)
    return tokenizer


def roberta_tokenizer() -> Tokenizer:
    """Byte-level BPE with RoBERTa's post-processor: <s> $A </s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.train_from_iterator(texts_of("train"), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tokenizer


def save_bert(folder: Path) -> torch.nn.Module:
    """A random BERT of non-default shapes (width 48, 3 heads, 3 layers) with its tokenizer.json."""
    tokenizer = bert_tokenizer()
    config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=48, num_hidden_layers=3,
                                     num_attention_heads=3, intermediate_size=72, max_position_embeddings=40,
                                     layer_norm_eps=1e-7)
    # Weights far from BERT's initial ones, so that the position and token-type rows and the LayerNorm matter.
    model = randomise(transformers.BertForMaskedLM(config), seed=3, std=0.3).eval()
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return model


def prepared(tmp_path: Path, tokenizer: str, max_length: int = MAX_LENGTH) -> TextClassificationDataModule:
    """The data module of the splits above, its cache built (``setup`` still to come)."""
    module = TextClassificationDataModule(source="files", files=write_splits(tmp_path), tokenizer=tokenizer,
                                          max_length=max_length, cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    return module


def classify_from(bert: Path, files: dict[str, str]) -> list[str]:
    """The command line of a classify run from ``bert`` (the architecture comes from it: no model=nano)."""
    small = [o for o in CLASSIFY_SMALL if o != "model=nano" and not o.startswith("data.max_length")]
    return [*small, f"init_from={bert}", "data.source=files", f"data.max_length={MAX_LENGTH}",
            f"data.files={{train: {files['train']}, validation: {files['validation']}, test: {files['test']}}}"]


@pytest.mark.parametrize("make_tokenizer", [bert_tokenizer, bert_tokenizer_with_limits, roberta_tokenizer])
def test_the_data_are_the_tokenizers_ids_cut_keeping_the_closing_token(tmp_path: Path, make_tokenizer: Callable[[], Tokenizer]) -> None:
    tokenizer = make_tokenizer()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    module = prepared(tmp_path, str(tmp_path / "tokenizer.json"))
    module.setup()
    tokenizer.no_padding()
    tokenizer.no_truncation()
    cut = 0
    for split in SIZES:
        for i, text in enumerate(texts_of(split)):
            ids = tokenizer.encode(text).ids
            expected = ids if len(ids) <= MAX_LENGTH else ids[: MAX_LENGTH - 1] + ids[-1:]
            cut += len(ids) > MAX_LENGTH
            assert module.splits[split][i][0].tolist() == expected, (split, i)
    assert cut >= 5, "the cut case is tested"
    assert module.task_inputs()["class_token_in_text"] is True


def test_tridents_own_tokenizer_leaves_room_for_the_learned_class_vector(tmp_path: Path) -> None:
    module = prepared(tmp_path, "char")
    module.setup()
    assert module.tokenizer is not None and module.task_inputs()["class_token_in_text"] is False
    text = texts_of("validation")[0]
    assert module.splits["validation"][0][0].tolist() == module.tokenizer.encode(text).ids[: MAX_LENGTH - 1]


def test_a_max_length_with_no_room_for_text_is_one_line(tmp_path: Path) -> None:
    bert_tokenizer().save(str(tmp_path / "tokenizer.json"))
    module = prepared(tmp_path, str(tmp_path / "tokenizer.json"), max_length=2)
    with pytest.raises(ConfigError) as caught:
        module.setup()
    assert str(caught.value) == ("data.max_length=2 leaves no token of text beside [CLS], [SEP]: "
                                 "set data.max_length=3 or more")


def test_bert_into_classify_feeds_the_first_layer_and_pools_cls_as_transformers_does(tmp_path: Path) -> None:
    reference = save_bert(tmp_path / "bert")
    run = tmp_path / "run"
    cfg = compose_config(classify_from(tmp_path / "bert", write_splits(tmp_path)), output_dir=run)
    source = source_for_run(configured_task_class(cfg), cfg, run, None, embeddings_only=False)  # the pipeline's steps up to the first batch
    assert source is not None
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    transfer_weights(task.net, source.state_dict, source.source)
    task.eval()
    texts = texts_of("validation")
    ids, padding, _ = pad_batch([datamodule.splits["validation"][i] for i in range(len(texts))])  # (B, T)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "bert" / "tokenizer.json"),
                                                        pad_token="[PAD]")
    inputs = hf_tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")
    assert ids.tolist() == inputs["input_ids"].tolist()
    assert (~padding).long().tolist() == inputs["attention_mask"].tolist()
    assert padding.any() and ids.size(1) == MAX_LENGTH, "padded rows and cut rows in the batch"
    seen: dict[str, torch.Tensor] = {}
    task.net.encoder.blocks[0].register_forward_pre_hook(lambda _, args: seen.setdefault("first_layer", args[0]))
    task.net.head.register_forward_pre_hook(lambda _, args: seen.setdefault("pooled", args[0]))
    with torch.no_grad():
        task(ids, padding)
        expected = reference.bert(**inputs, output_hidden_states=True)
    real = ~padding
    # Embeddings, positions from 0, token type 0 and the embedding LayerNorm: BERT's, position by position.
    torch.testing.assert_close(seen["first_layer"][real], expected.hidden_states[0][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen["pooled"], expected.last_hidden_state[:, 0], atol=1e-5, rtol=1e-5)


def test_bert_into_classify_trains_with_no_new_class_vector_and_resumes(tmp_path: Path) -> None:
    save_bert(tmp_path / "bert")
    run = tmp_path / "run"
    args = [*classify_from(tmp_path / "bert", write_splits(tmp_path)), "test=false", "trainer.max_steps=2"]
    train(compose_config(args, output_dir=run))
    with (run / "init" / "weights.csv").open() as file:
        rows = {(row["outcome"], row["group"]) for row in csv.DictReader(file)}
    assert {group for outcome, group in rows if outcome == "new"} == {"head"}, "BERT's [CLS] is pooled: no cls_token"
    assert ("loaded", "encoder.pos_encoding.embedding") in rows
    tuned = trident.load(run)
    assert tuned.hparams["class_token_in_text"] is True and "cls_token" not in dict(tuned.net.named_parameters())
    train(compose_config([*args, f"resume={run}", "trainer.max_steps=4"], output_dir=run))
    resumed = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 4
    assert {int(s["step"]) for s in resumed["optimizer_states"][0]["state"].values()} == {4}, "the optimizer continued"
