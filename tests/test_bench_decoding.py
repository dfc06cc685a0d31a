"""``python -m trident.bench --only kv_cache generation`` (quick shapes): grouped-query cache bytes fall exactly
by n_heads / n_kv_heads, measured from the cache's tensors; a sliding window's cache stays flat; the cached
decoding rows come at torch's thread count and at one thread."""

from __future__ import annotations

import pytest
import torch

from trident.backbone import TransformerConfig
from trident.bench import generation, kv_cache
from trident.bench.results import Settings
from trident.models import CausalLM
from trident.models.sampling import kv_cache_bytes_per_token

QUICK = Settings(device=torch.device("cpu"), quick=True, warmup=0, repeats=1)


def test_quick_rows_measure_exact_byte_ratios_and_a_flat_window(single_thread: None) -> None:
    rows = kv_cache.kv_cache_rows(QUICK)
    assert [row.group for row in rows] == ["kv_cache"] * 4
    heads, window = rows[:3], rows[3]
    assert [row.benchmark.split(" (")[0] for row in heads] == [f"KV cache of n_kv_heads={n}" for n in (8, 2, 1)]
    # Quick shapes: d=32, 8 heads (head_dim 4), 1 layer, fp32: 2 * 1 * n_kv_heads * 4 * 4 bytes per token.
    assert [row.trident.split(",")[0] for row in heads] == ["256 B/token", "64 B/token", "32 B/token"]
    assert [row.result.split(",")[0] for row in heads] == ["1x fewer bytes", "4x fewer bytes", "8x fewer bytes"]
    assert all(row.met == "yes" and "tokens/s" in row.trident for row in heads)
    # W=4: 4 positions of 256 bytes however long the sequence; without the window 4, 8, 16 positions.
    assert window.trident == "1024 B / 1024 B / 1024 B"
    assert window.reference == "no window: 1024 B / 2048 B / 4096 B"
    assert window.met == "yes"


def test_bytes_come_from_the_cache_tensors_of_the_key_value_heads_only() -> None:
    cfg = TransformerConfig(d_model=48, n_heads=6, n_kv_heads=3, n_layers=2, d_ff=96, max_seq_len=32, dropout=0.0,
                            pos_encoding="rope")
    model = CausalLM(cfg, 50).eval()
    prompt = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    assert kv_cache_bytes_per_token(model, prompt) == 2 * 2 * 3 * 8 * 4  # keys and values, layers, heads, width, fp32
    assert kv_cache_bytes_per_token(model.to(torch.float64), prompt) == 2 * 2 * 3 * 8 * 8


def test_a_cache_that_keeps_the_expanded_heads_fails_the_row(monkeypatch: pytest.MonkeyPatch, single_thread: None) -> None:
    """Were the cache to store the query heads' expanded keys, bytes would not fall: the row refuses to report."""
    def expanded(model: CausalLM, prompt: torch.Tensor) -> int:
        return 2 * model.cfg.n_layers * model.cfg.n_heads * model.cfg.head_dim * 4

    monkeypatch.setattr(kv_cache, "kv_cache_bytes_per_token", expanded)
    with pytest.raises(AssertionError, match="n_kv_heads=2: 256 cache bytes per token, not 256 / 4"):
        kv_cache.kv_heads_rows(QUICK)



def test_generation_rows_come_at_torchs_threads_and_at_one_thread() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = generation.generation_rows(QUICK)
        assert torch.get_num_threads() == 2, "the row restores torch's thread count"
    finally:
        torch.set_num_threads(threads)
    assert [row.benchmark.split(", ")[-1] for row in rows] == ["2 torch thread(s)"] * 2 + ["1 torch thread(s)"] * 2
    assert all("identical greedy tokens" in row.notes for row in rows)
