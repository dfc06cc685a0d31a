"""A finetune=lora run's checkpoints hold what trains, not the frozen base (issue 50): last, best and the EMA's
raw copy leave the base out and record where it comes from; trident.load, eval.py and averaging refill it and
give the model the run ended with; a moved or changed base is one error line, and TRIDENT_BASE points to a moved
one; full fine-tuning and runs from scratch keep every weight; sharded checkpoints are refused under LoRA.
(Resume: tests/test_lora.py; the hf and peft exports of such a run: tests/test_lora_export.py.)"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import trident
from trident.commands.average_checkpoints import average_checkpoints
from trident.commands.evaluate import evaluate
from trident.commands.export import main as export
from trident.commands.sample import load_lm_checkpoint
from trident.errors import ConfigError, DataError
from trident.runs.pipeline import train
from trident.weights.checkpoints import read_checkpoint
from trident.weights.frozen_base import BASE_VARIABLE, FROZEN_BASE_KEY, fingerprint
from trident.weights.init_from import read_init_source

from .conftest import compose_config
from .probes import NetworkAtEnd
from .test_lora import RUN

# LoRA with an EMA of the weights (decay 0.5: the average moves), tested at the end, a checkpoint at steps 2 and 4.
LORA = ["finetune=lora", "callbacks=ema", "callbacks.ema.decay=0.5", "test=true", "optimizer.lr=0.01",
        "+callbacks.probe._target_=tests.probes.NetworkAtEnd"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, dict[str, float], torch.nn.Module]]:
    """A base run, a LoRA run on it, the LoRA run's final metrics and its network as fitting ended."""
    base, tuned = tmp_path_factory.mktemp("base") / "run", tmp_path_factory.mktemp("lora") / "run"
    train(compose_config(RUN, output_dir=base))
    NetworkAtEnd.nets.clear()
    metrics = train(compose_config([*RUN, *LORA, f"init_from={base}"], output_dir=tuned))
    (at_end,) = NetworkAtEnd.nets
    yield base, tuned, metrics, at_end


def _net(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v for k, v in weights.items() if k.startswith("net.")}


def _logits(net: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return net(torch.arange(24).reshape(2, 12) % net.vocab_size)


def test_a_lora_checkpoint_holds_what_trains_and_where_its_base_came_from(runs: tuple[Path, Path, Any, Any]) -> None:
    base, tuned, _, at_end = runs
    trainable = {name for name, p in at_end.named_parameters() if p.requires_grad}
    source = read_init_source(str(base)).state_dict
    frozen = [name for name in at_end.state_dict() if name not in trainable]
    for checkpoint in sorted((tuned / "checkpoints").glob("*.ckpt")):
        saved = read_checkpoint(checkpoint, "the test")
        for entry in ("state_dict", "current_model_state"):  # the EMA's average, and the raw weights beside it
            assert set(_net(saved[entry])) == trainable, (checkpoint.name, entry)
        record = saved[FROZEN_BASE_KEY]
        assert record["source"] == str(base) and record["tensors"] == frozen
        assert record["fingerprint"] == fingerprint(source, frozen)
        # The whole checkpoint (adapters twice, their optimizer state, the tokenizer): a fraction of the base's weights.
        base_bytes = sum(t.numel() * t.element_size() for t in source.values())
        assert checkpoint.stat().st_size < 0.3 * base_bytes, (checkpoint.stat().st_size, base_bytes)


def test_load_eval_and_average_refill_the_base_and_give_the_model_the_run_ended_with(
        runs: tuple[Path, Path, dict[str, float], torch.nn.Module], tmp_path: Path) -> None:
    _, tuned, metrics, at_end = runs
    last = tuned / "checkpoints" / "last.ckpt"
    torch.testing.assert_close(_logits(trident.load(last).net), _logits(at_end), rtol=0, atol=0)
    torch.testing.assert_close(_logits(load_lm_checkpoint(last).net), _logits(at_end), rtol=0, atol=0)  # trident-sample
    # eval.py tests the best checkpoint as the run did at its end.
    assert evaluate([f"ckpt_path={tuned}"])["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-6)
    # Averaging: the adapters' mean, the base's record kept; written outside the run, it refills from init_from.
    checkpoints = sorted((tuned / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) == 2, checkpoints
    averaged = average_checkpoints(checkpoints, tmp_path / "averaged.ckpt")
    assert averaged[FROZEN_BASE_KEY] == read_checkpoint(last, "the test")[FROZEN_BASE_KEY]
    loaded, inputs = trident.load(tmp_path / "averaged.ckpt").net.state_dict(), [
        _net(read_checkpoint(c, "the test")["state_dict"]) for c in checkpoints]
    for name, tensor in loaded.items():
        expected = (sum(i[name].double() for i in inputs) / 2).float() if name in inputs[0] else at_end.state_dict()[name]
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


def test_a_moved_or_changed_base_is_one_line_and_trident_base_points_to_a_moved_one(
        runs: tuple[Path, Path, Any, torch.nn.Module], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint out of its run (as log_model=best uploads it) refills the base from the recorded init_from."""
    base, tuned, _, at_end = runs
    downloaded = tmp_path / "downloaded.ckpt"
    shutil.copy(tuned / "checkpoints" / "last.ckpt", downloaded)
    moved = tmp_path / "moved"
    base.rename(moved)
    try:
        with pytest.raises(DataError, match=rf"holds a finetune=lora run's adapters without the frozen base they adapt, "
                                            rf"init_from={base} \(\d+ tensors\), and {base} is not there: put the base "
                                            rf"back at {base}, or set {BASE_VARIABLE}=<where it is now>"):
            trident.load(downloaded)
        with pytest.raises(SystemExit):  # the public command: one line, no traceback
            export([str(downloaded), "--format", "safetensors", "--out", str(tmp_path / "export")])
        assert capsys.readouterr().err.strip().count("\n") == 0
        monkeypatch.setenv(BASE_VARIABLE, str(moved))
        torch.testing.assert_close(_logits(trident.load(downloaded).net), _logits(at_end), rtol=0, atol=0)
        monkeypatch.delenv(BASE_VARIABLE)
        shutil.copytree(moved, base)  # another base where the run's was: one of its weights changed
        best = next((base / "checkpoints").glob("best-*.ckpt"))
        checkpoint = torch.load(best, weights_only=True)
        checkpoint["state_dict"]["net.embed.weight"][0, 0] += 1
        torch.save(checkpoint, best)
        with pytest.raises(DataError, match=rf"and the weights at {base} changed \(fingerprint \w+, recorded \w+\): "
                                            rf"put the base back at {base}"):
            trident.load(downloaded)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        moved.rename(base)


def test_full_fine_tuning_and_a_run_from_scratch_keep_every_weight(runs: tuple[Path, Path, Any, Any],
                                                                  tmp_path: Path) -> None:
    base = runs[0]
    full = tmp_path / "full"
    train(compose_config([*RUN, f"init_from={base}", "trainer.max_steps=1"], output_dir=full))
    for run in (base, full):
        saved = read_checkpoint(run / "checkpoints" / "last.ckpt", "the test")
        assert FROZEN_BASE_KEY not in saved
        assert set(_net(saved["state_dict"])) == set(trident.load(run).net.state_dict())


def test_sharded_checkpoints_are_refused_under_lora(runs: tuple[Path, Path, Any, Any], tmp_path: Path) -> None:
    cfg = compose_config([*RUN, "trainer=fsdp_cpu", "trainer.strategy.save_distributed_checkpoint=true",
                          "finetune=lora", f"init_from={runs[0]}"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="finetune=lora checkpoints hold only what trains .*: set "
                                          "trainer.strategy.save_distributed_checkpoint=false"):
        train(cfg)
    assert not (tmp_path / "run").exists(), "refused before any work"


def test_a_resume_checks_its_base_against_the_checkpoint(runs: tuple[Path, Path, Any, Any], tmp_path: Path) -> None:
    """A run whose copy of its source is gone resumes from init_from=<where the base is now>, checked by its
    fingerprint: another base is one line, the right one continues."""
    base, tuned, _, _ = runs
    run, changed = tmp_path / "run", tmp_path / "changed"
    shutil.copytree(tuned, run)
    shutil.rmtree(run / "init")
    shutil.copytree(base, changed)
    best = next((changed / "checkpoints").glob("best-*.ckpt"))
    checkpoint = torch.load(best, weights_only=True)
    checkpoint["state_dict"]["net.decoder.final_norm.weight"] += 1
    torch.save(checkpoint, best)
    resume = [*RUN, *LORA, f"resume={run}", "trainer.max_steps=5", "test=false"]
    with pytest.raises(DataError, match=rf"resume: .* init_from={base} \(\d+ tensors\), and the weights at {changed} "
                                        r"changed \(fingerprint \w+, recorded \w+\): resume with init_from=<the base"):
        train(compose_config([*resume, f"init_from={changed}"], output_dir=run))
    train(compose_config([*resume, f"init_from={base}"], output_dir=run))
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5


def test_a_lora_run_from_a_llama_directory_refills_its_base_from_that_directory(tmp_path: Path) -> None:
    """The base of a run from a Hugging Face directory (a tiny random Llama saved by transformers): a checkpoint away
    from its run reads the directory again, through the same adapter, with the run's logits."""
    from .test_convert_llama_family import CORPUS, bpe_tokenizer, hf_model

    tokenizer = bpe_tokenizer()
    hf_dir, corpus, run = tmp_path / "llama", tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text(CORPUS)
    hf_model("llama", hf_dir, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    train(compose_config(["logger=none", "test=false", "trainer.max_steps=2", "trainer.val_check_interval=2",
                          "trainer.limit_val_batches=1", "data.block_size=32", "data.batch_size=4", "print_config=false",
                          "task.sampling.max_new_tokens=2", "finetune=lora", "optimizer.lr=0.01", f"init_from={hf_dir}",
                          "data=text_files", f"data.files=[{corpus}]"], output_dir=run))
    last = run / "checkpoints" / "last.ckpt"
    saved = read_checkpoint(last, "the test")
    assert saved[FROZEN_BASE_KEY]["source"] == str(hf_dir)
    assert all(".lora_" in name for name in saved["state_dict"]), sorted(saved["state_dict"])
    away = tmp_path / "away.ckpt"
    shutil.copy(last, away)
    torch.testing.assert_close(_logits(trident.load(away).net), _logits(trident.load(last).net), rtol=0, atol=0)


def test_a_lora_vit_from_a_timm_file_that_records_no_heads_refills_its_base_from_that_file(tmp_path: Path) -> None:
    """A timm file 96 wide with 3 heads records no head count (the run states it: model.n_heads=3): a checkpoint away
    from its run's copy reads the file again with the heads of the network it fills, not 64-channel ones."""
    from .test_init_from import FROZEN, VIT, _image_folder, _image_run, _timm_file

    _timm_file(tmp_path / "vit.safetensors", width=96, heads=3)
    run = tmp_path / "run"
    train(compose_config([*(o for o in VIT if o != "model=nano"), *FROZEN, "finetune=lora",
                          *_image_run(_image_folder(tmp_path / "images", 3, 10)),
                          f"init_from={tmp_path / 'vit.safetensors'}", "model.n_heads=3"], output_dir=run))
    images = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trident.load(run).net(images)
        shutil.rmtree(run / "init")
        torch.testing.assert_close(trident.load(run).net(images), expected, rtol=0, atol=0)
