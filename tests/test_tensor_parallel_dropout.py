"""Dropout under tensor parallelism (trident.parallel.tensor_parallel.HeadDropoutRNG), on 2 gloo processes.

Every rank starts from the same seed (as ``seed_everything`` seeds them). The attention-weight masks of the heads
each rank holds are drawn apart (head 0's, on rank 0, and head 2's, on rank 1, differ); the residual dropout on the
activations both ranks hold whole stays alike (the ranks' copies of the block's output are equal); activation
checkpointing recomputes the masks the first forward drew (the same gradients as without it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trident.backbone import TransformerConfig
from trident.models import CausalLM
from trident.parallel.fsdp import DATA_PARALLEL, parallelize
from trident.parallel.tensor_parallel import TENSOR_PARALLEL, HeadDropoutRNG

HEADS, HEAD_DIM = 4, 8


def identical_heads(net: CausalLM) -> None:
    """Every head's q, k and v rows (and biases) a copy of head 0's: the heads' outputs then differ only where
    their dropout masks do."""
    with torch.no_grad():
        for block in net.decoder.blocks:
            for param in block.self_attn.qkv_proj.parameters():
                parts = param.view(3, HEADS, HEAD_DIM, *param.shape[1:])  # [q; k; v], each HEADS heads
                parts.copy_(parts[:, :1].expand_as(parts))


def keep(seen: dict[str, Tensor], name: str, value: Tensor) -> None:
    """The rank's own share of ``value`` under ``name``, from the first forward (a recompute comes again)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    seen.setdefault(name, local.detach().clone())


def run_rank(rank: int, store: str, out: str) -> None:
    """One rank of a tensor-parallel group of 2: saves its heads' attention outputs, its copy of the first block's
    output, and its gradients with and without activation checkpointing."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    results: dict[str, Tensor] = {}
    for impl in ("sdpa", "explicit"):
        for recompute in (False, True):
            torch.manual_seed(0)  # every rank alike
            cfg = TransformerConfig(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=2, d_ff=64, max_seq_len=16,
                                    dropout=0.5, attn_dropout=0.5, attn_impl=impl, pos_encoding="rope",
                                    activation_checkpointing=recompute)
            net = CausalLM(cfg, vocab_size=50)
            identical_heads(net)
            parallelize(net, mesh, "32-true")
            seen: dict[str, Tensor] = {}
            # out_proj's input (the row-wise split made it a DTensor): this rank's heads' attention outputs
            # (B, T, heads / 2 * hs), after dropout.
            net.decoder.blocks[0].self_attn.out_proj.register_forward_pre_hook(
                lambda _m, inputs, seen=seen: keep(seen, "heads", inputs[0]))
            net.decoder.blocks[0].register_forward_hook(lambda _m, _i, output, seen=seen: keep(seen, "block", output[0]))
            ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
            net.train()
            net(ids).square().mean().backward()
            tag = f"{impl}-{'recompute' if recompute else 'plain'}"
            results[f"{tag}-heads"], results[f"{tag}-block"] = seen["heads"], seen["block"]
            grad = net.decoder.blocks[0].self_attn.qkv_proj.weight.grad
            results[f"{tag}-grad"] = grad.to_local() if isinstance(grad, DTensor) else grad
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Tensor]]:
    folder = tmp_path_factory.mktemp("tp_dropout")
    mp.start_processes(run_rank, args=(str(folder / "store"), str(folder)), nprocs=2, start_method="spawn")
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_the_ranks_heads_draw_their_own_attention_masks(ranks: list[dict[str, Tensor]], impl: str) -> None:
    heads = [ranks[rank][f"{impl}-plain-heads"].unflatten(-1, (HEADS // 2, HEAD_DIM)) for rank in range(2)]
    batch = heads[0].shape[0]
    everything = torch.cat(heads, dim=2).transpose(1, 2).reshape(batch, HEADS, -1)  # (B, heads, T * hs)
    for first in range(HEADS):
        for second in range(first + 1, HEADS):
            assert not torch.equal(everything[:, first], everything[:, second]), f"heads {first} and {second}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_residual_dropout_stays_alike_on_the_ranks(ranks: list[dict[str, Tensor]], impl: str) -> None:
    assert torch.equal(ranks[0][f"{impl}-plain-block"], ranks[1][f"{impl}-plain-block"])


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_activation_checkpointing_recomputes_the_same_masks(ranks: list[dict[str, Tensor]], impl: str) -> None:
    for rank in ranks:
        torch.testing.assert_close(rank[f"{impl}-recompute-grad"], rank[f"{impl}-plain-grad"])
        assert torch.equal(rank[f"{impl}-recompute-heads"], rank[f"{impl}-plain-heads"])


def test_the_rank_stream_leaves_the_default_stream_alike_on_every_rank() -> None:
    """Whatever the rank, the default stream moves on by the same draw; the rank's draws differ."""
    draws, after = [], []
    for rank in (0, 1):
        torch.manual_seed(3)
        draws.append(HeadDropoutRNG(rank)(lambda _m, q: (torch.rand(q.shape), None), nn.Identity(), torch.zeros(4))[0])
        after.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1]) and torch.equal(after[0], after[1])


def test_consecutive_attention_calls_draw_new_masks() -> None:
    """The next layer (or step) draws other masks, even with no dropout of the default stream in between (without
    the default stream's one draw, every layer of a block without residual dropout repeated the first's masks)."""
    torch.manual_seed(3)
    rng = HeadDropoutRNG(0)
    first, second = (rng(lambda _m, q: (torch.rand(q.shape), None), nn.Identity(), torch.zeros(4))[0] for _ in range(2))
    assert not torch.equal(first, second)
