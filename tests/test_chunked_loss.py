"""The chunked cross-entropy (issue 57 item 1, ``task.loss_chunk``): the head's matmul and the softmax computed a chunk
of tokens at a time give the loss and the gradients of the plain loss on whole logits, for every vocabulary head
(a bias, BART's fixed logits bias, T5 v1.0's rescaled head, a padded token table, tied embeddings, a softcap), and
through the tasks (lm, translation, mlm) and the one loss reduction of an optimizer step.

The loss function alone is compared in float64 at 1e-12 (the chunks sum the weight's gradient in another order than
one matmul does); the tasks, whose plain loss is fp32 (``.float()``), in fp32 at 1e-6 of the largest value.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trident.backbone import VocabularyHead
from trident.data.masking import IGNORE_INDEX
from trident.errors import ConfigError
from trident.objectives import Outputs
from trident.runs.pipeline import build_data_and_task, check_config
from trident.tasks.lm import LanguageModelTask
from trident.tasks.mlm import MaskedLanguageModelTask
from trident.tasks.translation import TranslationTask
from trident.training.chunked_loss import DEFAULT_LOSS_CHUNK, chunked_cross_entropy

from .conftest import SMALL, compose_config
from .test_token_loss import VOCAB, SGDLanguageModel, micro_batches, one_step

BACKBONE = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 8, "pos_encoding": "learned",
            "dropout": 0.0}


def plain_loss(head: VocabularyHead, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """The reference: F.cross_entropy on the whole logits, summed over the trained targets."""
    logits = head.logits().flatten(0, -2)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing, reduction="sum")


def gradients(loss: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def assert_equal(got: list[Tensor], expected: list[Tensor], relative: float) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=relative * max(float(b.abs().max()), 1e-30))


def head_and_targets(dtype: torch.dtype, *, bias: bool, tokens: tuple[int, int] = (3, 7), vocab: int = 13,
                     width: int = 6) -> tuple[Tensor, nn.Linear, Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(*tokens, width, dtype=dtype, generator=generator).requires_grad_()
    linear = nn.Linear(width, vocab, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(vocab, width, dtype=dtype, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(vocab, dtype=dtype, generator=generator))
    targets = torch.randint(0, vocab, tokens, generator=generator)
    targets[0, :4] = IGNORE_INDEX  # a prompt that trains nothing
    targets[2, -1] = IGNORE_INDEX  # padding
    return hidden, linear, targets


# Chunks of 1 token, of 5 (which do not divide the 21 tokens), of 21 and one larger than the batch.
@pytest.mark.parametrize("chunk", [1, 5, 21, 1000])
@pytest.mark.parametrize(("label_smoothing", "bias", "softcap", "fixed_bias"), [
    (0.0, False, None, False),  # the LM's head
    (0.1, False, None, True),  # translation's, with BART's final_logits_bias
    (0.0, True, None, False),  # BERT's, with a bias of its own
    (0.2, True, 3.0, True),  # everything at once, Gemma 2's softcap too
])
def test_the_chunked_loss_and_gradients_equal_the_plain_ones_in_float64(
        chunk: int, label_smoothing: float, bias: bool, softcap: float | None, fixed_bias: bool) -> None:
    hidden, linear, targets = head_and_targets(torch.float64, bias=bias)
    extra = torch.randn(13, dtype=torch.float64) if fixed_bias else None
    head = VocabularyHead(hidden, linear, bias=extra, softcap=softcap, chunk=chunk)
    loss, nll, count = chunked_cross_entropy(head, targets, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)
    expected = plain_loss(head, targets, label_smoothing)
    assert int(count) == 21 - 5
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(nll, plain_loss(head, targets), rtol=1e-12, atol=0)
    wrt = [hidden, linear.weight, *([linear.bias] if bias else [])]
    # A factor on the loss (the step's 1 / tokens) reaches the gradients: the backward scales what the forward made.
    assert_equal(gradients(2.5 * loss, wrt), gradients(2.5 * expected, wrt), 1e-12)


def test_fp32_loss_and_gradients_are_the_plain_ones_within_1e_6() -> None:
    hidden, linear, targets = head_and_targets(torch.float32, bias=True, tokens=(4, 32), vocab=257, width=16)
    head = VocabularyHead(hidden, linear, chunk=24)
    loss = chunked_cross_entropy(head, targets, ignore_index=IGNORE_INDEX)[0]
    expected = plain_loss(head, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    wrt = [hidden, linear.weight, linear.bias]
    assert_equal(gradients(loss, wrt), gradients(expected, wrt), 1e-6)


def test_no_trained_token_is_a_loss_of_zero_with_zero_gradients() -> None:
    hidden, linear, targets = head_and_targets(torch.float32, bias=True)
    head = VocabularyHead(hidden, linear, chunk=4)
    loss, nll, count = chunked_cross_entropy(head, torch.full_like(targets, IGNORE_INDEX), ignore_index=IGNORE_INDEX,
                                             label_smoothing=0.1)
    assert float(loss.detach()) == 0.0 and float(nll) == 0.0 and int(count) == 0
    assert all(float(g.abs().max()) == 0.0 for g in gradients(loss, [hidden, linear.weight, linear.bias]))


def test_a_frozen_head_weight_gets_no_gradient_and_the_rest_theirs() -> None:
    """finetune=lora on task=mlm: the tied weight is frozen, the head's bias and the states before it train (no
    converter puts an adapter on a vocabulary head: LORA_TARGETS are the blocks' layers, NF4 keeps the head)."""
    hidden, linear, targets = head_and_targets(torch.float64, bias=True)
    linear.weight.requires_grad_(False)
    head = VocabularyHead(hidden, linear, chunk=5)
    loss = chunked_cross_entropy(head, targets, ignore_index=IGNORE_INDEX)[0]
    assert_equal(gradients(loss, [hidden, linear.bias]), gradients(plain_loss(head, targets), [hidden, linear.bias]),
                 1e-12)


def test_without_gradients_only_the_loss_is_computed() -> None:
    hidden, linear, targets = head_and_targets(torch.float64, bias=False)
    head = VocabularyHead(hidden, linear, chunk=5)
    with torch.no_grad():
        loss = chunked_cross_entropy(head, targets, ignore_index=IGNORE_INDEX)[0]
    assert not loss.requires_grad
    torch.testing.assert_close(loss, plain_loss(head, targets), rtol=1e-12, atol=0)


def test_under_bf16_autocast_the_loss_is_fp32_and_the_weights_gradient_summed_in_fp32() -> None:
    """The head's matmuls run in bf16 as the plain head's do under autocast; the loss and the weight's gradient
    (summed over 16 chunks) stay as close to the float64 truth as the plain loss's."""
    hidden, linear, targets = head_and_targets(torch.float32, bias=False, tokens=(8, 64), vocab=97, width=32)
    truth_head = VocabularyHead(hidden.detach().double().requires_grad_(), copy.deepcopy(linear).double())
    truth = plain_loss(truth_head, targets)
    truth_grad = gradients(truth, [truth_head.linear.weight])[0]
    errors = {}
    for chunk in (0, 32):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            head = VocabularyHead(hidden, linear, chunk=chunk)
            loss = (chunked_cross_entropy(head, targets, ignore_index=IGNORE_INDEX)[0] if chunk
                    else plain_loss(head, targets))
        assert loss.dtype == torch.float32
        grad = gradients(loss, [linear.weight])[0]
        assert grad.dtype == torch.float32
        errors[chunk] = (abs(float(loss.detach()) - float(truth.detach())) / float(truth.detach()),
                         float((grad.double() - truth_grad).abs().max() / truth_grad.abs().max()))
    assert errors[32][0] < 1e-2 and errors[32][1] < 2 * errors[0][1] + 1e-3, errors


def test_outputs_of_a_head_give_the_whole_logits_where_they_are_read() -> None:
    hidden, linear, targets = head_and_targets(torch.float32, bias=True)
    outputs = Outputs(VocabularyHead(hidden, linear, chunk=4), targets)
    assert torch.equal(outputs.logits, linear(hidden)) and outputs.logits is outputs.logits  # computed once


# --- through the tasks: the objective's loss and every parameter's gradient, task.loss_chunk on against 0 ---


def _objective_gradients(task: Any, batch: Any, chunk: int, stage: str = "train") -> tuple[Tensor, dict[str, Tensor]]:
    task = copy.deepcopy(task)
    task.loss_chunk = chunk
    loss, _ = task.objective(task, batch, stage)
    task.zero_grad()
    loss.summed.backward()
    grads = {name: p.grad.clone() for name, p in task.named_parameters() if p.grad is not None}
    return loss.summed.detach(), grads


def _assert_task_equal(task: Any, batch: Any, chunks: tuple[int, ...] = (5, 1000), stage: str = "train") -> None:
    expected, expected_grads = _objective_gradients(task, batch, 0, stage)
    assert expected_grads, "nothing trained"
    for chunk in chunks:
        loss, grads = _objective_gradients(task, batch, chunk, stage)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert grads.keys() == expected_grads.keys()
        assert_equal(list(grads.values()), list(expected_grads.values()), 1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_the_lm_task_padded_table_and_tied_head_chunked_equals_plain(tie: bool) -> None:
    """A padded token table (task.embedding_rows): its rows past the tokenizer's count in the softmax, chunked as
    plain; a tied head's gradient reaches the one matrix it shares with the embedding."""
    torch.manual_seed(0)
    task = LanguageModelTask(BACKBONE, VOCAB, {}, {}, tie_embeddings=tie, embedding_rows=16)
    assert task.loss_chunk == DEFAULT_LOSS_CHUNK and task.net.head.weight.shape[0] == 16
    inputs, targets = torch.randint(0, VOCAB, (3, 8)), torch.randint(0, VOCAB, (3, 8))
    targets[0, :5] = IGNORE_INDEX  # a chat prompt
    assert isinstance(task.outputs((inputs, targets), "train").scores, VocabularyHead)
    _assert_task_equal(task, (inputs, targets))


def test_the_lm_task_with_a_softcap_chunked_equals_plain() -> None:
    torch.manual_seed(0)
    task = LanguageModelTask({**BACKBONE, "final_logit_softcap": 2.0}, VOCAB, {}, {})
    _assert_task_equal(task, (torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))))


@pytest.mark.parametrize("settings", [
    {"label_smoothing": 0.1, "logits_bias": True, "tie_embeddings": "none"},  # BART's fixed bias
    {"label_smoothing": 0.0, "rescale_head": True, "scale_embeddings": False, "embedding_rows": 14},  # T5 v1.0's
])
def test_the_translation_task_chunked_equals_plain(settings: dict[str, Any]) -> None:
    torch.manual_seed(0)
    task = TranslationTask(BACKBONE, 11, {}, {}, **settings)
    if task.net.logits_bias is not None:
        task.net.logits_bias.normal_()  # BART's is a trained checkpoint's, not zeros
    src, tgt_in, tgt_out = (torch.randint(3, 11, (3, 6)) for _ in range(3))
    tgt_out[1, 3:] = task.pad_id
    batch = {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}
    _assert_task_equal(task, batch)
    _assert_task_equal(task, batch, stage="val")  # without gradients: the loss alone, chunked


def test_the_mlm_task_chunked_equals_plain_and_validates_on_whole_logits() -> None:
    torch.manual_seed(0)
    task = MaskedLanguageModelTask(BACKBONE, vocab_size=11, optimizer={}, scheduler={}, mask_id=9, pad_id=10,
                                   num_regular_tokens=9)
    with torch.no_grad():
        task.net.head.bias.normal_()
    inputs, targets = task.mask(torch.randint(0, 9, (3, 8)), "train", 0)
    _assert_task_equal(task, (inputs, targets))
    assert isinstance(task.outputs((inputs, targets), "val").scores, Tensor)  # its accuracy reads the logits


def test_an_accumulated_step_of_the_chunked_loss_is_the_plain_steps_global_token_mean() -> None:
    """Two micro-batches of 1 and 16 trained tokens under gradient accumulation, chunked: the step of the whole batch
    on plain logits (trident.training.token_loss divides the summed losses by the step's tokens)."""
    torch.manual_seed(0)
    task = SGDLanguageModel(BACKBONE, VOCAB, {"lr": 1.0}, {"name": "constant"}, loss_chunk=3)
    first, second = micro_batches()
    whole = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    plain = copy.deepcopy(task)
    plain.loss_chunk = 0
    accumulated = one_step(copy.deepcopy(task), [first, second], 2)
    batch = one_step(plain, [whole], 1)
    start = task.net.state_dict()
    for name, value in batch.items():
        if name == "train/loss":
            assert float(accumulated[name]) == pytest.approx(float(value), rel=1e-6)
            continue
        step = value - start[name]
        torch.testing.assert_close(accumulated[name] - start[name], step, rtol=1e-4,
                                   atol=1e-6 * float(step.abs().max()))


def test_the_pipeline_builds_the_lm_with_its_chunk_and_one_batch_trains_as_plain(tmp_path: Path) -> None:
    cfg = compose_config([*SMALL, "task.loss_chunk=37"], output_dir=tmp_path)
    datamodule, task = build_data_and_task(cfg, check_config(cfg), "fit")
    assert task.loss_chunk == 37
    batch = next(iter(datamodule.train_dataloader()))  # (4, 32): 128 tokens, chunks of 37 do not divide them
    _assert_task_equal(task, tuple(batch), chunks=(37,))


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "true"])
def test_a_bad_loss_chunk_is_one_line_before_any_work(value: str, tmp_path: Path) -> None:
    for task in ("lm", "translation", "mlm"):
        with pytest.raises(ConfigError, match=r"^task.loss_chunk must be a whole number of tokens >= 0 .*got .*: set "
                                              rf"e.g. task.loss_chunk={DEFAULT_LOSS_CHUNK}$"):
            check_config(compose_config([f"task={task}", f"task.loss_chunk={value}"], output_dir=tmp_path))


def test_zero_and_null_mean_the_plain_loss(tmp_path: Path) -> None:
    for value in ("0", "null"):
        cfg = compose_config([f"task.loss_chunk={value}"], output_dir=tmp_path)
        check_config(cfg)
        task = LanguageModelTask(BACKBONE, VOCAB, {}, {}, loss_chunk=cfg.task.loss_chunk)
        assert task.loss_chunk == 0
        assert isinstance(task.outputs((torch.zeros(1, 4, dtype=torch.long),) * 2, "train").scores, Tensor)


class _FakeLigerLoss(nn.Module):
    """Liger's LigerFusedLinearCrossEntropyLoss as some of its versions are: ``reduction`` accepted and not passed on
    to the kernel, which returns the mean over the trained targets."""

    def __init__(self, ignore_index: int, reduction: str = "mean", softcap: float | None = None) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.cross_entropy(F.linear(_input, lin_weight, bias).float(), target, ignore_index=self.ignore_index)


def _fake_liger_functional(input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                           ce_weight: Tensor | None = None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                           label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
                           return_z_loss: bool = False, accum_dtype: torch.dtype | None = None) -> Tensor:
    """Liger's functional ``liger_fused_linear_cross_entropy`` (its keywords), computed plainly."""
    assert accum_dtype == torch.float32  # the weight's gradient summed in fp32, as the torch version's
    logits = F.linear(input, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def _fake_liger(monkeypatch: pytest.MonkeyPatch, functional: Any) -> None:
    import sys
    import types

    modules = {name: types.ModuleType(name) for name in
               ("liger_kernel.transformers.fused_linear_cross_entropy", "liger_kernel.transformers.functional")}
    modules["liger_kernel.transformers.fused_linear_cross_entropy"].LigerFusedLinearCrossEntropyLoss = _FakeLigerLoss  # type: ignore[attr-defined]
    if functional is not None:
        modules["liger_kernel.transformers.functional"].liger_fused_linear_cross_entropy = functional  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_the_liger_call_is_the_summed_loss_with_the_weight_states_bias_and_softcap_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The logic behind tests/gpu/test_gpu_chunked_loss.py on a CPU: Liger (faked) gets the states, the weight, the
    targets and the bias by name, ``reduction="sum"``, the softcap and an fp32 gradient sum; its loss is the summed
    one, also where Liger's loss module would drop ``reduction`` and return the mean (1 / tokens of the gradient)."""
    from trident.training import chunked_loss

    _fake_liger(monkeypatch, _fake_liger_functional)
    hidden, linear, targets = head_and_targets(torch.float64, bias=True)
    head = VocabularyHead(hidden, linear, softcap=3.0)
    loss = chunked_loss._liger(hidden.flatten(0, 1), linear.weight, linear.bias, targets.flatten(), IGNORE_INDEX, 3.0)
    torch.testing.assert_close(loss.double(), plain_loss(head, targets), rtol=1e-6, atol=0)


def test_a_liger_without_its_functional_keywords_leaves_the_loss_to_the_torch_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An older Liger: no functional API, or one that is the Function's positional ``apply``: None (the torch
    version scores the head), never its loss module's mean."""
    from trident.training import chunked_loss

    hidden, linear, targets = head_and_targets(torch.float64, bias=False)
    for functional in (None, lambda *args: _fake_liger_functional(*args)):
        _fake_liger(monkeypatch, functional)
        assert chunked_loss._liger(hidden.flatten(0, 1), linear.weight, None, targets.flatten(), IGNORE_INDEX,
                                   None) is None


def test_a_head_trained_on_frozen_states_leaves_the_loss_to_the_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger computes the weight's gradient only beside the states' (no gradient at all for a head trained on frozen
    states): None there, the torch version scores the head; with the states trained, or without gradients, Liger."""
    from trident.training import chunked_loss

    _fake_liger(monkeypatch, _fake_liger_functional)
    hidden, linear, targets = head_and_targets(torch.float32, bias=True)
    frozen = hidden.detach().flatten(0, 1)
    assert chunked_loss._liger(frozen, linear.weight, linear.bias, targets.flatten(), IGNORE_INDEX, None) is None
    assert chunked_loss._liger(hidden.flatten(0, 1), linear.weight, None, targets.flatten(), IGNORE_INDEX,
                               None) is not None
    with torch.no_grad():
        assert chunked_loss._liger(frozen, linear.weight, None, targets.flatten(), IGNORE_INDEX, None) is not None


def test_no_row_at_all_is_a_loss_of_zero() -> None:
    """task=mlm's batch that masked no token: (0, D) states."""
    hidden, linear, _ = head_and_targets(torch.float32, bias=True)
    empty = hidden[:0, 0]  # (0, D)
    loss, _, count = chunked_cross_entropy(VocabularyHead(empty, linear, chunk=4), torch.zeros(0, dtype=torch.long),
                                           ignore_index=IGNORE_INDEX)
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(count) == 0 and float(linear.weight.grad.abs().max()) == 0.0


def test_every_vocabulary_task_defaults_to_the_chunk_its_constructor_takes(tmp_path: Path) -> None:
    """The yaml's task.loss_chunk and the constructor's default (a checkpoint older than the key) agree."""
    import inspect

    for name, task in (("lm", LanguageModelTask), ("translation", TranslationTask), ("mlm", MaskedLanguageModelTask)):
        assert compose_config([f"task={name}"], output_dir=tmp_path).task.loss_chunk == DEFAULT_LOSS_CHUNK
        assert inspect.signature(task).parameters["loss_chunk"].default == DEFAULT_LOSS_CHUNK
