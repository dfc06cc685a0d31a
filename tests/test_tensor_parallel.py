"""Tensor parallelism (``trainer=fsdp_cpu trainer.strategy.tensor_parallel_size=2``, trident.parallel.tensor_parallel).

Fast, in one process: the rank-major row order of the fused projections and the weights and optimizer state saved
and loaded in today's order, the plan on a one-rank 2-D mesh (the network's outputs, its state dict, loading one as
Lightning does), one rank of two on torch's fake process group (the shapes it holds and computes), the data shared
by the ranks of a tensor-parallel group, the size from the preset and the settings refused. Slow: a real 2-process run
whose losses equal one process's, and whose checkpoint is the one-process run's weights in today's layout."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import hydra.utils
import pytest
import torch
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM
from trident.parallel.fsdp import DATA_PARALLEL, ShardedStrategy, parallelize
from trident.parallel.tensor_parallel import (
    TENSOR_PARALLEL,
    HeadDropoutRNG,
    check_tensor_parallel_config,
    clip_grad_norm,
    is_tensor_parallel,
    keep_optimizer_rows,
    rank_major_rows,
    split_fused_rows,
    tensor_parallelize,
)
from trident.runs.pipeline import build_data_and_task, check_config
from trident.runs.pipeline import train as train_in_process
from trident.training.resilience import NonFiniteLossGuard

from .conftest import SMALL, compose_config
from .sharding_helpers import fake_two_ranks, one_rank_process_group
from .shared_runs import QUIET
from .test_fsdp import RECORD, net_weights, ranks, train


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    """The 2-D mesh Lightning builds (data parallel x tensor parallel), here of one rank."""
    with one_rank_process_group(tmp_path):
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))


@pytest.fixture
def two_ranks() -> Iterator[DeviceMesh]:
    """Rank 0 of a tensor-parallel group of 2 (torch's fake process group)."""
    with fake_two_ranks() as mesh:
        yield mesh


def backbone(**options: object) -> TransformerConfig:
    """Grouped key/value heads and swiglu: both fused projections the plan reorders."""
    settings = {"d_model": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "d_ff": 48, "max_seq_len": 16,
                "dropout": 0.0, "activation": "swiglu", "pos_encoding": "rope", **options}
    return TransformerConfig(**settings)  # type: ignore[arg-type]


def test_rank_major_rows_give_each_rank_its_slice_of_every_part() -> None:
    # [q: 0-7 | k: 8-11 | v: 12-15] over 2 ranks: rank 0 takes q 0-3, k 8-9, v 12-13; rank 1 the rest.
    assert rank_major_rows((8, 4, 4), 2).tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert rank_major_rows((6, 6), 3).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    assert rank_major_rows((8, 4, 4), 1).tolist() == list(range(16))


def test_reordered_rows_are_saved_and_loaded_in_todays_order(mesh: DeviceMesh) -> None:
    """On one rank, the rank-major order of 2 ranks is a real permutation: the weights and the optimizer state
    are held in it, saved in today's order, and loaded back into it."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 16)
    split = copy.deepcopy(plain)
    order = rank_major_rows((8, 4, 4), 2)
    split_fused_rows(split, order, mesh[TENSOR_PARALLEL])
    torch.testing.assert_close(split.weight.full_tensor(), plain.weight[order])
    inputs = torch.randn(3, 4)
    optimizers = [torch.optim.AdamW(net.parameters()) for net in (plain, split)]
    for net, optimizer in zip((plain, split), optimizers, strict=True):
        net(inputs).square().sum().backward()  # the same loss: a sum over the rows in any order
        optimizer.step()
    keep_optimizer_rows(optimizers[1], split)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(split.state_dict()[key], value, msg=key)
    plain_state, split_state = (optimizer.state_dict()["state"] for optimizer in optimizers)
    for index, moments in plain_state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(split_state[index][name], moments[name], msg=f"{index} {name}")
    assert isinstance(optimizers[1].state[split.weight]["exp_avg"], DTensor), "saving leaves the optimizer as it was"
    # Loaded back (a resume): weights and moments in rank-major order again.
    fresh = nn.Linear(4, 16)
    split_fused_rows(fresh, order, mesh[TENSOR_PARALLEL])
    fresh.load_state_dict(plain.state_dict())
    torch.testing.assert_close(fresh.weight.full_tensor(), plain.weight[order])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    keep_optimizer_rows(fresh_optimizer, fresh)
    fresh_optimizer.load_state_dict(optimizers[0].state_dict())
    torch.testing.assert_close(fresh_optimizer.state[fresh.weight]["exp_avg"].full_tensor(),
                               optimizers[0].state[plain.weight]["exp_avg"][order])


def test_split_net_computes_saves_and_loads_as_the_plain_one(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    plain = CausalLM(backbone(), vocab_size=50)
    split = copy.deepcopy(plain)
    tensor_parallelize(split, mesh[TENSOR_PARALLEL])
    parallelize(split, mesh, "32-true")  # then FSDP over the data-parallel dimension, as configure_model does
    assert is_tensor_parallel(split) and not is_tensor_parallel(plain)
    assert split.head.weight is split.embed.weight, "the tied matrix stays one parameter"
    assert all(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == (DATA_PARALLEL, TENSOR_PARALLEL)
               for name, p in split.named_parameters() if "proj" in name or "fc_" in name or "embed" in name)
    ids = torch.randint(0, 50, (2, 8))
    for net in (split, plain):
        net(ids).square().mean().backward()
    # Clipped over both meshes (split matrices on data x tensor parallel, norms on data parallel): torch's own refuses.
    total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
    torch.testing.assert_close(clip_grad_norm(split.parameters(), 0.01), total)
    for (name, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, msg=name)
    # The non-finite gradient check sees them too: finite, nothing happens.
    NonFiniteLossGuard().on_before_optimizer_step(SimpleNamespace(precision="32-true"), plain,  # type: ignore[arg-type]
                                                  torch.optim.SGD(split.parameters()))
    torch.testing.assert_close(split(ids), plain(ids))
    # Saved as Lightning saves a sharded model: today's keys, order and values.
    saved = get_model_state_dict(split, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    expected = plain.state_dict()
    assert list(saved) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, msg=key)
    # Loaded as Lightning resumes one: another split network takes the plain weights.
    torch.manual_seed(1)
    other = CausalLM(backbone(), vocab_size=50)
    tensor_parallelize(other, mesh[TENSOR_PARALLEL])
    parallelize(other, mesh, "32-true")
    _load_raw_module_state(expected, other)
    torch.testing.assert_close(other(ids), plain(ids))

def test_a_rank_of_two_holds_half_of_each_split_matrix_and_computes_its_heads(two_ranks: DeviceMesh) -> None:
    net = CausalLM(backbone(), vocab_size=50)  # d_model 32: 4 query heads and 2 key/value heads of 8, d_ff 48
    parallelize(net, two_ranks, "32-true")
    attention = net.decoder.blocks[0].self_attn
    assert (attention.n_heads, attention.n_kv_heads, attention.split_sizes) == (2, 1, (16, 8, 8))
    held = {name: tuple(p.to_local().shape) for name, p in net.named_parameters()}
    block = "decoder.blocks.0."
    assert held[block + "self_attn.qkv_proj.weight"] == (32, 32) and held[block + "self_attn.qkv_proj.bias"] == (32,)
    assert held[block + "self_attn.out_proj.weight"] == (32, 16)
    assert held[block + "ffn.fc_in.weight"] == (48, 32) and held[block + "ffn.fc_out.weight"] == (32, 24)
    assert held["embed.weight"] == (25, 32) and net.head.weight is net.embed.weight
    assert held[block + "self_attn_norm.weight"] == (32,), "norms stay whole"
    logits = net(torch.randint(0, 50, (2, 8)))  # (B, T, V): gathered over the vocabulary
    assert logits.shape == (2, 8, 50)
    logits.sum().backward()
    assert held[block + "self_attn.qkv_proj.weight"] == tuple(net.decoder.blocks[0].self_attn.qkv_proj.weight.grad.to_local().shape)



def test_the_ranks_of_a_tensor_parallel_group_read_the_same_batches(tmp_path: Path) -> None:
    """Lightning's data-parallel share (``distributed_sampler_kwargs``), not the global rank: under
    tensor_parallel_size=2 on 2 processes (one data-parallel rank) both read every batch."""
    cfg = compose_config([*SMALL, "logger=none"], output_dir=tmp_path / "run")
    datamodule, _ = build_data_and_task(cfg, check_config(cfg), "fit")
    orders = []
    for rank in range(2):
        datamodule.trainer = SimpleNamespace(  # type: ignore[assignment]
            world_size=2, global_rank=rank, distributed_sampler_kwargs={"num_replicas": 1, "rank": 0})
        orders.append(list(datamodule.train_dataloader().sampler))
    assert orders[0] == orders[1] and len(orders[0]) > 1


def test_the_preset_builds_the_tensor_parallel_size() -> None:
    for size in (1, 2):
        trainer = compose_config(["trainer=fsdp_cpu", f"trainer.strategy.tensor_parallel_size={size}"]).trainer
        strategy = hydra.utils.instantiate(trainer.strategy)
        assert isinstance(strategy, ShardedStrategy) and strategy._tensor_parallel_size == size


@pytest.mark.parametrize(("size", "devices", "options", "named"), [
    (3, 3, {}, "tensor_parallel_size=3 does not divide model.n_heads=4"),
    (4, 4, {}, "tensor_parallel_size=4 does not divide model.n_kv_heads=2"),
    (2, 2, {"d_ff": 49}, "tensor_parallel_size=2 does not divide model.d_ff=49"),
    (2, 3, {}, "tensor_parallel_size=2 does not divide the 3 processes"),
    (2, 2, {"pos_encoding": "alibi"}, "cannot split pos_encoding=alibi"),
    (2, 2, {"pos_encoding": "relative"}, "cannot split pos_encoding=relative"),
    (2, 2, {"qk_norm": True}, "cannot split model.qk_norm"),
    (0, 2, {}, "tensor_parallel_size must be a positive integer, got 0"),
])
def test_what_tensor_parallelism_cannot_honour_is_refused(size: int, devices: int, options: dict[str, object],
                                                          named: str) -> None:
    trainer = {"devices": devices, "num_nodes": 1, "strategy": {"tensor_parallel_size": size}}
    with pytest.raises(ConfigError, match=named):
        check_tensor_parallel_config(trainer, backbone(**options), None)
    check_tensor_parallel_config({**trainer, "strategy": {"tensor_parallel_size": 1}}, backbone(**options), None)


@pytest.mark.parametrize("task", ["lm", "mlm", "classify", "vit", "translation"])
def test_every_task_takes_tensor_parallelism_and_lora_is_refused(task: str) -> None:
    check_config(compose_config([f"task={task}", "model=nano", "trainer=fsdp_cpu",
                                 "trainer.strategy.tensor_parallel_size=2"]))
    trainer = {"devices": 2, "num_nodes": 1, "strategy": {"tensor_parallel_size": 2}}
    with pytest.raises(ConfigError, match="cannot split finetune=lora's adapters"):
        check_tensor_parallel_config(trainer, backbone(), "lora")


# 12 steps of the nano LM with grouped key/value heads and swiglu (both fused projections), dropout off: under
# tensor parallelism dropout draws its masks on each rank's share of the heads, which one process cannot match.
# The global batch is 8 blocks in every run: one process reads them whole, a tensor-parallel group of 2 too (each
# rank the same 8), a 2 x 2 mesh deals them out to its 2 data-parallel groups (4 each).
TP_LM = [*(o for o in SMALL if not o.startswith("data.batch_size")), *QUIET, "model.activation=swiglu",
         "model.n_kv_heads=2", "model.dropout=0.0", "trainer.max_steps=12", "trainer.val_check_interval=12", "seed=3",
         "logger=none"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, single_thread: None) -> Path:
    """The run both slow tests compare with: 12 steps of the global batch of 8 in one process, in this one (the
    process boundary is what the tensor-parallel runs test, not the reference). Returns its run directory."""
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    train_in_process(compose_config(["trainer=cpu", *TP_LM, "data.batch_size=8", *RECORD], output_dir=run_dir))
    return run_dir


@pytest.mark.slow
def test_two_way_tensor_parallel_trains_as_one_process_and_saves_todays_layout(one_process: Path, tmp_path: Path) -> None:
    split = train(tmp_path / "split", "fsdp_cpu", *TP_LM, "data.batch_size=8", "trainer.strategy.tensor_parallel_size=2")
    whole = json.loads((one_process / "rank0.json").read_text())
    assert whole["world_size"] == 1 and len(whole["losses"]) == 12
    for rank in ranks(split):
        assert rank["world_size"] == 2 and len(rank["losses"]) == 12
        torch.testing.assert_close(rank["losses"], whole["losses"], rtol=0, atol=1e-5)
        # Each rank holds its share of every split matrix: a little over half the parameters (norms are whole).
        assert 0.5 < rank["params"]["local"] / rank["params"]["total"] < 0.6, rank["params"]
    # The checkpoint is whole and in today's layout: the one-process run's weights, key for key.
    saved, expected = net_weights(split), net_weights(one_process)
    assert list(saved) == list(expected)
    torch.testing.assert_close(saved, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_two_by_two_mesh_trains_as_ddp_over_its_data_parallel_ranks(one_process: Path, tmp_path: Path) -> None:
    """4 processes: data parallel 2 x tensor parallel 2, 4 blocks each data-parallel group. Ranks 0-1 and 2-3 form the
    tensor-parallel groups, each reading the batches of one DDP rank (the mesh is data-major): each rank's losses (of
    the global batch) are those of DDP's 2 ranks, i.e. one process's on the whole batch of 8, and the checkpoint holds
    its weights in today's layout."""
    mesh = train(tmp_path / "mesh", "fsdp_cpu", *TP_LM, "data.batch_size=4", "trainer.devices=4",
                 "trainer.strategy.tensor_parallel_size=2")
    whole = json.loads((one_process / "rank0.json").read_text())["losses"]
    for rank in range(4):
        record = json.loads((mesh / f"rank{rank}.json").read_text())
        assert record["world_size"] == 4 and len(record["losses"]) == 12
        torch.testing.assert_close(record["losses"], whole, rtol=0, atol=1e-5)
        # Half of every split matrix on each rank, then half of that again over the data-parallel dimension.
        assert 0.25 < record["params"]["local"] / record["params"]["total"] < 0.3, record["params"]
    saved, expected = net_weights(mesh), net_weights(one_process)
    assert list(saved) == list(expected)
    torch.testing.assert_close(saved, expected, rtol=0, atol=1e-5)


def test_rank_zero_of_two_holds_its_share_of_each_part_of_the_fused_projections(two_ranks: DeviceMesh) -> None:
    """Rank 0's rows of swiglu's [gate; value] are the first half of the gate and the first half of the value (an
    even split would give it the whole gate), and of [q; k; v] its query heads' q and its key/value heads' k and v."""
    torch.manual_seed(0)
    plain = CausalLM(backbone(), vocab_size=50)  # d_ff 48; q: 4 heads of 8 (32 rows), k and v: 2 heads (16 rows)
    split = copy.deepcopy(plain)
    parallelize(split, two_ranks, "32-true")
    plain_block, split_block = plain.decoder.blocks[0], split.decoder.blocks[0]
    gate, value = plain_block.ffn.fc_in.weight.chunk(2)
    torch.testing.assert_close(split_block.ffn.fc_in.weight.to_local(), torch.cat([gate[:24], value[:24]]))
    q, k, v = plain_block.self_attn.qkv_proj.weight.split((32, 16, 16))
    torch.testing.assert_close(split_block.self_attn.qkv_proj.weight.to_local(), torch.cat([q[:16], k[:8], v[:8]]))
    torch.testing.assert_close(split_block.ffn.fc_out.weight.to_local(), plain_block.ffn.fc_out.weight[:, :24])
    # Its heads draw their dropout masks from rank 0's own stream (test_tensor_parallel_dropout.py); one process's don't.
    assert isinstance(split_block.self_attn.head_rng, HeadDropoutRNG) and split_block.self_attn.head_rng.rank == 0
    assert plain_block.self_attn.head_rng is None
