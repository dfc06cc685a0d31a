"""``python -m trident.bench --only sharding``: per-rank bytes, peak RSS and step time of FSDP and tensor
parallelism against DDP. The row's arithmetic is checked on rank records written here; one real 2-process
FSDP run (nano) checks what :class:`~trident.bench.rank_record.RecordRank` reads from the ranks."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

from trident.bench import sharding
from trident.bench.__main__ import ROWS, main
from trident.bench.memory import peak_rss_bytes
from trident.bench.rank_record import local_bytes
from trident.bench.sharding import KINDS, REFERENCE, VARIANTS, WHOLE, Measured, rows_of, summarize
from trident.parallel.tensor_parallel import TENSOR_PARALLEL

from .sharding_helpers import fake_two_ranks

MIB = 2**20


def record(parameters: int, step_seconds: float = 0.5, peak_rss: int = 900 * MIB) -> dict[str, Any]:
    """A rank's ``rank<r>.json`` as RecordRank writes it (AdamW: two moments per parameter)."""
    return {"params": {"bytes": {"parameters": parameters, "gradients": parameters, "optimizer_state": 2 * parameters}},
            "peak_rss_bytes": peak_rss, "step_seconds": step_seconds}


WHOLE_BYTES = 40 * MIB


def measured_as_sharded(fsdp_2_share: float = 0.5) -> dict[str, Measured]:
    """Every variant's ranks holding what they should; fsdp_2's ranks ``fsdp_2_share`` of the whole."""
    def ranks(n: int, share: float, seconds: float) -> list[dict[str, Any]]:
        # rank 0 holds a little more: fully_shard rounds the first dimension up
        return [record(int(WHOLE_BYTES * share) + (1024 if r == 0 else 0), seconds) for r in range(n)]

    return {REFERENCE: summarize(ranks(2, 1.0, 1.0), 1), WHOLE: summarize(ranks(1, 1.0, 0.9), 2),
            "fsdp_2": summarize(ranks(2, fsdp_2_share, 1.6), 1), "fsdp_4": summarize(ranks(4, 0.25, 3.0), 1),
            "tp_2": summarize(ranks(2, 0.51, 1.2), 1)}


def by_variant(measured: dict[str, Measured]) -> dict[str, list[str]]:
    rows = rows_of(measured, quick=False)
    assert [row.group for row in rows] == ["sharding"] * len(VARIANTS)
    return {name: [row.trident, row.reference, row.result, row.target, row.met, row.notes]
            for name, row in zip(VARIANTS, rows)}


def test_summarize_takes_the_largest_rank_and_the_mean_step_time() -> None:
    m = summarize([record(10 * MIB, 1.0, 700 * MIB), record(12 * MIB, 2.0, 600 * MIB)], threads=1)
    assert m.bytes == {"parameters": 12 * MIB, "gradients": 12 * MIB, "optimizer_state": 24 * MIB}
    assert (m.total_bytes, m.peak_rss, m.step_seconds, m.processes) == (48 * MIB, 700 * MIB, 1.5, 2)


def test_rows_compare_every_variant_with_ddp_and_check_the_share_of_the_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharding, "_cores", lambda: 2)
    rows = by_variant(measured_as_sharded())
    assert rows[REFERENCE][1:3] == ["-", "-"]
    assert rows["fsdp_2"][0].startswith("parameters 20.00 MiB, gradients 20.00 MiB, optimizer state 40.00 MiB; "
                                        "peak RSS 900 MiB; step 1.600 s")
    assert rows["fsdp_2"][1].startswith("ddp_cpu: parameters 40.00 MiB")
    assert rows["fsdp_2"][2] == "0.50x DDP's bytes, 1.60x DDP's step time"
    assert rows["fsdp_4"][2] == "0.25x DDP's bytes, 3.00x DDP's step time"
    assert [rows[name][3] for name in VARIANTS] == [f"bytes {s} of one rank's whole model"
                                                    for s in ("1", "1", "0.5", "0.25", "0.5")]
    assert [rows[name][4] for name in VARIANTS] == ["yes"] * 5
    assert "oversubscribed" in rows["fsdp_4"][5]
    assert not any("oversubscribed" in rows[name][5] for name in VARIANTS if name != "fsdp_4")
    assert "global batch 4" in rows["tp_2"][5]


@pytest.mark.parametrize("share", [1.0, 0.4, 0.56])
def test_a_rank_holding_more_or_less_than_its_share_is_not_met(share: float) -> None:
    assert by_variant(measured_as_sharded(fsdp_2_share=share))["fsdp_2"][4] == "**no**"


def test_processes_share_the_cores_with_at_least_one_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharding, "_cores", lambda: 2)
    assert [sharding.threads_per_process(n) for n in (1, 2, 4)] == [2, 1, 1]


def test_local_bytes_count_a_rank_shard_of_a_dtensor_and_the_whole_of_a_tensor() -> None:
    with fake_two_ranks() as mesh:
        sharded = distribute_tensor(torch.zeros(8, 4), mesh[TENSOR_PARALLEL], [Shard(0)])  # rank 0 holds 4 x 4
        assert local_bytes([sharded, torch.zeros(3)]) == 4 * 4 * 4 + 3 * 4


def test_peak_rss_is_the_process_own_not_the_one_that_started_it() -> None:
    """Linux's ru_maxrss carries a parent's peak over fork and exec: rank 1, started by rank 0, and every run the
    bench starts would report at least their parent's peak."""
    ballast = bytearray(600 * MIB)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, page by page
    parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    script = "from trident.bench.memory import peak_rss_bytes; print(peak_rss_bytes())"
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    del ballast
    assert 0 < int(child.stdout) < parent - 500 * MIB
    assert peak_rss_bytes() >= parent - MIB  # this process's own peak: the ballast


@pytest.mark.slow
def test_a_real_two_rank_fsdp_run_records_half_of_every_tensor_on_each_rank(tmp_path: Path) -> None:
    """The row's run of ``trainer=fsdp_cpu`` (2 processes, model=nano): each rank holds half of every parameter,
    its gradients and its AdamW state (two moments a parameter, plus a step counter per tensor)."""
    directory = tmp_path / "fsdp_2"
    directory.mkdir()
    m = sharding.run(VARIANTS["fsdp_2"], quick=True, directory=directory)
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]
    for held in (r["params"] for r in ranks):
        assert held["dtensors"] == held["tensors"]
        assert 0.5 <= held["local"] / held["total"] < 0.51, held  # fully_shard rounds each first dimension up
        assert held["bytes"]["parameters"] == held["bytes"]["gradients"] == 4 * held["local"]  # fp32
        assert 2 * held["bytes"]["parameters"] < held["bytes"]["optimizer_state"] < 2.01 * held["bytes"]["parameters"]
    assert m.bytes == {kind: max(r["params"]["bytes"][kind] for r in ranks) for kind in KINDS}
    assert m.processes == 2 and m.step_seconds > 0
    # Each rank's own peak: a process of torch and Lightning, not the pytest process that started the run.
    assert all(200 * MIB < r["peak_rss_bytes"] < 3000 * MIB for r in ranks)


def test_the_row_runs_only_when_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five multi-process training runs: never part of a plain ``python -m trident.bench`` (nor --quick)."""
    ran: list[str] = []
    for name in ROWS:
        monkeypatch.setitem(ROWS, name, lambda settings, name=name: ran.append(name) or [])
    for argv in (["--quick"], ["--device", "cpu"]):
        assert main([*argv, "--out", str(tmp_path / "bench.md")]) == 0
        assert ran and "sharding" not in ran
        ran.clear()
    assert main(["--only", "sharding", "--out", str(tmp_path / "bench.md")]) == 0
    assert ran == ["sharding"]
