"""ALBERT and RoBERTa through the public entry points. task=classify from a Hugging Face sequence classifier: ``train``
with ``init_from=<directory>`` (its pooler, context and tokenizer come with it), one step at a learning rate that moves
nothing, then ``trident-export --format hf``: the exported classifier loads in transformers and gives the source's
logits on the run's own right-padded batch (RoBERTa's positions counted past its padding id). task=mlm from a masked
LM: its tokenizer's own mask and padding tokens, and transformers' loss on the run's first masked batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import trident
from trident.commands.export import main as export_main
from trident.runs.pipeline import train

from .conftest import compose_config
from .convert_helpers import randomise
from .test_classify_class_token import MAX_LENGTH, WORDS, classify_from, roberta_tokenizer, texts_of, write_splits
from .test_init_from import FROZEN, NEW_TEXT, SMALL_MLM, _first_val_batch, _history

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


def save_roberta_classifier(folder: Path) -> torch.nn.Module:
    tokenizer = roberta_tokenizer()
    config = transformers.RobertaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=40,
                                        type_vocab_size=1, num_labels=3)
    model = randomise(transformers.RobertaForSequenceClassification(config), seed=3, std=0.3).eval()
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<pad>", cls_token="<s>", sep_token="</s>").save_pretrained(folder)
    return model


def save_albert_classifier(folder: Path) -> torch.nn.Module:
    pieces = [f"▁{word}" for word in WORDS] + list("abcdefghijklmnopqrstuvwxyz")
    vocab = [("<pad>", 0.0), ("<unk>", 0.0), ("[CLS]", 0.0), ("[SEP]", 0.0), ("[MASK]", 0.0),
             *((piece, -1.0 - i / 10) for i, piece in enumerate(pieces))]
    transformers.AlbertTokenizer(vocab=vocab).save_pretrained(folder)
    config = transformers.AlbertConfig(vocab_size=len(vocab), embedding_size=12, hidden_size=32, num_hidden_layers=3,
                                       num_attention_heads=4, intermediate_size=48, max_position_embeddings=40,
                                       num_labels=3)
    model = randomise(transformers.AlbertForSequenceClassification(config), seed=3, std=0.3).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", ["roberta", "albert"])
def test_a_classifier_read_trained_and_exported_keeps_the_sources_logits(tmp_path: Path, family: str) -> None:
    save = save_roberta_classifier if family == "roberta" else save_albert_classifier
    reference = save(tmp_path / "source")
    run = tmp_path / "run"
    # lr 1e-30: the weights cannot move, so the exported classifier is the source's.
    train(compose_config([*classify_from(tmp_path / "source", write_splits(tmp_path)), "trainer.max_steps=1",
                          "optimizer.lr=1e-30", "scheduler=constant", "test=false"], output_dir=run))
    task = trident.load(run)
    assert task.hparams.pooler is True and task.net.cfg.family == family
    export_main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(exported) is type(reference)
    texts = texts_of("validation")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "source")
    inputs = hf_tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")
    ids, padding = inputs["input_ids"], inputs["attention_mask"] == 0
    assert padding.any(), "right-padded rows in the batch"
    with torch.no_grad():
        expected = reference(**inputs).logits
        torch.testing.assert_close(task.net(ids, key_padding_mask=padding), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(exported(**inputs).logits, expected, atol=1e-5, rtol=1e-5)


def albert_mlm(folder: Path) -> torch.nn.Module:
    """A random AlbertForMaskedLM whose AlbertTokenizer (Unigram) covers NEW_TEXT: <pad> (not [PAD]) and [MASK]."""
    words = sorted({word.strip(",.:").lower() for word in NEW_TEXT.split()} - {""})
    pieces = [*(f"▁{word}" for word in words), "▁", *"0123456789,.:"]
    vocab = [("<pad>", 0.0), ("<unk>", 0.0), ("[CLS]", 0.0), ("[SEP]", 0.0), ("[MASK]", 0.0),
             *((piece, -1.0 - i / 100) for i, piece in enumerate(pieces))]
    transformers.AlbertTokenizer(vocab=vocab).save_pretrained(folder)
    config = transformers.AlbertConfig(vocab_size=len(vocab), embedding_size=12, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    model = randomise(transformers.AlbertForMaskedLM(config), seed=0, std=0.3).eval()
    model.save_pretrained(folder)
    return model


def roberta_mlm(folder: Path) -> torch.nn.Module:
    """A random RobertaForMaskedLM whose byte-level BPE has RoBERTa's <s> <pad> </s> <unk> <mask>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([NEW_TEXT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<pad>", mask_token="<mask>").save_pretrained(folder)
    config = transformers.RobertaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=66,
                                        type_vocab_size=1)
    model = randomise(transformers.RobertaForMaskedLM(config), seed=0, std=0.3).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize(("family", "mask"), [("albert", "[MASK]"), ("roberta", "<mask>")])
def test_a_masked_lm_read_fine_tunes_from_its_own_loss_with_its_own_tokens(tmp_path: Path, family: str, mask: str) -> None:
    """task=mlm from the directory: its tokenizer's <pad> and mask are used (none added: the vocabulary is the
    embedding's), and the first validation loss is transformers' on the run's masked batch."""
    reference = (albert_mlm if family == "albert" else roberta_mlm)(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(NEW_TEXT)
    run = tmp_path / "run"
    overrides = [o for o in SMALL_MLM if o != "model=nano"]  # the sizes come from config.json
    train(compose_config([*overrides, *FROZEN, f"init_from={tmp_path / 'hf'}", "data=text_files",
                          f"data.files=[{corpus}]"], output_dir=run))
    task = trident.load(run)
    source = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert task.tokenizer.get_vocab_size() == reference.config.vocab_size, "nothing added"
    assert (task.mask_id, task.hparams.pad_id) == (source.convert_tokens_to_ids(mask), source.pad_token_id)
    inputs, targets = task.mask(_first_val_batch(run), "val", 0)  # the run's masks of its first validation batch
    select = targets != -100
    with torch.no_grad():
        expected = F.cross_entropy(reference(inputs).logits[select], targets[select]).item()
    assert next(r["val/loss"] for r in _history(run) if "val/loss" in r) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("family", ["albert", "roberta"])
def test_a_masked_lm_of_the_family_trained_here_exports_with_its_logits(tmp_path: Path, family: str) -> None:
    """architecture=<family> task=mlm (ALBERT: shared layers, a 128-wide embedding under the nano width 64), then
    trident-export --format hf: AutoModelForMaskedLM reads the family's class with the run's logits, its padding id
    the run's [PAD] (RoBERTa's positions are counted past it)."""
    run = tmp_path / "run"
    train(compose_config([*SMALL_MLM, *FROZEN, f"architecture={family}"], output_dir=run))
    task = trident.load(run)
    export_main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    exported = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == f"{family.capitalize()}ForMaskedLM"
    assert exported.config.pad_token_id == task.hparams.pad_id
    ids = torch.randint(0, task.hparams.pad_id, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(16)[None, :] < torch.tensor([16, 9, 3])[:, None]
    ids = ids.masked_fill(~mask, task.hparams.pad_id)
    with torch.no_grad():
        theirs = exported(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(task.net(ids, key_padding_mask=~mask)[mask], theirs[mask], atol=1e-5, rtol=1e-5)
