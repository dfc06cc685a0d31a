"""The chat template of an ``init_from`` source has one home, the run's record of its source (``<run>/init``, written
once; docs/weights.md, docs/data.md): the data renders with it (staged under the data cache, named by its content, by
the data module's ``stage_source``), the checkpoint and the export carry what the run rendered with, and trident-chat
reads it from the record, writing nothing (issue 51, item 5)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from tests.chat_templates import CHATML
from trident.commands.chat import run_template
from trident.data.chat import ChatDataModule
from trident.weights.init_from import stage_run_source

SETTINGS = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<s>"}


def run_from_a_source(root: Path, settings: dict[str, str] = SETTINGS) -> tuple[Path, Path]:
    """A run directory as train.py leaves one after ``data=chat init_from=<a Hugging Face directory>`` (its record of
    the source, its config naming the staged template), whose data cache is gone; its checkpoint and the template
    directory its config names."""
    run, cache = root / "run", root / "cache"
    (run / "init").mkdir(parents=True)
    (run / "init" / "source.json").write_text(json.dumps({
        "source": str(root / "hf"), "format": "hf-llama", "task": "lm", "model": {}, "pos_encoding": "rope",
        "task_options": {}, "data_options": {}, "tokenizer_settings": settings}))
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    staged = cache / "templates" / digest  # the name a run of this version and of the versions before gives it
    data = {"_target_": f"{ChatDataModule.__module__}.{ChatDataModule.__qualname__}", "name": "chat",
            "template": str(staged), "tokenizer": "char", "cache_dir": str(cache)}
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml({"data": data}))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")  # trident-chat's template needs its run, not its weights
    return run / "checkpoints" / "last.ckpt", staged


def test_trident_chat_reads_the_sources_template_from_the_runs_record_and_writes_nothing(tmp_path: Path) -> None:
    checkpoint, staged = run_from_a_source(tmp_path)
    template = run_template(checkpoint, None)
    assert (template.text, template.special_tokens) == (CHATML, {"eos_token": "<|im_end|>", "bos_token": "<s>"})
    assert template.source == str(staged)  # error lines name what data.template named, as before
    assert not (tmp_path / "cache").exists(), "trident-chat wrote a copy of the template into the data cache"


def test_eval_stages_the_sources_template_again_where_the_data_reads_it(tmp_path: Path) -> None:
    """eval.py rebuilds the data, which reads data.template: the data module stages it from the record, as read."""
    checkpoint, staged = run_from_a_source(tmp_path)
    data = OmegaConf.load(checkpoint.parents[1] / "config_resolved.yaml").data
    stage_run_source(checkpoint.parents[1], data)
    assert json.loads((staged / "tokenizer_config.json").read_text()) == SETTINGS
    assert run_template(checkpoint, None).text == CHATML


def test_a_run_whose_template_is_its_own_reads_it_from_its_data_settings(tmp_path: Path) -> None:
    """``data.template`` that names another template than the source's (a .jinja file) is the one trident-chat uses."""
    checkpoint, _ = run_from_a_source(tmp_path)
    mine = tmp_path / "mine.jinja"
    mine.write_text(CHATML.replace("<|im_start|>", "<|im_start|> "))
    config = checkpoint.parents[1] / "config_resolved.yaml"
    saved = OmegaConf.load(config)
    saved.data.template = str(mine)
    config.write_text(OmegaConf.to_yaml(saved))
    assert run_template(checkpoint, None).text == mine.read_text()
