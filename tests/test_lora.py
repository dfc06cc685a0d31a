"""finetune=lora (issue 41): the adapter layer starts as the frozen layer and merges exactly, only the
adapters (and a task's new head) get gradients in every task, the optimizer holds nothing else, and a
run's adapter rebuilds it, resumes exactly and exports merged."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

import trident
from trident.backbone import LoRALinear, is_lora_parameter, merge_lora
from trident.errors import ConfigError, DataError
from trident.runs.pipeline import train
from trident.tasks.base import TridentTask
from trident.tasks.lm import LanguageModelTask
from trident.weights.lora_adapter import load_adapter, save_adapter

from .conftest import SMALL, compose_config
from .probes import NetworkAtStart
from .test_task_contract import BACKBONE, OPTIMIZER, SCHEDULER, _every_task

LORA = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q", "k", "v", "o", "mlp"]}
# Swiglu splits fc_in into gate and up, grouped-query attention makes k and v narrower than q.
GATED = {**BACKBONE, "activation": "swiglu", "n_heads": 2, "n_kv_heads": 1}


def _randomised(layer: LoRALinear) -> LoRALinear:
    """B is zero at initialisation; random B's make the adapters do something."""
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.normal_()
    return layer


def test_an_adapter_starts_as_the_frozen_layer_and_changes_only_its_rows() -> None:
    torch.manual_seed(0)
    base = nn.Linear(6, 10)
    x = torch.randn(3, 4, 6)
    layer = LoRALinear(base, {"q": (0, 4), "v": (7, 10)}, rank=2, alpha=4.0, dropout=0.0)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    changed = _randomised(layer)(x) - base(x)  # (3, 4, 10)
    assert changed[..., 4:7].abs().max() == 0, "the k rows have no adapter"
    assert changed[..., :4].abs().min() > 0 and changed[..., 7:].abs().min() > 0
    expected = 2.0 * x @ (layer.lora_B["v"] @ layer.lora_A["v"]).T  # scaling alpha / rank = 2
    torch.testing.assert_close(changed[..., 7:], expected, rtol=1e-5, atol=1e-5)


def test_merging_is_exact_and_leaves_the_plain_layer() -> None:
    torch.manual_seed(0)
    layer = _randomised(LoRALinear(nn.Linear(6, 10), {"k": (4, 7), "v": (7, 10)}, rank=3, alpha=8.0, dropout=0.0))
    x = torch.randn(5, 6)
    merged = layer.merged()
    assert type(merged) is nn.Linear
    torch.testing.assert_close(merged(x), layer(x), rtol=1e-5, atol=1e-5)


def test_adapters_go_on_each_slice_of_the_fused_projections() -> None:
    task = LanguageModelTask(GATED, 11, OPTIMIZER, SCHEDULER, lora=LORA)
    attention, ffn = task.net.decoder.blocks[0].self_attn, task.net.decoder.blocks[0].ffn
    # q: 2 heads x 4, k and v: 1 head x 4; gate and up: d_ff 16 each.
    assert {n: tuple(b.shape) for n, b in attention.qkv_proj.lora_B.items()} == {"q": (8, 2), "k": (4, 2), "v": (4, 2)}
    assert {n: tuple(b.shape) for n, b in ffn.fc_in.lora_B.items()} == {"gate": (16, 2), "up": (16, 2)}
    assert set(ffn.fc_out.lora_B) == {"out"} and set(attention.out_proj.lora_B) == {"o"}
    assert "decoder.blocks.0.self_attn.qkv_proj.weight" in task.net.state_dict(), "the base keeps its names"
    # The k adapter changes the k rows (8:12 of [q 8; k 4; v 4]) and no other.
    qkv, x = attention.qkv_proj, torch.randn(3, 8)
    with torch.no_grad():
        qkv.lora_B["k"].normal_()
        changed = (qkv(x) - nn.functional.linear(x, qkv.weight, qkv.bias)).abs().amax(dim=0)  # (16,)
    assert changed[8:12].min() > 0 and changed[:8].max() == 0 and changed[12:].max() == 0


def _lora_task(task: TridentTask) -> TridentTask:
    return type(task)(**{**task.hparams, "lora": LORA})


# task=electra pre-trains both its networks and refuses finetune=lora in one line (tests/test_electra_task.py).
@pytest.mark.parametrize("plain", [task for task in _every_task() if task.NAME != "electra"],
                         ids=lambda task: f"{task.NAME}-{task.hparams.get('pool', '')}")
def test_only_adapters_and_the_new_head_get_gradients(plain: TridentTask) -> None:
    torch.manual_seed(0)
    task = _lora_task(plain)
    for layer in task.net.modules():
        if isinstance(layer, LoRALinear):
            _randomised(layer)  # so that A gets a gradient too
    inputs = {i.parameter: i.example for i in task.example_input()}
    task.net.train()(**inputs).float().square().mean().backward()
    got = {name for name, p in task.net.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    expected = {name for name, _ in task.net.named_parameters() if is_lora_parameter(name) or name.startswith(task.HEAD)}
    assert got == expected
    assert any(is_lora_parameter(name) for name in got)
    if task.NAME == "translation":  # the cross-attention's q_proj and kv_proj have adapters too
        assert any("cross_attn.kv_proj.lora_B.k" in name for name in got)
    optimized = {id(p) for group in _optimizer(task).param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in task.net.named_parameters() if name in expected}


def _optimizer(task: TridentTask) -> torch.optim.Optimizer:
    task._trainer = SimpleNamespace(estimated_stepping_batches=10)  # what configure_optimizers reads of a trainer
    return task.configure_optimizers()["optimizer"]


def test_merge_lora_gives_the_base_layers_and_the_same_logits() -> None:
    torch.manual_seed(0)
    task = LanguageModelTask(GATED, 11, OPTIMIZER, SCHEDULER, lora=LORA).eval()
    for layer in task.net.modules():
        if isinstance(layer, LoRALinear):
            _randomised(layer)
    ids = torch.randint(0, 11, (2, 8))
    with torch.no_grad():
        before = task.net(ids)
        merge_lora(task.net)
        after = task.net(ids)
    plain = LanguageModelTask(GATED, 11, OPTIMIZER, SCHEDULER)
    assert task.net.state_dict().keys() == plain.net.state_dict().keys()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


RUN = [*SMALL, "logger=none", "model.dropout=0.1", "scheduler=constant", "callbacks.throughput=null",
       "callbacks.lr_monitor=null", "test=false"]
CSV = ["+logger.csv._target_=lightning.pytorch.loggers.CSVLogger", "+logger.csv.name=csv"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base") / "run"
    train(compose_config(RUN, output_dir=out))
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(row["step"]): float(row["train/loss"]) for metrics in sorted(run_dir.glob("csv/version_*/metrics.csv"))
            for row in csv.DictReader(metrics.open()) if row.get("train/loss")}


def test_a_lora_run_saves_its_adapter_which_rebuilds_it(base_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "lora"
    train(compose_config([*RUN, *CSV, "finetune=lora", f"init_from={base_run}", "finetune.dropout=0.1"], output_dir=run))
    adapter = load_file(str(run / "adapter" / "adapter.safetensors"))
    assert adapter and all(is_lora_parameter(name) for name in adapter), "an LM has no new head: adapters alone"
    assert {name.rsplit(".", 1)[-1] for name in adapter} == {"q", "v"}  # finetune.targets' default
    saved = json.loads((run / "adapter" / "adapter.json").read_text())
    assert saved == {"base": str(base_run), "lora": {"rank": 8, "alpha": 16, "dropout": 0.1, "targets": ["q", "v"]}}
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if ".lora_B." in name), "the adapters trained"

    tuned, base = trident.load(run), trident.load(base_run)
    assert tuned.hparams["lora"] == saved["lora"]
    # The run's logged hyperparameters say what trains: the adapters, a small share of the network.
    logged = yaml.safe_load((run / "csv" / "version_0" / "hparams.yaml").read_text())
    total = sum(p.numel() for p in base.net.parameters())
    assert logged["params/trainable"] == sum(t.numel() for t in adapter.values())
    assert logged["params/total"] == total + logged["params/trainable"]
    assert logged["params/trainable_share"] == pytest.approx(logged["params/trainable"] / logged["params/total"])
    rebuilt = type(base)(**{**base.hparams, "lora": saved["lora"]}).eval()
    rebuilt.net.load_state_dict(base.net.state_dict(), strict=False)
    load_adapter(rebuilt.net, str(run), saved["lora"], str(base_run))
    ids = torch.randint(0, tuned.net.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.net(ids), tuned.net(ids), rtol=0, atol=0)
        assert not torch.allclose(base.net(ids), tuned.net(ids))


def test_init_from_and_finetune_adapter_start_train_py_where_the_adapter_run_ended(base_run: Path,
                                                                                 tmp_path: Path) -> None:
    """The real pipeline, not load_adapter alone: ``init_from=<base> finetune=lora finetune.adapter=<run>`` has,
    at step 0, the logits of the adapter run's weights; an adapter trained on another base is one error line."""
    lora = [*RUN, "finetune=lora", f"init_from={base_run}"]
    adapted = tmp_path / "adapted"
    train(compose_config(lora, output_dir=adapted))
    NetworkAtStart.nets.clear()
    probe = ["+callbacks.probe._target_=tests.probes.NetworkAtStart", "trainer.max_steps=1"]
    train(compose_config([*lora, *probe, f"finetune.adapter={adapted}"], output_dir=tmp_path / "continued"))
    (at_start,) = NetworkAtStart.nets
    tuned, base = trident.load(adapted), trident.load(base_run)
    ids = torch.randint(0, tuned.net.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(at_start(ids), tuned.net(ids), rtol=0, atol=0)
        assert not torch.allclose(base.net(ids), tuned.net(ids)), "the adapter changes the base's logits"
    other_base = tmp_path / "other_base"
    shutil.copytree(base_run, other_base)
    with pytest.raises(ConfigError, match=rf"finetune.adapter={adapted} adapts init_from={base_run}, not "
                                          rf"init_from={other_base}: set init_from={base_run}"):
        train(compose_config([*RUN, "finetune=lora", f"init_from={other_base}", f"finetune.adapter={adapted}"],
                             output_dir=tmp_path / "refused"))


def test_a_resumed_lora_run_equals_the_uninterrupted_one_step_for_step(base_run: Path, tmp_path: Path) -> None:
    """With an EMA of the weights: the raw weights it resumes from (current_model_state) lack the base too."""
    lora = [*RUN, *CSV, "finetune=lora", f"init_from={base_run}", "trainer.max_steps=6",
            "callbacks.last_checkpoint.every_n_train_steps=3", "callbacks=ema", "callbacks.ema.decay=0.5"]
    train(compose_config(lora, output_dir=tmp_path / "uninterrupted"))
    expected = _losses(tmp_path / "uninterrupted")
    assert sorted(expected) == list(range(6))
    cut = tmp_path / "cut"
    train(compose_config([*lora, "trainer.max_steps=3"], output_dir=cut))
    # What it resumes from holds what trains, not the frozen base (refilled from the run's copy of init_from).
    saved = torch.load(cut / "checkpoints" / "last.ckpt", weights_only=True)
    for entry in ("state_dict", "current_model_state"):
        assert all(is_lora_parameter(name) for name in saved[entry]), sorted(saved[entry])
    assert saved["trident_frozen_base"]["source"] == str(base_run)
    train(compose_config([*lora, f"resume={cut}"], output_dir=cut))
    resumed = {step: loss for step, loss in _losses(cut).items() if step >= 3}
    assert sorted(resumed) == [3, 4, 5]
    torch.testing.assert_close(resumed, {step: expected[step] for step in resumed}, rtol=0, atol=1e-6)


def test_the_adapter_dropout_acts_in_training_only() -> None:
    torch.manual_seed(0)
    layer = _randomised(LoRALinear(nn.Linear(6, 4), {"o": (0, 4)}, rank=2, alpha=2.0, dropout=0.5))
    x = torch.randn(8, 6)
    assert not torch.allclose(layer.train()(x), layer.eval()(x))
    torch.testing.assert_close(layer.eval()(x), layer.merged()(x), rtol=1e-5, atol=1e-5)


def test_the_adapter_dropout_drops_the_input_of_a_as_peft_does() -> None:
    """peft's LoraLayer: ``base(x) + lora_B(lora_A(dropout(x))) * scaling``; the same seed draws the same mask
    (x's shape), so a dropout anywhere else (after B: the output's shape) gives other outputs."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as PeftLinear

    torch.manual_seed(0)
    base, x = nn.Linear(6, 4), torch.randn(8, 6)
    ours = _randomised(LoRALinear(base, {"o": (0, 4)}, rank=2, alpha=3.0, dropout=0.5)).train()
    theirs = PeftLinear(nn.Linear(6, 4), "default", LoraConfig(r=2, lora_alpha=3, lora_dropout=0.5), r=2, lora_alpha=3,
                        lora_dropout=0.5).train()
    with torch.no_grad():
        theirs.base_layer.load_state_dict(base.state_dict())
        theirs.lora_A["default"].weight.copy_(ours.lora_A["o"])
        theirs.lora_B["default"].weight.copy_(ours.lora_B["o"])
    torch.manual_seed(1)
    dropped = ours(x)
    torch.manual_seed(1)
    torch.testing.assert_close(dropped, theirs(x), rtol=1e-5, atol=1e-5)


def test_an_adapter_of_other_settings_or_shapes_is_one_line(tmp_path: Path) -> None:
    settings = {**LORA, "targets": ["q", "v"]}
    task = LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, lora=settings)
    save_adapter(task.net, tmp_path, "base", settings, None)
    other = {**settings, "rank": 4}
    with pytest.raises(ConfigError, match=r"was trained with finetune.rank=2: set finetune.rank=2 to rebuild it"):
        load_adapter(LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, lora=other).net, str(tmp_path), other, "base")
    wider = LanguageModelTask({**BACKBONE, "d_model": 16}, 11, OPTIMIZER, SCHEDULER, lora=settings)
    with pytest.raises(DataError, match="does not fit this model"):
        load_adapter(wider.net, str(tmp_path), settings, "base")


def test_an_adapter_names_its_base_by_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """init_from=base from one directory and init_from=<its absolute path> from another are the same base."""
    task = LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, lora=LORA)
    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    save_adapter(task.net, tmp_path / "lora", "base", LORA, None)
    assert json.loads((tmp_path / "lora" / "adapter" / "adapter.json").read_text())["base"] == str(tmp_path / "base")
    monkeypatch.chdir(tmp_path / "lora")
    load_adapter(task.net, str(tmp_path / "lora"), LORA, str(tmp_path / "base"))


def test_the_adapter_is_the_best_checkpoints(tmp_path: Path) -> None:
    """``trident.load(run)`` reads the best checkpoint: the adapter beside it holds that checkpoint's tensors."""
    task = LanguageModelTask(BACKBONE, 11, OPTIMIZER, SCHEDULER, lora=LORA)
    best = {f"net.{name}": torch.full_like(t, 3.0) for name, t in task.net.state_dict().items()}
    torch.save({"state_dict": best}, tmp_path / "best.ckpt")
    save_adapter(task.net, tmp_path, "base", LORA, str(tmp_path / "best.ckpt"))
    adapter = load_file(str(tmp_path / "adapter" / "adapter.safetensors"))
    assert adapter.keys() == {name for name in task.net.state_dict() if is_lora_parameter(name)}
    assert all((t == 3.0).all() for t in adapter.values())
