"""The GPU-side decisions that a CPU can check: a forced SDPA kernel's refusal in CUDA's wording is
one clear ConfigError, MFU takes the table peak of the GPU by its name (H100, H200), and translation attends
without cuDNN's per-shape plans."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trident.backbone import Decoder
from trident.bench.levers import sdpa_rows
from trident.bench.results import Settings
from trident.errors import ConfigError
from trident.models.seq2seq import EncoderDecoder
from trident.training.callbacks import Throughput
from trident.training.flops import device_peak_flops

from .backbone_helpers import make_cfg
from .conftest import compose_config

pytestmark = pytest.mark.usefixtures("single_thread")

# What PyTorch raises when a forced kernel refuses the inputs: CUDA's dispatcher (after warnings
# naming the reasons, e.g. "Flash attention does not support non-null attn_mask") and the CPU's.
REFUSALS = ["No available kernel. Aborting execution.",
            "No viable backend for scaled_dot_product_attention was found."]


def refusing_kernel(message: str) -> Callable[..., torch.Tensor]:
    """A stand-in for F.scaled_dot_product_attention that refuses every call with ``message``."""

    def sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(message)

    return sdpa


@pytest.mark.parametrize("message", REFUSALS)
def test_a_refused_forced_kernel_is_one_clear_config_error(message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = Decoder(make_cfg(sdpa_backend="flash"))
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 4:] = True
    monkeypatch.setattr(F, "scaled_dot_product_attention", refusing_kernel(message))
    with pytest.raises(ConfigError, match=r"model.sdpa_backend=flash has no kernel for these inputs "
                                          r"\(device cpu, torch.float32, head size 8, boolean mask\): "
                                          r"use model.sdpa_backend=auto, or a kernel that takes them "
                                          r"\(on a CPU only math and flash exist\)") as caught:
        stack(torch.randn(2, 6, 32), key_padding_mask=padding)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # one line, no PyTorch chain


def test_the_refusal_names_a_causal_call_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "scaled_dot_product_attention", refusing_kernel(REFUSALS[0]))
    with pytest.raises(ConfigError, match=r"model.sdpa_backend=cudnn .*causal, no mask tensor"):
        Decoder(make_cfg(sdpa_backend="cudnn"))(torch.randn(1, 5, 32))


def test_other_kernel_errors_stay_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a refusal is the user's choice to fix; any other failure is a real error, kept whole."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", refusing_kernel("CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        Decoder(make_cfg(sdpa_backend="efficient"))(torch.randn(1, 5, 32))


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4e12), ("NVIDIA H100 80GB HBM3", "16-mixed", 989.4e12),
     ("NVIDIA H200", "bf16-mixed", 989.4e12), ("NVIDIA H100 PCIe", "bf16-mixed", 756e12)],
)
def test_throughput_takes_the_table_peak_of_the_cuda_device_by_name(
    name: str, precision: str, peak: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What runs on the lent GPU: on_fit_start reads the CUDA device's name and looks it up."""
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or name)
    callback = Throughput()
    callback.on_fit_start(SimpleNamespace(precision=precision), SimpleNamespace(device=torch.device("cuda", 0)))
    assert callback._device_peak == peak
    assert asked == [torch.device("cuda", 0)]


def test_an_unknown_gpu_gives_no_peak_and_says_how_to_set_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B300")
    with caplog.at_level(logging.WARNING, logger="trident.training.flops"):
        assert device_peak_flops(torch.device("cuda", 0), "bf16") is None
    assert "set callbacks.throughput.peak_flops" in caplog.text


def test_sdpa_bench_row_reports_a_refusing_kernel_instead_of_stopping(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the row forces every kernel; one that refuses (cuDNN on some versions) is named in
    the row, and the other kernels are still timed. Here the flash kernel refuses, as CUDA's would."""
    real_sdpa = F.scaled_dot_product_attention

    def flash_refuses(*args: object, **kwargs: object) -> torch.Tensor:
        if torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled():
            raise RuntimeError(REFUSALS[0])
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", flash_refuses)
    settings = Settings(device=torch.device("cpu"), quick=True, warmup=0, repeats=1)
    (row,) = sdpa_rows(settings)
    assert row.notes.endswith("refused these inputs: flash")
    assert row.trident.startswith("auto ") and "flash" not in row.trident and row.reference.startswith("math ")


def test_translation_attends_without_cudnn_and_no_cudnn_matches_auto_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """task=translation sets model.sdpa_backend=no_cudnn: every SDPA call runs with cuDNN's kernel switched off (it
    plans anew for each shape), the others left to PyTorch; on a CPU the same kernel as auto, the same output."""
    assert compose_config(["task=translation"]).model.sdpa_backend == "no_cudnn"
    assert compose_config(["task=lm"]).model.sdpa_backend == "auto", "fixed shapes: PyTorch's own choice"
    sdpa, cudnn_on = F.scaled_dot_product_attention, []

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        cudnn_on.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    src = torch.tensor([[5, 6, 7, 2, 0, 0], [8, 9, 4, 5, 6, 2]])  # (B, S), padded: boolean masks
    tgt = torch.tensor([[1, 5, 6, 0], [1, 7, 8, 9]])  # (B, T)
    outputs = {}
    for backend in ("auto", "no_cudnn"):
        torch.manual_seed(0)
        outputs[backend] = EncoderDecoder(make_cfg(sdpa_backend=backend), 12, pad_id=0).eval()(src, tgt)
        assert set(cudnn_on) == {backend == "auto"}, "cuDNN allowed in every call under auto, in none under no_cudnn"
        cudnn_on.clear()
    torch.testing.assert_close(outputs["no_cudnn"], outputs["auto"], rtol=0, atol=0)
