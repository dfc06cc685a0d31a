"""Config values given as booleans (``true`` on the command line) are refused where a number is
expected: Python counts True as 1, so an unchecked ``isinstance(value, int)`` would let it through
(each value below would pass its range check as 1 or 0)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from trident.backbone import TransformerConfig
from trident.data.masking import Masking
from trident.errors import ConfigError, is_int, is_number
from trident.models.sampling import check_filters
from trident.training.optim import check_optimizer_config, check_scheduler_config
from trident.training.run_checks import check_seed, check_trainer_config


def test_bools_are_neither_ints_nor_numbers() -> None:
    assert is_int(3) and not is_int(True) and not is_int(2.5) and not is_int("3")
    assert is_number(3) and is_number(2.5) and not is_number(False) and not is_number("2.5")


@pytest.mark.parametrize("check", [
    lambda: TransformerConfig(n_layers=True),
    lambda: TransformerConfig(dropout=False),
    lambda: Masking(mask_fraction=True, random_fraction=0.0),
    lambda: check_optimizer_config({"lr": True}),
    lambda: check_scheduler_config({"warmup_steps": True}),
    lambda: check_trainer_config({"max_steps": True}),
    lambda: check_seed(True),
    lambda: check_filters(True, None),
], ids=["model.n_layers", "model.dropout", "task.mask_token_fraction", "optimizer.lr", "scheduler.warmup_steps",
        "trainer.max_steps", "seed", "top_k"])
def test_every_config_check_refuses_a_bool(check: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        check()
