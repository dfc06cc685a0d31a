"""objective=contrastive (issue 54 item 1): CLIP's symmetric image-text cross entropy equals open_clip's ``ClipLoss``
on the same features, and under data parallelism (features gathered from every rank with their gradients) 2 gloo
processes train task=clip's network as 1 does on the global batch: the same loss and the same gradients of every
parameter, through trident's one loss reduction (trident.training.token_loss.StepLoss) and DDP's gradient average."""

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
from torch import Tensor

from trident.backbone import TransformerConfig
from trident.models.clip import CLIP
from trident.objectives import OBJECTIVES, Contrastive, PairedFeatures
from trident.objectives.contrastive import contrastive_loss, paired_features
from trident.tasks.network_builders import clip
from trident.training.token_loss import StepLoss

from .open_clip_reference import import_open_clip

GLOBAL_BATCH, VOCAB, WIDTH = 6, 11, 4


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


def _network() -> CLIP:
    """task=clip's network, small, in float64 (the comparison then sees the reduction, not the rounding)."""
    torch.manual_seed(0)
    backbone = TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, max_seq_len=6, pos_encoding="learned",
                                 dropout=0.0, activation="quick_gelu")
    net = clip(backbone, vocab_size=VOCAB, eos_id=VOCAB - 1, embed_dim=WIDTH, text=None,
               image={"embedding_norm": True}, image_size=8, patch_size=4, in_channels=1)
    return net.double()


def _global_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (GLOBAL_BATCH, 6), generator=generator)
    ids[:, -1] = VOCAB - 1  # each caption ends in its end-of-text token
    return torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=generator, dtype=torch.float64), ids


def _step(rank: int, world_size: int) -> dict[str, Any]:
    """One optimizer step's loss and gradients on this rank's share of the global batch, reduced as a trident run
    reduces them (StepLoss) with DDP's average between backward and the step's end."""
    net = _network()

    def outputs(batch: tuple[Tensor, Tensor], stage: str) -> PairedFeatures:
        return paired_features(*net.normalised(*batch), net.scale())

    source = SimpleNamespace(outputs=outputs, device_mesh=None)
    share = GLOBAL_BATCH // world_size
    images, ids = (part[rank * share:(rank + 1) * share] for part in _global_batch())
    group = dist.group.WORLD if world_size > 1 else None
    step_loss = StepLoss()
    loss, _ = Contrastive()(source, (images, ids), "train")
    step_loss.micro_batch(loss.summed, loss.count, group).backward()
    parameters = list(net.parameters())
    if group is not None:  # DDP: the gradients averaged over the ranks
        for param in parameters:
            dist.all_reduce(param.grad, group=group)
            param.grad /= world_size
    metrics = step_loss.finish(parameters, 1, group)
    seen: dict[str, Any] = {"loss": metrics[StepLoss.LOSS]}
    seen |= {name: param.grad.flatten().tolist() for name, param in net.named_parameters()}
    if group is not None:  # open_clip's loss of the gathered features, on this rank
        open_clip = import_open_clip()
        features = outputs((images, ids), "train")
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
        names = [name for name, _ in _network().named_parameters()]
        assert set(names) <= set(two)
        for name in names:
            assert torch.allclose(torch.tensor(two[name]), torch.tensor(one[name]), rtol=0, atol=1e-5), (rank, name)
    assert any(abs(g) > 1e-3 for g in one["image.head.weight"]) and abs(one["logit_scale"][0]) > 1e-3
