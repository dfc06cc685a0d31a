"""Export a trained trident model: ``trident-export CKPT --format hf|safetensors|onnx|peft|gguf --out DIR``.

``CKPT`` is a checkpoint or a run directory (its best, else last checkpoint; ``trident.load``).

- ``hf``: a Hugging Face directory (GPT-2 for task=lm, BERT for task=mlm, ViT for task=vit; task=electra's
  discriminator as ElectraForPreTraining, its generator beside it in ``generator/`` as ElectraForMaskedLM) that
  ``AutoModelFor...from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` read; a setting
  with no Hugging Face equivalent (rope, pre-norm BERT, swiglu, ...) is refused, naming it. A
  ``finetune=lora`` run's adapters are merged into the weights. The network is read without its task
  (``trident.weights.network.load_network``) and the directory written without transformers
  (``trident.weights.adapters.hf_writing``, the files transformers' ``save_pretrained`` writes): the export imports
  neither Lightning nor transformers.
- ``safetensors``: ``model.safetensors`` (the ``net``, tied weights stored once) and ``config.json``
  (the task and its hyperparameters, which rebuild it), plus ``tokenizer.json``.
- ``onnx``: ``model.onnx`` (``torch.onnx.export(dynamo=True)``) of every task, on the inputs its
  ``example_input`` names (``input_ids``; classify also ``padding_mask``; translation ``source_ids`` and
  ``target_ids``; vit ``pixel_values``), batch and text lengths dynamic.
- ``peft``: a ``finetune=lora`` run's adapters alone as a peft LoRA directory (``adapter_config.json``,
  ``adapter_model.safetensors``) for the hf export of its base (``adapters.peft_export``).
- ``gguf``: ``model.gguf``, the file llama.cpp, Ollama and LM Studio run (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2
  and 3, with the run's byte-level BPE tokenizer and chat template), in ``--gguf-type`` f16 (the default), bf16, f32
  or q8_0 (``adapters.gguf_export``; the ``[gguf]`` extra).

The output is written into a temporary directory beside ``--out`` and renamed at the end; an
existing non-empty ``--out`` is refused, so earlier outputs are never damaged. Its files and
directories get the permissions of any file the user writes (0644 / 0755 under umask 022).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.errors import ConfigError, choose, run_with_clear_errors
from trident.extras import require_package

if TYPE_CHECKING:
    from trident.tasks.base import TridentTask
    from trident.weights.network import TrainedNetwork

# Each format imports what it writes with once the arguments are parsed: ``--help`` and a refused argument
# answer without torch (docs/commands.md, start-up).


def export_hf(subject: TrainedNetwork | TridentTask, directory: Path) -> None:
    """The Hugging Face directory of a network read without its task, or of a task's ``net``."""
    from trident.weights.adapters.hf_export import write_hf
    from trident.weights.network import TrainedNetwork, network_of

    network = subject if isinstance(subject, TrainedNetwork) else network_of(subject)
    network.merge_converters()  # a finetune=lora run: its adapters folded into the weights Hugging Face reads
    write_hf(network.net, network.tokenizer, network.settings.get("class_names"), directory, network.tokenizer_settings)
    for name, other in network.others.items():  # task=electra's generator: <out>/generator
        write_hf(other, network.tokenizer, None, directory / name, network.tokenizer_settings)


# --gguf-type: how the gguf export stores the matrices (norms, biases and position tables stay float32); the first is
# the default. Each is llama.cpp's GGMLQuantizationType of the same name.
GGUF_TYPES = {"f16": "half precision (the default, as llama.cpp's converter's)", "bf16": "bfloat16",
              "f32": "single precision, exact", "q8_0": "8-bit blocks of 32 weights with one f16 scale each"}
DEFAULT_GGUF_TYPE = next(iter(GGUF_TYPES))


def export_gguf(subject: TrainedNetwork | TridentTask, directory: Path, gguf_type: str = DEFAULT_GGUF_TYPE) -> None:
    """``model.gguf`` of a network read without its task, or of a task's ``net``; a finetune=lora run merged."""
    require_package("gguf")
    from trident.weights.adapters.gguf_export import write_gguf
    from trident.weights.network import TrainedNetwork, network_of

    network = subject if isinstance(subject, TrainedNetwork) else network_of(subject)
    network.merge_converters()
    write_gguf(network.net, network.tokenizer, network.tokenizer_settings, directory, gguf_type)


def export_safetensors(task: TridentTask, directory: Path) -> None:
    from safetensors.torch import save_model

    # save_model keeps one name of each group of shared tensors (the tied head); load_model ties them again.
    save_model(task.net, str(directory / "model.safetensors"))
    config = {
        "task": task.NAME,
        "task_class": f"{type(task).__module__}.{type(task).__qualname__}",
        "hyper_parameters": dict(task.hparams),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if task.tokenizer is not None:
        task.tokenizer.save(str(directory / "tokenizer.json"))


def export_onnx(task: TridentTask, directory: Path) -> None:
    require_package("onnxscript")
    import torch

    inputs = task.example_input()  # the task's network inputs, with which of their axes are free
    torch.onnx.export(task.net, (), str(directory / "model.onnx"), kwargs={i.parameter: i.example for i in inputs},
                      dynamo=True, dynamic_shapes={i.parameter: i.dynamic for i in inputs},
                      input_names=[i.onnx_name for i in inputs], output_names=["logits"], optimize=True,
                      external_data=False)


def export_peft(task: TridentTask, directory: Path) -> None:
    from trident.weights.adapters.peft_export import write_peft

    write_peft(task, directory)


# The formats that write the network alone, read without its task (trident.weights.network: no Lightning to import),
# and those that write what the task knows of it (its name and settings, its example inputs, its converters' files).
NETWORK_FORMATS: dict[str, Callable[[TrainedNetwork | TridentTask, Path], None]] = {"hf": export_hf, "gguf": export_gguf}
TASK_FORMATS: dict[str, Callable[[TridentTask, Path], None]] = {
    "safetensors": export_safetensors,
    "onnx": export_onnx,
    "peft": export_peft,
}
FORMATS: dict[str, Callable[[Any, Path], None]] = NETWORK_FORMATS | TASK_FORMATS


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory: choose a new directory (nothing was written)")


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def give_user_permissions(directory: Path) -> None:
    """The modes ``open`` and ``mkdir`` give under the user's umask, for ``directory`` and all it holds:
    ``mkdtemp`` creates 0700 and safetensors writes 0600, private whatever the umask."""
    mask = current_umask()
    for path in [directory, *directory.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def export(checkpoint: Path, fmt: str, out: Path, gguf_type: str | None = None) -> None:
    """Write ``checkpoint``'s model in format ``fmt`` to the directory ``out`` (atomically); ``gguf_type``: the
    gguf format's storage of the matrices (None: the default)."""
    writer = choose(FORMATS, fmt, "--format")
    if gguf_type is not None and fmt != "gguf":
        raise ConfigError(f"--gguf-type={gguf_type} applies to --format gguf only: leave it out, or export as gguf")
    if fmt == "gguf":
        chosen = gguf_type or DEFAULT_GGUF_TYPE
        choose(GGUF_TYPES, chosen, "--gguf-type")
        writer = partial(export_gguf, gguf_type=chosen)
    check_out(out)
    import torch

    if fmt in NETWORK_FORMATS:
        from trident.weights.network import load_network

        subject: TrainedNetwork | TridentTask = load_network(checkpoint)
    else:
        from trident.weights.load import load

        subject = load(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with torch.no_grad():
            writer(subject, scratch)
        give_user_permissions(scratch)
        check_out(out)  # still free after the (possibly long) export
        if out.exists():
            out.rmdir()
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a trident checkpoint (.ckpt) or train.py run directory")
    parser.add_argument("--format", required=True, help=f"one of {', '.join(FORMATS)}")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (new or empty)")
    parser.add_argument("--gguf-type",
                        help="--format gguf: " + "; ".join(f"{name}: {what}" for name, what in GGUF_TYPES.items()))
    args = parser.parse_args(argv)

    def run() -> None:
        export(args.checkpoint, args.format, args.out, args.gguf_type)
        print(f"exported {args.checkpoint} as {args.format} -> {args.out}")

    run_with_clear_errors(run)


if __name__ == "__main__":
    main()
