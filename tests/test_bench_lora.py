"""The ``lora`` benchmark rows (issue 41): full fine-tuning against LoRA of one LM. Its byte counts are checked
against an independent count, its 124 M shape against GPT-2 small's, and its 1 % target is computed."""

from __future__ import annotations

import pytest
import torch

from trident.bench import lora
from trident.bench.results import Settings


def independent_bytes(net: torch.nn.Module) -> tuple[int, int]:
    """AdamW's gradient and state bytes from the trainable parameters alone: a gradient and two moments of
    each, plus fused AdamW's step counter (a float32 scalar per trainable tensor)."""
    trainable = [p for p in net.parameters() if p.requires_grad]
    size = sum(p.numel() * p.element_size() for p in trainable)
    return size, 2 * size + 4 * len(trainable)


@pytest.mark.parametrize("variant", list(lora.VARIANTS))
def test_training_state_bytes_match_an_independent_count(variant: str, single_thread: None) -> None:
    net = lora.build(variant, quick=True).net
    optimizer, step = lora.step_of(net, quick=True, device=torch.device("cpu"))
    step()
    measured = lora.training_state(net, optimizer)
    assert (measured.grad_bytes, measured.state_bytes) == independent_bytes(net)
    assert measured.total == sum(p.numel() for p in net.parameters())
    d, layers = lora.QUICK["d_model"], lora.QUICK["n_layers"]
    # Each adapted slice of width d trains A (r x d) and B (d x r); mlp: fc_in (4d rows) and fc_out (d rows).
    expected = {"full": measured.total, "lora_qv": layers * 2 * 2 * lora.RANK * d,
                "lora_all": layers * (4 * 2 * lora.RANK * d + lora.RANK * (d + lora.QUICK["d_ff"]) * 2)}
    assert measured.trainable == expected[variant]


def test_the_full_size_model_is_gpt2_small() -> None:
    """124,439,808 parameters (GPT-2 small, tied embeddings); LoRA r=8 on q and v trains 12 x 2 x (8 x 768 x 2)."""
    with torch.device("meta"):
        full, adapted = lora.build("full", quick=False).net, lora.build("lora_qv", quick=False).net
    assert sum(p.numel() for p in full.parameters()) == 124_439_808
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 12 * 2 * 8 * 768 * 2


@pytest.mark.parametrize(("target", "met"), [(0.01, "**no**"), (0.2, "yes")])
def test_rows_compute_the_share_of_full_bytes_against_the_target(
    target: float, met: str, monkeypatch: pytest.MonkeyPatch, single_thread: None
) -> None:
    """At quick sizes LoRA r=8 on q, v keeps 2,048 of 20,224 parameters' state: 10.1 % of full's bytes."""
    monkeypatch.setattr(lora, "STATE_SHARE_TARGET", target)
    monkeypatch.setattr(lora, "child_peak", lambda variant, quick: {"imports_mib": 1.0, "peak_mib": 2.0})
    rows = lora.lora_rows(Settings(torch.device("cpu"), quick=True, warmup=0, repeats=1))
    assert [row.group for row in rows] == ["lora"] * 3
    full_net = lora.build("full", quick=True).net
    qv_net = lora.build("lora_qv", quick=True).net
    share = sum(independent_bytes(qv_net)) / sum(independent_bytes(full_net))
    checked = [row for row in rows if row.target != "-"]
    assert len(checked) == 1 and checked[0].benchmark.startswith("LoRA r=8 on q, v ")
    assert checked[0].result.startswith(f"{share:.2%} of full's")
    assert checked[0].target == f"<= {target:.0%} of full's grad + optimizer-state bytes"
    assert checked[0].met == met
    assert "peak RSS 2 MiB" in checked[0].trident and "20,224 trainable (100.00%)" in checked[0].reference


def test_a_lora_dpo_task_holds_one_copy_of_the_base_and_full_fine_tuning_two(single_thread: None) -> None:
    """Issue 53: objective=dpo with LoRA takes the network with its adapters off as its reference, so the task's
    tensors hold the base's bytes once (the adapters beside them); full fine-tuning DPO holds a frozen copy: twice."""
    from trident.bench import preference

    rows = preference.lora_dpo_rows(Settings(torch.device("cpu"), quick=True, warmup=0, repeats=1))
    assert len(rows) == 1 and rows[0].group == "lora_dpo"
    assert rows[0].result == "1.00 copies of the base" and rows[0].met == "yes"
    assert ": 2.00x the base's" in rows[0].reference
    task = preference.dpo_task("lora_qv", quick=True)
    assert not task.companions
    base = sum(p.numel() * 4 for p in preference.dpo_task("full", quick=True).net.parameters())  # tied: once
    assert preference.held_bytes([task]) == base + preference.adapter_bytes(task)


def test_the_lora_dpo_row_sees_a_second_copy_of_the_base(monkeypatch: pytest.MonkeyPatch, single_thread: None) -> None:
    """Planted: LoRA that cannot be switched off makes DPO keep a frozen copy of the base as its reference; the row
    counts it (2.00 copies) and misses its target."""
    from trident.bench import preference
    from trident.converters import LoRA

    monkeypatch.setattr(LoRA, "SWITCHES_OFF", False)
    rows = preference.lora_dpo_rows(Settings(torch.device("cpu"), quick=True, warmup=0, repeats=1))
    assert rows[0].result == "2.00 copies of the base" and rows[0].met == "**no**"
