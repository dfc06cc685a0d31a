"""KV-cache memory and decoding speed of grouped-query attention, and a sliding window's flat cache.

Bytes are read from the cache's own tensors (their storages), never computed from the formula
2 * n_layers * n_kv_heads * head_dim * dtype bytes, so the rows check the cache, not the arithmetic.
"""

from __future__ import annotations

import torch

from trident.backbone import TransformerConfig
from trident.bench.results import Row, Settings, verdict
from trident.bench.timing import Budget, interleaved, synchronize
from trident.models import CausalLM, generate
from trident.models.sampling import cache_bytes, kv_cache_bytes_per_token

PROMPT = 16
VOCAB = 256


def _config(settings: Settings, n_kv_heads: int | None, *, window: int | None, max_seq_len: int) -> TransformerConfig:
    d_model, n_heads, n_layers = (32, 8, 1) if settings.quick else (256, 8, 4)
    return TransformerConfig(
        d_model=d_model, n_heads=n_heads, n_layers=n_layers, d_ff=4 * d_model, max_seq_len=max_seq_len, dropout=0.0,
        pos_encoding="rope", n_kv_heads=n_kv_heads, attention_window=window,
    )


def _model(cfg: TransformerConfig, device: torch.device) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(cfg, VOCAB).to(device).eval()
    # Decisive greedy choices (as in the generation rows): random weights give near-uniform logits.
    torch.nn.init.normal_(model.embed.weight, std=1.0)
    return model


def kv_heads_rows(settings: Settings) -> list[Row]:
    """n_kv_heads = n_heads, n_heads / 4, 1: cache bytes per token (must fall exactly by n_heads /
    n_kv_heads, asserted) and greedy batch-1 generation speed, the variants timed in turns."""
    new_tokens = 16 if settings.quick else 256
    n_heads = _config(settings, None, window=None, max_seq_len=1).n_heads
    kv_heads = (n_heads, n_heads // 4, 1)
    models = {n: _model(_config(settings, n, window=None, max_seq_len=PROMPT + new_tokens), settings.device)
              for n in kv_heads}
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(settings.device)
    per_token = {n: kv_cache_bytes_per_token(model, prompt) for n, model in models.items()}

    def run(model: CausalLM) -> None:
        generate(model, prompt, new_tokens, temperature=0.0)
        synchronize(settings.device)

    seconds = interleaved({str(n): (lambda m=model: run(m)) for n, model in models.items()},
                          Budget(settings.warmup, settings.repeats))
    full = per_token[n_heads]
    cfg = models[n_heads].cfg
    rows = []
    for n in kv_heads:
        if per_token[n] * n_heads != full * n:
            raise AssertionError(
                f"n_kv_heads={n}: {per_token[n]} cache bytes per token, not {full} / {n_heads // n} (n_heads / n_kv_heads)"
            )
        tokens_per_second = new_tokens / seconds[str(n)]
        rows.append(Row(
            "kv_cache",
            f"KV cache of n_kv_heads={n} ({n_heads} query heads): d={cfg.d_model}, {cfg.n_layers} layers, rope, "
            f"greedy, batch 1, {new_tokens} new tokens after a {PROMPT}-token prompt",
            f"{per_token[n]} B/token, {tokens_per_second:.0f} tokens/s",
            f"n_kv_heads={n_heads}: {full} B/token, {new_tokens / seconds[str(n_heads)]:.0f} tokens/s",
            f"{full / per_token[n]:g}x fewer bytes, {seconds[str(n_heads)] / seconds[str(n)]:.2f}x tokens/s",
            f"bytes / {n_heads // n} exactly", verdict(True),
            f"bytes = the cache tensors' storage / positions (asserted exact); fp32; median of {settings.repeats} run(s), "
            f"variants in turns; {torch.get_num_threads()} torch threads",
        ))
    return rows


def _bytes_after(model: CausalLM, positions: int, device: torch.device) -> int:
    """Cache bytes after decoding ``positions`` tokens one at a time into a cache sized for them."""
    ids = torch.randint(0, VOCAB, (1, positions), generator=torch.Generator().manual_seed(1)).to(device)
    cache = model.new_cache(positions)
    with torch.no_grad():
        for position in range(positions):
            model(ids[:, position : position + 1], cache=cache)
    return cache_bytes(cache)


def window_rows(settings: Settings) -> list[Row]:
    """A sliding window's cache stays flat past the window (W, 2W, 4W positions: equal bytes), where
    a cache without a window grows with the sequence (asserted)."""
    window = 4 if settings.quick else 64
    lengths = (window, 2 * window, 4 * window)
    measured: dict[int | None, list[int]] = {}
    for attention_window in (window, None):
        model = _model(_config(settings, None, window=attention_window, max_seq_len=4 * window), settings.device)
        measured[attention_window] = [_bytes_after(model, n, settings.device) for n in lengths]
    windowed, full = measured[window], measured[None]
    if len(set(windowed)) != 1 or windowed[0] != full[0]:
        raise AssertionError(f"attention_window={window}: cache bytes {windowed} after {lengths} positions are not flat "
                             f"at the bytes of {window} positions ({full[0]})")
    if full != [full[0] * n // window for n in lengths]:
        raise AssertionError(f"without a window the cache should grow with the positions: {full} after {lengths}")
    cfg = model.cfg
    return [Row(
        "kv_cache",
        f"KV cache after {', '.join(map(str, lengths))} positions with attention_window={window}: d={cfg.d_model}, "
        f"{cfg.n_layers} layers, rope",
        " / ".join(f"{b} B" for b in windowed), "no window: " + " / ".join(f"{b} B" for b in full),
        f"flat past the window; {full[-1] / windowed[-1]:g}x smaller at {lengths[-1]} positions",
        "flat past W", verdict(True), "decoded one token at a time into a cache sized for the sequence; bytes of the "
        "cache tensors' storage (asserted flat)",
    )]


def kv_cache_rows(settings: Settings) -> list[Row]:
    return kv_heads_rows(settings) + window_rows(settings)
