"""What the pipeline expects of every trident task, whatever it trains."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from tokenizers import Tokenizer
from torch import Tensor, nn
from torch.export import Dim
from torch.optim import Optimizer

from trident.backbone import TransformerConfig, redraw_features
from trident.converters import Converter
from trident.data.base import TridentDataModule, WeightsSource
from trident.errors import ConfigError
from trident.objectives import Loss, Objective, build_objective, objective_name
from trident.parallel.tensor_parallel import clip_grad_norm, is_tensor_parallel
from trident.tasks.networks import NetworkLifecycle, companion_path, shard_networks, switched_off
from trident.tasks.task_in_checkpoint import TaskInCheckpoint
from trident.tasks.teacher import check_distill_run
from trident.training.optim import check_optimizer_config, optimizers_for, parameter_groups, positional_parameter_names
from trident.training.token_loss import StepLoss, TokenMean, checked_mean_loss, data_parallel_group, perplexity

if TYPE_CHECKING:  # Hydra's config, imported where a run is configured, not where a checkpoint loads
    from omegaconf import DictConfig

# The checkpoint key of the training loss's constant scale (trident.training.token_loss.StepLoss.scale).
LOSS_SCALE_KEY = "trident_loss_scale"

# A capability (TridentTask.CAPABILITIES): ``net`` continues token ids (``net(ids, cache=...)`` -> logits (B, T, V),
# ``net.new_cache(length)``, ``net.context_length``) and the task holds its tokenizer: trident-sample, trident-chat.
GENERATE = "generate"
# A capability: the task fills in the [MASK]s of texts (``task.fill_mask(texts, top_k=...)`` -> per text, per mask,
# its top-k (token, probability)): trident-fill-mask.
FILL_MASK = "fill in masks"
# A capability: the task translates sentences (``task.translate(texts, beam_size=..., use_cache=...)`` -> one text
# each; its decoding settings ``length_penalty``, ``max_len_a``, ``max_len_b`` are attributes): trident-translate.
TRANSLATE = "translate"

# What a network's stack is, in the words of the error lines.
STACK_KINDS = {"decoder": "a decoder (causal)", "encoder": "an encoder (bidirectional)"}


@dataclass(frozen=True)
class NetInput:
    """One input of a task's ``net.forward`` as the ONNX export traces it."""

    parameter: str  # the name ``net.forward`` takes it by
    onnx_name: str  # the exported graph's input name
    example: Tensor
    dynamic: dict[int, Dim]  # axis -> its size, free at run time (inputs that share one Dim share the size)


def token_ids(vocab_size: int, longest: int, length: int = 8) -> tuple[Tensor, dict[int, Dim]]:
    """Example token ids (B=2, T=``length`` or ``longest`` if shorter) and their dynamic axes: any batch size,
    any length up to ``longest``."""
    ids = torch.randint(0, vocab_size, (2, min(length, longest)))  # (B, T)
    return ids, {0: Dim("batch", min=1), 1: Dim("length", min=1, max=longest)}


def token_input(net: nn.Module) -> list[NetInput]:
    """The example input of a network that reads token ids alone (a causal or masked LM: ``net.vocab_size`` rows,
    ``net.cfg.max_seq_len`` positions at most): its ``ids`` (B, T), named ``input_ids`` in the exports."""
    ids, dynamic = token_ids(int(net.vocab_size), int(net.cfg.max_seq_len))
    return [NetInput("ids", "input_ids", ids, dynamic)]


class TridentTask(TaskInCheckpoint, L.LightningModule, ABC, metaclass=NetworkLifecycle):
    """A LightningModule that the pipeline builds from the config groups and the data's inputs.

    A task names the data module it trains on (``DATA_MODULE``), may derive the backbone's sequence
    geometry from the data (:meth:`backbone_geometry`) and check its settings before any work
    (:meth:`validate_config`). Its constructor takes the ``backbone`` (the model and pos_encoding
    groups as one dict), ``optimizer`` and ``scheduler`` configs as plain dicts, and a text task the
    ``tokenizer_json`` of its data; it builds ``net`` on ``backbone_config``, the network that
    ``compile=true``, ``init_from=`` and the export commands work on, and may build more (:attr:`NETWORKS`)
    and frozen companions (:meth:`add_companion`). What happens to them next (weights loaded, converters such
    as ``lora=`` applied, sharding, compiling) is the lifecycle's (trident.tasks.networks), not the task's.
    It counts what one training batch holds (:meth:`throughput_units`, :meth:`flops_per_batch`) for
    throughput and MFU.

    The hyperparameters saved in every checkpoint are the constructor's arguments (plain values),
    so ``load_from_checkpoint`` rebuilds the task; the tokenizer is not one of them (a BPE
    vocabulary is large): it travels in the checkpoint itself (:class:`TaskInCheckpoint`).
    """

    #: The ``task=`` option (its yaml's ``task.name``; tests/test_task_contract.py holds them equal).
    NAME: ClassVar[str]
    #: The data module this task trains on (checked before any work).
    DATA_MODULE: ClassVar[type[TridentDataModule]]
    #: Whether a checkpoint of this task must hold a tokenizer (text tasks) to be usable.
    NEEDS_TOKENIZER: ClassVar[bool] = True
    #: What the network reads, ``"text"`` or ``"images"``: ``init_from`` takes only sources that read the same.
    READS: ClassVar[str] = "text"
    #: Whether the network is an encoder-decoder, which starts only from (and gives weights only to) another one:
    #: an LM or MLM network has no cross-attention and its tokenizer no <s> / </s>.
    ENCODER_DECODER: ClassVar[bool] = False
    #: The stack a single-stack network runs, ``"decoder"`` or ``"encoder"`` (see :meth:`stack`).
    STACK: ClassVar[str | None] = None
    #: Whether the network reads its text in segments with a memory (``model.memory_length``: task=lm's causal LM).
    RECURRENT: ClassVar[bool] = False
    #: The parameters of ``net`` (name prefixes) that a fine-tuning adds and that train under a converter
    #: (``finetune=lora``) beside what it lets train, the base frozen (peft's ``modules_to_save``): e.g. a classifier head.
    HEAD: ClassVar[tuple[str, ...]] = ()
    #: The attributes holding the networks the task trains: each is converted, sharded, compiled and saved in the
    #: checkpoints under its name (trident.tasks.networks). ``init_from`` loads ``net``.
    NETWORKS: ClassVar[tuple[str, ...]] = ("net",)
    #: The objectives (trident.objectives, by name) this task's outputs fit, its default first: the ``objective``
    #: config group chooses among them. None: the task computes its loss in ``training_step`` itself.
    TRAINS_WITH: ClassVar[tuple[str, ...]] = ()
    #: What the commands may ask of a trained task beyond training and export (e.g. :data:`GENERATE`): a command
    #: checks it before it loads the weights, in one line naming the tasks that can (trident.weights.capable).
    CAPABILITIES: ClassVar[frozenset[str]] = frozenset()

    #: The settings (constructor arguments, ``task.<name>``) that shape ``net``: what a checkpoint of this task, read as
    #: an ``init_from`` source, fixes in a run whose task has the same setting (:meth:`settings_from_source`).
    SOURCE_SETTINGS: ClassVar[tuple[str, ...]] = ()
    #: The settings that are the data's (``data.<name>``) and that the network was built or trained for (a ViT's patch
    #: size and image normalisation): what such a source fixes in the run's data, as its data module takes them.
    SOURCE_DATA_SETTINGS: ClassVar[tuple[str, ...]] = ()
    #: The network (a trident.models class) an outside family's files must hold to be read as a source of this task's
    #: weights (a GPT-2 or Llama directory holds a CausalLM); None: no outside family is read as this task's.
    OUTSIDE_NETWORK: ClassVar[type[nn.Module] | None] = None
    #: How this task reads what such outside files say of their network (trident.models.properties, in the words of
    #: networks): property -> ``task.<setting>`` or ``data.<setting>``, the counterpart of :data:`SOURCE_SETTINGS` /
    #: :data:`SOURCE_DATA_SETTINGS` for a checkpoint of this task (:meth:`stated_by_network`).
    FROM_NETWORK: ClassVar[Mapping[str, str]] = {}

    #: The metrics the task logs at every validation: what early stopping (and a checkpoint) may monitor.
    VALIDATION_METRICS: ClassVar[tuple[str, ...]]

    #: The task's network: all its weights, and the module ``compile=true`` and the exports use.
    net: nn.Module

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A task class that names no data module, no ``task=`` name or no validation metrics fails where it is
        defined, not in its first run."""
        super().__init_subclass__(**kwargs)
        data_module = getattr(cls, "DATA_MODULE", None)
        if not (isinstance(data_module, type) and issubclass(data_module, TridentDataModule)):
            raise TypeError(f"{cls.__qualname__} must set DATA_MODULE to the TridentDataModule subclass it trains on, "
                            f"got {data_module!r}")
        if not isinstance(getattr(cls, "NAME", None), str):
            raise TypeError(f"{cls.__qualname__} must set NAME to its task= option (its conf/task yaml's task.name)")
        metrics = getattr(cls, "VALIDATION_METRICS", None)
        if not (isinstance(metrics, tuple) and metrics and all(isinstance(name, str) for name in metrics)):
            raise TypeError(f"{cls.__qualname__} must set VALIDATION_METRICS to the names of the metrics its validation "
                            "logs, e.g. (\"val/loss\",)")

    def __init__(
        self,
        backbone: dict[str, Any],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        tokenizer_json: str | None = None,
        lora: dict[str, Any] | None = None,
        nf4: dict[str, Any] | None = None,
        objective: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # Plain values only: Lightning collects the arguments of every constructor up the chain
        # (the subclass's included), so load_from_checkpoint can rebuild the task from them.
        self.save_hyperparameters(ignore=["tokenizer_json"])
        self.backbone_config = TransformerConfig(**backbone)
        self.optimizer_cfg, self.scheduler_cfg = optimizer, scheduler
        self.tokenizer = Tokenizer.from_str(tokenizer_json) if tokenizer_json else None
        self.tokenizer_settings: dict[str, str] = {}  # an init_from source's chat template and special tokens
        # lora, nf4: finetune=lora's (and qlora's) settings, applied by the lifecycle once the networks are built
        # (trident.converters).
        self.converters: list[Converter] = []  # those applied (trident.tasks.networks.convert_networks)
        # Frozen companions by name (a teacher, a reference policy) and where their weights are read from: kept out of
        # the module tree, so no state dict, optimizer or checkpoint holds them (trident.tasks.networks).
        self.companions: dict[str, nn.Module] = {}
        self.companion_sources: dict[str, str] = {}
        self.companion_initial: dict[str, str] = {}  # a copy of a trained network's initial weights: which network
        # Every task's one loss reduction (trident.training.token_loss): training over the optimizer step's global
        # batch, validation and test over the whole epoch, both summed losses over trained tokens.
        self.step_loss = StepLoss()
        self.epoch_losses = nn.ModuleDict({"val": TokenMean(), "test": TokenMean()})

    def chosen_objective(self, **settings: Any) -> Objective:
        """The objective of the ``objective`` setting (the ``objective`` config group, saved with the
        hyperparameters; None, as in checkpoints that predate it: this task's default), given the task's own
        ``settings`` that it takes (e.g. ``label_smoothing``)."""
        return build_objective(self.hparams.get("objective"), self.NAME, self.TRAINS_WITH, **settings)

    def trained(self, loss: Loss) -> Tensor:
        """What ``training_step`` returns for a micro-batch's objective ``loss`` (:meth:`trained_loss`); its parts
        are logged as ``train/<part>``, over the optimizer step's global batch as the loss is."""
        for name, (mean, weight) in loss.parts.items():
            self.step_metric(f"train/{name}", mean * weight, weight)
        return self.trained_loss(loss.summed, loss.count)

    def trained_loss(self, summed: Tensor, count: Tensor) -> Tensor:
        """What ``training_step`` returns for a micro-batch whose ``count`` trained tokens (targets, sequences or
        images) have the summed loss ``summed``: the optimizer step's gradient becomes that of the summed losses of
        its global batch over its trained tokens (:meth:`on_before_optimizer_step`)."""
        return self.step_loss.micro_batch(summed, count, data_parallel_group(self))

    def step_metric(self, name: str, total: Tensor | float, weight: Tensor | float) -> None:
        """Log training metric ``name`` of the optimizer step: ``total`` over ``weight`` items of this micro-batch,
        summed with the step's other micro-batches and ranks (logged at the step's end, as ``train/loss`` is)."""
        self.step_loss.add(name, total, weight)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Performer layers (model.attention=performer) redraw their random features by the optimizer step."""
        redraw_features(self, self.global_step)

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """After the step's last backward (and fp16 unscaling), before clipping: the gradients become the global
        token mean's, and the step's training metrics are logged, once per optimizer step."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        metrics = self.step_loss.finish(parameters, self.trainer.accumulate_grad_batches, data_parallel_group(self))
        for name, value in metrics.items():  # already reduced over the ranks: no sync_dist
            self.log(name, value, prog_bar=name == StepLoss.LOSS, on_step=True, on_epoch=False, batch_size=1)

    def evaluated_loss(self, stage: str, summed: Tensor, count: Tensor) -> None:
        """A validation (``stage="val"``) or test batch's summed loss over its ``count`` trained tokens."""
        self.epoch_losses[stage].update(summed, count)

    def log_epoch_loss(self, stage: str, with_perplexity: bool = False) -> None:
        """Log ``<stage>/loss``, the epoch's token-weighted mean over every rank (one line stops a run whose
        epoch trained no token or whose loss is not finite), and with ``with_perplexity`` ``<stage>/ppl``, its
        exp (not torchmetrics' Perplexity, whose fp32 softmax-then-log turns one confident wrong prediction into
        an infinite perplexity beside a finite loss)."""
        value = checked_mean_loss(self.epoch_losses[stage], f"{stage}/loss", self.global_step)
        self.log(f"{stage}/loss", value, prog_bar=stage == "val", sync_dist=True)  # equal on every rank
        if with_perplexity:
            self.log(f"{stage}/ppl", perplexity(value), sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[LOSS_SCALE_KEY] = self.step_loss.scale  # a resumed run scales its losses as before

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.step_loss.scale = checkpoint.get(LOSS_SCALE_KEY, self.step_loss.scale)

    @property
    def learning_rate(self) -> float:
        """``optimizer.lr``, by the name Lightning's learning-rate finder looks for (``Tuner.lr_find``
        sets it to its suggestion; trident.runs.lr_find)."""
        return float(self.optimizer_cfg["lr"])

    @learning_rate.setter
    def learning_rate(self, lr: float) -> None:
        self.optimizer_cfg = {**self.optimizer_cfg, "lr": float(lr)}
        self.hparams["optimizer"] = self.optimizer_cfg  # what a checkpoint saved after it records

    def networks(self) -> dict[str, nn.Module]:
        """The networks the task trains, by attribute name (:attr:`NETWORKS`)."""
        return {name: getattr(self, name) for name in self.NETWORKS}

    def add_companion(self, name: str, network: nn.Module, source: str, initial_of: str | None = None) -> None:
        """Hold ``network`` as a frozen companion ``name`` whose weights are read from ``source`` (a ``.safetensors``
        file or a trident checkpoint) each time the task is built: never trained, never saved with the run, sharded
        and moved like the trained networks. Its source belongs in the task's hyperparameters. ``initial_of``: the
        trained network whose initial weights it copies; a new run fills it from that network once ``init_from`` is
        loaded and writes it to ``source`` (a ``.safetensors`` file), which a resume or a load reads."""
        self.companions[name], self.companion_sources[name] = network, companion_path(source)  # a run's: run-relative
        if initial_of is not None:
            self.companion_initial[name] = initial_of

    @classmethod
    def validation_metrics(cls, cfg: DictConfig) -> tuple[str, ...]:
        """The metrics a validation of the task configured by ``cfg`` logs (what early stopping may monitor):
        :attr:`VALIDATION_METRICS` unless its objective adds some."""
        return cls.VALIDATION_METRICS

    @classmethod
    def initial_copies(cls, cfg: DictConfig) -> tuple[str, ...]:
        """The constructor keys naming the source of a companion that copies a trained network's initial weights,
        for the run's config ``cfg`` (a run names a file under ``<run>/init/`` for each: trident.runs.lifecycle)."""
        return ()

    def switched_off(self) -> AbstractContextManager[None] | None:
        """A context in which the trained networks run as they were loaded, their converters switched off (LoRA's
        adapters off); None when none is applied or one cannot be (trident.tasks.networks)."""
        return switched_off(self)

    def on_networks_converted(self) -> None:
        """Called once the converters are applied (trident.tasks.networks): what the task freezes beyond them."""

    def _apply(self, fn: Any, recurse: bool = True) -> TridentTask:
        # .to(), .half(), a precision plugin's dtype: the companions, outside the module tree, follow the task.
        super()._apply(fn, recurse)
        for companion in getattr(self, "companions", {}).values():
            companion._apply(fn, recurse)
        return self

    @classmethod
    def backbone_geometry(cls, data: dict[str, Any], task: dict[str, Any],
                          model: dict[str, Any] | None = None) -> dict[str, Any]:
        """Backbone settings that follow from the data (``data``, ``task`` and ``model``: the groups as plain
        dicts, ``model`` None for its defaults): by default the context length, ``data.max_seq_len``."""
        return {"max_seq_len": data["max_seq_len"]}

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Checked before any work, with a message naming the fix: the data option feeds this task
        (e.g. not image data for the language model). A task that checks more calls this first."""
        import hydra.utils

        data_class = hydra.utils.get_class(cfg.data._target_)
        if not issubclass(data_class, cls.DATA_MODULE):
            raise ConfigError(
                f"data={cfg.data.name} ({data_class.__name__}) is not data for task={cfg.task.name}, which needs "
                f"{cls.DATA_MODULE.__name__}: choose a {cfg.task.name} data option (docs/configuration.md, config groups)"
            )
        if cfg.model.get("memory_length") and not cls.RECURRENT:  # a decoder stack would build, the memory unused
            raise ConfigError(f"model.memory_length (Transformer-XL's segment recurrence) serves task=lm's causal LM, not "
                              f"task={cfg.task.name}: set model.memory_length=0")
        if cls.TRAINS_WITH:  # the objective fits the task's outputs
            objective_name(cfg.task.get("objective"), cls.NAME, cls.TRAINS_WITH)
        check_distill_run(cls, cfg)  # distill=kd: a task and objective it fits, its settings

    @classmethod
    def stated_as_source(cls, settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint of this task (its hyperparameters, ``settings``) states as an ``init_from`` source: its
        task settings and its data settings that shape the network (:data:`SOURCE_SETTINGS`,
        :data:`SOURCE_DATA_SETTINGS`), where it has them (an earlier version's may not)."""
        return ({key: settings[key] for key in cls.SOURCE_SETTINGS if key in settings},
                {key: settings[key] for key in cls.SOURCE_DATA_SETTINGS if key in settings})

    @classmethod
    def stated_by_network(cls, properties: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """What an outside network of this task's kind (:data:`OUTSIDE_NETWORK`) states as an ``init_from`` source, in
        this task's words, as :meth:`stated_as_source` for a checkpoint of it: the task settings and the data settings
        its ``properties`` fix (:data:`FROM_NETWORK`); a property this task has no setting for is not its business."""
        stated = [(*cls.FROM_NETWORK[name].split("."), value) for name, value in properties.items()
                  if name in cls.FROM_NETWORK]
        return ({key: value for group, key, value in stated if group == "task"},
                {key: value for group, key, value in stated if group == "data"})

    @classmethod
    def settings_from_source(cls, source: WeightsSource, cfg: DictConfig, explicit: Sequence[str]) -> dict[str, Any]:
        """What an ``init_from`` ``source`` fixes in a run of this task besides its architecture (config path -> value):
        each task setting the source states that this task has (a classifier's pooling, a tied output layer), and what
        the run's data takes of it (``TridentDataModule.settings_from_source``: context length, patch size, tokenizer,
        chat template). ``explicit``: the keys the command line set."""
        import hydra.utils

        fixed = {f"task.{key}": value for key, value in source.task_options.items() if key in cfg.task}
        rows, tokenizer = source.vocab_size, source.tokenizer
        if "embedding_rows" in cfg.task and rows is not None and tokenizer is not None and rows > tokenizer.get_vocab_size():
            fixed["task.embedding_rows"] = rows  # a token table padded past its tokenizer (network_builders.table_rows)
        return fixed | hydra.utils.get_class(cfg.data._target_).settings_from_source(source, cfg.data, explicit)

    @classmethod
    def stack(cls, task: DictConfig) -> str | None:
        """The stack the network of a run with the ``task`` settings runs (None: not a single stack)."""
        return cls.STACK

    @classmethod
    def other_stack(cls, task: DictConfig, source_stack: str) -> tuple[str, str]:
        """How the error line names this run (``task`` settings) when ``init_from`` holds the other stack,
        ``source_stack``, and the fix it proposes."""
        return f"task={cls.NAME}", f"pass the weights of {STACK_KINDS[str(cls.stack(task))]}"

    @abstractmethod
    def example_input(self) -> list[NetInput]:
        """A batch ``net`` runs on, as the ONNX export traces it: its inputs in ``net.forward``'s order."""

    @abstractmethod
    def throughput_units(self, batch: Any) -> dict[str, int]:
        """What one training ``batch`` holds, by unit (e.g. ``{"tokens": 8192, "samples": 32}``):
        logged as ``throughput/<unit>_per_sec``."""

    @abstractmethod
    def flops_per_batch(self, batch: Any) -> int:
        """Model FLOPs of one training step on ``batch``, forward and backward (for MFU;
        trident.training.flops)."""

    def parameter_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The optimizer's parameter groups, the one place a task changes them (e.g. per-layer
        learning rates): by default matrices decay, biases, norm gains and positional tables not."""
        return parameter_groups(self.net, weight_decay, positional_parameter_names(self.net))

    def configure_model(self) -> None:
        """``trainer=fsdp``: Lightning's ModelParallelStrategy has built the device mesh; every network is sharded
        on it (the lifecycle's shard step). Under any other strategy there is no mesh and nothing to do."""
        if self.device_mesh is not None:
            shard_networks(self, self.device_mesh, str(self.trainer.precision))

    def configure_gradient_clipping(self, optimizer: Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Under tensor parallelism the parameters live on two device meshes, whose gradient norms torch's
        ``clip_grad_norm_`` cannot stack: the norm is taken mesh by mesh (trident.parallel.tensor_parallel).
        Under bf16-mixed (no GradScaler) the gradients are clipped here too: Lightning's MixedPrecision refuses any
        fused optimizer (it would unscale fp16 gradients inside its step, after clipping), though without a scaler
        there is nothing to unscale, so trainer=gpu's fused AdamW keeps its kernel under clipping (fp16 keeps foreach:
        trident.training.optim.fused_allowed)."""
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and is_tensor_parallel(self.net):
            clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], float(gradient_clip_val))
            return
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(plugin, optimizer, float(gradient_clip_val), algorithm)  # without the refusal
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """The ``optimizer`` config over :meth:`parameter_groups`, and the ``scheduler`` stepped
        every optimizer step over the run's estimated steps."""
        check_optimizer_config(self.optimizer_cfg)  # weight_decay is read below: a number, or one clear line
        groups = self.parameter_groups(float(self.optimizer_cfg.get("weight_decay", 0.0)))
        # A converter's frozen base (finetune=lora) takes no optimizer state (a task's groups may still name it).
        groups = [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in groups
                  if not group["params"] or any(p.requires_grad for p in group["params"])]
        steps = int(self.trainer.estimated_stepping_batches)
        return optimizers_for(self.net, self.optimizer_cfg, self.scheduler_cfg, steps, groups=groups)
