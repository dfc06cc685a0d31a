"""The language model's perplexity and the image classifier's accuracies, logged by their steps, against
values written out by hand on fixed logits (translation and MLM: their own test files)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trident.tasks.lm import LanguageModelTask
from trident.tasks.vit import ImageClassificationTask

from .test_translation_losses_metrics import FixedLogits

pytestmark = pytest.mark.usefixtures("single_thread")

BACKBONE = {"d_model": 8, "n_heads": 2, "n_layers": 1, "d_ff": 16, "dropout": 0.0, "max_seq_len": 8}


def logged_by(task: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the task's steps pass to ``self.log``, by name (metric objects as they are)."""
    logged: dict[str, Any] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **_: logged.__setitem__(name, value))
    return logged


def test_lm_perplexity_is_exp_of_the_mean_token_nll_over_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = [[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]]  # (T=2, V=3), the same for every batch
    task = LanguageModelTask(BACKBONE, vocab_size=3, optimizer={}, scheduler={})
    task.net = FixedLogits(torch.tensor(probs).log().view(1, 2, 3))
    logged = logged_by(task, monkeypatch)
    task.test_step((torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, 2]])), 0)  # -log 0.25, -log 0.6
    task.test_step((torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0, 0]])), 1)  # -log 0.5, -log 0.2
    task.log_epoch_loss("test", with_perplexity=True)  # what on_test_epoch_end logs first
    mean_nll = -(math.log(0.25) + math.log(0.6) + math.log(0.5) + math.log(0.2)) / 4
    assert float(logged["test/ppl"]) == pytest.approx(math.exp(mean_nll), rel=1e-6)  # 2.9428
    assert float(logged["test/loss"]) == pytest.approx(mean_nll, rel=1e-6), "every token's, not the last batch's"


def test_vit_accuracy_is_the_share_of_images_right_and_top5_of_labels_in_the_five_best(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Six classes, four images; each row ranks the classes 0 > 1 > ... > 5 shifted by the row.
    logits = torch.tensor([[6.0, 5, 4, 3, 2, 1], [1, 6, 5, 4, 3, 2], [2, 1, 6, 5, 4, 3], [3, 2, 1, 6, 5, 4]])
    labels = torch.tensor([0, 2, 1, 5])  # right (best); 2nd best; last; 3rd best
    task = ImageClassificationTask(
        {**BACKBONE, **ImageClassificationTask.backbone_geometry({"image_size": 4, "patch_size": 2}, {})}, optimizer={}, scheduler={}, num_classes=6, image_size=4, in_channels=1,
        patch_size=2, class_names=[str(c) for c in range(6)], mean=[0.5], std=[0.5], num_figure_images=0)
    task.net = FixedLogits(logits)
    logged = logged_by(task, monkeypatch)
    task.test_step((torch.zeros(4, 1, 4, 4), labels), 1)  # not the first batch: no attention figure
    task.log_epoch_loss("test")  # what on_test_epoch_end logs first
    assert float(logged["test/acc"].compute()) == pytest.approx(1 / 4)
    assert float(logged["test/acc_top5"].compute()) == pytest.approx(3 / 4)
    assert float(logged["test/loss"]) == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))
    confusion = torch.zeros(6, 6, dtype=torch.long)  # rows: true class, columns: predicted (0, 1, 2, 3)
    confusion[0, 0] = confusion[2, 1] = confusion[1, 2] = confusion[5, 3] = 1
    assert torch.equal(task.test_confusion.compute(), confusion)
