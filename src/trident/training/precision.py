"""The precision a run really uses, said in one line where it is not what ``precision=`` suggests.

Lightning has no fp16 autocast on a CPU and runs ``precision=fp16`` as ``bf16-mixed`` there. And
bf16 is only fast where the CPU multiplies bf16 matrices natively (AMX, AVX512-BF16); elsewhere
PyTorch emulates them, up to ~100x slower than fp32, so ``precision=bf16`` would make training
many times slower without a word. Both facts are checked when the trainer is built.
"""

from __future__ import annotations

import logging

import lightning as L
from lightning.pytorch.accelerators import CPUAccelerator

from trident.training.flops import compute_dtype, measured_peak_flops

log = logging.getLogger(__name__)

# A 256 x 256 matmul: a fraction of a second in all even where bf16 is emulated (~0.6 GFLOP/s:
# 34 MFLOP, ~60 ms each), and large enough to tell native from emulated bf16 (a 3-100x gap).
PROBE_SIZE = 256
PROBE_REPEATS = 2
# bf16 at less than half the fp32 rate is a CPU without native bf16 units, not measurement noise.
SLOW_BF16_FACTOR = 2.0


def cpu_matmul_rates() -> tuple[float, float]:
    """(bf16, fp32) matmul FLOP/s of this CPU, measured once per process (cached)."""
    return (measured_peak_flops("cpu", "bf16", PROBE_SIZE, PROBE_REPEATS),
            measured_peak_flops("cpu", "fp32", PROBE_SIZE, PROBE_REPEATS))


def check_precision(trainer: L.Trainer, requested: str) -> str:
    """Lightning's ``trainer.precision`` (what runs), after one warning line where it differs
    from ``requested`` (``trainer.precision`` of the config) or where bf16 is slow on this CPU."""
    running = str(trainer.precision)
    if compute_dtype(running) != compute_dtype(requested):  # not an alias, such as 16 for 16-mixed
        log.warning("trainer.precision=%s runs as %s on %s (Lightning has no fp16 autocast there); recorded as precision_used",
                    requested, running, trainer.strategy.root_device.type)
    if running.startswith("bf16") and isinstance(trainer.accelerator, CPUAccelerator):
        bf16, fp32 = cpu_matmul_rates()
        if bf16 * SLOW_BF16_FACTOR < fp32:
            log.warning("bf16 is emulated on this CPU: a matmul runs at %.3g GFLOP/s in bf16 against %.3g GFLOP/s "
                        "in fp32, so training in %s is much slower: use precision=fp32", bf16 / 1e9, fp32 / 1e9, running)
    return running
