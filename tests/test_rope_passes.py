"""Rope without ``cat`` (issue 57, fewer memory passes): the tables and the rotation equal the cat-based rope they
replace, written out here, for every variant (1-D, each long-context scaling, dynamic NTK over packed documents,
per-row positions, the ViT's 2-D grid with a class token, a KV cache's offset), forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from trident.backbone import Decoder, pos_encoding_class
from trident.backbone.positional import apply_rotary
from trident.backbone.positional.base import grid_coordinates
from trident.backbone.positional.rotary import _rotate_traced

from .backbone_helpers import make_cfg, perturb_

HEAD_DIM = 16
SCALINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "linear": {"type": "linear", "factor": 2.5},
    "dynamic": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
    "yarn": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
    "llama3": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
}


def old_rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def old_apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotation before issue 57: a cat per call."""
    return x * cos.to(x.dtype) + old_rotate_half(x) * sin.to(x.dtype)


def old_tables(enc: Any, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The tables before issue 57 (1-D and grid; the frequencies as the encoding holds them now)."""
    if enc.grid is None:
        angles = positions.float()[..., None] * enc.inv_freq
    else:
        rows, cols, is_patch = grid_coordinates(positions, enc.grid, enc.num_prefix_tokens)
        angles = torch.cat((rows.float()[:, None] * enc.inv_freq, cols.float()[:, None] * enc.inv_freq), dim=1)
        angles = angles * is_patch[:, None]
    angles = torch.cat((angles, angles), dim=-1)
    if positions.dim() == 2:
        angles = angles[:, None]
    return angles.cos() * enc.attention_factor, angles.sin() * enc.attention_factor


def encoding(scaling: dict[str, Any] | None = None, **overrides: Any) -> Any:
    options = {} if scaling is None else {"scaling": scaling}
    cfg = make_cfg(d_model=HEAD_DIM * 2, n_heads=2, pos_encoding="rope", pos_encoding_options=options,
                   max_seq_len=256, **overrides)
    return pos_encoding_class("rope")(cfg, causal=True)


@pytest.mark.parametrize("name", SCALINGS)
def test_tables_equal_the_cat_built_ones_bit_for_bit(name: str) -> None:
    for positions in (torch.arange(40), torch.arange(7, 12), torch.tensor([[0, 0, 1, 2], [3, 4, 5, 6]])):
        enc = encoding(SCALINGS[name])
        ours = enc.rotary(positions)
        expected = old_tables(enc, positions)  # after the call: dynamic NTK has grown its frequencies for it
        assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])


def test_grid_tables_equal_the_cat_built_ones_bit_for_bit() -> None:
    enc = encoding(grid=(3, 4), num_prefix_tokens=1)
    positions = torch.arange(13)
    cos, sin = enc.rotary(positions)
    expected = old_tables(enc, positions)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    assert torch.equal(cos[0], torch.ones(HEAD_DIM)) and torch.equal(sin[0], torch.zeros(HEAD_DIM))  # class token


def test_dynamic_packed_documents_tables_have_equal_halves() -> None:
    """Dynamic NTK over packed documents: (B, 1, T, hs), each pair's angle in both halves, as the cat made them."""
    enc = encoding(SCALINGS["dynamic"])
    documents = torch.tensor([[0] * 20 + [1] * 30, [0] * 30 + [1] * 20])
    cos, sin = enc.rotary(torch.arange(50), documents)
    assert cos.shape == sin.shape == (2, 1, 50, HEAD_DIM)
    half = HEAD_DIM // 2
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    assert torch.equal(cos[0, 0, 20:], cos[1, 0, :30])  # a document of 30 tokens, from position 0 wherever it sits


@pytest.mark.parametrize("table_shape", ["shared", "per_row"])
def test_rotation_and_gradient_equal_the_cat_form_in_float64(table_shape: str) -> None:
    torch.manual_seed(0)
    enc = encoding(SCALINGS["yarn"]).double()  # attention factor != 1
    positions = torch.arange(9) if table_shape == "shared" else torch.randint(0, 30, (3, 9))
    cos, sin = enc.rotary(positions)
    cos, sin = cos.double(), sin.double()
    # (B, nh, T, hs) as attention makes it: a transposed view, not contiguous
    x = torch.randn(3, 9, 2, HEAD_DIM, dtype=torch.float64).transpose(1, 2).requires_grad_()
    grad = torch.randn(3, 2, 9, HEAD_DIM, dtype=torch.float64)
    ours = apply_rotary(x, cos, sin)
    (ours_grad,) = torch.autograd.grad(ours, x, grad)
    expected = old_apply_rotary(x, cos, sin)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(_rotate_traced(x, cos, sin), expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x.detach()[:, :1].requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_the_cat_form_in_low_precision(dtype: torch.dtype) -> None:
    """cos and sin cast to the input's dtype first, as before (and as transformers does); in bf16 the in-place
    product-add rounds once where the old form rounded twice: within bf16's resolution."""
    torch.manual_seed(0)
    cos, sin = encoding().rotary(torch.arange(33))
    x = (torch.randn(2, 33, 2, HEAD_DIM) * 4).to(dtype).transpose(1, 2)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 4e-2}
    ours = apply_rotary(x, cos, sin)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, old_apply_rotary(x, cos, sin), **tolerance)


class _Ops(TorchDispatchMode):
    """The aten operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_training_step_of_a_rope_decoder_copies_no_halves() -> None:
    """Forward and backward of a rope decoder: the rotation and its tables concatenate nothing (the cat-based rope
    made 3 per layer and 1 per step) and negate nothing. The one cat left per layer is the backward of the fused
    q/k/v projection's split (its three gradients into one)."""
    cfg = make_cfg(pos_encoding="rope")
    torch.manual_seed(0)
    decoder = Decoder(cfg).train()
    x = torch.randn(2, 6, 32, requires_grad=True)
    with _Ops() as seen:
        decoder(x).sum().backward()
    assert seen.ops.count("cat") == cfg.n_layers and "neg" not in seen.ops and "stack" not in seen.ops, seen.ops


def test_decoder_with_a_kv_cache_equals_the_full_pass() -> None:
    """The rotation at a cache's offsets: one token at a time equals the full pass."""
    cfg = make_cfg(pos_encoding="rope")
    torch.manual_seed(0)
    decoder = perturb_(Decoder(cfg)).eval()
    x = torch.randn(1, 10, cfg.d_model)
    cache = decoder.new_cache(cfg.max_seq_len)
    steps = torch.cat([decoder(x[:, :4], cache=cache)] + [decoder(x[:, t : t + 1], cache=cache) for t in range(4, 10)],
                      dim=1)
    torch.testing.assert_close(steps, decoder(x), rtol=1e-4, atol=1e-5)


def test_tables_that_require_grad_get_their_gradient() -> None:
    """apply_rotary is public: tables that train (learned frequencies) get their gradient, which the hand-written
    Function (None for cos and sin) would silently drop."""
    torch.manual_seed(0)
    cos, sin = (t.double().requires_grad_() for t in encoding().rotary(torch.arange(4)))
    x = torch.randn(1, 2, 4, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(apply_rotary, (x, cos, sin))
    grad = torch.randn(1, 2, 4, HEAD_DIM, dtype=torch.float64)
    ours = torch.autograd.grad(apply_rotary(x, cos, sin), (x, cos), grad)
    expected = torch.autograd.grad(old_apply_rotary(x, cos, sin), (x, cos), grad)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


def test_torch_func_transforms_go_through_the_rotation() -> None:
    """torch.func.grad and vmap (per-sample gradients) over the rotation, as over the cat form before."""
    torch.manual_seed(0)
    cos, sin = (t.double() for t in encoding().rotary(torch.arange(5)))
    x = torch.randn(3, 2, 5, HEAD_DIM, dtype=torch.float64)

    def loss(rotate: Any) -> Any:
        return lambda t: rotate(t, cos, sin).pow(2).mul(torch.arange(HEAD_DIM, dtype=t.dtype)).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss(apply_rotary)))(x)
    torch.testing.assert_close(per_sample, torch.func.vmap(torch.func.grad(loss(old_apply_rotary)))(x),
                               rtol=0, atol=1e-12)
