"""GPU-scale rows: lm, translation and vit at ``model=base`` (trident.bench.workloads: the tasks train.py builds),
one training step under each variant of a list: step time, tokens (target tokens, images) per second, model FLOPs
utilisation against the device's peak (trident.training.flops) and peak memory.

A variant is a name and train.py overrides (``precision=bf16``, ``compile=blocks``, ``trainer=fsdp``,
``task.loss_chunk=...``): the step is built as a run with those overrides builds it. ``compile`` goes through the
run's own helper (trident.tasks.networks.compile_network, traced at the first call); a sharding strategy
(``trainer=fsdp``) shards every network as ``configure_model`` does (trident.tasks.networks.shard_networks: each
Transformer block its own FSDP2 unit, then the root) on a one-rank device mesh of this process. Adding a variant is
one entry of :data:`PRECISION_VARIANTS` (the ``mfu`` rows) or :data:`SPEED_VARIANTS` (issue #57's table, the
``speed`` rows).

The batch fills the device: the task's batch (translation: its token budget), halved until a training step fits.
Every variant of a task after the first starts from the first's batch (compiling each halving would cost minutes).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trident.bench.results import Row, Settings, milliseconds
from trident.bench.timing import Budget, interleaved, training_step
from trident.bench.workloads import WORKLOADS, Batch, Workload
from trident.objectives import TRAIN
from trident.parallel.fsdp import DATA_PARALLEL, shards_weights
from trident.parallel.tensor_parallel import TENSOR_PARALLEL
from trident.tasks.base import TridentTask
from trident.tasks.networks import compile_network, shard_networks
from trident.training.flops import compute_dtype, device_peak_flops
from trident.training.optim import build_optimizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One way to run a task's training step: train.py overrides under a short name (the row's, after the task's)."""

    name: str
    overrides: tuple[str, ...]
    plain: str | None = None  # a sharded variant: the unsharded variant whose step it is compared with
    needs: str | None = None  # a config key the variant sets, which a task's config may lack (then: not available)


BF16, EAGER, WHOLE, BLOCKS, FSDP = "precision=bf16", "compile=false", "compile=true", "compile=blocks", "trainer=fsdp"

# The mfu rows: each precision eagerly, and bf16 compiled whole (fp16 without Lightning's gradient scaler: its
# unscaling and inf checks, a few elementwise passes over the gradients, are not timed).
PRECISION_VARIANTS = (
    Variant("bf16", (BF16, EAGER)),
    Variant("fp16", ("precision=fp16", EAGER)),
    Variant("fp32", ("precision=fp32", EAGER)),
    Variant("bf16-compile", (BF16, WHOLE)),
)
# Issue #57's table, cheapest first (a deadline cuts the compiled ones): eager, compiled per block, compiled whole;
# plain and FSDP2 at one GPU; each with the task's default loss (the chunked cross-entropy where the task has
# task.loss_chunk), and compiled per block with the loss on the whole logits (task.loss_chunk=0) to compare.
SPEED_VARIANTS = (
    Variant("bf16", (BF16, EAGER)),
    Variant("bf16-fsdp", (BF16, EAGER, FSDP), plain="bf16"),
    Variant("bf16-blocks", (BF16, BLOCKS)),
    Variant("bf16-fsdp-blocks", (BF16, BLOCKS, FSDP), plain="bf16-blocks"),
    Variant("bf16-compile", (BF16, WHOLE)),
    Variant("bf16-blocks-whole-logits", (BF16, BLOCKS, "task.loss_chunk=0"), needs="task.loss_chunk"),
)
FSDP_TARGET = 1.2  # issue #57: FSDP at one GPU within 1.2x of plain's time per item (its step time at equal batches)
# Lightning's precision setting -> the autocast dtype of the step (fp32: none).
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
_ABSENT = object()


@dataclass
class Measured:
    """One variant of one workload: what it measured, or why it did not."""

    name: str  # <workload key>-<variant name>, e.g. lm-bf16-fsdp
    workload: str  # the workload's description
    status: str = "not run"  # ok | failed: <error> | not available: <why>
    batch: int | None = None
    seconds: float | None = None  # median step
    first_seconds: float | None = None  # the first step: allocation, compilation
    units: float | None = None  # tokens, target tokens or images per step (the task's throughput_units)
    unit: str = ""
    flops: int | None = None  # model FLOPs per step (the task's flops_per_batch)
    peak_flops: float | None = None  # of the step's compute dtype on this device
    dtype: str = ""
    memory_gib: float | None = None  # peak allocated, CUDA only
    target: float | None = None  # the task's bf16 MFU target

    @property
    def mfu(self) -> float | None:
        if self.flops is None or not self.seconds or not self.peak_flops:
            return None
        return self.flops / self.seconds / self.peak_flops


def _reset(device: torch.device) -> None:
    """Forget the last variant: its tensors, and its compiled graphs (a block's code is shared by every task: dynamo
    would count their graphs towards one recompile limit, then run the rest eagerly)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def one_rank_mesh(device: torch.device) -> Iterator[DeviceMesh]:
    """The device mesh ``trainer=fsdp`` gives one process (data parallel x tensor parallel, 1 x 1), on a process group
    of this process alone (NCCL on a GPU, gloo on a CPU), taken down after unless one was already there."""
    created = not dist.is_initialized()
    if created:
        if device.type == "cuda" and device.index is not None:  # (plain "cuda": the current device)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        yield init_device_mesh(device.type, (1, 1), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    finally:
        if created:
            dist.destroy_process_group()


def mean_loss(task: TridentTask, batch: Batch) -> Tensor:
    """The training loss the task's objective gives ``batch``: its sum over the trained items over their count."""
    loss, _ = task.objective(task, batch, TRAIN)
    return loss.summed / loss.count


def optimizer_of(task: TridentTask) -> torch.optim.Optimizer:
    """The optimizer ``configure_optimizers`` builds (from the run's ``optimizer`` config over the task's parameter
    groups; its schedule left out: one learning rate is as fast as another)."""
    groups = task.parameter_groups(float(task.optimizer_cfg.get("weight_decay", 0.0)))
    return build_optimizer(task.net, task.optimizer_cfg, groups=groups)


def prepared_step(workload: Workload, cfg: DictConfig, settings: Settings, size: int,
                  mesh: DeviceMesh | None) -> tuple[Callable[[], None], TridentTask, Batch]:
    """One training step of the task ``cfg`` builds, on a batch of ``size``: built, compiled and sharded in the order
    of a run (the lifecycle compiles, then ``configure_model`` shards; the graph is traced at the first call)."""
    torch.manual_seed(0)
    task = workload.build(cfg).to(settings.device)
    compile_network(task, cfg.get("compile", False))
    if mesh is not None:
        shard_networks(task, mesh, str(cfg.trainer.precision))
    batch = workload.batch(cfg, size, settings.device)
    dtype, clip = AUTOCAST[str(cfg.trainer.precision)], cfg.trainer.get("gradient_clip_val")
    step = training_step(task, lambda: mean_loss(task, batch), settings.device, dtype, optimizer_of(task), clip)
    return step, task, batch


def measure(workload: Workload, variant: Variant, settings: Settings, start_batch: int) -> Measured:
    """``variant``'s training step at the largest of ``start_batch``, its half, its quarter... that fits."""
    base = workload.base
    result = Measured(f"{workload.KEY}-{variant.name}", workload.describe(base), target=workload.TARGET)
    if variant.needs and OmegaConf.select(base, variant.needs, default=_ABSENT) is _ABSENT:
        result.status = f"not available: this tree has no {variant.needs} for task={base.task.name}"
        return result
    cfg = workload.compose(variant.overrides)
    size = start_batch
    with ExitStack() as stack:
        mesh = stack.enter_context(one_rank_mesh(settings.device)) if shards_weights(cfg.trainer.get("strategy")) else None
        while True:
            _reset(settings.device)
            step, task, batch = prepared_step(workload, cfg, settings, size, mesh)
            try:
                start = time.perf_counter()
                step()
                result.first_seconds = time.perf_counter() - start
                break
            except torch.OutOfMemoryError:
                if size == 1:
                    raise
            del step, task, batch
            size //= 2
        result.seconds = interleaved({"step": step}, Budget(settings.warmup, settings.repeats))["step"]
        precision = str(cfg.trainer.precision)
        result.dtype = compute_dtype(precision)
        result.peak_flops = device_peak_flops(settings.device, result.dtype)
        result.batch, result.unit = size, workload.UNIT
        result.units = task.throughput_units(batch)[workload.UNIT]
        result.flops = task.flops_per_batch(batch)  # the Throughput callback's count
        if settings.device.type == "cuda":
            result.memory_gib = torch.cuda.max_memory_allocated(settings.device) / 2**30
        result.status = "ok"
        del step, task, batch
    return result


def measure_variants(workload: Workload, variants: tuple[Variant, ...], settings: Settings,
                     start_batch: int | None = None, deadline: float = float("inf")) -> Iterator[Measured]:
    """Each of ``variants`` in turn; a failure (a compile error, an OOM at batch 1) becomes its row, not the end.
    No variant starts within 20 s of ``deadline`` (epoch seconds)."""
    start = start_batch or workload.max_batch(workload.base)
    for variant in variants:
        if time.time() > deadline - 20:
            return
        try:
            result = measure(workload, variant, settings, start)
        except Exception as err:  # one variant's failure (a compile error, an OOM at batch 1) must not lose the others
            log.exception("%s-%s failed", workload.KEY, variant.name)
            first_line = (str(err).strip().splitlines() or [""])[0]
            # (Described by its key alone: composing the config may be what failed.)
            result = Measured(f"{workload.KEY}-{variant.name}", workload.KEY,
                              status=f"failed: {type(err).__name__}: {first_line}"[:300], target=workload.TARGET)
        _reset(settings.device)
        if result.status == "ok" and result.batch is not None:
            start = result.batch
        log.info("%s: %s", result.name, result.status)
        yield result


def ratio_to_plain(result: Measured, variant: Variant, measured: dict[str, Measured]) -> float | None:
    """A sharded variant's time per item (token, target token, image) over its plain variant's (same task), where
    both were measured: the step times' ratio at equal batches, and still the rates' where the sharded step fit only
    a smaller batch (it starts from the plain variant's and halves on OOM), whose shorter step must not pass."""
    plain = measured.get(f"{result.name.split('-', 1)[0]}-{variant.plain}") if variant.plain else None
    if plain is None or not plain.seconds or not result.seconds or not plain.units or not result.units:
        return None
    return (result.seconds / result.units) / (plain.seconds / plain.units)


def target_of(result: Measured, variant: Variant, measured: dict[str, Measured]) -> tuple[str, str]:
    """(target, met) of a row: the time per item against plain's for a sharded variant, the task's MFU in bf16."""
    if variant.plain is not None:
        ratio = ratio_to_plain(result, variant, measured)
        return f"<= {FSDP_TARGET}x {variant.plain}'s time per item", "-" if ratio is None else ("yes" if ratio <= FSDP_TARGET else "**no**")
    if BF16 not in variant.overrides or result.target is None:
        return "-", "-"
    mfu = result.mfu
    return f">= {result.target:.0%} MFU", "-" if mfu is None else ("yes" if mfu >= result.target else "**no**")


def as_row(group: str, result: Measured, variant: Variant, measured: dict[str, Measured]) -> Row:
    target, met = target_of(result, variant, measured)
    if result.status != "ok":
        return Row(group, f"{result.workload}, {variant.name}", result.status, "-", "-", target, "-",
                   " ".join(variant.overrides))
    assert result.seconds is not None and result.units is not None and result.flops is not None
    ratio = ratio_to_plain(result, variant, measured)
    mfu = result.mfu
    return Row(
        group, f"{result.workload}, {variant.name}: batch {result.batch}",
        f"{milliseconds(result.seconds)}; {result.units / result.seconds:,.0f} {result.unit}/s",
        f"peak {result.peak_flops / 1e12:.4g} TFLOP/s ({result.dtype})" if result.peak_flops else "no peak known",
        (f"MFU {mfu:.1%}" if mfu is not None else "-") + (f"; {ratio:.2f}x {variant.plain}'s time per item" if ratio else ""),
        target, met,
        f"{' '.join(variant.overrides)}; first step {result.first_seconds:.1f} s; "
        + (f"peak memory {result.memory_gib:.1f} GiB; " if result.memory_gib is not None else "")
        + f"{result.flops / 1e12:.3g} TFLOP per step (the task's flops_per_batch)",
    )


def workload_rows(group: str, variants: tuple[Variant, ...], settings: Settings) -> list[Row]:
    rows = []
    for kind in WORKLOADS:
        measured: dict[str, Measured] = {}
        for variant, result in zip(variants, measure_variants(kind(settings.quick), variants, settings), strict=False):
            measured[result.name] = result
            rows.append(as_row(group, result, variant, measured))
    return rows


def mfu_rows(settings: Settings) -> list[Row]:
    # --quick is a smoke test of the rows: one variant (fp16 matmuls crawl on CPUs; compiling takes minutes).
    return workload_rows("mfu", PRECISION_VARIANTS[:1] if settings.quick else PRECISION_VARIANTS, settings)


def speed_rows(settings: Settings) -> list[Row]:
    return workload_rows("speed", SPEED_VARIANTS, settings)
