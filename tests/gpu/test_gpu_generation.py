"""KV-cache generation on CUDA: the cached decoder gives the full forward pass's logits and tokens."""

from __future__ import annotations

import pytest
import torch

from trident.backbone import TransformerConfig, available_pos_encodings
from trident.models import CausalLM, generate

from ..backbone_helpers import perturb_

VOCAB, PROMPT, NEW = 50, 7, 30


def lm(encoding: str, device: torch.device) -> CausalLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=64, n_heads=4, n_layers=2, d_ff=128, dropout=0.0, pos_encoding=encoding,
                            max_seq_len=64)
    return perturb_(CausalLM(cfg, VOCAB), std=0.05).to(device).eval()


@pytest.mark.parametrize("encoding", available_pos_encodings())
def test_greedy_tokens_same_with_and_without_cache(encoding: str, cuda: torch.device) -> None:
    model = lm(encoding, cuda)
    prompt = torch.randint(0, VOCAB, (3, PROMPT), device=cuda)
    cached = generate(model, prompt, NEW, temperature=0.0, use_cache=True)
    recomputed = generate(model, prompt, NEW, temperature=0.0, use_cache=False)
    assert cached.device.type == "cuda" and cached.shape == (3, PROMPT + NEW)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("encoding", available_pos_encodings())
def test_cached_logits_equal_the_full_forward(encoding: str, dtype: torch.dtype, cuda: torch.device) -> None:
    """Prefill the prompt, then one token at a time through the cache: every position's logits are
    the full forward pass's, within the dtype's rounding (bf16: ||diff|| / ||ref|| < 2e-2)."""
    model = lm(encoding, cuda)
    ids = torch.randint(0, VOCAB, (2, PROMPT + NEW), device=cuda)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        full = model(ids).float()
        cache = model.new_cache(ids.size(1))
        steps = [model(ids[:, :PROMPT], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(PROMPT, ids.size(1))]
    cached = torch.cat(steps, dim=1).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert float((cached - full).norm() / full.norm()) < tolerance
