"""The speed table's machinery on the GPU, at model=nano and in seconds, before ``scripts/gpu_check.sh speed`` spends
minutes on model=base: a bf16 step on CUDA and the FSDP2 variant on a one-rank NCCL mesh of the test's process, with
MFU against this GPU's table peak and CUDA peak memory. (Compilation is left to the table: minutes, not seconds.)"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.bench.mfu import SPEED_VARIANTS, measure_variants
from trident.bench.results import Settings
from trident.bench.workloads import Translation


def test_speed_rows_measure_plain_and_fsdp_steps_on_cuda() -> None:
    eager = [variant for variant in SPEED_VARIANTS if variant.name in ("bf16", "bf16-fsdp")]
    # The device as `python -m trident.bench.speed --device cuda` names it: no index.
    results = list(measure_variants(Translation(quick=True), tuple(eager), Settings(torch.device("cuda"), True, 1, 2)))
    assert [result.status for result in results] == ["ok", "ok"], [result.status for result in results]
    for result in results:
        assert result.peak_flops and result.mfu is not None and 0 < result.mfu < 1
        assert result.memory_gib is not None and result.memory_gib > 0
    assert not dist.is_initialized(), "the one-rank process group is taken down after the variant"
