"""The LM's test stage logs, beside quality, the KV cache's bytes per token (read from a real cache) and
greedy decoding speed (its callbacks.model_costs): what experiment=ablation_kv_heads puts side by side."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trident.tasks.lm import LanguageModelTask
from trident.training.callbacks import ModelCosts


@pytest.mark.parametrize(("n_kv_heads", "window", "max_seq_len"), [(4, None, 16), (2, None, 16), (1, None, 16), (1, 8, 16),
                                                                     (2, None, 2)])
def test_test_stage_logs_cache_bytes_of_the_key_value_heads_and_a_speed(
    n_kv_heads: int, window: int | None, max_seq_len: int, monkeypatch: pytest.MonkeyPatch, single_thread: None
) -> None:
    backbone = {"d_model": 32, "n_heads": 4, "n_kv_heads": n_kv_heads, "n_layers": 3, "d_ff": 64, "dropout": 0.0,
                "max_seq_len": max_seq_len, "pos_encoding": "rope", "attention_window": window}
    task = LanguageModelTask(backbone, vocab_size=11, optimizer={}, scheduler={}).eval()
    logged: dict[str, Any] = {}
    monkeypatch.setattr(task, "log", lambda name, value, **kwargs: logged.update({name: value}))
    with torch.no_grad():
        task.test_step((torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)), 0)
    task.on_test_epoch_end()
    ModelCosts().on_test_epoch_end(None, task)  # type: ignore[arg-type]  # every task=lm run's callbacks.model_costs
    assert set(logged) == {"test/loss", "test/ppl", "test/kv_cache_bytes_per_token", "test/greedy_tokens_per_s",
                           "test/trainable_params"}
    # keys and values, 3 layers, n_kv_heads heads of width 8, fp32
    assert logged["test/kv_cache_bytes_per_token"] == 2 * 3 * n_kv_heads * 8 * 4
    assert logged["test/greedy_tokens_per_s"] > 0 and torch.isfinite(torch.tensor(logged["test/greedy_tokens_per_s"]))
