"""Tensor parallelism beyond the LM (trident.parallel.tensor_parallel): the networks of task=mlm (encoder, split
vocabulary), translation (encoder-decoder with cross-attention, shared embeddings whole), vit and classify (whole
patch embedding, class token and head), split 2 ways over 2 gloo processes, compute, train and save as one process;
the ranks of a tensor-parallel group mask and batch the same; vit trains and tests through train.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trident.models import (
    Decoding,
    EncoderDecoder,
    MaskedLM,
    SequenceClassifier,
    VisionTransformer,
    attention_rollout,
    greedy_decode,
    vit_geometry,
)
from trident.parallel.fsdp import DATA_PARALLEL, parallelize, whole_weights
from trident.parallel.tensor_parallel import TENSOR_PARALLEL, is_tensor_parallel
from trident.runs.pipeline import build_data_and_task, check_config

from .conftest import compose_config
from .sharding_helpers import fake_two_ranks
from .test_fsdp import TASKS, assert_completed_with_one_wandb_run, ranks, train
from .test_mlm import SMALL_MLM
from .test_tensor_parallel import backbone
from .test_translation_train import SMALL_MT
from .test_vit_pipeline import VIT_SMALL

VOCAB, CLASSES, STEPS = 50, 3, 3


def mlm(inputs: dict[str, Tensor]) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    net = MaskedLM(backbone(), VOCAB)
    select = inputs["ids"] % 3 == 0  # (B, T): the positions predicted
    return net, lambda n: F.cross_entropy(n(inputs["ids"], select=select), inputs["targets"][select])


def translation(inputs: dict[str, Tensor]) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    net = EncoderDecoder(backbone(), VOCAB)  # shared source/target embeddings tied to the head
    return net, lambda n: F.cross_entropy(n(inputs["ids"], inputs["targets"]).flatten(0, 1), inputs["ids"].flatten())


def vit(inputs: dict[str, Tensor]) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    cfg = backbone(**vit_geometry(8, 4, "cls"), activation="gelu")  # a 2x2 grid of patches and the class token
    net = VisionTransformer(cfg, patch_size=4, in_channels=3, num_classes=CLASSES)
    return net, lambda n: F.cross_entropy(n(inputs["images"]), inputs["labels"])


def classify(inputs: dict[str, Tensor]) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    net = SequenceClassifier(backbone(), VOCAB, CLASSES, pool="mean")
    return net, lambda n: F.cross_entropy(n(inputs["ids"]), inputs["labels"])


NETWORKS = {"mlm": mlm, "translation": translation, "vit": vit, "classify": classify}


def _worker(rank: int, store: str) -> None:
    """One rank of 2 (one tensor-parallel group): each network split and trained beside its plain copy, on the same
    batch (dropout off), whose losses, saved weights, decoding and attention weights it must equal."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
        generator = torch.Generator().manual_seed(0)
        inputs = {"ids": torch.randint(0, VOCAB, (2, 8), generator=generator),
                  "targets": torch.randint(0, VOCAB, (2, 8), generator=generator),
                  "images": torch.randn(2, 3, 8, 8, generator=generator),
                  "labels": torch.randint(0, CLASSES, (2,), generator=generator)}
        for name, build in NETWORKS.items():
            torch.manual_seed(0)
            plain, loss = build(inputs)
            split = copy.deepcopy(plain)
            parallelize(split, mesh, "32-true")
            assert is_tensor_parallel(split), name
            losses: dict[str, list[float]] = {"plain": [], "split": []}
            for net, key in ((plain, "plain"), (split, "split")):
                # SGD, not Adam: the key biases' true gradient is zero (softmax ignores a constant added to every
                # score), and Adam would blow their rounding noise, which differs between the splits, up to lr-sized steps.
                optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
                for _ in range(STEPS):
                    optimizer.zero_grad()
                    value = loss(net)
                    value.backward()
                    optimizer.step()
                    losses[key].append(float(value.detach()))
            torch.testing.assert_close(losses["split"], losses["plain"], rtol=0, atol=1e-5, msg=name)
            saved = get_model_state_dict(split, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:  # only rank 0 receives the gathered weights (cpu_offload)
                assert list(saved) == list(plain.state_dict()), name
                torch.testing.assert_close(saved, plain.state_dict(), rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
            if name == "translation":  # decoding with the KV cache (cross-attention's keys/values projected once)
                with whole_weights(split):  # as the task decodes: encode() and decode() are not the root's forward
                    plain_out, split_out = (greedy_decode(net.eval(), inputs["ids"].clamp(min=3),
                                                          Decoding(1, 2, max_len_b=6, banned_ids=(0, 1))) for net in (plain, split))
                assert [h.tokens for h in split_out] == [h.tokens for h in plain_out]
                torch.testing.assert_close([h.score for h in split_out], [h.score for h in plain_out])
        # The attention figure's weights: every head's, on every rank, as one process computes them.
        torch.manual_seed(0)
        plain, _ = vit(inputs)
        split = copy.deepcopy(plain)
        parallelize(split, mesh, "32-true")
        for net in (plain, split):
            net.eval()
        with whole_weights(split):  # as the task draws it: forward_with_attention is not the root's forward
            (_, whole), (_, shared) = (net.forward_with_attention(inputs["images"]) for net in (plain, split))
        torch.testing.assert_close(attention_rollout(shared), attention_rollout(whole))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_task_network_split_two_ways_trains_and_saves_as_one_process(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=2)


def test_the_split_holds_each_task_networks_share() -> None:
    """Rank 0 of 2 (fake process group): cross-attention's [k; v] split per rank, the MLM's vocabulary split,
    the translation embeddings, the patch embedding and the classifier heads whole."""
    inputs = {"ids": torch.zeros(2, 8, dtype=torch.long), "targets": torch.zeros(2, 8, dtype=torch.long)}
    nets = {name: NETWORKS[name](inputs)[0] for name in NETWORKS}
    with fake_two_ranks() as mesh:
        for net in nets.values():
            parallelize(net, mesh, "32-true")
    held = {name: {key: (tuple(p.to_local().shape), p.device_mesh.mesh_dim_names) for key, p in net.named_parameters()}
            for name, net in nets.items()}
    both, data = (DATA_PARALLEL, TENSOR_PARALLEL), (DATA_PARALLEL,)
    cross = "decoder.blocks.0.cross_attn."
    assert held["translation"][cross + "q_proj.weight"] == ((16, 32), both)  # 2 of 4 query heads of 8
    assert held["translation"][cross + "kv_proj.weight"] == ((16, 32), both)  # 1 of 2 key/value heads: k and v
    assert held["translation"][cross + "out_proj.weight"] == ((32, 16), both)
    assert held["translation"]["src_embed.weight"] == ((VOCAB, 32), data)
    attention = nets["translation"].decoder.blocks[0].cross_attn
    assert (attention.n_heads, attention.n_kv_heads, attention.split_sizes) == (2, 1, (16, 8, 8))
    assert held["mlm"]["embed.weight"] == ((VOCAB // 2, 32), both) and held["mlm"]["head.bias"] == ((VOCAB // 2,), both)
    assert held["mlm"]["transform.0.weight"] == ((32, 32), data)
    assert held["vit"]["patch_embed.proj.weight"][1] == held["vit"]["head.weight"][1] == data
    assert held["classify"]["embed.weight"] == ((VOCAB, 32), data) and held["classify"]["head.weight"] == ((CLASSES, 32), data)
    assert held["classify"]["encoder.blocks.0.ffn.fc_out.weight"] == ((32, 24), both)
    assert all(isinstance(p, DTensor) for net in nets.values() for p in net.parameters())


def group_of_two(rank: int) -> SimpleNamespace:
    """Rank ``rank`` of 2 processes forming one tensor-parallel group (one data-parallel rank), as a trainer says it."""
    return SimpleNamespace(world_size=2, global_rank=rank, distributed_sampler_kwargs={"num_replicas": 1, "rank": 0})


def test_the_ranks_of_a_tensor_parallel_group_mask_the_same_tokens(tmp_path: Path) -> None:
    """Both ranks of a group compute on one batch: its masks must be the same (each DDP rank draws its own)."""
    cfg = compose_config([*SMALL_MLM, "logger=none"], output_dir=tmp_path / "run")
    _, task = build_data_and_task(cfg, check_config(cfg), "fit")
    ids = torch.randint(5, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    masked = []
    for trainer in (group_of_two(0), group_of_two(1), SimpleNamespace(global_rank=1, distributed_sampler_kwargs={
            "num_replicas": 2, "rank": 1})):
        task._trainer = trainer  # type: ignore[assignment]
        masked.append(task.mask(ids, "train", 7)[0])
    assert torch.equal(masked[0], masked[1]) and not torch.equal(masked[0], masked[2])


def test_the_ranks_of_a_tensor_parallel_group_read_the_same_translation_batches(tmp_path: Path) -> None:
    cfg = compose_config([*SMALL_MT, "logger=none"], output_dir=tmp_path / "run")
    datamodule, _ = build_data_and_task(cfg, check_config(cfg), "fit")
    orders = []
    for rank in range(2):
        datamodule.trainer = group_of_two(rank)  # type: ignore[assignment]
        orders.append([list(batch) for batch in datamodule.train_dataloader().batch_sampler])
    assert orders[0] == orders[1] and len(orders[0]) > 1


@pytest.mark.slow
def test_vit_trains_and_tests_under_two_way_tensor_parallelism_with_the_default_logger(tmp_path: Path) -> None:
    """Through train.py, test stage included (the attention figure: a forward every rank of the group runs). The
    other tasks' networks train as one process in the test above; the run is what they share (pipeline, logger)."""
    run_dir = train(tmp_path, "fsdp_cpu", *TASKS["vit"], "trainer.strategy.tensor_parallel_size=2",
                    "trainer.max_steps=2", "trainer.limit_test_batches=1")
    assert_completed_with_one_wandb_run(run_dir)
    for rank in ranks(run_dir):
        assert 0.5 < rank["params"]["local"] / rank["params"]["total"] < 0.9, rank["params"]  # the blocks split


def test_the_ranks_of_a_tensor_parallel_group_augment_the_same_images(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader worker's random crops and RandAugment are seeded by a rank: Lightning's own seeding (what the trainer
    adds under ``seed_everything(workers=True)``, with the global rank) would give the two ranks of a group different
    augmentations of their shared batch; the data module seeds its workers by the data-parallel rank."""
    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # as seed_everything(workers=True) in the pipeline sets it
    cfg = compose_config([*VIT_SMALL, "logger=none", "data.num_workers=1", "data.persistent_workers=false"],
                         output_dir=tmp_path / "run")
    datamodule, _ = build_data_and_task(cfg, check_config(cfg), "fit")
    batches = []
    for trainer in (group_of_two(0), group_of_two(1), SimpleNamespace(world_size=2, global_rank=1,
                                                                      distributed_sampler_kwargs={"num_replicas": 2,
                                                                                                  "rank": 1})):
        datamodule.trainer = trainer  # type: ignore[assignment]
        loader = datamodule.train_dataloader()
        _auto_add_worker_init_fn(loader, trainer.global_rank)
        batches.append(next(iter(loader))[0])
    assert torch.equal(batches[0], batches[1])
    assert not torch.equal(batches[0], batches[2])
