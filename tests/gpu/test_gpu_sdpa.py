"""SDPA kernels on CUDA against the explicit path: each forced ``model.sdpa_backend`` gives the
explicit softmax(QK^T/sqrt(d) + mask)V within its dtype's rounding, with a causal flag, padding
(boolean mask) and score biases (ALiBi, T5 relative), or refuses the inputs with one clear error."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from trident.backbone import Decoder, Encoder, TransformerConfig
from trident.errors import ConfigError

from ..backbone_helpers import perturb_

# ||out - ref|| / ||ref|| against the explicit path in fp32: bf16 operands land between 1e-3 and
# 1e-2, fp16 about 8x lower (3 more mantissa bits), fp32 far under 1e-3. Two perturbed layers
# compound the rounding, hence the margin; a wrong mask moves the output by O(1).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (stack, pos_encoding, padded): what mask reaches SDPA.
CASES = {
    "causal": ("decoder", "rope", False),  # is_causal=True, no mask tensor: the fused fast path
    "causal_padding": ("decoder", "rope", True),  # boolean allowed mask (B, 1, Tq, Tk)
    "alibi": ("decoder", "alibi", True),  # float bias with -inf at masked keys
    "relative": ("decoder", "relative", True),  # T5 bucketed bias (learned), float mask
    "encoder_padding": ("encoder", "sinusoidal", True),  # bidirectional, boolean padding mask
}
BATCH, LENGTH, D_MODEL, N_HEADS = 3, 40, 64, 4  # head size 16: every CUDA kernel takes it


def stack(kind: str, pos_encoding: str, **options: object) -> Decoder | Encoder:
    cfg = TransformerConfig(d_model=D_MODEL, n_heads=N_HEADS, n_layers=2, d_ff=128, dropout=0.0,
                            max_seq_len=64, pos_encoding=pos_encoding, **options)
    return (Decoder if kind == "decoder" else Encoder)(cfg)


def inputs(device: torch.device, padded: bool) -> tuple[Tensor, Tensor | None]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, LENGTH, D_MODEL, generator=generator)
    if not padded:
        return x.to(device), None
    padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    padding[0, LENGTH - 11:] = True  # right padding in one sequence, none in the others
    padding[1, LENGTH - 3:] = True
    return x.to(device), padding.to(device)


def relative_error(out: Tensor, ref: Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def outputs(backend: str, case: str, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """(forced backend under autocast in ``dtype``, explicit path in fp32) on the same weights and inputs."""
    kind, pos_encoding, padded = CASES[case]
    torch.manual_seed(0)
    explicit = perturb_(stack(kind, pos_encoding, attn_impl="explicit")).to(device).eval()
    forced = stack(kind, pos_encoding, sdpa_backend=backend).to(device).eval()
    forced.load_state_dict(explicit.state_dict())
    x, padding = inputs(device, padded)
    with torch.no_grad():
        reference = explicit(x, key_padding_mask=padding)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = forced(x, key_padding_mask=padding)
    if padding is not None:  # padded query rows are never read; compare real positions only
        keep = ~padding
        return out[keep], reference[keep]
    return out, reference


def refuses(backend: str, case: str, dtype: torch.dtype) -> bool:
    """Inputs the kernel does not take (PyTorch's CUDA dispatcher): flash takes no mask tensor and
    only fp16/bf16. cuDNN's limits vary with its version: see the cudnn test below."""
    _, _, padded = CASES[case]
    return backend == "flash" and (padded or dtype == torch.float32)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["math", "efficient", "flash"])
def test_forced_backend_matches_explicit_or_refuses_clearly(
    backend: str, case: str, dtype_name: str, cuda: torch.device
) -> None:
    dtype = DTYPES[dtype_name]
    if refuses(backend, case, dtype):
        with pytest.raises(ConfigError, match=rf"model.sdpa_backend={backend} has no kernel for these inputs \(device cuda"
                                              r".*flash takes no mask tensor and only fp16/bf16\)$"):
            outputs(backend, case, dtype, cuda)
        return
    out, reference = outputs(backend, case, dtype, cuda)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cudnn_backend_matches_explicit_or_refuses_clearly(
    case: str, dtype_name: str, cuda: torch.device, record_property: pytest.RecordProperty
) -> None:
    """cuDNN's attention takes more inputs with each cuDNN release: whichever it refuses must end
    in the clear ConfigError, and whatever it runs must be right. The outcome lands in the JUnit report."""
    dtype = DTYPES[dtype_name]
    try:
        out, reference = outputs("cudnn", case, dtype, cuda)
    except ConfigError as err:
        assert "model.sdpa_backend=cudnn has no kernel for these inputs" in str(err)
        assert case != "causal", "cuDNN attention must take the plain causal case on a Hopper GPU"
        record_property("cudnn", "refused")
        return
    record_property("cudnn", "ran")
    assert torch.isfinite(out).all()
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_auto_backend_matches_explicit_with_every_mask(dtype_name: str, cuda: torch.device) -> None:
    for case in CASES:
        out, reference = outputs("auto", case, DTYPES[dtype_name], cuda)
        assert relative_error(out, reference) < TOLERANCE[DTYPES[dtype_name]], case

