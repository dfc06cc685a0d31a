"""Long-context rope scalings (``pos_encoding.options.scaling``), as the open model families state them.

Each type computes exactly what ``transformers`` computes for the same ``rope_parameters``
(``transformers.modeling_rope_utils``), so imported checkpoints keep their outputs:

* ``linear`` (position interpolation): every frequency divided by ``factor``;
* ``dynamic`` (NTK-aware): the base grows with the sequence once it passes the original length;
* ``yarn``: high frequencies kept, low ones interpolated, a linear ramp between, and cos/sin
  multiplied by an attention factor (mscale);
* ``llama3``: Llama 3.1's piecewise rule, by wavelength against the original context.

The keys are transformers' ``rope_parameters`` keys verbatim, ``rope_type`` renamed ``type``
(``rope_theta`` is the rope option ``base``). ``original_max_position_embeddings`` is the context
the model was trained on; for ``dynamic`` it is what transformers reads as ``max_position_embeddings``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from trident.errors import ConfigError, is_int, is_number

# type -> (required keys, optional keys); `type` itself is required everywhere.
SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}


def check_scaling(scaling: Any) -> dict[str, Any] | None:
    """``scaling`` as a plain dict with its keys checked, or None (no scaling); one ConfigError line otherwise."""
    if scaling is None:
        return None
    where = "pos_encoding.options.scaling"
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"{where}={scaling!r} is not a mapping: give null or {{type: ..., factor: ...}}")
    scaling = dict(scaling)
    kind = scaling.get("type")
    if kind not in SCALING_KEYS:
        raise ConfigError(f"{where}.type={kind!r} is not a rope scaling: choose one of {', '.join(SCALING_KEYS)}")
    required, optional = SCALING_KEYS[kind]
    unknown = sorted(set(scaling) - {"type", *required, *optional})
    missing = [key for key in required if key not in scaling]
    if unknown or missing:
        problem = f"has no key(s) {unknown}" if unknown else f"needs the key(s) {missing}"
        raise ConfigError(f"{where} of type {kind} {problem}: it takes {', '.join(['type', *required, *optional])}")
    _check_values(scaling, where)
    return scaling


def _check_values(scaling: dict[str, Any], where: str) -> None:
    """The values transformers' formulas need to mean anything (it only warns on most of them)."""
    required, optional = SCALING_KEYS[scaling["type"]]
    for key in [*required, *optional]:
        absent = key in optional and scaling.get(key) is None  # transformers reads a null as its default
        if key not in ("truncate", "original_max_position_embeddings") and not absent and not is_number(scaling[key]):
            raise ConfigError(f"{where}.{key}={scaling[key]!r} is not a number: give the number transformers' config has")
    if scaling["factor"] < 1:
        raise ConfigError(f"{where}.factor={scaling['factor']} is below 1: give a factor >= 1 (it stretches the context)")
    original = scaling.get("original_max_position_embeddings", 1)  # required where the type reads it
    if not (is_int(original) and original > 0):
        raise ConfigError(f"{where}.original_max_position_embeddings={original!r} is not a positive integer: "
                          "give the context length the model was trained on")
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        raise ConfigError(f"{where}.truncate={scaling['truncate']!r} is not true or false: give true (default) or false")
    if scaling["type"] == "llama3" and not 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ConfigError(
            f"{where}: llama3 needs 0 < low_freq_factor < high_freq_factor, got {scaling['low_freq_factor']} and "
            f"{scaling['high_freq_factor']}: give e.g. Llama 3.1's 1 and 4"
        )
    if (scaling.get("beta_fast") or 32) < (scaling.get("beta_slow") or 1):
        raise ConfigError(f"{where}: yarn's beta_fast is below its beta_slow: give beta_fast >= beta_slow (defaults 32 and 1)")
    if (scaling.get("attention_factor") or 0) < 0:
        raise ConfigError(f"{where}.attention_factor={scaling['attention_factor']} is negative: give a positive number, "
                          "or leave it out for YaRN's 0.1 ln(factor) + 1")


def inverse_frequencies(base: float | Tensor, dim: int, device: torch.device | None = None) -> Tensor:
    """1 / base^(2i/dim), i < dim/2, with transformers' rounding (the scaled types start from it)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def scaled_frequencies(
    scaling: dict[str, Any], base: float, dim: int, length: int | None = None, device: torch.device | None = None
) -> tuple[Tensor, float]:
    """(inv_freq (dim/2,), attention factor multiplying cos and sin) of a rope of ``dim`` rotated
    features; ``length`` (the sequence length, largest position + 1) matters to ``dynamic`` only."""
    return _FREQUENCIES[scaling["type"]](scaling, base, dim, length, device)


def _linear(scaling: dict[str, Any], base: float, dim: int, length: int | None, device: torch.device | None
            ) -> tuple[Tensor, float]:
    return inverse_frequencies(base, dim, device) / scaling["factor"], 1.0


def _dynamic(scaling: dict[str, Any], base: float, dim: int, length: int | None, device: torch.device | None
             ) -> tuple[Tensor, float]:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    # transformers computes the initial base in Python floats and a grown one in float32 tensor
    # arithmetic (its length is a tensor there): the same here, for the same bits.
    seen: int | Tensor = original if length is None else torch.tensor(max(length, original), device=device)
    # NTK-aware: a larger base slows every frequency but the fastest, more the slower ones.
    grown = base * ((factor * seen / original) - (factor - 1)) ** (dim / (dim - 2))
    return inverse_frequencies(grown, dim, device), 1.0


def _yarn(scaling: dict[str, Any], base: float, dim: int, length: int | None, device: torch.device | None
          ) -> tuple[Tensor, float]:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's form
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_turning(turns: float) -> float:
        """The (fractional) rotated pair that turns ``turns`` times over the original context."""
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (dim/2,)
    keep = 1 - ramp.to(device=device, dtype=torch.float)  # 1: extrapolate (fast pairs), 0: interpolate (slow)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, attention_factor


def _yarn_mscale(factor: float, mscale: float = 1) -> float:
    """YaRN's attention temperature: 0.1 ln(factor) + 1 (times mscale on the log)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3(scaling: dict[str, Any], base: float, dim: int, length: int | None, device: torch.device | None
            ) -> tuple[Tensor, float]:
    inv_freq = inverse_frequencies(base, dim, device)
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Short wavelengths kept, long ones divided by factor, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


_FREQUENCIES: dict[str, Callable[..., tuple[Tensor, float]]] = {
    "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3,
}
