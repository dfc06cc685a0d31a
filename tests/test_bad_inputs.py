"""Bad input, table-driven: each case exits non-zero with ONE clear line naming the problem and
the fix, prints no traceback, and leaves earlier outputs untouched.

Most cases run ``train.py`` / ``eval.py`` / ``python -m trident.commands.sample`` in this process
(``tests/entry_points.py``); ``test_in_process_matches_the_command_line`` checks that a real
subprocess gives the same result.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from trident.runs.compose import compose_train_config
from trident.runs.jobs import discard_failed_run_dir
from trident.runs.pipeline import train

from .conftest import ROOT, SMALL
from .entry_points import run_in_process, run_subprocess
from .sharding_helpers import save_sharded_copy

# A small corpus for the earlier run and the vocabulary cases (fast to prepare).
CORPUS = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200))
OTHER_CORPUS = "".join(f"{i} ZYXW VUTS RQPO NMLK {i * 7}\n" for i in range(400))
PREVIOUS_RUN = "runs/2000-01-01/00-00-00_previous"


def snapshot(outputs: Path) -> dict[str, str]:
    """Every file under ``outputs`` with its hash, and every run directory (``runs/<date>/<run>``)."""
    files = {str(p.relative_to(outputs)): hashlib.sha256(p.read_bytes()).hexdigest() for p in outputs.rglob("*") if p.is_file()}
    runs = {str(p.relative_to(outputs)): "run dir" for p in outputs.glob("runs/*/*")}
    return files | runs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding corpora, a corrupt checkpoint, and ``outputs/`` with an earlier run
    (trained on the small corpus: resolved config, tokenizer, checkpoints)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "corpus.txt").write_text(CORPUS)
    (root / "other.txt").write_text(OTHER_CORPUS)
    (root / "empty.txt").write_text("")
    (root / "corrupt.ckpt").write_bytes(b"not a checkpoint" * 64)
    previous = root / "outputs" / PREVIOUS_RUN
    train(compose_train_config(
        [*SMALL, "data=text_files", f"data.files=[{root / 'corpus.txt'}]", "data.tokenizer=char",
         "logger=none", "test=false", "trainer.max_steps=2"],
        output_dir=previous,
    ))
    # An earlier run directory whose checkpoint was damaged (e.g. a copy cut short).
    damaged = root / "outputs" / "runs/2000-01-01/00-00-01_damaged"
    (damaged / "checkpoints").mkdir(parents=True)
    shutil.copy(previous / "config_resolved.yaml", damaged)
    last = (previous / "checkpoints" / "last.ckpt").read_bytes()
    (damaged / "checkpoints" / "last.ckpt").write_bytes(last[: len(last) // 2])
    write_classify_files(root)
    readme_error_files(root)
    hf_family_files(root)
    chat_files(root)
    lora_adapter_files(root)
    sharded_checkpoint_files(root)
    return root


def write_classify_files(root: Path) -> None:
    """``classify/``: labelled CSV files for task=classify, files with a bad row or encoding, and
    ``learned/``, a one-step LM run with a 32-row learned position table to start from (init_from)."""
    folder = root / "classify"
    folder.mkdir()
    rows = [{"text": f"passage {i} of the {kind} kind", "label": kind} for i in range(24) for kind in ("comic", "tragic")]

    def write_csv(name: str, table: list[dict[str, object]], encoding: str = "utf-8") -> None:
        with (folder / name).open("w", newline="", encoding=encoding) as handle:
            writer = csv.DictWriter(handle, ["text", "label"])
            writer.writeheader()
            writer.writerows(table)

    def write_jsonl(name: str, table: list[dict[str, object]], encoding: str = "utf-8") -> None:
        (folder / name).write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in table).encode(encoding))

    for name in ("train", "validation", "test"):
        write_csv(f"{name}.csv", rows)
    write_csv("empty_label.csv", [*rows[:5], {"text": "a passage with no label", "label": ""}, *rows[5:]])
    write_jsonl("null_label.jsonl", [*rows[:7], {"text": "a passage with a null label", "label": None}, *rows[7:]])
    write_jsonl("missing_label.jsonl", [*rows[:3], {"text": "a passage without the key"}, *rows[3:]])
    accented = [*rows[:9], {"text": "a café passage", "label": "comic"}, *rows[9:]]
    write_csv("latin1.csv", accented, encoding="latin-1")
    write_jsonl("latin1.jsonl", accented, encoding="latin-1")
    train(compose_train_config(
        [*SMALL, "pos_encoding=learned", "data=text_files", f"data.files=[{root / 'corpus.txt'}]", "data.tokenizer=char",
         "logger=none", "test=false", "trainer.max_steps=1"],
        output_dir=root / "learned",
    ))


def readme_error_files(root: Path) -> None:
    """The bad files and sources of the README's error list (issue 38): data files, outside model
    directories, a pickled checkpoint, a few images."""
    (root / "docs.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": three}\n')
    (root / "body.jsonl").write_text("".join(f'{{"body": "line {i}", "id": {i}}}\n' for i in range(20)))
    (root / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (root / "reordered.txt").write_text("".join(reversed(CORPUS.splitlines(keepends=True))))
    (root / "latin1.txt").write_bytes(("Caf\xe9 cr\xe8me, d\xe9j\xe0 vu.\n" * 200).encode("latin-1"))
    lines = [f"line {i} of a verse" for i in range(30)]
    (root / "train.en").write_text("\n".join(lines) + "\n")
    (root / "train.de").write_text("\n".join(lines[:29]) + "\n")
    (root / "pairs.en").write_text("\n".join(lines) + "\n")
    (root / "pairs.de").write_text("\n".join(lines) + "\n")
    (root / "no_model").mkdir()
    for name, config in (("t5_dir", {"model_type": "t5", "num_layers": 2, "num_decoder_layers": 3}),
                         ("phi3_dir", {"model_type": "phi3"}),
                         ("gpt2_without_weights", {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    save_file({"shared.weight": torch.zeros(2, 2)}, str(root / "t5_dir" / "model.safetensors"))
    (root / "gpt2_other_names").mkdir()
    shutil.copy(root / "gpt2_without_weights" / "config.json", root / "gpt2_other_names")
    save_file({"encoder.layer.0.weight": torch.zeros(2, 2)}, str(root / "gpt2_other_names" / "model.safetensors"))
    import timm  # a grey-image ViT: 7x7 patches of 1 channel

    one_channel = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, in_chans=1,
                                    embed_dim=64, depth=1, num_heads=1, num_classes=2)
    torch.save(one_channel.state_dict(), root / "vit_one_channel.pth")
    torch.save(argparse.Namespace(step=1), root / "pickled.ckpt")  # a pickled object, not tensors and plain values
    for label in ("a", "b"):
        (root / "few_images" / label).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (28, 28), color=40 * i).save(root / "few_images" / label / f"{i}.png")


LAST = f"outputs/{PREVIOUS_RUN}/checkpoints/last.ckpt"
DAMAGED = "outputs/runs/2000-01-01/00-00-01_damaged/checkpoints/last.ckpt"
TEXT = ["data=text_files", "data.files=[corpus.txt]", "data.tokenizer=char"]
# Issue 43: a short run on TEXT (two steps).
SHORT = [*TEXT, "trainer.max_steps=2"]
# Issue 42: the earlier run's last checkpoint, sharded (files: sharded_checkpoint_files).
SHARDED = "sharded/{}/checkpoints/last.ckpt"
# finetune=lora on the earlier run (nano: d_model 64), its tokenizer.
LORA_TUNE = ["data=text_files", "data.files=[corpus.txt]", "finetune=lora", f"init_from=outputs/{PREVIOUS_RUN}"]
QLORA_TUNE = [*LORA_TUNE[:2], "finetune=qlora", *LORA_TUNE[3:]]


def hf_family_files(root: Path) -> None:
    """Tiny Llama and Gemma 2 directories (random weights) whose config states what trident lacks."""
    transformers = pytest.importorskip("transformers")
    sizes = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
             "max_position_embeddings": 64}
    for name, config in (
        ("llama_gelu", transformers.LlamaConfig(**sizes, hidden_act="gelu")),
        ("llama_longrope", transformers.LlamaConfig(**sizes, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
            "original_max_position_embeddings": 32})),
        # (A Qwen2 window in some layers only was the example until trident read it, issue 51.)
        ("gemma2_bidirectional", transformers.Gemma2Config(**sizes, head_dim=8, num_key_value_heads=1,
                                                           use_bidirectional_attention=True)),
        ("llama_gqa", transformers.LlamaConfig(**(sizes | {"num_attention_heads": 8}), num_key_value_heads=2, head_dim=8)),
    ):
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)


def chat_files(root: Path) -> None:
    """``chat/``: chat files with a tool role, no rows, a row without messages, a null answer, an image part; a
    tokenizer directory without a template."""
    folder = root / "chat"
    (folder / "no_template").mkdir(parents=True)
    (folder / "no_template" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    turns = [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, answer me."}]
    (folder / "roles.jsonl").write_text(json.dumps({"messages": turns}) + "\n" +
                                        json.dumps({"messages": [*turns, {"role": "tool", "content": "{}"}]}) + "\n")
    (folder / "empty.jsonl").write_text("")
    (folder / "no_messages.jsonl").write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"prompt": "Hi"}) + "\n")
    image = [turns[0], {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]
    (folder / "null_answer.jsonl").write_text(json.dumps({"messages": turns}) + "\n" +
                                              json.dumps({"messages": [turns[0], {"role": "assistant", "content": None}]}) + "\n")
    (folder / "image.jsonl").write_text(json.dumps({"messages": image}) + "\n")


def lora_adapter_files(root: Path) -> None:
    """``lora/other_base``: an adapter directory trained on a base that is not the workspace's earlier run."""
    folder = root / "lora" / "other_base"
    folder.mkdir(parents=True)
    settings = {"rank": 8, "alpha": 16, "dropout": 0.05, "targets": ["q", "v"]}
    (folder / "adapter.json").write_text(json.dumps({"base": "/elsewhere/base", "lora": settings}))
    save_file({"decoder.blocks.0.self_attn.qkv_proj.lora_A.q": torch.zeros(8, 64)}, str(folder / "adapter.safetensors"))


def sharded_checkpoint_files(root: Path) -> None:
    """``sharded/run``: the earlier run with its last checkpoint sharded (a directory, as trainer=fsdp writes it with
    save_distributed_checkpoint=true); ``sharded/cut_short``: a copy whose shard file was cut in half;
    ``sharded/no_index``: a copy without DCP's index of its shards."""
    run = root / "sharded" / "run"
    shutil.copytree(root / "outputs" / PREVIOUS_RUN, run)
    for whole in run.glob("checkpoints/*.ckpt"):  # its best and last checkpoint files
        whole.unlink()
    last = run / "checkpoints" / "last.ckpt"
    save_sharded_copy(root / "outputs" / PREVIOUS_RUN / "checkpoints" / "last.ckpt", last)
    for copy in ("cut_short", "no_index"):
        shutil.copytree(run, root / "sharded" / copy)
    shard = root / "sharded" / "cut_short" / "checkpoints" / "last.ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (root / "sharded" / "no_index" / "checkpoints" / "last.ckpt" / ".metadata").unlink()


def classify_files(train: str, validation: str = "validation.csv", test: str = "test.csv") -> list[str]:
    """task=classify on files of the workspace's ``classify/`` folder."""
    return ["task=classify", "data.source=files",
            f"data.files={{train: classify/{train}, validation: classify/{validation}, test: classify/{test}}}"]


# (case id, entry point, arguments, words the error line must contain)
CASES: list[tuple[str, str, list[str], list[str]]] = [
    # Wrong types and impossible sizes
    ("layers-not-a-number", "train.py", ["model.n_layers=abc"], ["model.n_layers", "positive integer", "'abc'"]),
    ("layers-fraction", "train.py", ["model.n_layers=2.5"], ["model.n_layers", "positive integer"]),
    ("width-zero", "train.py", ["model.d_model=0"], ["model.d_model", "positive integer"]),
    ("heads-negative", "train.py", ["model.n_heads=-4"], ["model.n_heads", "positive integer"]),
    ("context-zero", "train.py", ["data.max_seq_len=0"], ["max_seq_len", "positive integer"]),
    ("heads-not-dividing-width", "train.py", ["model=nano", "model.n_heads=5"], ["d_model=64 is not divisible by model.n_heads=5", "divisors"]),
    ("dropout-above-one", "train.py", ["model.dropout=1.5"], ["model.dropout", "[0, 1)"]),
    ("unknown-activation", "train.py", ["model.activation=swish"], ["model.activation='swish'", "gelu"]),
    ("unknown-norm", "train.py", ["model.norm=batchnorm"], ["model.norm='batchnorm'", "rmsnorm"]),
    ("block-longer-than-table", "train.py", ["pos_encoding=learned", "data.block_size=64", "data.max_seq_len=32"], ["block_size=64 is longer than data.max_seq_len=32", "raise data.max_seq_len"]),
    ("batch-size-zero", "train.py", ["data.batch_size=0"], ["data.batch_size", "positive"]),
    # Typos and unknown options
    ("typo-in-key", "train.py", ["model.d_modle=64"], ["model.d_modle", "model.d_model"]),
    ("unknown-model-setting", "train.py", ["+model.d_modle=64"], ["d_modle", "model.d_model"]),
    ("unknown-data-setting", "train.py", ["+data.batchsize=8"], ["data.batchsize", "data.batch_size"]),
    ("unknown-task-setting", "train.py", ["+task.tie_embedding=false"], ["task.tie_embedding", "task.tie_embeddings"]),
    ("unknown-group-option", "train.py", ["pos_encoding=rotary"], ["pos_encoding=rotary does not exist", "rope"]),
    ("unknown-option-in-sweep", "train.py", ["-m", "pos_encoding=rope,rotary"], ["pos_encoding=rotary does not exist"]),
    ("unknown-dataset", "train.py", ["data=imagenet21k"], ["data=imagenet21k does not exist", "shakespeare"]),
    ("bad-precision", "train.py", ["precision=fp64"], ["precision=fp64 does not exist", "bf16"]),
    # Lightning checks the trainer settings when the trainer is built, after the data is prepared.
    ("bad-trainer-precision", "train.py", [*TEXT, "trainer.precision=64-banana"], ["trainer settings are invalid", "64-banana"]),
    ("trainer-negative-steps", "train.py", [*TEXT, "trainer.max_steps=-5"], ["trainer.max_steps", ">= -1", "-5"]),
    # Seed and trainer values that Lightning lets through to a crash, or checks only after the data is prepared
    ("seed-not-a-number", "train.py", ["seed=abc"], ["seed", "integer", "'abc'"]),
    ("seed-negative", "train.py", ["seed=-1"], ["seed", "[0, 2**32)"]),
    ("seed-too-large", "train.py", ["seed=5000000000"], ["seed", "[0, 2**32)"]),
    ("accumulate-zero", "train.py", ["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches", ">= 1"]),
    ("accumulate-fraction", "train.py", ["trainer.accumulate_grad_batches=1.5"], ["trainer.accumulate_grad_batches", "1.5"]),
    ("val-interval-zero", "train.py", ["trainer.val_check_interval=0"], ["trainer.val_check_interval", "(0, 1]"]),
    ("val-interval-above-one-epoch", "train.py", ["trainer.val_check_interval=1.5"], ["trainer.val_check_interval", "1.5"]),
    ("val-every-zero-epochs", "train.py", ["trainer.check_val_every_n_epoch=0"], ["trainer.check_val_every_n_epoch", ">= 1"]),
    ("devices-zero", "train.py", ["trainer.devices=0"], ["trainer.devices", "auto"]),
    ("max-epochs-negative", "train.py", ["trainer.max_epochs=-5"], ["trainer.max_epochs", ">= -1"]),
    ("max-steps-text", "train.py", ["trainer.max_steps=many"], ["trainer.max_steps", "'many'"]),
    ("limit-val-negative", "train.py", ["trainer.limit_val_batches=-1"], ["trainer.limit_val_batches", "[0, 1]"]),
    ("log-every-zero", "train.py", ["trainer.log_every_n_steps=0"], ["trainer.log_every_n_steps", ">= 1"]),
    ("clip-negative", "train.py", ["trainer.gradient_clip_val=-1"], ["trainer.gradient_clip_val", ">= 0"]),
    ("sanity-steps-below-minus-one", "train.py", ["trainer.num_sanity_val_steps=-2"], ["trainer.num_sanity_val_steps", ">= -1"]),
    ("sampling-top-k-negative", "train.py", ["task.sampling.top_k=-5"], ["top_k", ">= 0"]),
    ("sampling-top-k-fraction", "train.py", ["task.sampling.top_k=2.5"], ["top_k", "integer", "2.5"]),
    ("sampling-top-k-not-a-number", "train.py", ["task.sampling.top_k=abc"], ["top_k", "integer", "'abc'"]),
    ("sampling-top-p-not-a-number", "train.py", ["task.sampling.top_p=abc"], ["top_p", "number", "'abc'"]),
    ("sample-top-p-above-one", "trident.commands.sample", [LAST, "--top-p", "1.5"], ["top_p", "[0, 1]"]),
    ("sampling-temperature-negative", "train.py", ["task.sampling.temperature=-0.5"], ["temperature", ">= 0", "-0.5"]),
    ("sample-temperature-negative", "trident.commands.sample", [LAST, "--temperature", "-1"], ["temperature", ">= 0"]),
    ("unknown-scheduler", "train.py", ["scheduler.name=linear"], ["scheduler.name", "cosine"]),
    # Optimisation
    ("negative-learning-rate", "train.py", ["optimizer.lr=-0.001"], ["optimizer.lr", "positive"]),
    ("negative-weight-decay", "train.py", ["optimizer.weight_decay=-0.1"], ["optimizer.weight_decay", ">= 0"]),
    ("negative-warmup", "train.py", ["scheduler.warmup_steps=-10"], ["scheduler.warmup_steps", ">= 0"]),
    # Data that does not fit the task, or is not there
    ("image-data-for-lm", "train.py", ["task=lm", "data=mnist"], ["data=mnist", "task=lm"]),
    ("patch-not-dividing-image", "train.py", ["task=vit", "data.patch_size=5"], ["patch size 5 does not divide image size 28", "data.patch_size"]),
    ("alibi-on-images", "train.py", ["task=vit", "pos_encoding=alibi"], ["pos_encoding=alibi", "learned"]),
    ("unknown-pooling", "train.py", ["task=vit", "task.pool=max"], ["task.pool='max'", "cls"]),
    ("missing-corpus-file", "train.py", ["data=text_files", "data.files=[missing.txt]"], ["missing.txt", "not found", "data.files"]),
    ("empty-corpus", "train.py", ["data=text_files", "data.files=[empty.txt]"], ["empty.txt is empty", "data.files"]),
    ("unknown-tokenizer", "train.py", [*TEXT, "data.tokenizer=word"], ["data.tokenizer", "bpe"]),
    # About 10,900 characters, 90 % for training: 307 blocks of 32, fewer than one batch of 400
    ("train-split-smaller-than-a-batch", "train.py", [*TEXT, "model=nano", "data.block_size=32", "data.batch_size=400"],
     ["no training batch", "307 training examples", "data.batch_size=400", "at most 307"]),
    ("train-batches-limited-to-none", "train.py", [*TEXT, "model=nano", "data.block_size=32", "data.batch_size=200",
                                                   "trainer.limit_train_batches=0.1"], ["no training batch", "limit_train_batches"]),
    # Checkpoints
    ("resume-missing-checkpoint", "train.py", [*TEXT, "ckpt_path=nowhere.ckpt"], ["nowhere.ckpt", "not found", "ckpt_path"]),
    ("resume-corrupt-checkpoint", "train.py", [*TEXT, "ckpt_path=corrupt.ckpt"], ["corrupt.ckpt", "corrupt"]),
    ("resume-other-model-size", "train.py", [*TEXT, "model=nano", "model.d_model=128", f"ckpt_path={LAST}"], ["does not fit", "128"]),
    ("resume-other-vocabulary", "train.py", [*TEXT, "model=nano", "data.files=[other.txt]", f"ckpt_path={LAST}"], ["init_from=", "other"]),
    # The same characters in another order: the tokenizer is the same, the data are not (the run's saved config says so)
    ("resume-other-data-same-tokenizer", "train.py", [*TEXT, "model=nano", "data.files=[reordered.txt]", f"ckpt_path={LAST}"],
     ["was trained on other data (data.files=", "reordered.txt", "start a new run with init_from="]),
    ("eval-other-model-size", "eval.py", [f"ckpt_path={LAST}", "model.d_model=128"], ["does not fit", "128"]),
    ("eval-truncated-checkpoint", "eval.py", [f"ckpt_path={DAMAGED}"], ["corrupt", "last.ckpt"]),
    ("eval-missing-checkpoint", "eval.py", ["ckpt_path=nowhere.ckpt"], ["nowhere.ckpt", "not found"]),
    ("eval-without-checkpoint", "eval.py", ["task.beam_size=1"], ["ckpt_path="]),
    ("sample-corrupt-checkpoint", "trident.commands.sample", ["corrupt.ckpt"], ["corrupt.ckpt", "corrupt"]),
    ("loss-chunk-negative", "train.py", ["task.loss_chunk=-1"], ["task.loss_chunk", ">= 0", "-1", "task.loss_chunk=1024"]),
    ("loss-chunk-not-a-number", "train.py", ["task=translation", "task.loss_chunk=many"], ["task.loss_chunk", "'many'"]),
    # Masked language modelling
    ("mlm-mask-rate-zero", "train.py", ["task=mlm", "task.mask_rate=0"], ["task.mask_rate", "(0, 1)", "0.15"]),
    ("mlm-mask-rate-above-one", "train.py", ["task=mlm", "task.mask_rate=1.2"], ["task.mask_rate", "(0, 1)"]),
    ("mlm-no-room-for-context", "train.py", ["task=mlm", "task.mask_rate=0.8", "data.block_size=2"], ["selects 2 of the 2 tokens", "data.block_size"]),
    ("mlm-fractions-above-one", "train.py", ["task=mlm", "task.random_token_fraction=0.5"], ["exceeds 1", "task.mask_token_fraction"]),
    ("mlm-block-size-not-a-number", "train.py", ["task=mlm", "data.block_size=abc"], ["data.block_size", "integer", "'abc'"]),
    ("mlm-seed-not-a-number", "train.py", ["task=mlm", "task.seed=abc"], ["task.seed", "integer", "'abc'"]),
    ("mlm-num-examples-not-a-number", "train.py", ["task=mlm", "task.num_examples=abc"], ["task.num_examples", "integer", "'abc'"]),
    ("mlm-image-data", "train.py", ["task=mlm", "data=mnist"], ["data=mnist is not text data for task=mlm", "shakespeare"]),
    ("task-target-not-a-task", "train.py", ["task._target_=trident.data.lm.LMDataModule"],
     ["task._target_=trident.data.lm.LMDataModule is not a trident task", "TridentTask"]),
    # init_from reads its source before the config is checked: the task it starts is checked first
    ("init-from-task-target-not-a-task", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", "task._target_=trident.data.lm.LMDataModule"],
     ["task._target_=trident.data.lm.LMDataModule is not a trident task", "TridentTask"]),
    ("mlm-corpus-smaller-than-a-block", "train.py", ["task=mlm", *TEXT, "data.block_size=4000"], ["fewer than one block", "data.block_size"]),
    ("fill-mask-corrupt-checkpoint", "trident.commands.fill_mask", ["corrupt.ckpt", "To be or not to [MASK]"], ["corrupt.ckpt", "corrupt"]),
    ("fill-mask-lm-checkpoint", "trident.commands.fill_mask", [LAST, "To be or not to [MASK]"], ["written by task=lm, which cannot fill in masks", "trident-fill-mask needs a run of task=mlm"]),
    # Issue 38: exports and commands
    ("sample-directory-not-a-run", "trident.commands.sample", ["outputs"], ["'outputs' holds no checkpoint", "train.py run"]),
    ("fill-mask-directory-not-a-run", "trident.commands.fill_mask", ["outputs", "To be or not to [MASK]"], ["'outputs' holds no checkpoint", "train.py run"]),
    ("translate-directory-not-a-run", "trident.commands.translate", ["outputs", "Hello."], ["'outputs' holds no checkpoint", "train.py run"]),
    ("eval-directory-not-a-run", "eval.py", ["ckpt_path=outputs"], ["'outputs' holds no checkpoint", "train.py run"]),
    ("eval-damaged-run-directory", "eval.py", ["ckpt_path=outputs/runs/2000-01-01/00-00-01_damaged"], ["corrupt", "last.ckpt"]),
    ("export-directory-not-a-run", "trident.commands.export", ["outputs", "--format", "hf", "--out", "exported"], ["'outputs' holds no checkpoint", "train.py run"]),
    # Issue 38: classify files
    ("classify-empty-label-csv", "train.py", classify_files("empty_label.csv"),
     ["row 5 of the train split", "classify/empty_label.csv", "no label", "data.label_column=label"]),
    ("classify-null-label-jsonl", "train.py", classify_files("train.csv", validation="null_label.jsonl"),
     ["row 7 of the validation split", "null_label.jsonl", "no label", "data.label_column=label"]),
    ("classify-missing-label-key-jsonl", "train.py", classify_files("train.csv", test="missing_label.jsonl"),
     ["row 3 of the test split", "missing_label.jsonl", "no label", "data.label_column=label"]),
    ("classify-latin1-csv", "train.py", classify_files("latin1.csv"), ["latin1.csv is not UTF-8 text", "convert it to UTF-8"]),
    ("classify-latin1-jsonl", "train.py", classify_files("latin1.jsonl"), ["latin1.jsonl is not UTF-8 text", "convert it to UTF-8"]),
    ("classify-max-length-longer-than-table", "train.py",
     [*classify_files("train.csv"), "pos_encoding=learned", "data.max_length=64", "data.max_seq_len=32"],
     ["data.max_length=64 is longer than data.max_seq_len=32", "raise data.max_seq_len or lower data.max_length"]),
    ("classify-init-from-max-length-longer-than-its-table", "train.py",
     [*classify_files("train.csv"), "init_from=learned", "task.stack=decoder", "task.pool=last", "data.max_length=64"],
     ["data.max_length=64 is longer than data.max_seq_len=32", "init_from=learned fixes", "lower data.max_length to at most 32"]),
    ("init-from-block-longer-than-its-table", "train.py", ["data=text_files", "data.files=[corpus.txt]", "init_from=learned",
                                                          "data.block_size=64"],
     ["data.block_size=64 is longer than data.max_seq_len=32", "init_from=learned fixes", "lower data.block_size to at most 32"]),
    # A rope source fixes no table length: data.max_seq_len stays the user's to raise.
    ("init-from-rope-block-longer-than-context", "train.py", ["data=text_files", "data.files=[corpus.txt]",
                                                             f"init_from=outputs/{PREVIOUS_RUN}", "data.block_size=64", "data.max_seq_len=32"],
     ["data.block_size=64 is longer than data.max_seq_len=32 (the configured context): raise data.max_seq_len or lower"]),
    # The context and the sequence length are data settings (model.max_seq_len is not a key).
    ("classify-max-length-not-a-number", "train.py", ["task=classify", "data.max_length=abc"],
     ["data.max_length must be a positive integer, got 'abc'", "set e.g. data.max_length="]),
    ("lm-block-size-not-a-number", "train.py", ["data.block_size=abc"],
     ["data.block_size must be a positive integer, got 'abc'", "set e.g. data.block_size="]),
    ("context-negative", "train.py", ["data.max_seq_len=-3"], ["data.max_seq_len must be a positive integer", "set e.g. data.max_seq_len="]),
    # Issue 38: README error list (each refusal the README states that no case above runs; files: readme_error_files)
    # Errors (and the README's examples: test_every_documented_error_example_is_a_case)
    ("readme-top-k-example", "train.py", ["task.sampling.top_k=-1"], ["top_k must be an integer >= 0"]),
    ("readme-heads-example", "train.py", ["model.n_heads=5"], ["model.d_model=128 is not divisible by model.n_heads=5: choose n_heads among the divisors of d_model (e.g. 1, 2, 4, 8, 16, 32, 64)"]),
    ("nodes-zero", "train.py", ["trainer.num_nodes=0"], ["trainer.num_nodes"]),
    ("steps-boolean", "train.py", ["trainer.max_steps=true"], ["trainer.max_steps"]),
    ("value-left-unset", "train.py", ["task=vit", "data=imagefolder"], ["data.data_dir not set: add data.data_dir=<a folder of"]),
    ("pretrained-run-unset", "train.py", ["experiment=pretrain_pays_text"], ["pretrained_run not set: add pretrained_run=<value> to the command line"]),
    # Your own data
    ("corpus-bad-json-line", "train.py", ["data=text_files", "data.files=[docs.jsonl]", "data.tokenizer=char"], ["docs.jsonl line 3 is not valid JSON"]),
    ("corpus-missing-column", "train.py", ["data=text_files", "data.files=[body.jsonl]", "data.tokenizer=char"], ["has no column 'text' (its columns: body, id)"]),
    ("corpus-binary-file", "train.py", ["data=text_files", "data.files=[binary.txt]", "data.tokenizer=char"], ["binary.txt is a binary file"]),
    ("corpus-not-utf-8", "train.py", ["data=text_files", "data.files=[latin1.txt]", "data.tokenizer=char"], ["latin1.txt is not UTF-8 text"]),
    ("corpus-mostly-unknown", "train.py", ["data=text_files", "data.files=[other.txt]", f"data.tokenizer=outputs/{PREVIOUS_RUN}/tokenizer.json"], ["unknown", "tokenizer"]),
    ("parallel-lines-differ", "train.py", ["task=translation", "data=parallel_files", "data.files={train:[train.en,train.de]}"], ["train.en has 30 lines but train.de has 29"]),
    ("images-too-few-to-cut", "train.py", ["task=vit", "data=imagefolder", "data.data_dir=few_images", "data.validation_size=150", "data.test_size=100"], ["the train split has 6 images, too few to cut"]),
    # Translation, vit, classify
    ("translation-tokenizer-without-specials", "train.py", ["task=translation", "data=parallel_files", "data.files={train:[pairs.en,pairs.de]}", f"data.tokenizer=outputs/{PREVIOUS_RUN}/tokenizer.json"], ["<s>"]),
    ("relative-on-images", "train.py", ["task=vit", "pos_encoding=relative"], ["pos_encoding=relative"]),
    ("classify-freeze-below-minus-one", "train.py", ["task=classify", "task.freeze_backbone_steps=-2"], ["task.freeze_backbone_steps"]),
    ("classify-layer-decay-zero", "train.py", ["task=classify", "task.layer_decay=0"], ["task.layer_decay"]),
    ("classify-head-lr-negative", "train.py", ["task=classify", "task.head_lr=-1"], ["task.head_lr"]),
    # Pretrained weights: in and out (the earlier run is an LM: a decoder, character tokenizer, tied head)
    ("init-from-missing", "train.py", ["init_from=nowhere"], ["init_from=nowhere not found"]),
    ("init-from-no-model", "train.py", ["init_from=no_model"], ["init_from=no_model is a directory that holds no model"]),
    ("init-from-contradicting-width", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", "model.d_model=128"], ["model.d_model=128 contradicts init_from=", "drop that override"]),
    ("init-from-and-tokenizer", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", "data.tokenizer=char"], ["both name a tokenizer", "drop data.tokenizer"]),
    ("init-from-and-ckpt-path", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", f"ckpt_path={LAST}"], ["drop one of them"]),
    ("init-from-lm-into-translation", "train.py", ["task=translation", f"init_from=outputs/{PREVIOUS_RUN}"], ["task=translation starts only from"]),
    ("init-from-decoder-into-encoder", "train.py", ["task=classify", f"init_from=outputs/{PREVIOUS_RUN}"], ["a decoder (causal)", "set task.stack=decoder task.pool=last", "init_only=embeddings"]),
    ("init-from-text-into-vit", "train.py", ["task=vit", f"init_from=outputs/{PREVIOUS_RUN}"], ["reads text", "task=vit reads images"]),
    ("init-only-unknown", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", "init_only=everything"], ["init_only='everything' is not supported", "embeddings"]),
    ("init-new-head-not-boolean", "train.py", ["init_new_head=yes"], ["init_new_head must be true or false, got 'yes'"]),
    ("init-new-head-on-a-tied-lm", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", "init_new_head=true", "data=text_files", "data.files=[corpus.txt]"], ["no head of its own", "drop init_new_head"]),
    ("init-from-vocabulary-does-not-fit", "train.py", ["task=mlm", f"init_from=outputs/{PREVIOUS_RUN}", "init_only=embeddings", "data=text_files", "data.files=[corpus.txt]"], ["has a vocabulary of", "tokens"]),
    # Outside formats
    ("init-from-t5-uneven-stacks", "train.py", ["task=translation", "init_from=t5_dir"], ["num_decoder_layers=3 beside num_layers=2", "one model.n_layers"]),
    ("init-from-other-architecture", "train.py", ["init_from=phi3_dir"], ["phi3", "which trident does not convert"]),
    ("init-from-hf-without-weights", "train.py", ["init_from=gpt2_without_weights"], ["gpt2_without_weights"]),
    ("init-from-hf-other-names", "train.py", ["init_from=gpt2_other_names"], ["gpt2_other_names", "encoder.layer.0.weight"]),
    # The timm file's grey images (data.in_channels=1) against imagefolder's three means and deviations
    ("init-from-grey-vit-colour-statistics", "train.py", ["task=vit", "data=imagefolder", "data.data_dir=few_images", "init_from=vit_one_channel.pth"], ["data.mean and data.std need 1 values", "data.mean=[0.5] data.std=[0.5]"]),
    # Resume
    ("resume-other-task", "train.py", [*TEXT, "task=mlm", f"ckpt_path={LAST}"], ["last.ckpt"]),
    ("eval-group-choice", "eval.py", [f"ckpt_path={LAST}", "task=vit"], ["task=vit", "not config groups", "task.<key>="]),
    ("sample-missing-checkpoint", "trident.commands.sample", ["nowhere.ckpt"], ["nowhere.ckpt", "not found"]),
    ("resume-missing-run", "train.py", ["resume=outputs/runs/nowhere"], ["outputs/runs/nowhere"]),
    ("resume-auto-in-a-sweep", "train.py", ["-m", "resume=auto"], ["drop -m/--multirun"]),
    ("resume-run-in-a-sweep", "train.py", ["-m", f"resume=outputs/{PREVIOUS_RUN}"], ["drop -m/--multirun"]),
    ("resume-pickled-checkpoint", "train.py", [*TEXT, "ckpt_path=pickled.ckpt"], ["cannot read checkpoint 'pickled.ckpt'", "weights_only=True"]),
    # Sweeps and budgets
    ("budget-with-max-steps", "train.py", ["budget=equal_compute", "trainer.max_steps=100"], ["trainer.max_steps"]),
    ("budget-negative", "train.py", ["budget=equal_compute", "budget.flops=-1"], ["budget.flops"]),
    ("sweep-exclusion-names-no-swept-key", "train.py", ["-m", "pos_encoding=rope,alibi", "hydra/sweeper=excluding", "hydra.sweeper.exclude=[['task=vit','pos_encoding=alibi']]"], ["hydra.sweeper.exclude names task, which this sweep does not set"]),
    ("sweep-exclusion-not-a-list", "train.py", ["-m", "pos_encoding=rope,alibi", "hydra/sweeper=excluding", "hydra.sweeper.exclude=['pos_encoding=alibi']"], ["is not a list of key=value overrides"]),
    # Issue 40: rope scaling
    ("rope-scaling-unknown-type", "train.py", [*TEXT, "pos_encoding=rope", "pos_encoding.options.scaling={type:longrope,factor:2}"],
     ["pos_encoding.options.scaling.type='longrope' is not a rope scaling: choose one of linear, dynamic, yarn, llama3"]),
    ("rope-scaling-unknown-key", "train.py", [*TEXT, "pos_encoding=rope", "pos_encoding.options.scaling={type:linear,factor:2,beta_fast:32}"],
     ["pos_encoding.options.scaling of type linear has no key(s) ['beta_fast']", "it takes type, factor"]),
    ("rope-scaling-missing-factor", "train.py", [*TEXT, "pos_encoding=rope", "pos_encoding.options.scaling={type:yarn,original_max_position_embeddings:64}"],
     ["pos_encoding.options.scaling of type yarn needs the key(s) ['factor']", "it takes type, factor, original_max_position_embeddings"]),
    # Issue 40: HF families (files: hf_family_files)
    ("init-from-llama-gelu", "train.py", ["init_from=llama_gelu"], ["llama_gelu", "activation 'gelu'", "cannot reproduce exactly"]),
    ("init-from-llama-longrope", "train.py", ["init_from=llama_longrope"], ["rope scaling 'longrope'", "llama3"]),
    ("init-from-gemma2-bidirectional", "train.py", ["init_from=gemma2_bidirectional"], ["bidirectional attention", "use_bidirectional_attention"]),
    ("init-from-llama-other-kv-heads", "train.py", ["init_from=llama_gqa", "model.n_kv_heads=4"],
     ["model.n_kv_heads=4 contradicts init_from=llama_gqa, which has model.n_kv_heads=2", "drop that override"]),
    # A Hugging Face rope model states its context (max_position_embeddings): raising data.max_seq_len is refused, so
    # the advice is to shorten the blocks (it said "raise data.max_seq_len" before).
    ("init-from-llama-block-longer-than-its-context", "train.py",
     ["data=text_files", "data.files=[corpus.txt]", "init_from=llama_gqa", "data.block_size=128"],
     ["data.block_size=128 is longer than data.max_seq_len=64", "init_from=llama_gqa fixes data.max_seq_len to the context",
      "lower data.block_size to at most 64"]),
    # A contrastive batch split into micro-batches has fewer negatives each (issue 54's review): refused.
    ("clip-gradient-accumulation", "train.py", ["task=clip", "trainer.accumulate_grad_batches=2"],
     ["trainer.accumulate_grad_batches=2 would split task=clip's contrastive batch", "raise data.batch_size"]),
    ("init-from-run-other-kv-heads", "train.py", [f"init_from=outputs/{PREVIOUS_RUN}", "model.n_kv_heads=2"],
     ["model.n_kv_heads=2 contradicts init_from=outputs/", "which has model.n_kv_heads=4"]),
    # Issue 40: attention shapes
    ("kv-heads-not-dividing-heads", "train.py", ["model.n_kv_heads=3"], ["model.n_heads=4 is not divisible by model.n_kv_heads=3: choose n_kv_heads among the divisors of n_heads (1, 2, 4)"]),
    ("kv-heads-not-dividing-llama-heads", "train.py", ["architecture=llama", "model.n_heads=5", "model.head_dim=32"], ["model.n_heads=5 is not divisible by model.n_kv_heads=2"]),
    ("head-dim-zero", "train.py", ["model.head_dim=0"], ["model.head_dim must be a positive integer or null, got 0: set e.g. model.head_dim=64"]),
    ("qk-norm-not-boolean", "train.py", ["model.qk_norm=yes"], ["model.qk_norm must be true or false, got 'yes'"]),
    # Issue 40: attention window
    ("window-zero", "train.py", ["model.attention_window=0"], ["model.attention_window must be a positive integer or null, got 0"]),
    ("window-not-an-integer", "train.py", ["model.attention_window=2.5"], ["model.attention_window must be a positive integer or null, got 2.5"]),
    ("window-larger-than-context", "train.py", ["data.max_seq_len=32", "model.attention_window=64"], ["model.attention_window=64 is larger than the context data.max_seq_len=32", "lower model.attention_window"]),
    # Issue 41: chat data (files: chat_files)
    ("chat-role-not-allowed", "train.py", ["data=chat", "data.source=files", "data.files=[chat/roles.jsonl]"],
     ["chat/roles.jsonl line 2: role 'tool' is not one of system, user, assistant"]),
    ("chat-template-missing", "train.py", ["data=chat", "data.template=chat/no_template"],
     ["data.template=chat/no_template: the tokenizer directory has no chat template", "data.template=default"]),
    ("chat-empty-file", "train.py", ["data=chat", "data.source=files", "data.files=[chat/empty.jsonl]"],
     ["chat/empty.jsonl holds no conversations"]),
    ("chat-row-without-messages", "train.py", ["data=chat", "data.source=files", "data.files=[chat/no_messages.jsonl]"],
     ["chat/no_messages.jsonl line 2 has neither 'messages' nor 'instruction' and 'output'"]),
    # Issue 50: answers and contents that are not text
    ("chat-null-answer", "train.py", ["data=chat", "data.source=files", "data.files=[chat/null_answer.jsonl]"],
     ["chat/null_answer.jsonl line 2: the assistant message's content is null, not text"]),
    ("chat-image-part", "train.py", ["data=chat", "data.source=files", "data.files=[chat/image.jsonl]"],
     ["chat/image.jsonl line 1: the assistant message has a content part of type 'image_url'", "only text parts"]),
    # Issue 41: LoRA
    ("lora-without-init-from", "train.py", ["finetune=lora"], ["finetune=lora adapts a trained model and none is given: add init_from="]),
    ("lora-unknown-target", "train.py", [*LORA_TUNE, "finetune.targets=[q,query,ffn]"],
     ["finetune.targets names query, ffn, which the model does not have: choose among q, k, v, o, mlp"]),
    ("lora-rank-zero", "train.py", [*LORA_TUNE, "finetune.rank=0"], ["finetune.rank must be an integer from 1 to 64", "got 0"]),
    ("lora-rank-wider-than-the-model", "train.py", [*LORA_TUNE, "finetune.rank=65"], ["finetune.rank must be an integer from 1 to 64", "got 65"]),
    ("lora-adapter-missing", "train.py", [*LORA_TUNE, "finetune.adapter=nowhere"], ["finetune.adapter=nowhere holds no adapter.safetensors"]),
    # Issue 41: LoRA adapters and new vocabulary (files: lora_adapter_files)
    ("lora-adapter-of-another-base", "train.py", [*LORA_TUNE, "finetune.adapter=lora/other_base"],
     [f"finetune.adapter=lora/other_base adapts init_from=/elsewhere/base, not init_from=outputs/{PREVIOUS_RUN}",
      "set init_from=/elsewhere/base"]),
    ("lora-vocabulary-does-not-fit", "train.py", [*LORA_TUNE[:2], "data.block_size=32", "finetune=lora", "init_from=llama_gqa"],
     ["init_from=llama_gqa has a vocabulary of 32 tokens"]),
    ("lora-mlm-vocabulary-does-not-fit", "train.py", ["task=mlm", "init_only=embeddings", *LORA_TUNE],
     ["has a vocabulary of"]),
    # Issue 56: QLoRA (nano: d_model 64; qkv_proj 192x64 holds 192 blocks of 64, out_proj 64)
    ("qlora-without-init-from", "train.py", ["finetune=qlora"], ["finetune=qlora adapts a trained model and none is given: add init_from="]),
    ("qlora-block-does-not-divide-the-rows", "train.py", [*QLORA_TUNE, "finetune.block_size=48"],
     ["finetune.block_size=48, which does not divide their input width d_model=64", "finetune.block_size=32"]),
    ("qlora-with-ema", "train.py", [*QLORA_TUNE, "callbacks=ema"],
     ["callbacks=ema averages every weight of the network, and finetune=qlora's NF4 base cannot be copied"]),
    ("qlora-with-bf16-true", "train.py", [*QLORA_TUNE, "trainer.precision=bf16-true"],
     ["trainer.precision=bf16-true casts every weight of the network", "use precision=bf16"]),
    ("qlora-scale-groups-do-not-fill", "train.py", QLORA_TUNE,
     ["finetune=qlora cannot quantize decoder.blocks.0.self_attn.qkv_proj (192x64)", "finetune.scaler_block_size=64"]),
    # Issue 42: FSDP2
    ("fsdp-with-ema", "train.py", ["trainer=fsdp_cpu", "callbacks=ema"],
     ["callbacks=ema does not work with FSDP's sharded weights", "use trainer=ddp"]),
    ("fsdp1-by-name", "train.py", ["trainer=ddp_cpu", "trainer.strategy=fsdp"], ["trainer.strategy=fsdp is Lightning's FSDP1", "choose trainer=fsdp"]),
    # Issue 43: early stopping and the learning-rate finder (SHORT: a case whose check is missing ends in seconds)
    ("early-stopping-unknown-metric", "train.py", [*SHORT, "callbacks=early_stopping", "callbacks.early_stopping.monitor=val/accuracy"],
     ["callbacks.early_stopping.monitor=val/accuracy is not a metric task=lm logs at validation: choose among val/loss, val/ppl"]),
    ("early-stopping-patience-zero", "train.py", [*SHORT, "callbacks=early_stopping", "callbacks.early_stopping.patience=0"],
     ["callbacks.early_stopping.patience must be an integer >= 1", "got 0"]),
    ("lr-find-frozen-model", "train.py", ["tune=lr_find", "task._target_=tests.test_lr_find.FrozenLanguageModel"],
     ["tune=lr_find: every parameter of task=lm's network is frozen", "e.g. finetune=full"]),
    ("lr-find-too-few-steps", "train.py", ["tune=lr_find", "tune.num_training=5"], ["tune.num_training must be an integer >= 20", "got 5"]),
    ("lr-find-on-a-checkpoint", "train.py", [*SHORT, "tune=lr_find", "tune.num_training=20", f"ckpt_path={LAST}"], ["tune=lr_find starts from the configured weights", "drop resume/ckpt_path"]),
    # Issue 43: torchrun, MLflow, W&B artifacts
    ("mlflow-server-unreachable", "train.py", ["logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"],
     ["logger.mlflow.tracking_uri=http://127.0.0.1:9 cannot be reached", "drop the override"]),
    ("wandb-log-model-all", "train.py", ["logger.wandb.log_model=all"], ["logger.wandb.log_model=all is not a choice: set false"]),
    # Issue 42: tensor parallelism (SHORT: a case whose check is missing ends in seconds)
    ("tensor-parallel-not-dividing-heads", "train.py", [*SHORT, "model=nano", "trainer=fsdp_cpu", "trainer.devices=3", "trainer.strategy.tensor_parallel_size=3"],
     ["trainer.strategy.tensor_parallel_size=3 does not divide model.n_heads=4", "choose a tensor-parallel size that divides model.n_heads"]),
    ("tensor-parallel-not-dividing-kv-heads", "train.py", [*SHORT, "model=nano", "model.n_kv_heads=2", "trainer=fsdp_cpu", "trainer.devices=4", "trainer.strategy.tensor_parallel_size=4"],
     ["trainer.strategy.tensor_parallel_size=4 does not divide model.n_kv_heads=2"]),
    ("tensor-parallel-not-dividing-processes", "train.py", [*SHORT, "model=nano", "trainer=fsdp_cpu", "trainer.strategy.tensor_parallel_size=4"],
     ["trainer.strategy.tensor_parallel_size=4 does not divide the 2 processes", "choose a tensor-parallel size that divides 2"]),
    ("tensor-parallel-alibi", "train.py", [*SHORT, "model=nano", "trainer=fsdp_cpu", "trainer.strategy.tensor_parallel_size=2", "pos_encoding=alibi"],
     ["trainer.strategy.tensor_parallel_size=2 cannot split pos_encoding=alibi", "use pos_encoding=rope"]),
    ("tensor-parallel-vit-qk-norm", "train.py", ["task=vit", "model=nano", "model.qk_norm=true", "trainer=fsdp_cpu", "trainer.strategy.tensor_parallel_size=2"],
     ["trainer.strategy.tensor_parallel_size=2 cannot split model.qk_norm", "set model.qk_norm=false"]),
    ("tensor-parallel-lora", "train.py", [*LORA_TUNE, "trainer=fsdp_cpu", "trainer.strategy.tensor_parallel_size=2", "trainer.max_steps=2"],
     ["trainer.strategy.tensor_parallel_size=2 cannot split finetune=lora's adapters", "use finetune=full"]),
    # Issue 42: distributed checkpoints (files: sharded_checkpoint_files)
    ("resume-sharded-other-model-size", "train.py", [*TEXT, "model=nano", "model.d_model=128", "trainer=fsdp_cpu",
                                                     "data.batch_size=4", f"ckpt_path={SHARDED.format('run')}"], ["does not fit", "128"]),
    ("resume-sharded-without-fsdp", "train.py", [*TEXT, "model=nano", f"ckpt_path={SHARDED.format('run')}"],
     ["is a sharded checkpoint", "which only FSDP resumes", "add trainer=fsdp"]),
    ("eval-sharded-other-model-size", "eval.py", [f"ckpt_path={SHARDED.format('run')}", "model.d_model=128"], ["does not fit", "128"]),
    ("eval-sharded-shard-cut-short", "eval.py", [f"ckpt_path={SHARDED.format('cut_short')}"],
     ["is incomplete: its shard __0_0.distcp is missing or shorter than its index says"]),
    ("export-sharded-without-index", "trident.commands.export",
     [SHARDED.format("no_index"), "--format", "safetensors", "--out", "exported"], ["is not a complete sharded checkpoint (it has no .metadata)"]),
    ("fsdp-sharded-setting-not-boolean", "train.py", ["trainer=fsdp_cpu", "trainer.strategy.save_distributed_checkpoint=yes"],
     ["trainer.strategy.save_distributed_checkpoint must be true or false, got 'yes'"]),
    ("fsdp-sharded-with-tensor-parallel", "train.py", ["trainer=fsdp_cpu", "trainer.strategy.save_distributed_checkpoint=true",
                                                       "trainer.strategy.tensor_parallel_size=2"],
     ["trainer.strategy.save_distributed_checkpoint=true does not work with tensor parallelism"]),
    # Issue 55: model.attention
    ("linformer-for-a-causal-lm", "train.py", ["model=nano", "model.attention=linformer"],
     ["model.attention=linformer", "serves encoders only", "use model.attention=softmax or performer"]),
    ("performer-with-alibi", "train.py", ["model=nano", "model.attention=performer", "pos_encoding=alibi"],
     ["model.attention=performer forms no attention scores for pos_encoding=alibi", "use pos_encoding=rope"]),
    # Issue 42: fsdp options (the rest work under trainer=fsdp_cpu: docs/scaling.md's table, tests/test_fsdp.py)
    ("fsdp-with-fp16", "train.py", ["trainer=fsdp_cpu", "precision=fp16"],
     ["precision=fp16 (trainer.precision=16-mixed) does not work with trainer=fsdp", "use precision=bf16"]),
    ("fsdp-with-swa", "train.py", ["trainer=fsdp_cpu", "+callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging",
                                   "+callbacks.swa.swa_lrs=0.01"],
     ["callbacks.swa (StochasticWeightAveraging) does not work with FSDP's sharded weights", "remove callbacks.swa"]),
    ("fsdp-with-backbone-frozen-for-steps", "train.py", ["task=classify", "model=nano", "trainer=fsdp_cpu", "task.freeze_backbone_steps=1",
                                                         "trainer.max_steps=2", "trainer.val_check_interval=1",
                                                         "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"],
     ["task.freeze_backbone_steps=1 does not work with trainer=fsdp", "set task.freeze_backbone_steps=0"]),
]


@pytest.mark.parametrize(("entry", "args", "keywords"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_line(
    entry: str, args: list[str], keywords: list[str], workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = workspace / "outputs"
    before = snapshot(outputs)
    result = run_in_process(entry, [*args, "paths.output_root=outputs"] if entry == "train.py" else args, workspace, monkeypatch)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.last_line.startswith("error: "), result.stderr
    assert ": " in result.last_line[len("error: "):], "the line names the problem, then the fix"
    for keyword in keywords:
        assert keyword in result.last_line
    assert snapshot(outputs) == before, "earlier outputs changed, or the failure left a run directory behind"


def test_the_table_is_large_and_unique() -> None:
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES) and len({(c[1], *c[2]) for c in CASES}) == len(CASES)


@pytest.mark.slow
def test_in_process_matches_the_command_line(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One case through Hydra's run directory, data preparation and the model (a real subprocess costs ~5 s of imports)."""
    entry, args = next((c[1], [*c[2], "paths.output_root=outputs"]) for c in CASES if c[0] == "resume-other-model-size")
    expected = run_in_process(entry, args, workspace, monkeypatch)
    result = run_subprocess(entry, args, workspace)
    assert (result.returncode, result.last_line) == (expected.returncode, expected.last_line)
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_full_error_shows_the_traceback(workspace: Path) -> None:
    result = run_subprocess("train.py", ["model.d_model=0", "paths.output_root=outputs"], workspace, HYDRA_FULL_ERROR="1")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError: model.d_model must be a positive integer" in result.stderr


def test_a_refused_resume_leaves_the_run_as_it_was(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``resume=<run> data.files=[other.txt]`` is refused before Hydra rewrites the run's ``.hydra/``
    (or its train.log): the same ``resume=<run>`` without the change is not refused afterwards."""
    run_dir = workspace / "outputs" / "runs/2000-01-01/00-00-02_resumable"
    shutil.copytree(workspace / "outputs" / PREVIOUS_RUN, run_dir)
    saved = [*SMALL, "data=text_files", f"data.files=[{workspace / 'corpus.txt'}]", "data.tokenizer=char",
             "logger=none", "test=false", "trainer.max_steps=2"]
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in saved))
    before = snapshot(run_dir)
    refused = run_in_process("train.py", [f"resume={run_dir}", "data.files=[other.txt]"], workspace, monkeypatch)
    assert refused.returncode == 2 and refused.last_line.startswith("error: "), refused.stderr
    assert snapshot(run_dir) == before, "the refused command changed the run directory"
    again = run_in_process("train.py", [f"resume={run_dir}", "print_config=false"], workspace, monkeypatch)
    assert again.returncode == 0, again.stderr
    shutil.rmtree(run_dir)


@pytest.mark.parametrize("how", ["resume=auto", "-m resume=<run>"])
def test_a_refused_resume_auto_or_sweep_changes_nothing(how: str, workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: ``resume=auto`` that finds a run and refuses it (other data), and ``-m resume=<run>``
    (refused before Hydra starts a sweep), leave every file and directory under outputs as it was."""
    outputs = workspace / "outputs"
    run_dir = outputs / "runs/2000-01-01/00-00-03_resumable"  # the newest run of its name: resume=auto's choice
    shutil.copytree(outputs / PREVIOUS_RUN, run_dir)
    try:
        # The same settings as the command line below (resume=auto continues only such a run), but the run's own
        # config (config_resolved.yaml, copied) trained on other data than data.files=[other.txt] gives.
        saved = [*SMALL, "data=text_files", "model=nano", "data.files=[other.txt]"]
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in saved))
        before = snapshot(outputs) | {str(p.relative_to(outputs)): "dir" for p in outputs.rglob("*") if p.is_dir()}
        args = (["resume=auto", *saved] if how == "resume=auto" else ["-m", f"resume={run_dir}"])
        refused = run_in_process("train.py", [*args, "paths.output_root=outputs"], workspace, monkeypatch)
        assert refused.returncode == 2 and refused.last_line.startswith("error: "), refused.stderr
        assert ("00-00-03_resumable" if how == "resume=auto" else "drop -m/--multirun") in refused.last_line
        after = snapshot(outputs) | {str(p.relative_to(outputs)): "dir" for p in outputs.rglob("*") if p.is_dir()}
        assert after == before, "the refused command changed or left something under outputs"
    finally:
        shutil.rmtree(run_dir)


# The docs' error examples that are not bad input a command refuses, with the test that checks each.
NOT_IN_THE_TABLE = {
    "logger=tensorboard needs": "a package that is not installed: tests/test_extras.py",
    "DDP rank": "a rank that fails while training: tests/test_ddp_signals.py",
    "non-finite training loss": "a training that diverges: tests/test_resume.py",
}


def documented_error_examples() -> list[str]:
    """Every ``error: ...`` the README and the docs pages show (in inline code, maybe across a line break,
    or a line of a code block), up to a first ``...``: the words some case's error line must hold."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    shown = re.findall(r"`error: ([^`]*)`", text) + re.findall(r"^error: (.*)$", text, flags=re.MULTILINE)
    return [" ".join(e.split()).split("...")[0].rstrip(" (") for e in shown]


def test_every_documented_error_example_is_a_case() -> None:
    examples = documented_error_examples()
    assert len(examples) >= 8, examples
    keywords = [keyword for case in CASES for keyword in case[3]]
    unchecked = [e for e in examples if not any(e in k for k in keywords) and not e.startswith(tuple(NOT_IN_THE_TABLE))]
    assert not unchecked, f"error examples of the README or docs/ that no case of CASES checks: {unchecked}"


def test_a_refused_first_run_of_the_day_leaves_no_empty_run_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra makes <output_root>/runs/<date>/ for the run: a refused first run leaves neither behind."""
    (tmp_path / "empty.txt").write_text("")
    result = run_in_process("train.py", ["data=text_files", "data.files=[empty.txt]", "paths.output_root=outputs"], tmp_path, monkeypatch)
    assert result.returncode == 2 and result.last_line.startswith("error: "), result.stderr
    assert not (tmp_path / "outputs" / "runs").exists()


def test_a_failed_run_directory_outside_hydras_layout_leaves_its_parent(tmp_path: Path) -> None:
    """Only Hydra's <output_root>/runs/<date>/ goes with the run: a folder the user named stays, empty or not."""
    run_dir = tmp_path / "mine" / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    discard_failed_run_dir(run_dir)
    assert not run_dir.exists() and (tmp_path / "mine").is_dir()
