"""The converter seam: what changes a built network after its weights are loaded and before it is sharded.

A converter (LoRA today; a quantized base, a pruning mask later) is chosen by the config (``finetune=<NAME>``),
checks its settings there (:meth:`Converter.check`: its typed settings or one ``ConfigError`` line), and is
recorded in the task's hyperparameters under its :attr:`Converter.NAME`, so a checkpoint re-applies it from its own
hyperparameters (trident.tasks.networks, the lifecycle). On the network it says how it changes it
(:meth:`Converter.apply`), which parameters may train (:meth:`Converter.trains`: the rest are frozen, the task's
``HEAD`` trains whatever a converter says), what artifact a run writes (:meth:`Converter.write_artifact`, through
an :class:`ArtifactFiles` the weights room injects: files in and out are that room's), how it is folded away
for an export (:meth:`Converter.merge`) and, where it can, how the network runs without it for a while
(:meth:`Converter.switched_off`: the network as it was loaded, e.g. preference tuning's reference policy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torch import nn

if TYPE_CHECKING:  # omegaconf is imported where a config is read: a command that loads a run (sample) reads none
    from omegaconf import DictConfig

    from trident.backbone import TransformerConfig


class ArtifactFiles(Protocol):
    """How a converter's artifact is written after a run and read back onto a network (trident.weights)."""

    def save(self, net: nn.Module, run_dir: Path, base: str, settings: dict[str, Any], best: str | None) -> Path:
        """Write the artifact of ``net`` (trained on ``base``, the ``init_from``) under ``run_dir``: of the ``best``
        checkpoint's weights when there is one; returns its directory."""
        ...

    def load(self, net: nn.Module, source: str, settings: dict[str, Any], base: str) -> None:
        """Put the artifact at ``source`` on ``net``, converted with ``settings`` on the weights of ``base``."""
        ...


class Converter(ABC):
    """One change of a network, built from the settings recorded in the task's hyperparameters."""

    #: The ``finetune=`` option that chooses it and the task hyperparameter that records its settings.
    NAME: ClassVar[str]
    #: The key of its config group naming an artifact of an earlier run to start from (None: it has none).
    START_FROM: ClassVar[str | None] = None
    #: Whether the parameters it freezes are the source's unchanged, which the run's checkpoints then leave out
    #: (trident.weights.frozen_base): they are refilled from ``init_from`` when a checkpoint is read.
    FREEZES_SOURCE: ClassVar[bool] = False
    #: Whether tensor parallelism's plan (trident.parallel) can split a network it converted: a converter that wraps
    #: the projections the plan splits (LoRA's adapters) cannot run under ``tensor_parallel_size`` > 1.
    TENSOR_PARALLEL: ClassVar[bool] = False
    #: Whether :meth:`switched_off` runs the network as it was loaded (no copy of the loaded weights needed).
    SWITCHES_OFF: ClassVar[bool] = False

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = dict(settings)

    @classmethod
    @abstractmethod
    def check(cls, cfg: DictConfig, settings: dict[str, Any], backbone: TransformerConfig) -> dict[str, Any]:
        """The config group's ``settings`` (``cfg``: the run's config) checked against ``backbone``: what the task
        records (plain values), or one ``ConfigError`` line naming the fix."""

    @classmethod
    def check_run(cls, cfg: DictConfig) -> None:
        """What a training run under this converter cannot do (checked before any work; not by eval.py)."""

    @abstractmethod
    def apply(self, net: nn.Module) -> None:
        """Change ``net`` in place (its weights loaded by then); the names of its parameters stay as they were."""

    @abstractmethod
    def trains(self, name: str) -> bool:
        """Whether parameter ``name`` of the converted network may train (the others are frozen)."""

    @abstractmethod
    def merge(self, net: nn.Module) -> None:
        """Fold the change into ``net``'s plain layers, in place (an export writes what the base's format reads)."""

    def check_shards(self, net: nn.Module, shards: int) -> None:
        """What FSDP's split of the converted ``net``'s weights over ``shards`` ranks needs (one ``ConfigError``
        line): nothing, for plain tensors."""

    def switched_off(self, net: nn.Module) -> AbstractContextManager[None]:
        """A context in which ``net`` runs as it was before :meth:`apply` (its loaded weights), for a converter that
        :attr:`SWITCHES_OFF`; one that cannot (e.g. weights quantized in place) leaves the loaded network to a copy."""
        raise TypeError(f"finetune={self.NAME} changes the network for good: it cannot be switched off")

    def write_artifact(self, net: nn.Module, run_dir: Path, base: str, best: str | None, files: ArtifactFiles) -> Path:
        """Write what a run of this converter hands on beside its checkpoints, with ``files``."""
        return files.save(net, run_dir, base, self.settings, best)

    def start_from(self, net: nn.Module, source: str, base: str, files: ArtifactFiles) -> None:
        """Put an earlier run's artifact (``source``, the config's :attr:`START_FROM`) on the converted ``net``."""
        files.load(net, source, self.settings, base)
