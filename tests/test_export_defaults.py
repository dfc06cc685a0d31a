"""Every task's default network (``python train.py task=<t>``'s positions, attention, norms, activations, at a
tiny width) exports to ONNX (``trident-export --format onnx``'s writer), and onnxruntime computes its outputs as
the network does, on another batch size and length than the export traced with. Driven by the task registry: a
new task fails here until its data inputs are listed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from trident.commands.export import export_onnx
from trident.runs.pipeline import check_config, constructor_args
from trident.tasks.base import TridentTask
from trident.tasks.registry import TASKS

from .conftest import compose_config

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 40
# The data module's inputs to each task (``task_inputs()``), small.
DATA_INPUTS: dict[str, dict[str, Any]] = {
    "lm": {"vocab_size": VOCAB},
    "mlm": {"vocab_size": VOCAB, "mask_id": 4, "pad_id": 0, "num_regular_tokens": VOCAB - 5},
    "electra": {"vocab_size": VOCAB, "mask_id": 4, "pad_id": 0, "num_regular_tokens": VOCAB - 5},
    "translation": {"vocab_size": VOCAB, "pad_id": 0, "bos_id": 1, "eos_id": 2},
    "classify": {"vocab_size": VOCAB, "class_names": ["a", "b", "c"], "majority_accuracy": {"validation": 0.5, "test": 0.5}},
    "vit": {"num_classes": 3, "image_size": 28, "in_channels": 1, "patch_size": 7, "class_names": ["a", "b", "c"],
            "mean": [0.5], "std": [0.5]},
    "clip": {"vocab_size": VOCAB, "eos_id": VOCAB - 1, "image_size": 28, "in_channels": 1, "patch_size": 7,
             "mean": [0.5], "std": [0.5]},
}
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32"]


def default_task(name: str, tmp_path: Path) -> TridentTask:
    """``task=<name>``'s network as train.py builds it (its defaults kept), at a tiny width, untrained."""
    cfg = compose_config([f"task={name}", *TINY, "logger=none"], output_dir=tmp_path / "run")
    backbone = check_config(cfg)
    torch.manual_seed(0)
    task = instantiate(constructor_args(cfg, "task"), backbone=vars(backbone), optimizer={"name": "adamw", "lr": 1e-3},
                       scheduler={"name": "constant"}, **DATA_INPUTS[name], _convert_="all", _recursive_=False)
    return task.eval()


def inputs_unlike_the_example(task: TridentTask) -> dict[str, torch.Tensor]:
    """``net.forward``'s inputs by parameter, of another batch size (3) and other lengths (7 and 5) than the
    export's example (2, 8 and 6), one row padded where the task pads."""
    sizes = {"batch": 3, "length": 7, "target_length": 5}
    inputs = {}
    for spec in task.example_input():
        shape = [sizes[spec.dynamic[axis].__name__] if axis in spec.dynamic else size
                 for axis, size in enumerate(spec.example.shape)]
        if spec.example.is_floating_point():  # images
            inputs[spec.parameter] = torch.randn(shape)
        elif spec.example.dtype == torch.bool:  # a padding mask: True at padding
            inputs[spec.parameter] = torch.zeros(shape, dtype=torch.bool)
            inputs[spec.parameter][1, 4:] = True
        else:
            inputs[spec.parameter] = torch.randint(3, VOCAB, shape)
    if "src" in inputs:
        inputs["src"][1, 4:] = DATA_INPUTS["translation"]["pad_id"]
    return inputs


def test_every_task_has_its_data_inputs_listed() -> None:
    assert sorted(DATA_INPUTS) == sorted(TASKS)


@pytest.mark.slow  # an ONNX export takes seconds (5 to 15 s each on 2 busy cores), as test_export.py's
@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_default_network_of_every_task_exports_to_onnx_with_the_same_outputs(name: str, tmp_path: Path) -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    task = default_task(name, tmp_path)
    with torch.no_grad():
        export_onnx(task, tmp_path)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    inputs = inputs_unlike_the_example(task)
    names = [spec.onnx_name for spec in task.example_input()]
    assert [i.name for i in session.get_inputs()] == names
    (outputs,) = session.run(None, {key: value.numpy() for key, value in zip(names, inputs.values(), strict=True)})
    with torch.no_grad():
        expected = task.net(**inputs)
    torch.testing.assert_close(torch.from_numpy(outputs), expected, atol=1e-4, rtol=1e-4)
