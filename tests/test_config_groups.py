"""Every option of every config group composes, resolves and passes the config check."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trident.errors import ConfigError
from trident.runs.command_line import group_options
from trident.runs.pipeline import backbone_options, check_config
from trident.tasks.registry import TASKS

from .conftest import CONF_DIR, compose_config

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
# Options that need a value only the user can give.
REQUIRED = {"data/text_files": ["data.files=[corpus.txt]"], "data/imagefolder": ["data.data_dir=images"],
            # The pre-trained run (text: and its tokenizer file, which composing cannot check here).
            "experiment/pretrain_pays_vision": ["pretrained_run=run"],
            "experiment/pretrain_pays_text": ["pretrained_run=run", "data.tokenizer=char"],
            "experiment/ablation_lora_rank": ["pretrained_run=run"],
            # The teacher's run (text: and its tokenizer file).
            "experiment/distill_pays_vision": ["teacher_run=run"],
            "experiment/distill_pays_text": ["teacher_run=run", "data.tokenizer=char"],
            # LoRA adapts a trained model (checked here by name only; test_lora.py trains from one).
            "finetune/lora": ["init_from=run"], "finetune/qlora": ["init_from=run"],
            # Distillation needs its teacher (checked here by name only; tests/test_distill.py reads them).
            "distill/kd": ["distill.teacher=run"],
            # Preference pairs and the objective that trains on them go together, from trained weights.
            "data/preference": ["objective=dpo", "init_from=run"],
            "objective/dpo": ["data=preference", "init_from=run"],
            "objective/orpo": ["data=preference"], "objective/kto": ["data=preference", "init_from=run"]}


def all_options() -> list[tuple[str, str]]:
    return [(group, option) for group in GROUPS for option in group_options(group, CONF_DIR / group)]


def test_every_group_has_options() -> None:
    assert {"task", "model", "pos_encoding", "precision", "data", "trainer", "logger", "callbacks"} <= set(GROUPS)
    assert {"optimizer", "scheduler", "debug", "experiment"} <= set(GROUPS)


# Data options belong to one task: compose them with it.
TASK_OF_DATA = {"LMDataModule": "lm", "TranslationDataModule": "translation", "ImageDataModule": "vit",
                "TextClassificationDataModule": "classify", "ChatDataModule": "lm",
                "PreferenceDataModule": "lm", "ImageTextDataModule": "clip"}


@pytest.mark.parametrize(("group", "option"), all_options(), ids=lambda v: str(v))
def test_option_composes(group: str, option: str, tmp_path: Path) -> None:
    overrides = [f"{group}={option}", *REQUIRED.get(f"{group}/{option}", [])]
    cfg = compose_config(overrides, output_dir=tmp_path)
    if group == "data":
        task = TASK_OF_DATA[cfg.data._target_.rsplit(".", 1)[-1]]
        cfg = compose_config([f"task={task}", *overrides], output_dir=tmp_path)
        if cfg.data._target_.endswith(".LMDataModule"):  # the masked LM reads the same data options (not data=chat's)
            check_config(compose_config(["task=mlm", *overrides], output_dir=tmp_path))
    if group == "augment":  # image augmentation: settings of the ViT task and its data
        cfg = compose_config(["task=vit", *overrides], output_dir=tmp_path)
    if group == "objective":  # a loss on a task's outputs: composed with a task that trains with it
        task = next(name for name, task_class in TASKS.items() if option in task_class.TRAINS_WITH)
        cfg = compose_config([f"task={task}", *overrides], output_dir=tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    if group == "model":
        assert cfg.model.name == option
    if group == "pos_encoding":
        assert backbone_options(cfg)["pos_encoding"] == option
    if group == "precision":
        assert cfg.trainer.precision == {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}[option]
    check_config(cfg)


def test_sizes_extend_one_architecture_file() -> None:
    shared = OmegaConf.load(CONF_DIR / "model" / "_architecture.yaml")
    assert "_architecture" not in group_options("model", CONF_DIR / "model"), "a shared part, not a size"
    for option in group_options("model", CONF_DIR / "model"):
        size = OmegaConf.load(CONF_DIR / "model" / f"{option}.yaml")
        assert list(size.defaults) == ["_architecture"], f"model/{option}.yaml extends _architecture.yaml"
        composed = compose_config([f"model={option}"]).model
        assert composed.keys() == shared.keys() | size.keys() - {"defaults"}
        assert all(composed[key] == size.get(key, shared.get(key)) for key in composed)


def test_paper_sizes_are_defined_once() -> None:
    base = OmegaConf.load(CONF_DIR / "model" / "base.yaml")
    assert (base.d_model, base.n_layers, base.n_heads, base.d_ff) == (768, 12, 12, 3072)
    paper = OmegaConf.load(CONF_DIR / "model" / "transformer_base.yaml")
    assert (paper.d_model, paper.n_layers, paper.n_heads, paper.d_ff, paper.dropout) == (512, 6, 8, 2048, 0.1)
    assert paper.norm_first is False and paper.activation == "relu"
    big = OmegaConf.load(CONF_DIR / "model" / "transformer_big.yaml")
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)


def test_task_selects_its_defaults_and_command_line_wins(tmp_path: Path) -> None:
    cfg = compose_config([], output_dir=tmp_path)
    assert (cfg.task.name, cfg.data.name, cfg.pos_encoding.name) == ("lm", "shakespeare", "rope")
    cfg = compose_config(["pos_encoding=alibi", "data=bible_kjv"], output_dir=tmp_path)
    assert (cfg.pos_encoding.name, cfg.data.name, cfg.data.source) == ("alibi", "bible_kjv", "bible")


def test_data_of_another_task_is_refused(tmp_path: Path) -> None:
    cfg = compose_config(["data=mnist"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="data=mnist .ImageDataModule. is not data for task=lm, which needs LMDataModule"):
        check_config(cfg)
