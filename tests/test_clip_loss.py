"""objective=contrastive (issue 54 item 1): CLIP's symmetric image-text cross entropy equals open_clip's ``ClipLoss``
on the same features, and under data parallelism (features gathered from every rank with their gradients) 2 gloo
processes train as 1 on the global batch: the same loss and the same gradients, through trident's one loss
reduction (trident.training.token_loss.StepLoss) and DDP's gradient average."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from trident.objectives import OBJECTIVES, Contrastive, PairedFeatures
from trident.objectives.contrastive import contrastive_loss, paired_features
from trident.training.token_loss import StepLoss

from .open_clip_reference import import_open_clip

GLOBAL_BATCH, IMAGE_IN, TEXT_IN, WIDTH = 6, 5, 7, 4


def _features(n: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, WIDTH, generator=generator, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(n, WIDTH, generator=generator, dtype=torch.float64), dim=-1)
    return image, text, torch.tensor(math.log(1 / 0.07), dtype=torch.float64).exp()


def test_the_loss_is_open_clips_clip_loss_on_the_same_features() -> None:
    open_clip = import_open_clip()
    image, text, scale = _features(GLOBAL_BATCH, seed=0)
    reference = open_clip.loss.ClipLoss()(image, text, scale)
    assert torch.allclose(contrastive_loss(image, text, scale), reference, rtol=0, atol=1e-12)
    # Through the objective, as a task hands it its outputs: the summed loss over B pairs and their count.
    source = SimpleNamespace(outputs=lambda batch, stage: paired_features(image, text, scale), device_mesh=None)
    loss, outputs = Contrastive()(source, None, "train")
    assert isinstance(outputs, PairedFeatures) and outputs.logits.shape == (GLOBAL_BATCH, GLOBAL_BATCH)
    assert int(loss.count) == GLOBAL_BATCH
    assert torch.allclose(loss.summed / loss.count, reference, rtol=0, atol=1e-12)
    assert OBJECTIVES["contrastive"] is Contrastive


class Towers(nn.Module):
    """Two linear towers and CLIP's learned temperature: enough to see every gradient the loss sends."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(IMAGE_IN, WIDTH, dtype=torch.float64)
        self.text = nn.Linear(TEXT_IN, WIDTH, dtype=torch.float64)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), dtype=torch.float64))

    def outputs(self, batch: tuple[Tensor, Tensor], stage: str) -> PairedFeatures:
        images, texts = batch
        return paired_features(F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1),
                               self.logit_scale.exp())


def _global_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(GLOBAL_BATCH, IMAGE_IN, generator=generator, dtype=torch.float64),
            torch.randn(GLOBAL_BATCH, TEXT_IN, generator=generator, dtype=torch.float64))


def _step(rank: int, world_size: int) -> dict[str, Any]:
    """One optimizer step's loss and gradients on this rank's share of the global batch, reduced as a trident run
    reduces them (StepLoss) with DDP's average between backward and the step's end."""
    towers = Towers()
    source = SimpleNamespace(outputs=towers.outputs, device_mesh=None)
    share = GLOBAL_BATCH // world_size
    images, texts = (part[rank * share:(rank + 1) * share] for part in _global_batch())
    group = dist.group.WORLD if world_size > 1 else None
    step_loss = StepLoss()
    loss, _ = Contrastive()(source, (images, texts), "train")
    step_loss.micro_batch(loss.summed, loss.count, group).backward()
    parameters = list(towers.parameters())
    if group is not None:  # DDP: the gradients averaged over the ranks
        for param in parameters:
            dist.all_reduce(param.grad, group=group)
            param.grad /= world_size
    metrics = step_loss.finish(parameters, 1, group)
    seen: dict[str, Any] = {"loss": metrics[StepLoss.LOSS]}
    seen |= {name: param.grad.flatten().tolist() for name, param in towers.named_parameters()}
    if group is not None:  # open_clip's loss of the gathered features, on this rank
        open_clip = import_open_clip()
        features = towers.outputs((images, texts), "train")
        reference = open_clip.loss.ClipLoss(gather_with_grad=True, rank=rank, world_size=world_size)
        seen["open_clip"] = float(reference(features.image, features.text, features.scale))
    return seen


def _rank(rank: int, port: int, tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        (tmp_path / f"{rank}.json").write_text(json.dumps(_step(rank, 2)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_train_as_one_on_the_global_batch(tmp_path: Path) -> None:
    import_open_clip()  # skipped without the [clip] extra, before the processes start
    one = _step(0, 1)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, tmp_path), nprocs=2)
    for rank in (0, 1):
        two = json.loads((tmp_path / f"{rank}.json").read_text())
        assert two["loss"] == pytest.approx(one["loss"], rel=0, abs=1e-5)
        assert two["open_clip"] == pytest.approx(one["loss"], rel=0, abs=1e-5)
        for name in ("image.weight", "image.bias", "text.weight", "text.bias", "logit_scale"):
            assert torch.allclose(torch.tensor(two[name]), torch.tensor(one[name]), rtol=0, atol=1e-5), (rank, name)
    assert any(abs(g) > 1e-3 for g in one["image.weight"]), "a gradient to compare"
