"""Tensor parallelism (``trainer=fsdp trainer.strategy.tensor_parallel_size=N``): the mechanics that carry out the
parallel plans the modules declare (trident.backbone.parallel_plan), through ``torch.distributed.tensor.parallel``,
on the device mesh's ``tensor_parallel`` dimension (N processes): the rank-major row order of fused projections and
its state-dict hooks, the attention's head share and gathered weights, tied matrices kept one parameter, the
heads' dropout streams, and gradient norms over several meshes. Nothing here names a kind of module.

The plans declared today are Megatron-LM's. In each Transformer block (encoder, decoder, and a decoder's cross-attention) the q/k/v projections and the
feed-forward input (gate and value for swiglu) are split column-wise: each rank computes its own heads (its query
heads and the key/value heads they read) and its own hidden units from the whole input. The attention output and
feed-forward output projections are split row-wise: each rank's partial sum, added over the ranks (one all-reduce
per sub-layer). A token embedding whose head projects onto its vocabulary (the LM's, the MLM's) is split by
vocabulary rows (each rank looks up the ids it holds) and the head by vocabulary columns, gathered for the loss.
The rest stays whole on every rank of a group (FSDP still shards it over the data-parallel dimension): norms, the
MLM's transform, the patch embedding, class tokens, classifier heads, translation's shared embeddings and head.

The fused projections hold their parts one after the other ([q; k; v] in ``qkv_proj``, [k; v] in cross-attention's
``kv_proj``, [gate; value] in a swiglu ``fc_in``): an even split of their rows would hand rank 0 all the queries.
Their rows are put in rank-major order ([q_0; k_0; v_0; q_1; k_1; v_1], q_r: rank r's heads) before the split, so
each rank holds its own heads' q, k and v. Their state dict and their optimizer state keep today's order
(checkpoints, exports, a one-process model read them unchanged): the rows go back on saving and to rank-major
order on loading.

Dropout: the activations every rank of a group holds whole (the residual stream, embeddings) must be dropped
alike on every rank, or the ranks' copies part; the attention weights each rank computes for its own heads must
be dropped unlike, or head h and head h + heads / N share one mask (every rank starts from the same seed). As
Megatron-LM's model-parallel RNG tracker: the default random stream stays the same on every rank, and each rank's
attention draws its masks from a stream of its own (:class:`HeadDropoutRNG`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.optim import Optimizer

from trident.backbone import Heads, PositionalEncoding, Rows, Split, TransformerConfig, pos_encoding_class
from trident.errors import ConfigError, is_int

# The mesh dimension the tensor-parallel plan splits over (Lightning's name for it).
TENSOR_PARALLEL = "tensor_parallel"


def tensor_parallel_size(strategy: Any) -> int:
    """``trainer.strategy.tensor_parallel_size`` of a ``trainer=fsdp`` strategy mapping; 1 for any other strategy."""
    return strategy.get("tensor_parallel_size", 1) if isinstance(strategy, Mapping) else 1


def check_tensor_parallel_config(trainer: Mapping[str, Any], backbone: TransformerConfig,
                                 unsplittable: str | None) -> None:
    """The tensor-parallel size fits the heads, the hidden units and the processes, and nothing the plan
    cannot split is asked for (``unsplittable``: the ``finetune=`` converter whose network it cannot split, whose
    ``TENSOR_PARALLEL`` is false: trident.converters): one line each, before any work."""
    size = tensor_parallel_size(trainer.get("strategy"))
    key = "trainer.strategy.tensor_parallel_size"
    if not is_int(size) or size < 1:
        raise ConfigError(f"{key} must be a positive integer, got {size!r}: "
                          f"set e.g. {key}=2 (1: no tensor parallelism)")
    if size == 1:
        return
    for name, count in (("model.n_heads", backbone.n_heads), ("model.n_kv_heads", backbone.n_kv_heads),
                        ("model.d_ff", backbone.d_ff)):
        if count % size:
            raise ConfigError(f"{key}={size} does not divide {name}={count} (each rank takes an equal share): "
                              f"choose a tensor-parallel size that divides {name}")
    processes = trainer.get("devices")
    if is_int(processes) and processes > 0 and is_int(trainer.get("num_nodes", 1)):
        world_size = processes * trainer.get("num_nodes", 1)
        check_world_size(world_size, size)
    # Options whose weights or outputs belong to every head at once: each rank would see or train only its share.
    if pos_encoding_class(backbone.pos_encoding).attention_bias is not PositionalEncoding.attention_bias:
        raise ConfigError(f"{key}={size} cannot split pos_encoding={backbone.pos_encoding} (a bias on every head's "
                          "scores, built for all heads): use pos_encoding=rope, or tensor_parallel_size=1")
    if backbone.qk_norm:
        raise ConfigError(f"{key}={size} cannot split model.qk_norm (one norm weight shared by heads on different "
                          "ranks would train on each rank's heads only): "
                          "set model.qk_norm=false, or tensor_parallel_size=1")
    if unsplittable is not None:
        raise ConfigError(f"{key}={size} cannot split finetune={unsplittable}'s adapters (they wrap the projections "
                          "the plan splits): use finetune=full, or tensor_parallel_size=1")


def check_world_size(world_size: int, size: int) -> None:
    """``size`` ranks per tensor-parallel group: the processes form whole groups (data parallelism over the groups)."""
    if world_size % size:
        raise ConfigError(f"trainer.strategy.tensor_parallel_size={size} does not divide the {world_size} processes "
                          "(trainer.devices x trainer.num_nodes): "
                          f"choose a tensor-parallel size that divides {world_size}")


def rank_major_rows(parts: Sequence[int], ranks: int) -> Tensor:
    """The row order that turns a fused projection of ``parts`` (row counts, each divisible by ``ranks``) into
    rank-major order: rank 0's slice of every part, then rank 1's... (``weight[order]``)."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    slices = [torch.arange(start + rank * size // ranks, start + (rank + 1) * size // ranks)
              for rank in range(ranks) for start, size in zip(starts, parts, strict=True)]
    return torch.cat(slices)


def tensor_parallelize(net: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``net`` over ``mesh`` (the tensor-parallel dimension), in place, as each of its modules declares
    (``parallel_plan()``, trident.backbone.parallel_plan); its parameters become DTensors, its forward keeps taking
    and returning whole tensors. A matrix tied to several modules stays one parameter."""
    tied = _holders(net)
    for module in list(net.modules()):
        declare = getattr(module, "parallel_plan", None)
        for path, split in (declare() if declare is not None else {}).items():
            _apply(split, module.get_submodule(path), mesh)
    _retie(tied)


def _apply(split: Split, module: nn.Module, mesh: DeviceMesh) -> None:
    """One declared split carried out on ``module``."""
    if isinstance(split, Heads):
        # Attention weights (the explicit path's, for figures) come back whole: (B, heads, Tq, Tk) of all heads.
        module.register_forward_hook(partial(_all_heads, mesh))
        module.head_rng = HeadDropoutRNG(mesh.get_local_rank(), mesh.size())  # its local view: the rank's heads
    elif isinstance(split, Rows):
        parallelize_module(module, mesh, RowwiseParallel(input_layouts=Replicate()) if split.whole_input
                           else RowwiseParallel())
    elif len(split.parts) > 1:
        assert isinstance(module, nn.Linear) and not split.gather, "fused parts: a projection whose output stays split"
        split_fused_rows(module, rank_major_rows(split.parts, mesh.size()), mesh)
    else:
        parallelize_module(module, mesh, ColwiseParallel(output_layouts=Replicate()) if split.gather
                           else ColwiseParallel())


def _holders(net: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The parameters held by more than one module (a tied embedding and head): each as (module, name) pairs."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in net.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [pairs for pairs in holders.values() if len(pairs) > 1]


def _retie(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Each tied matrix one parameter again: every module that held it holds the first holder's split copy. The
    plans must split it alike (both vocabulary splits take dim 0), or no one copy fits both."""
    for pairs in tied:
        first, *others = (getattr(module, name) for module, name in pairs)
        if not any(isinstance(param, DTensor) for param in (first, *others)):
            continue  # left whole: still one parameter
        if not all(isinstance(param, DTensor) and param.placements == first.placements for param in (first, *others)):
            raise ValueError(f"{[name for _, name in pairs]} share one weight, which their parallel plans split "
                             "differently: declare the same split for each")
        for module, name in pairs[1:]:
            setattr(module, name, first)


class HeadDropoutRNG:
    """Runs a tensor-parallel rank's attention (its dropout on its own heads' weights) on a random stream of the
    rank's own; the default stream, which drops the activations every rank holds whole, moves on alike on every rank.

    Megatron-LM keeps a second generator state per rank (seed + 2718 + rank); here the rank's stream is seeded
    from the default stream's state and the rank, so it holds no state of its own: activation checkpointing, which
    restores the default stream before recomputing a block, recomputes the same masks, and a resumed run needs no
    extra state. Every rank's default stream then draws one number, so the next attention call (the next layer,
    the next step) draws new masks."""

    def __init__(self, rank: int, ranks: int = 1) -> None:
        self.rank = rank
        self.ranks = ranks  # the ranks the heads are split over: the attention computes heads / ranks of them

    @torch.compiler.disable  # generator states are host-side: a compiled network runs this part eagerly
    def __call__(self, compute: Callable[..., tuple[Tensor, Tensor | None]], module: nn.Module, q: Tensor,
                 *args: Any) -> tuple[Tensor, Tensor | None]:
        generator = _default_generator(q.device)
        shared = generator.get_state()  # alike on every rank of the group
        digest = hashlib.blake2b(shared.numpy().tobytes(), digest_size=8, person=b"tp-rank-%d" % self.rank).digest()
        generator.manual_seed(int.from_bytes(digest, "big") >> 1)  # the rank's stream (a 63-bit seed)
        try:
            return compute(module, q, *args)
        finally:
            generator.set_state(shared)
            torch.empty(1, device=q.device).random_(generator=generator)  # moves on alike on every rank


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator dropout draws from on ``device`` (SDPA's dropout takes no generator argument)."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


def _all_heads(mesh: DeviceMesh, module: nn.Module, inputs: Any, output: tuple[Tensor, Tensor | None]
               ) -> tuple[Tensor, Tensor | None]:
    """Forward hook: attention weights of this rank's heads (B, heads / ranks, Tq, Tk) gathered into all heads'."""
    out, weights = output
    if weights is None:
        return output
    return out, funcol.all_gather_tensor(weights.contiguous(), gather_dim=1, group=mesh)


def split_fused_rows(linear: nn.Linear, order: Tensor, mesh: DeviceMesh) -> None:
    """Column-wise split of ``linear`` after putting its rows in ``order`` (rank-major); its state dict keeps
    today's order: the rows go back on saving and to ``order`` on loading."""
    with torch.no_grad():
        for param in linear.parameters():
            param.copy_(param[order])
    parallelize_module(linear, mesh, ColwiseParallel())
    linear.tensor_parallel_rows = order  # read by keep_optimizer_rows: the optimizer state follows the weights
    linear.register_state_dict_post_hook(partial(_rows_in_order, torch.argsort(order)))
    linear.register_load_state_dict_pre_hook(partial(_rows_rank_major, order))


def keep_optimizer_rows(optimizer: Optimizer, model: nn.Module) -> None:
    """The state ``optimizer`` keeps per weight of ``model``'s reordered projections (Adam's moments) saved in
    today's row order and loaded back in rank-major order, as their weights are: a checkpoint's optimizer state
    is a one-process run's."""
    orders = {id(param): module.tensor_parallel_rows for module in model.modules()
              if hasattr(module, "tensor_parallel_rows") for param in module.parameters(recurse=False)}
    if orders:
        optimizer.register_state_dict_post_hook(partial(_state_in_order, orders))
        optimizer.register_load_state_dict_pre_hook(partial(_state_rank_major, orders))


def _whole(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _split_like(rows: Tensor, param: Tensor) -> Tensor:
    """``rows`` (whole) split over the ranks as ``param`` is."""
    if not isinstance(param, DTensor):
        return rows
    return distribute_tensor(rows.to(param.device), param.device_mesh, param.placements)


def _rows_in_order(restore: Tensor, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """State-dict hook: the rows in today's order, whole (every rank takes part in the gather)."""
    for name, _ in module.named_parameters(recurse=False):
        if prefix + name in state_dict:
            state_dict[prefix + name] = _whole(state_dict[prefix + name])[restore]


def _rows_rank_major(order: Tensor, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load hook: rows in today's order (whole, or a DTensor split as the parameter is) put in rank-major order
    and split as the parameter is."""
    for name, param in module.named_parameters(recurse=False):
        if prefix + name in state_dict:
            state_dict[prefix + name] = _split_like(_whole(state_dict[prefix + name])[order], param)


def _by_parameter(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[Any, Tensor]:
    """The key of each parameter's state in ``state_dict`` (an index, or a name under torch.distributed.checkpoint)
    -> the parameter: the groups' parameters in order, as ``Optimizer.load_state_dict`` pairs them."""
    keys = [key for group in state_dict["param_groups"] for key in group["params"]]
    return dict(zip(keys, [param for group in optimizer.param_groups for param in group["params"]], strict=True))


def _state_in_order(orders: dict[int, Tensor], optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Optimizer state-dict hook: the per-weight state of reordered rows in today's order, whole. New dicts: the
    state dict shares the optimizer's own."""
    for key, param in _by_parameter(optimizer, state_dict).items():
        if id(param) in orders and key in state_dict["state"]:
            restore = torch.argsort(orders[id(param)])
            state_dict["state"][key] = {name: _whole(value)[restore] if _per_weight(value, param) else value
                                        for name, value in state_dict["state"][key].items()}


def _state_rank_major(orders: dict[int, Tensor], optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Optimizer load hook: per-weight state in today's order put in rank-major order, split as its parameter is."""
    for key, param in _by_parameter(optimizer, state_dict).items():
        if id(param) in orders and key in state_dict["state"]:
            order = orders[id(param)]
            state_dict["state"][key] = {name: _split_like(_whole(value)[order], param) if _per_weight(value, param)
                                        else value for name, value in state_dict["state"][key].items()}


def _per_weight(value: Any, param: Tensor) -> bool:
    """Whether an optimizer state ``value`` holds one number per weight of ``param`` (not, e.g., Adam's step)."""
    return isinstance(value, Tensor) and value.shape == param.shape


def is_tensor_parallel(net: nn.Module) -> bool:
    """Whether ``net`` was split by :func:`tensor_parallelize`: every forward is then collective, run by all
    the ranks of a group together (none may run one alone, e.g. rank 0's samples)."""
    return any(isinstance(p, DTensor) and TENSOR_PARALLEL in (p.device_mesh.mesh_dim_names or ())
               for p in net.parameters())


def grad_norm(parameters: Iterable[Tensor]) -> Tensor:
    """The 2-norm of the gradients of ``parameters`` (a whole tensor, every rank alike), whichever device meshes
    they live on: under tensor parallelism the split ones are DTensors on (data parallel x tensor parallel), the
    whole ones on data parallel alone, whose norms torch cannot stack. Each mesh's norm is reduced over its ranks."""
    norms = [_whole(torch.nn.utils.get_total_norm([p.grad for p in params])) for params in _by_mesh(parameters)]
    return torch.linalg.vector_norm(torch.stack(norms))  # () each, then over the meshes


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters on several device meshes (:func:`grad_norm`): each
    mesh's gradients scaled apart (torch's scaling takes one mesh). Returns the norm before clipping."""
    groups = _by_mesh(parameters)
    total = grad_norm(param for params in groups for param in params)
    for params in groups:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _by_mesh(parameters: Iterable[Tensor]) -> list[list[Tensor]]:
    """The parameters that have a gradient, grouped by the device mesh it lives on (plain tensors: one group)."""
    groups: dict[DeviceMesh | None, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    return list(groups.values())
