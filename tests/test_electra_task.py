"""task=electra (issue 55, item 3): the loss is the generator's MLM loss + lambda x the discriminator's binary cross
entropy, by hand on a tiny batch; two uneven micro-batches step as the batch they make; the discriminator term gives
the generator's own weights no gradient; bad settings are one line each."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from trident.data.masking import mask_tokens, masking_generator
from trident.errors import ConfigError
from trident.tasks import electra
from trident.tasks.electra import ElectraTask
from trident.tasks.mlm import STAGES

from .conftest import SMALL, compose_config
from .test_token_loss import Batches

VOCAB, MASK, PAD = 20, 18, 19  # 18 regular tokens, then [MASK] and [PAD]
BACKBONE = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 16, "pos_encoding": "learned",
            "norm_first": False, "embedding_norm": True, "dropout": 0.0, "attn_dropout": 0.0}


def electra_task(**settings: Any) -> ElectraTask:
    torch.manual_seed(0)
    return ElectraTask(BACKBONE, VOCAB, {"name": "sgd", "lr": 1.0}, {"name": "constant"}, mask_id=MASK, pad_id=PAD,
                       num_regular_tokens=MASK, **settings)


def blocks(rows: int, seed: int = 1) -> Tensor:
    return torch.randint(0, MASK, (rows, 16), generator=torch.Generator().manual_seed(seed))


def test_the_networks_share_their_embeddings_and_the_generator_is_a_quarter_as_wide() -> None:
    task = electra_task()
    generator, discriminator = task.generator, task.net
    assert (generator.cfg.d_model, generator.cfg.n_heads, generator.cfg.d_ff) == (8, 1, 16)
    assert generator.cfg.embedding_dim == 32, "the discriminator's embedding width, projected to the generator's"
    assert generator.embed is discriminator.embed and generator.head.weight is discriminator.embed.weight
    assert generator.encoder.pos_encoding is discriminator.encoder.pos_encoding
    assert generator.encoder.embedding_norm is discriminator.encoder.embedding_norm
    optimized = [p for group in task.parameter_groups(0.1) for p in group["params"]]
    assert len(optimized) == len({id(p) for p in optimized}) == len(list(task.parameters())), "each weight once"


def test_the_loss_is_the_generators_mlm_loss_plus_lambda_times_the_discriminators_bce_by_hand() -> None:
    task = electra_task(discriminator_weight=7.0)
    ids = blocks(3)
    step = task.step(ids, "val", 5)
    # The masks are task=mlm's of the same batch (ELECTRA's rates: 85% [MASK], the rest unchanged, none random).
    inputs, targets = mask_tokens(ids, task.masking, mask_id=MASK, num_regular_tokens=MASK,
                                  generator=masking_generator(ids.device, task.seed, STAGES["val"], 5, 0))
    select = targets != -100
    assert select.sum(dim=1).tolist() == [2, 2, 2] and not ((inputs != ids) & (inputs != MASK)).any()
    assert torch.equal(step.corrupted[~select], ids[~select]) and int(step.corrupted[select].max()) < MASK
    assert torch.equal(step.replaced, step.corrupted != ids)
    with torch.no_grad():
        logits = task.generator(inputs)[select].double()  # (6, V)
        mlm = -(logits.log_softmax(-1).gather(1, ids[select][:, None])).mean()
        x, y = task.net(step.corrupted).double(), step.replaced.double()  # (3, 16)
        bce = -(y * torch.log(torch.sigmoid(x)) + (1 - y) * torch.log(1 - torch.sigmoid(x))).mean()
    summed, count = (value.detach() for value in task.loss(step))
    assert int(count) == 6
    assert float(summed) / 6 == pytest.approx(float(mlm + 7.0 * bce), rel=1e-5)


def test_masks_and_samples_are_drawn_again_alike_and_differ_between_batches() -> None:
    """From (seed, stage, batch, rank): a resumed run draws as the uninterrupted one did."""
    task = electra_task()
    ids = blocks(4)
    first, again, other = (task.step(ids, "train", index).corrupted for index in (3, 3, 4))
    assert torch.equal(first, again) and not torch.equal(first, other)
    logits = torch.full((2, VOCAB), float("nan"))
    assert electra.sample_replacements(logits, (MASK, PAD), torch.Generator().manual_seed(0)).lt(MASK).all()


@pytest.mark.parametrize(("mask_id", "pad_id", "regular"), [
    (3, 0, VOCAB),  # BERT's WordPiece from weights: [PAD] 0, [MASK] 103, inside the tokenizer's own vocabulary
    (MASK, PAD, MASK - 1),  # <|endoftext|> (17) added after the corpus vocabulary, before [MASK] and [PAD]
])
def test_samples_are_never_mask_or_pad_by_id_and_may_be_any_text_token(mask_id: int, pad_id: int, regular: int) -> None:
    """The generator favouring [MASK], [PAD] and the last id: the samples are never the first two, wherever the
    tokenizer puts them, and the last (a token of the text, e.g. an added document end) is drawn."""
    torch.manual_seed(0)
    task = ElectraTask(BACKBONE, VOCAB, {"name": "sgd", "lr": 1.0}, {"name": "constant"}, mask_id=mask_id,
                       pad_id=pad_id, num_regular_tokens=regular)
    with torch.no_grad():
        task.generator.head.bias[[mask_id, pad_id, MASK - 1]] = 30.0
    ids = torch.randint(4, MASK - 1, (8, 16), generator=torch.Generator().manual_seed(1))
    step = task.step(ids, "train", 0)
    sampled = step.corrupted[step.corrupted != ids]
    assert not torch.isin(step.corrupted, torch.tensor([mask_id, pad_id])).any()
    assert (sampled == MASK - 1).float().mean() > 0.9


def test_the_discriminator_term_gives_the_generator_no_gradient() -> None:
    """Through the sample nothing flows; the shared embedding is trained by both terms."""
    task = electra_task()
    step = task.step(blocks(2), "train", 0)
    step.discriminator_summed.backward()
    shared = {id(p) for p in task.net.parameters()}
    own = [(name, p) for name, p in task.generator.named_parameters() if id(p) not in shared]
    assert own and all(p.grad is None for _, p in own), [name for name, p in own if p.grad is not None]
    assert task.net.embed.weight.grad is not None and task.net.detector[2].weight.grad is not None
    task.zero_grad(set_to_none=True)
    step = task.step(blocks(2), "train", 0)
    step.generator_summed.backward()
    assert all(p.grad is not None for _, p in own)
    assert task.net.detector[0].weight.grad is None and task.net.embed.weight.grad is not None


def fixed_masks(ids: Tensor, masking: Any, *, mask_id: int, num_regular_tokens: int,
                generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Positions 1, 6 and 11 of every row masked ([MASK]): the masks of a row whatever batch it is in."""
    targets = torch.full_like(ids, -100)
    targets[:, [1, 6, 11]] = ids[:, [1, 6, 11]]
    return ids.masked_fill(targets != -100, mask_id), targets


def most_likely(logits: Tensor, never: tuple[int, ...], generator: torch.Generator) -> Tensor:
    return logits[:, :MASK].argmax(dim=-1)


def one_step(task: ElectraTask, batches: list[Tensor], accumulate: int) -> dict[str, Tensor]:
    trainer = L.Trainer(accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        accelerator="cpu", devices=1, max_steps=1)
    trainer.fit(task, DataLoader(Batches(batches), batch_size=None, shuffle=False))
    metrics = {name: trainer.callback_metrics[name] for name in ("train/loss", "train/discriminator_loss")}
    return {**{k: v.detach().clone() for k, v in task.state_dict().items()}, **metrics}


def test_two_uneven_micro_batches_step_as_the_batch_they_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 rows then 1 (gradient accumulation 2) against the 4 rows at once: the same step and logged losses. The masks
    and samples are made row-wise here (fixed positions, the generator's most likely token), as the seeded draws of
    a batch are not those of its halves."""
    monkeypatch.setattr(electra, "mask_tokens", fixed_masks)
    monkeypatch.setattr(electra, "sample_replacements", most_likely)
    task = electra_task()
    ids = blocks(4)
    accumulated = one_step(copy.deepcopy(task), [ids[:3], ids[3:]], 2)
    whole = one_step(copy.deepcopy(task), [ids], 1)
    start = task.state_dict()
    for name, value in whole.items():
        if name.startswith("train/"):
            assert float(accumulated[name]) == pytest.approx(float(value), rel=1e-5), name
            continue
        moved = value - start[name]
        torch.testing.assert_close(accumulated[name] - start[name], moved, rtol=1e-4, atol=1e-5 * float(moved.abs().max()))
    assert any(not torch.equal(whole[name], start[name]) for name in start), "the step moved the weights"


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.generator_size=1.5"], ("task.generator_size must be in (0, 1] (the generator's width over the "
                                   "discriminator's), got 1.5: a generator wider than the discriminator is refused")),
    (["task.discriminator_weight=-1"], "task.discriminator_weight must be a number >= 0"),
    (["objective=masked_tokens"], "objective=masked_tokens does not apply to task=electra, which trains its own loss"),
    (["trainer=fsdp_cpu"], "task=electra's generator and discriminator share their embedding, which trainer=fsdp"),
    (["architecture=gpt2"], "model.family=gpt2 (architecture=gpt2) is not a discriminator's: task=electra trains"),
    (["architecture=llama"], "model.family=llama (architecture=llama) is not a discriminator's"),
    (["model.activation=swiglu"], "model.activation=swiglu is gated, which task=electra's heads"),
    (["data=mnist"], "data=mnist is not text data for task=electra"),
    (["distill=kd", "distill.teacher=teacher.ckpt"], ("distill=kd is for task=lm, classify, vit and translation, not "
                                                      "task=electra")),
    (["finetune=lora"], "finetune=lora adapts a pre-trained network, the rest frozen; task=electra pre-trains"),
])
def test_a_bad_electra_setting_is_one_line_before_any_work(overrides: list[str], message: str, tmp_path: Path) -> None:
    cfg = compose_config(["task=electra", "model=nano", *overrides], output_dir=tmp_path)
    with pytest.raises(ConfigError) as raised:
        ElectraTask.validate_config(cfg)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.parametrize(("settings", "message"), [
    ({"generator_size": 0.875}, ("task.generator_size=0.875 gives the generator a width of 28, which 3 heads of the "
                                 "discriminator's size 8 do not split")),
    ({"generator_size": 0}, "task.generator_size must be in (0, 1]"),
])
def test_a_generator_the_stack_cannot_build_is_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message.replace('(', '.').replace(')', '.')}"):
        electra_task(**settings)


def test_a_causal_stack_is_no_discriminator(tmp_path: Path) -> None:
    """A decoder's weights (task=lm) are refused as init_from of task=electra, as of task=mlm: the stack is an
    encoder's."""
    assert ElectraTask.STACK == "encoder"
    assert ElectraTask.other_stack(compose_config(["task=electra"], output_dir=tmp_path).task, "decoder")[1].startswith(
        "fine-tune it with task=lm")
    assert math.isclose(electra_task().discriminator_weight, 50.0)


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_an_electra_run_exports_both_networks_and_starts_a_classifier(tmp_path: Path) -> None:
    """train.py task=electra architecture=electra (a handful of steps on the default MLM data), then
    trident-export --format hf: the discriminator is ElectraForPreTraining with the run's logits, the generator beside
    it (generator/) ElectraForMaskedLM with the generator's; then task=classify init_from the run takes the
    discriminator's encoder."""
    transformers = pytest.importorskip("transformers")
    import trident
    from trident.commands.export import main as export_main
    from trident.runs.pipeline import train

    from .test_classify_class_token import CLASSIFY_SMALL, write_splits
    from .test_init_from import _history

    run = tmp_path / "electra"
    small = [o for o in SMALL if not o.startswith("task.sampling")]
    train(compose_config(["task=electra", "architecture=electra", *small, "logger=none", "test=false"], output_dir=run))
    logged = {key for row in _history(run) for key in row}
    assert {"train/loss", "train/generator_loss", "train/discriminator_loss", "val/loss", "val/discriminator_acc",
            "val/replaced_recall"} <= logged
    task = trident.load(run)
    export_main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    discriminator = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "hf").eval()
    generator = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf" / "generator").eval()
    assert (type(discriminator).__name__, type(generator).__name__) == ("ElectraForPreTraining", "ElectraForMaskedLM")
    ids = torch.randint(0, task.num_regular_tokens, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(discriminator(ids).logits, task.net(ids), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(generator(ids).logits, task.generator(ids), atol=1e-5, rtol=1e-5)

    classify = tmp_path / "classify"
    files = write_splits(tmp_path)
    small = [o for o in CLASSIFY_SMALL if o != "model=nano"]
    train(compose_config([*small, f"init_from={run}", "task.pooler=gelu", "trainer.max_steps=1", "optimizer.lr=1e-30",
                          "scheduler=constant", "test=false", "data.source=files",
                          (f"data.files={{train: {files['train']}, validation: {files['validation']}, "
                           f"test: {files['test']}}}")], output_dir=classify))
    classifier = trident.load(classify)
    assert classifier.net.cfg.family == "electra" and classifier.net.cfg.embedding_dim == task.net.cfg.embedding_dim
    for name, tensor in task.net.encoder.state_dict().items():
        torch.testing.assert_close(classifier.net.encoder.state_dict()[name], tensor, rtol=0, atol=1e-20)


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_an_electra_classifier_read_trained_and_exported_keeps_the_sources_logits(tmp_path: Path) -> None:
    """task=classify init_from an ElectraForSequenceClassification directory (its WordPiece tokenizer, [CLS] ... [SEP]):
    the source sets task.pooler=gelu; one step that moves nothing, then trident-export --format hf gives the source's
    logits on the run's right-padded batch."""
    transformers = pytest.importorskip("transformers")
    import trident
    from trident.commands.export import main as export_main
    from trident.runs.pipeline import train

    from .convert_helpers import randomise
    from .test_classify_class_token import MAX_LENGTH, bert_tokenizer, classify_from, texts_of, write_splits

    tokenizer = bert_tokenizer()
    config = transformers.ElectraConfig(vocab_size=tokenizer.get_vocab_size(), embedding_size=16, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                        max_position_embeddings=40, num_labels=3)
    reference = randomise(transformers.ElectraForSequenceClassification(config), seed=3, std=0.3).eval()
    reference.save_pretrained(tmp_path / "source")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                         cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
                                         ).save_pretrained(tmp_path / "source")
    run = tmp_path / "run"
    train(compose_config([*classify_from(tmp_path / "source", write_splits(tmp_path)), "trainer.max_steps=1",
                          "optimizer.lr=1e-30", "scheduler=constant", "test=false"], output_dir=run))
    task = trident.load(run)
    assert task.hparams.pooler == "gelu" and task.net.cfg.family == "electra"
    export_main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(exported) is type(reference)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "source")
    inputs = hf_tokenizer(texts_of("validation"), truncation=True, max_length=MAX_LENGTH, padding=True,
                          return_tensors="pt")
    assert (inputs["attention_mask"] == 0).any(), "right-padded rows in the batch"
    with torch.no_grad():
        expected = reference(**inputs).logits
        torch.testing.assert_close(task.net(inputs["input_ids"], key_padding_mask=inputs["attention_mask"] == 0),
                                   expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(exported(**inputs).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("args", "line"), [
    (["task.generator_size=1.5"], "error: task.generator_size must be in (0, 1]"),
    (["architecture=gpt2"], "error: model.family=gpt2 (architecture=gpt2) is not a discriminator's"),
])
def test_train_py_refuses_a_bad_electra_run_in_one_line(args: list[str], line: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from .entry_points import run_in_process

    result = run_in_process("train.py", ["task=electra", *args, "paths.output_root=outputs"], tmp_path, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert result.last_line.startswith(line)
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.ckpt"))
