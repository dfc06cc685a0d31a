"""Model FLOPs per step (against PyTorch's FLOP counter), device peaks, and MFU in a real run."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from trident.backbone import TransformerConfig
from trident.errors import ConfigError
from trident.models import CausalLM
from trident.models.seq2seq import EncoderDecoder
from trident.models.vit import VisionTransformer, vit_geometry
from trident.training.callbacks import Throughput
from trident.training.flops import (
    causal_lm_flops,
    compute_dtype,
    device_peak_flops,
    encoder_decoder_flops,
    gpu_peak_flops,
    measured_peak_flops,
    vit_flops,
)


def counted_training_flops(forward: Callable[[], Tensor]) -> int:
    """Matmul FLOPs of one forward and backward pass, as torch.utils.flop_counter counts them."""
    with FlopCounterMode(display=False) as counter:
        forward().float().sum().backward()
    return counter.get_total_flops()


def tiny_cfg(activation: str, **extra: object) -> TransformerConfig:
    # The explicit attention path: the FLOP counter has no formula for the CPU flash kernel.
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 48, "max_seq_len": 64, "attn_impl": "explicit",
               "activation": activation, "dropout": 0.0, **extra}
    return TransformerConfig(**options)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_causal_lm_flops_equal_the_flop_counter(activation: str) -> None:
    cfg = tiny_cfg(activation)
    model, ids = CausalLM(cfg, 50), torch.randint(0, 50, (3, 16))
    assert causal_lm_flops(cfg, 50, 3, 16) == counted_training_flops(lambda: model(ids))


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_encoder_decoder_flops_equal_the_flop_counter(activation: str) -> None:
    cfg = tiny_cfg(activation)
    model = EncoderDecoder(cfg, 50, tie_embeddings="none")
    src, tgt = torch.randint(1, 50, (3, 12)), torch.randint(1, 50, (3, 9))  # source and target lengths differ
    assert encoder_decoder_flops(cfg, 50, 3, 12, 9) == counted_training_flops(lambda: model(src, tgt))


@pytest.mark.parametrize("shape", [{"n_kv_heads": 2}, {"n_kv_heads": 1, "head_dim": 12}, {"head_dim": 4}])
def test_attention_shape_flops_equal_the_flop_counter(shape: dict[str, int]) -> None:
    """Issue 40: fewer key/value heads shrink the K and V projections only; the head width sets the Q, K, V
    and output projections and the score matmuls."""
    cfg = tiny_cfg("swiglu", **shape)
    model, ids = CausalLM(cfg, 50), torch.randint(0, 50, (3, 16))
    assert causal_lm_flops(cfg, 50, 3, 16) == counted_training_flops(lambda: model(ids))
    model = EncoderDecoder(cfg, 50, tie_embeddings="none")
    src, tgt = torch.randint(1, 50, (3, 12)), torch.randint(1, 50, (3, 9))
    assert encoder_decoder_flops(cfg, 50, 3, 12, 9) == counted_training_flops(lambda: model(src, tgt))


@pytest.mark.parametrize("memory_length", [8, 16, 40])
def test_segment_memory_flops_equal_the_flop_counter(memory_length: int) -> None:
    """model.memory_length: each layer projects Q, K, V over [memory; segment] and attends to memory + segment keys;
    counted at a full memory (shorter, as long as and longer than the 16-token segments)."""
    cfg = tiny_cfg("swiglu", pos_encoding="rope", max_seq_len=16, memory_length=memory_length)
    model = CausalLM(cfg, 50)
    memory = model.new_memory()
    for _ in range(3):  # a full memory: 3 segments of 16 tokens fill up to 48 states
        model(torch.randint(0, 50, (3, 16)), memory=memory)
    assert memory.held == memory_length
    counted = counted_training_flops(lambda: model(torch.randint(0, 50, (3, 16)), memory=memory))
    assert causal_lm_flops(cfg, 50, 3, 16) == counted
    assert causal_lm_flops(cfg, 50, 3, 16) > causal_lm_flops(cfg, 50, 3, 16, memory=False)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_flops_equal_the_flop_counter(pool: str) -> None:
    cfg = tiny_cfg("gelu", pos_encoding="learned", **vit_geometry(16, 4, pool))
    model = VisionTransformer(cfg, patch_size=4, in_channels=3, num_classes=10, pool=pool)
    images = torch.randn(3, 3, 16, 16)
    expected = vit_flops(cfg, batch=3, patch_size=4, in_channels=3, num_classes=10)
    assert expected == counted_training_flops(lambda: model(images))


@pytest.mark.parametrize("attention", [{}, {"attention": "performer", "attn_impl": "sdpa", "performer": {"features": 12}},
                                       {"attention": "linformer", "linformer": {"k": 8}}],
                         ids=["softmax", "performer", "linformer"])
def test_a_frozen_networks_forward_flops_equal_the_flop_counter(attention: dict[str, object]) -> None:
    """A distillation teacher's count (training=False): one forward without gradients, for each network a teacher
    can be, and for self-attention that is not softmax's."""
    def forward_flops(forward: Callable[[], Tensor]) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            forward()
        return counter.get_total_flops()

    cfg = tiny_cfg("swiglu", **attention)
    if cfg.attention != "linformer":  # an encoder's only
        model, ids = CausalLM(cfg, 50), torch.randint(0, 50, (3, 16))
        assert causal_lm_flops(cfg, 50, 3, 16, training=False) == forward_flops(lambda: model(ids))
        model = EncoderDecoder(cfg, 50, tie_embeddings="none")
        src, tgt = torch.randint(1, 50, (3, 12)), torch.randint(1, 50, (3, 9))
        # Performer's cross-attention is softmax's on SDPA, which the counter counts a little apart
        # (tests/test_linear_attention_review.py).
        assert encoder_decoder_flops(cfg, 50, 3, 12, 9, training=False) == pytest.approx(
            forward_flops(lambda: model(src, tgt)), rel=1e-3 if cfg.attention == "performer" else 0)
    cfg = tiny_cfg("gelu", pos_encoding="learned", **vit_geometry(16, 4, "cls"), **attention)
    model = VisionTransformer(cfg, patch_size=4, in_channels=3, num_classes=10, pool="cls")
    expected = vit_flops(cfg, batch=3, patch_size=4, in_channels=3, num_classes=10, training=False)
    assert expected == forward_flops(lambda: model(torch.randn(3, 3, 16, 16)))


def test_attention_term_grows_with_the_square_of_the_length() -> None:
    cfg = tiny_cfg("gelu")
    # Doubling the length doubles the per-token terms and quadruples the attention term.
    per_token = causal_lm_flops(cfg, 50, 1, 1) - 12 * cfg.n_layers * cfg.d_model
    attention = 12 * cfg.n_layers * cfg.d_model
    assert causal_lm_flops(cfg, 50, 1, 32) == per_token * 32 + attention * 32 * 32


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "bf16", 989.4e12),
        ("NVIDIA H200 NVL", "fp16", 835e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA L4", "fp32", 30.3e12),
        ("NVIDIA A10G", "bf16", 125e12),
        ("Tesla V100-SXM2-16GB", "tf32", 15.7e12),  # no tensor-core float32 before Ampere
        ("Tesla V100-PCIE-32GB", "fp16", 112e12),
        ("Tesla T4", "fp16", 65e12),
        ("Tesla T4", "bf16", None),  # Turing has no bf16
        ("NVIDIA L40S", "bf16", None),  # not an L4
        ("Some Future GPU", "bf16", None),
    ],
)
def test_gpu_peak_flops_come_from_the_table_by_device_name(name: str, dtype: str, peak: float | None) -> None:
    assert gpu_peak_flops(name, dtype) == peak


def test_compute_dtype_follows_the_precision_setting() -> None:
    assert compute_dtype("bf16-mixed") == "bf16"
    assert compute_dtype("16-mixed") == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compute_dtype("32-true") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert compute_dtype("32-true") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_cpu_peak_is_measured_once_per_process() -> None:
    peak = device_peak_flops(torch.device("cpu"), "fp32")
    assert peak is not None and 1e8 < peak < 1e14  # any CPU: between 0.1 GFLOP/s and 100 TFLOP/s
    hits = measured_peak_flops.cache_info().hits
    assert device_peak_flops(torch.device("cpu"), "fp32") == peak
    assert measured_peak_flops.cache_info().hits == hits + 1  # cached, not measured again


class FakeTrainer(SimpleNamespace):
    """What Throughput reads of a trainer: its data-parallel replicas, devices, loggers, and where the batch
    stands in its optimizer step (``accumulate`` micro-batches each; Lightning counts the step after the hooks)."""

    def __init__(self, replicas: int | None = None, world_size: int = 1, accumulate: int = 1) -> None:
        rows: list[tuple[int, dict[str, float]]] = []
        logger = SimpleNamespace(log_metrics=lambda metrics, step: rows.append((step, dict(metrics))))
        loop = SimpleNamespace(_batches_that_stepped=0, micro_batches=0)
        fit_loop = SimpleNamespace(epoch_loop=loop, _should_accumulate=lambda: (loop.micro_batches % accumulate) != 0)
        super().__init__(distributed_sampler_kwargs={"num_replicas": replicas, "rank": 0} if replicas else None,
                         world_size=world_size, precision="32-true", loggers=[logger], fit_loop=fit_loop, rows=rows)

    def batch_end(self, callback: Throughput, module: SimpleNamespace) -> None:
        loop = self.fit_loop.epoch_loop
        loop.micro_batches += 1
        callback.on_train_batch_end(self, module, {}, None, loop.micro_batches - 1)
        if not self.fit_loop._should_accumulate():
            loop._batches_that_stepped += 1


def counting_module() -> SimpleNamespace:
    return SimpleNamespace(throughput_units=lambda batch: {"tokens": 100}, flops_per_batch=lambda batch: 1e6,
                           device=torch.device("cpu"))


def test_throughput_reports_an_epoch_shorter_than_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 batches an epoch, a window of 20: the epoch's end logs the 4 steps after the first, timed from the
    first batch's end to the last's (the GPU check's ViT runs, 18 batches an epoch, used to log nothing)."""
    clock = iter([10.0, 11.0, 12.0, 13.0, 14.0])  # each batch end, one second apart
    monkeypatch.setattr("trident.training.callbacks.time.perf_counter", lambda: next(clock))
    module, trainer = counting_module(), FakeTrainer()
    callback = Throughput(window=20, peak_flops=1e7)
    callback.on_fit_start(trainer, module)
    callback.on_train_epoch_start(trainer, module)
    for _ in range(5):
        trainer.batch_end(callback, module)
    assert trainer.rows == []
    callback.on_train_epoch_end(trainer, module)
    # One row, at the last training step's (steps 0-4: the 5th step's row is at 4).
    assert trainer.rows == [(4, pytest.approx({"throughput/tokens_per_sec": 100.0, "throughput/flops_per_sec": 1e6,
                                               "throughput/mfu": 0.1}))]
    callback.on_train_epoch_end(trainer, module)  # nothing since: nothing more
    assert len(trainer.rows) == 1


def test_a_validation_between_steps_stays_out_of_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps end at 10, 11, 12; a validation runs from 12.5 to 32.5 (a translation's greedy decoding); steps end at
    33 and 34: the window of 4 steps after the first is 4 seconds of training, not 24."""
    clock = iter([10.0, 11.0, 12.0, 12.5, 32.5, 33.0, 34.0])
    monkeypatch.setattr("trident.training.callbacks.time.perf_counter", lambda: next(clock))
    module, trainer = counting_module(), FakeTrainer()
    callback = Throughput(window=4, peak_flops=1e7)
    callback.on_fit_start(trainer, module)
    callback.on_train_epoch_start(trainer, module)
    for _ in range(3):
        trainer.batch_end(callback, module)
    callback.on_validation_start(trainer, module)
    callback.on_validation_end(trainer, module)
    for _ in range(2):
        trainer.batch_end(callback, module)
    assert trainer.rows == [(4, pytest.approx({"throughput/tokens_per_sec": 100.0, "throughput/flops_per_sec": 1e6,
                                               "throughput/mfu": 0.1}))]


def validate(callback: Throughput, trainer: FakeTrainer, module: SimpleNamespace) -> None:
    callback.on_validation_start(trainer, module)
    callback.on_validation_end(trainer, module)


RATE = {"throughput/tokens_per_sec": 100.0, "throughput/flops_per_sec": 1e6, "throughput/mfu": 0.1}


def test_the_validation_after_an_epochs_last_step_stays_out_of_its_last_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning validates at an epoch's end after the last batch's hooks and before on_train_epoch_end: steps end at
    10-14, a validation runs from 14.5 to 34.5, then the epoch's row covers its 4 steps after the first, 4 seconds
    (the pass ran after the window's last step: it must not shorten the window, here to -16 s)."""
    clock = iter([10.0, 11.0, 12.0, 13.0, 14.0, 14.5, 34.5])
    monkeypatch.setattr("trident.training.callbacks.time.perf_counter", lambda: next(clock))
    module, trainer = counting_module(), FakeTrainer()
    callback = Throughput(window=20, peak_flops=1e7)
    callback.on_fit_start(trainer, module)
    callback.on_train_epoch_start(trainer, module)
    for _ in range(5):
        trainer.batch_end(callback, module)
    validate(callback, trainer, module)
    callback.on_train_epoch_end(trainer, module)
    assert trainer.rows == [(4, pytest.approx(RATE))]


def test_a_validation_after_every_step_over_two_epochs_stays_out_of_every_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """val_check_interval=1: 1 s of training per step, each step followed by a 10 s validation, 3 steps an epoch and a
    window of 2: each epoch one full window (2 steps after the first) and nothing else, each at 100 tokens/s."""
    times = []
    for epoch_start in (0.0, 100.0):
        for step in range(3):  # step end, then a validation from 0.5 s to 10.5 s after it
            end = epoch_start + 11.0 * step + 1.0
            times += [end, end + 0.5, end + 10.5]
    clock = iter(times)
    monkeypatch.setattr("trident.training.callbacks.time.perf_counter", lambda: next(clock))
    module, trainer = counting_module(), FakeTrainer()
    callback = Throughput(window=2, peak_flops=1e7)
    callback.on_fit_start(trainer, module)
    for _ in range(2):
        callback.on_train_epoch_start(trainer, module)
        for _ in range(3):
            trainer.batch_end(callback, module)
            validate(callback, trainer, module)
        callback.on_train_epoch_end(trainer, module)
    assert trainer.rows == [(2, pytest.approx(RATE)), (5, pytest.approx(RATE))]


def test_throughput_counts_data_parallel_replicas_not_tensor_parallel_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 processes as 2 tensor-parallel groups of 2: two batches per step, not four (the ranks of a group share
    one); MFU is over the peak of all 4 devices."""
    clock = iter([10.0, 11.0])
    monkeypatch.setattr("trident.training.callbacks.time.perf_counter", lambda: next(clock))
    module, trainer = counting_module(), FakeTrainer(replicas=2, world_size=4)
    callback = Throughput(window=1, peak_flops=1e7)
    callback.on_fit_start(trainer, module)
    callback.on_train_epoch_start(trainer, module)
    for _ in range(2):
        trainer.batch_end(callback, module)
    assert trainer.rows == [(1, pytest.approx({"throughput/tokens_per_sec": 200.0, "throughput/flops_per_sec": 2e6,
                                               "throughput/mfu": 2e6 / 4e7}))]


def test_throughput_windows_count_optimizer_steps_under_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """accumulate_grad_batches=2, a window of 2 steps: after the first step (warm-up), steps 1-2 are one window of
    4 micro-batches, logged once, at step 2, and the clock is read at steps' ends only."""
    clock = iter([10.0, 11.0, 12.0])  # the ends of steps 0, 1 and 2
    monkeypatch.setattr("trident.training.callbacks.time.perf_counter", lambda: next(clock))
    module, trainer = counting_module(), FakeTrainer(accumulate=2)
    callback = Throughput(window=2, peak_flops=1e7)
    callback.on_fit_start(trainer, module)
    callback.on_train_epoch_start(trainer, module)
    for _ in range(6):
        trainer.batch_end(callback, module)
    callback.on_train_epoch_end(trainer, module)  # the window ended with the epoch's last step: no second row
    assert trainer.rows == [(2, pytest.approx({"throughput/tokens_per_sec": 200.0, "throughput/flops_per_sec": 2e6,
                                               "throughput/mfu": 0.2}))]


def test_throughput_rejects_a_bad_peak() -> None:
    with pytest.raises(ConfigError, match="peak_flops"):
        Throughput(peak_flops=-1.0)


def test_lm_run_logs_mfu_against_the_configured_peak(lm_reference_run: tuple[Path, dict[str, float]]) -> None:
    peak = 2.0e9  # conftest.LM_REFERENCE
    run_dir, _ = lm_reference_run
    with next(run_dir.rglob("metrics.csv")).open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("throughput/mfu")]
    assert len(rows) >= 2, "one window per step after the first (window=1)"
    # model=nano on data.block_size=32 (tests/conftest.py SMALL), the run's own character vocabulary.
    cfg = TransformerConfig(d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=32)
    vocab = Tokenizer.from_file(str(run_dir / "tokenizer.json")).get_vocab_size()
    for row in rows:
        mfu, flops, tokens = (float(row[f"throughput/{k}"]) for k in ("mfu", "flops_per_sec", "tokens_per_sec"))
        assert mfu == pytest.approx(flops / peak, rel=1e-5)
        assert flops / tokens == pytest.approx(causal_lm_flops(cfg, vocab, 1, 32) / 32, rel=1e-5)
