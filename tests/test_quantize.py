"""trident-quantize (issue 56, item 2): a run's block linears in int8 / int4 equal torchao's own quantization of the
same weights, the file holds what it measures, every reader loads it (trident.load, trident-sample, trident-harness,
eval.py), the quality it reports is a direct evaluation of the quantized model, and bad inputs are one line each."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import trident
from tests.convert_helpers import randomise
from trident.converters.weight_only import QUANTIZED_KEY, _pack, _unpack
from trident.data.tokenization import train_tokenizer
from trident.errors import DataError
from trident.tasks.base import TridentTask
from trident.tasks.lm import LanguageModelTask
from trident.tasks.networks import merge_converters
from trident.weights.quantize import quantize_checkpoint

from .entry_points import run_in_process
from .test_load_network import TASK_BUILDS, saved

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
from torchao.quantization.granularity import PerGroup, PerRow

pytestmark = pytest.mark.usefixtures("single_thread")

CORPUS = [f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(40)]
# d_model 32 and d_ff 64: int4's default groups of 32 divide every block linear's inputs; a group of 24 does not.
BACKBONE = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 32, "pos_encoding": "learned",
            "dropout": 0.0}


def torchao_reference(bits: int, group_size: int | None) -> object:
    """torchao's config for each scheme, written here as its docs give it (int4 on a CPU: the intx tensor)."""
    if bits == 8:
        return Int8WeightOnlyConfig(granularity=PerRow() if group_size is None else PerGroup(group_size))
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


def block_linears(net: nn.Module) -> list[str]:
    return [name for name, module in net.named_modules() if isinstance(module, nn.Linear) and ".blocks." in f".{name}"]


def save_task(task: LanguageModelTask, path: Path) -> Path:
    """``task`` as a checkpoint file holds it (what Lightning's trainer.save_checkpoint writes of a model)."""
    checkpoint = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                  "pytorch-lightning_version": L.__version__}
    task.on_save_checkpoint(checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of a GPT-2-shaped LM (tied head), every weight drawn anew: config and checkpoints/last.ckpt."""
    tokenizer = train_tokenizer("bpe", CORPUS, vocab_size=300)
    task = LanguageModelTask(BACKBONE, tokenizer.get_vocab_size(), {"name": "adamw", "lr": 1e-3}, {"name": "constant"},
                             tokenizer_json=tokenizer.to_str())
    randomise(task.net, seed=0, std=0.3)
    run = tmp_path_factory.mktemp("quantize") / "run"
    save_task(task, run / "checkpoints" / "last.ckpt")
    (run / "config_resolved.yaml").write_text("seed: 0\n")  # found by the command; these tests never evaluate
    return run


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (8, 16), (4, 32), (4, 16)])
def test_quantized_layers_equal_torchaos_own(lm_run: Path, tmp_path: Path, bits: int, group_size: int | None) -> None:
    source = lm_run / "checkpoints" / "last.ckpt"
    written = quantize_checkpoint(source, tmp_path / "q" / "last.ckpt", bits, group_size)
    original, loaded = trident.load(source), trident.load(tmp_path / "q")
    reference = trident.load(source)
    assert written.layers == block_linears(original.net) and len(written.layers) == 8
    for name in written.layers:
        quantize_(reference.net.get_submodule(name), torchao_reference(bits, group_size))
        ours, theirs = loaded.net.get_submodule(name).weight, reference.net.get_submodule(name).weight
        assert type(ours) is type(theirs)
        assert torch.equal(ours.dequantize(), theirs.dequantize())  # the dequantized weights exactly
        assert not torch.equal(ours.dequantize(), original.net.get_submodule(name).weight)
    # The rest stays as trained: the tied head and embedding, biases, norms, positions.
    rest = {key: value for key, value in original.net.state_dict().items()
            if key.removesuffix(".weight") not in written.layers}
    assert all(torch.equal(loaded.net.state_dict()[key], value) for key, value in rest.items())
    assert loaded.net.head.weight is loaded.net.embed.weight
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.no_grad():
        assert torch.equal(loaded.net(ids), reference.net(ids))


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 32)])
def test_bytes_are_measured_from_the_tensors(lm_run: Path, tmp_path: Path, bits: int, group_size: int | None) -> None:
    source = lm_run / "checkpoints" / "last.ckpt"
    written = quantize_checkpoint(source, tmp_path / "last.ckpt", bits, group_size)
    net = trident.load(source).net
    shapes = [net.get_submodule(name).weight.shape for name in written.layers]
    floats = sum(p.numel() for p in net.parameters()) * 4  # float32; the tied head counted once
    layers = sum(out * inputs * 4 for out, inputs in shapes)
    # Each row: its values (int8 in memory; int4 two a byte in the file), a float32 scale and an int8 zero point for
    # each row (int8) or group (int4).
    scales = sum(out * (1 if group_size is None else inputs // group_size) * (4 + 1) for out, inputs in shapes)
    values = sum(out * inputs for out, inputs in shapes)
    assert written.bytes["before"] == floats and written.bytes["layers_before"] == layers
    assert written.bytes["layers_after"] == values + scales
    assert written.bytes["after"] == floats - layers + values + scales
    assert written.bytes["stored"] == floats - layers + (values if bits == 8 else values // 2) + scales
    # The file holds what is measured: the record's tensors and the state dict's.
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    held = sum(t.numel() * t.element_size() for parts in checkpoint[QUANTIZED_KEY]["layers"].values() for t in parts.values())
    state = {k: v for k, v in checkpoint["state_dict"].items() if k != "net.head.weight"}  # tied: one tensor
    assert held + sum(t.numel() * t.element_size() for t in state.values()) == written.bytes["stored"]
    assert not {"optimizer_states", "callbacks", "loops"} & set(checkpoint)


@pytest.mark.parametrize("name", list(TASK_BUILDS))
def test_every_task_loads_quantized(name: str, tmp_path: Path) -> None:
    """Each task's network (LoRA runs: the adapters folded in first): its block linears in int4 as torchao makes
    them, its head and the rest as they were."""
    source = saved(randomise_task(TASK_BUILDS[name]()), tmp_path / "source.ckpt")
    written = quantize_checkpoint(source, tmp_path / "q" / "last.ckpt", 4, 16)
    reference, loaded = trident.load(source), trident.load(tmp_path / "q")
    merge_converters(reference)
    assert written.layers == block_linears(reference.net) and not loaded.converters
    for layer in written.layers:
        quantize_(reference.net.get_submodule(layer), torchao_reference(4, 16))
    for key, value in reference.net.state_dict().items():
        ours = loaded.net.state_dict()[key]
        assert torch.equal(ours.dequantize(), value.dequantize()) if key.removesuffix(".weight") in written.layers \
            else torch.equal(ours, value), key


def randomise_task(task: TridentTask) -> TridentTask:
    randomise(task.net, seed=1, std=0.3)
    return task


def test_int4_values_pack_two_a_byte_and_back() -> None:
    values = torch.randint(-8, 8, (3, 5), dtype=torch.int8)  # an odd count: the last byte half empty
    packed = _pack(values)
    assert packed.dtype == torch.uint8 and packed.shape == (8,)
    assert torch.equal(_unpack(packed, values.shape), values)


def test_readers_that_need_float_weights_refuse_one(lm_run: Path, tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from trident.runs.resume import check_resume_continues
    from trident.weights.network import load_network
    from trident.weights.sources import read_init_source

    quantized = quantize_checkpoint(lm_run / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt", 8, None).path
    resume = lambda path: check_resume_continues(torch.load(path, weights_only=True), path, OmegaConf.create({}), None)
    for read in (load_network, lambda path: read_init_source(str(path)), resume,
                 lambda path: quantize_checkpoint(path, tmp_path / "again.ckpt", 4, 32)):
        with pytest.raises(DataError, match="holds int8 weights written by trident-quantize"):
            read(quantized)


def test_a_quantized_checkpoint_as_a_teacher_or_averaged_is_one_line_naming_its_float_source(
        lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """distill.teacher reads float weights (the line said init_from), and averaging would mix float parts with one
    input's int layers (two quantized checkpoints averaged silently; one beside a float one: "different weights"):
    each is one line that names the float checkpoint it was quantized from."""
    from trident.runs.pipeline import configured_task_class
    from trident.weights.teacher import stage_teacher

    from .conftest import SMALL, compose_config

    source = lm_run / "checkpoints" / "last.ckpt"
    quantized = quantize_checkpoint(source, tmp_path / "int8.ckpt", 8, None).path
    cfg = compose_config([*SMALL, "distill=kd", f"distill.teacher={quantized}"], output_dir=tmp_path / "run")
    with pytest.raises(DataError, match=rf"holds int8 weights written by trident-quantize and distill.teacher reads "
                                        rf"float weights: use the checkpoint it was quantized from, {source}"):
        stage_teacher(configured_task_class(cfg), cfg, tmp_path / "run", resumed=False)
    for inputs in ([quantized, quantized], [source, quantized]):
        result = run_in_process("trident.commands.average_checkpoints", [*map(str, inputs), "-o", "averaged.ckpt"],
                                tmp_path, monkeypatch)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert (f"checkpoint '{quantized}' holds int8 weights written by trident-quantize and an average is taken of "
                f"float weights (average those, then quantize the average): use the checkpoint it was quantized from, "
                f"{source}") in result.last_line
        assert not (tmp_path / "averaged.ckpt").exists()


def test_a_record_that_does_not_fit_the_network_is_one_line(lm_run: Path, tmp_path: Path) -> None:
    """A record whose tensors this torchao does not make (another version's names or shapes) is refused, not loaded."""
    path = quantize_checkpoint(lm_run / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt", 4, 32).path
    checkpoint = torch.load(path, weights_only=True)
    layer = checkpoint[QUANTIZED_KEY]["layers"]["decoder.blocks.0.ffn.fc_out"]  # 64 inputs: 2 groups a row
    layer["scale"] = layer["scale"][:, :1]
    torch.save(checkpoint, path)
    with pytest.raises(DataError, match=r"holds \(32, 1\) torch.float32 as decoder.blocks.0.ffn.fc_out.scale, where "
                                        r"this torchao makes \(32, 2\) torch.float32"):
        trident.load(path)
    del layer["scale"]
    torch.save(checkpoint, path)
    with pytest.raises(DataError, match="holds nothing as decoder.blocks.0.ffn.fc_out.scale"):
        trident.load(path)


def refused(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    result = run_in_process("trident.commands.quantize", args, cwd, monkeypatch)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.last_line


def test_bad_inputs_are_one_line(lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "argument --bits: invalid choice: 3 (choose from 8, 4)" in refused([str(lm_run), "--bits", "3"], tmp_path,
                                                                              monkeypatch)
    line = refused([str(tmp_path / "nowhere"), "--bits", "8"], tmp_path, monkeypatch)
    assert "nowhere' not found: pass a trident checkpoint (.ckpt) or a train.py run directory" in line
    line = refused([str(lm_run), "--bits", "4", "--group-size", "24"], tmp_path, monkeypatch)
    assert ("--group-size 24 does not divide the 32 inputs of decoder.blocks.0.self_attn.qkv_proj" in line
            and "(e.g. --group-size 32)" in line)
    assert not (lm_run / "quantized-int4").exists()  # the folder it made for the refused model is gone
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: find_spec answers None
    line = refused([str(lm_run), "--bits", "8"], tmp_path, monkeypatch)
    assert "needs trident's [quant] extra, which is not installed: run pip install -e '.[quant]'" in line


@pytest.mark.slow
def test_the_command_on_a_trained_run(lm_reference_run: tuple[Path, dict[str, float]], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The reference LM run (a copy: it is shared) quantized to int4 by the command: its reported quality after is
    a direct evaluation of torchao's quantization of the run's weights, and eval.py, trident-sample, trident-chat and
    trident-harness read the quantized model."""
    from lm_eval import simple_evaluate

    from tests.test_harness import write_tasks
    from trident.commands import chat, quantize, sample
    from trident.runs.evaluation import evaluate, load_config
    from trident.runs.harness import harness_model
    from trident.runs.harness_tasks import task_manager
    from trident.runs.pipeline import build_data_and_task, check_config
    from trident.weights.checkpoint_files import checkpoint_of

    run = tmp_path / "run"
    shutil.copytree(lm_reference_run[0], run, ignore=shutil.ignore_patterns("wandb", "csv"))
    own = run / "eval" / f"{checkpoint_of(run).stem}.json"  # eval.py's results of the run's checkpoint
    own.parent.mkdir()
    own.write_text("{}")
    # The run tested one batch (SMALL): --eval keeps it so (the command's default is the whole split).
    quantize.main([str(run), "--bits", "4", "--eval", "trainer.limit_test_batches=1"])
    assert own.read_text() == "{}"
    table = capsys.readouterr().out
    report = json.loads((run / "quantized-int4" / "quantization.json").read_text())
    assert report["bits"] == 4 and report["group_size"] == 32 and "test/loss" in table
    after = report["metrics"]["after"]

    # Direct: the run's own weights, its block linears quantized by torchao here, tested on the run's test split.
    cfg, checkpoint = load_config([f"ckpt_path={run}"])
    datamodule, _ = build_data_and_task(cfg, check_config(cfg), "test")
    direct = trident.load(checkpoint)
    for name in block_linears(direct.net):
        quantize_(direct.net.get_submodule(name), torchao_reference(4, 32))
    trainer = L.Trainer(logger=False, enable_checkpointing=False, callbacks=[], enable_progress_bar=False,
                        enable_model_summary=False, limit_test_batches=cfg.trainer.limit_test_batches)
    trainer.test(direct, datamodule=datamodule, verbose=False)
    assert float(trainer.callback_metrics["test/loss"]) == pytest.approx(after["test/loss"], rel=1e-6)
    assert report["metrics"]["before"]["test/loss"] == pytest.approx(evaluate([f"ckpt_path={run}"])["test/loss"], rel=1e-6)
    assert evaluate([f"ckpt_path={run / 'quantized-int4'}"])["test/loss"] == pytest.approx(after["test/loss"], rel=1e-6)
    assert (run / "eval" / "quantized-int4-last.json").is_file()  # the run's own eval results keep their name

    # trident-sample: greedy tokens of the quantized model as torchao's generates them.
    capsys.readouterr()
    sample.main([str(run / "quantized-int4"), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--temperature", "0"])
    from trident.data.tokenization import encode_plain
    from trident.models import generate

    assert direct.tokenizer is not None
    prompt = torch.tensor([encode_plain(direct.tokenizer, "ROMEO:")])
    expected = direct.tokenizer.decode(generate(direct.net, prompt, 6, temperature=0.0)[0].tolist())
    assert capsys.readouterr().out == f"{expected}\n{'-' * 40}\n"

    # trident-chat: a turn through the run's template.
    chat.main([str(run / "quantized-int4"), "--message", "ROMEO:", "--max-new-tokens", "3"])
    assert capsys.readouterr().out

    # trident-harness's model on the quantized run scores a multiple-choice task.
    tasks = write_tasks(tmp_path / "tasks")
    model = harness_model(run / "quantized-int4", batch_size=1, chat=False)
    results = simple_evaluate(model=model, tasks=["tiny_mc"], task_manager=task_manager(["tiny_mc"], str(tasks)))
    assert results is not None and "acc,none" in results["results"]["tiny_mc"]


def fake_evaluate(calls: list[tuple[list[str], bool]]) -> object:
    """eval.py's evaluate, recording its arguments (these runs have no data to test on)."""
    def evaluate(arguments: list[str], write: bool = True) -> dict[str, float]:
        calls.append((arguments, write))
        return {"test/loss": 1.0}
    return evaluate


def test_the_whole_test_split_before_and_after(lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both evaluations test the same batches: every one of the split unless --eval limits them (a run trained with
    trainer.limit_test_batches would test part of it), and neither replaces the run's own eval.py results."""
    from trident.commands import quantize
    from trident.runs import evaluation

    calls: list[tuple[list[str], bool]] = []
    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate(calls))
    quantize.main([str(lm_run), "--bits", "8", "--out", str(tmp_path / "q")])
    quantize.main([str(lm_run), "--bits", "8", "--out", str(tmp_path / "q"), "--eval", "trainer.limit_test_batches=3"])
    (before, write_before), (after, write_after) = calls[:2]
    assert before[1:] == after[1:] == ["trainer.limit_test_batches=1.0"] and not write_before and not write_after
    assert calls[2][0][1:] == calls[3][0][1:] == ["trainer.limit_test_batches=1.0", "trainer.limit_test_batches=3"]
    report = json.loads((tmp_path / "q" / "quantization.json").read_text())  # the second run replaced the first's
    assert report["eval_overrides"] == ["trainer.limit_test_batches=1.0", "trainer.limit_test_batches=3"]


def test_out_never_replaces_the_runs_checkpoints(lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = lm_run / "checkpoints" / "last.ckpt"
    before = source.read_bytes()
    for out in (lm_run / "checkpoints", lm_run):
        line = refused([str(lm_run), "--bits", "8", "--out", str(out)], tmp_path, monkeypatch)
        assert "holds the run's own checkpoints" in line and "pass another folder" in line, line
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(source, other / "last.ckpt")  # a float checkpoint elsewhere
    assert "holds the run's own checkpoints (or one trident-quantize did not write)" in refused(
        [str(lm_run), "--bits", "8", "--out", str(other)], tmp_path, monkeypatch)
    assert source.read_bytes() == before and (other / "last.ckpt").read_bytes() == before
    assert not (lm_run / "last.ckpt").exists() and not (lm_run / "quantization.json").exists()


def test_the_tied_head_stays_float_and_tied(lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM's head is its token embedding: read back float and still the same tensor; without torchao, reading the
    quantized model is one line naming the [quant] extra."""
    from trident.extras import MissingExtra

    quantize_checkpoint(lm_run / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt", 4, 32)
    net = trident.load(tmp_path / "last.ckpt").net
    assert net.head.weight is net.embed.weight and type(net.head.weight) is nn.Parameter
    assert net.head.weight.dtype == torch.float32
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"needs trident's \[quant\] extra"):
        trident.load(tmp_path / "last.ckpt")


def test_an_ema_runs_raw_weights_stay_behind(lm_run: Path, tmp_path: Path) -> None:
    """callbacks=ema's checkpoint holds the average as its state dict and the raw float weights beside it: the
    quantized file holds the quantized average alone."""
    source = tmp_path / "ema.ckpt"
    checkpoint = torch.load(lm_run / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["current_model_state"] = {key: value.clone() for key, value in checkpoint["state_dict"].items()}
    torch.save(checkpoint, source)
    quantize_checkpoint(source, tmp_path / "q" / "last.ckpt", 8, None)
    assert "current_model_state" not in torch.load(tmp_path / "q" / "last.ckpt", weights_only=True)


@pytest.mark.slow
def test_a_lora_run_quantized_is_tested_with_its_adapters_folded_in(
        lm_reference_run: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    """A finetune=lora run (one step on the reference run): the quantized file holds the merged weights, and eval.py
    (the command's "after" too) tests it as they are, not through the run's finetune=lora settings."""
    from trident.commands import quantize
    from trident.runs.evaluation import evaluate
    from trident.runs.pipeline import train

    from .conftest import SMALL, compose_config

    run = tmp_path / "lora"
    train(compose_config([*SMALL, "trainer.max_steps=1", "finetune=lora", f"init_from={lm_reference_run[0]}"],
                         output_dir=run))
    quantize.main([str(run), "--bits", "8"])
    after = json.loads((run / "quantized-int8" / "quantization.json").read_text())["metrics"]["after"]
    assert evaluate([f"ckpt_path={run / 'quantized-int8'}", "trainer.limit_test_batches=1.0"])["test/loss"] == \
        pytest.approx(after["test/loss"], rel=1e-6)


def test_a_failed_evaluation_leaves_no_model_without_its_report(lm_run: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from trident.commands import quantize
    from trident.runs import evaluation

    def fails(arguments: list[str], write: bool = True) -> dict[str, float]:
        raise DataError("the test data is gone")

    monkeypatch.setattr(evaluation, "evaluate", fails)
    with pytest.raises(SystemExit):
        quantize.main([str(lm_run), "--bits", "8", "--out", str(tmp_path / "q")])
    assert not (tmp_path / "q").exists()
