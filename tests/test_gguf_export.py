"""trident-export --format gguf (issue 56, item 3): a GGUF file that transformers' GGUF reader
(``from_pretrained(dir, gguf_file=...)``) loads with the logits of the trident model and whose tokenizer gives the
run's ids, for models initialised from random-weight Hugging Face GPT-2, Llama, Qwen2 and Qwen3 directories (every
parameter randomised); bad inputs in one line.

Tolerances: f32 stores the weights as they are (1e-4 on logits of order 1-10, summed in another order by transformers).
f16, bf16 and q8_0 round the matrices: the logits are compared, within the same 1e-4, with the trident model whose
matrices were rounded the same way (``gguf.quants`` quantize then dequantize, the reader's own dequantization), and,
for q8_0, with the unrounded model within 5% of the logits' spread: a q8_0 weight is off by at most half a step of
its block's largest weight / 127 (0.4%), and a logit sums many such errors of both signs.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import trident
from tests.conftest import SMALL, compose_config
from tests.convert_helpers import randomise
from trident.commands.export import main
from trident.converters import converters_of
from trident.data.tokenization import END_OF_TEXT, train_tokenizer
from trident.runs.pipeline import train
from trident.tasks.lm import LanguageModelTask
from trident.tasks.networks import merge_network
from trident.weights import read_pretrained

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CORPUS = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, and then it rests.\n" for i in range(200))
SAMPLE = "The quick brown fox? It jumps over 12 lazy dogs, and then it rests.\n\nLine 7: the end."
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3's split (and Qwen2's, which takes digits one at a time), as their tokenizer.json state it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
GPT2_SPLIT = None  # GPT-2's own: a ByteLevel pre-tokenizer with its built-in regex
TRAINING = {"optimizer": {"name": "adamw", "lr": 1.0e-3}, "scheduler": {"name": "constant"}}


def byte_level_bpe(split: str | None, specials: list[str], bos: str | None = None) -> Tokenizer:
    """A byte-level BPE of 300 tokens trained on CORPUS: GPT-2's split (None) or a Split regex's; ``bos``: a token its
    post-processor puts first (Llama 3's <|begin_of_text|>)."""
    tokenizer = Tokenizer(models.BPE())
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def hf_directory(directory: Path, family: str, vocab: int = 320) -> Path:
    """A random-weight transformers model of ``family`` with a byte-level BPE tokenizer (and, but for GPT-2, a chat
    template and special tokens in tokenizer_config.json), saved as the Hub's directories are; its
    ``vocab`` rows more than the tokenizer's 300 tokens by default: the ids past the tokenizer are listed unused."""
    torch.manual_seed(0)
    if family == "gpt2":
        # transformers' GGUF reader takes GPT-2's 1,024 positions and 4 x width feed-forward from GPT2Config. A width
        # of 48: q8_0 stores rows of 48 (c_attn, c_fc, the embedding) as f16, the MLP's c_proj rows of 192 as q8_0.
        config = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=2, n_positions=1024, vocab_size=vocab)
        model = transformers.GPT2LMHeadModel(config)
        tokenizer = byte_level_bpe(GPT2_SPLIT, [END_OF_TEXT])
        settings: dict[str, Any] = {}
    else:
        shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
                 "rope_theta": 5e5}
        specials = [END_OF_TEXT, "<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]
        if family == "llama":
            config = transformers.LlamaConfig(**shape, head_dim=16, tie_word_embeddings=False)
            tokenizer = byte_level_bpe(LLAMA3_SPLIT, specials, bos="<|begin_of_text|>")
        elif family == "mistral":  # its 4,096-token window is longer than the context: none (written as llama)
            config = transformers.MistralConfig(**shape, tie_word_embeddings=True)
            tokenizer = byte_level_bpe(LLAMA3_SPLIT, specials, bos="<|begin_of_text|>")
        elif family == "qwen2":
            config = transformers.Qwen2Config(**shape, tie_word_embeddings=True)
            tokenizer = byte_level_bpe(QWEN2_SPLIT, specials)
        elif family == "qwen3":  # Qwen3's reader takes the head width as Qwen3Config's 128
            config = transformers.Qwen3Config(**shape, head_dim=128, tie_word_embeddings=False)
            tokenizer = byte_level_bpe(QWEN2_SPLIT, specials)
        else:  # Gemma's head width is Gemma2Config's 256; a window of 8 in the sliding layers (every other / all but
            # each 6th), shorter than the texts; Gemma 2's soft-caps its config's
            gemma = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 8}
            config = (transformers.Gemma2Config(**shape, **gemma) if family == "gemma2" else
                      transformers.Gemma3TextConfig(**{**shape, "num_hidden_layers": 7}, **gemma))
            tokenizer = byte_level_bpe(GPT2_SPLIT, specials)
        model = transformers.AutoModelForCausalLM.from_config(config)
        settings = {"chat_template": CHATML, "bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    randomise(model, seed=1)
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    if settings:
        (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def checkpoint_from(source: Path, path: Path, lora: dict[str, Any] | None = None) -> LanguageModelTask:
    """The task=lm model init_from=``source`` builds (``lora``: under finetune=lora, its adapters randomised too), with
    its weights, tokenizer and tokenizer settings, saved as a checkpoint at ``path`` the way Lightning writes one."""
    weights = read_pretrained(source)
    backbone = dict(weights.model, pos_encoding=weights.pos_encoding, pos_encoding_options=weights.pos_encoding_options,
                    dropout=0.0, max_seq_len=weights.data_options["max_seq_len"])
    assert weights.tokenizer is not None and weights.vocab_size is not None
    task = LanguageModelTask(backbone, weights.vocab_size, **TRAINING, tokenizer_json=weights.tokenizer.to_str(),
                             **weights.task_options, lora=lora)
    task.net.load_state_dict(weights.state_dict, strict=lora is None)
    if lora is not None:
        randomise(task.net, seed=3)
    task.tokenizer_settings = dict(weights.tokenizer_settings)
    checkpoint: dict[str, Any] = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                                  "pytorch-lightning_version": L.__version__}
    task.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return task.eval()


def stored_type(shape: tuple[int, ...], gguf_type: str, vector: bool) -> Any:
    """How llama.cpp stores a tensor of ``shape``: float32 for vectors, norms and the position table (``vector``),
    q8_0 where 32 divides a row (else f16), the other types as they are."""
    if vector or len(shape) < 2:
        return gguf.GGMLQuantizationType.F32
    if gguf_type == "q8_0" and shape[-1] % 32:
        return gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType[gguf_type.upper()]


def rounded(task: LanguageModelTask, gguf_type: str) -> torch.nn.Module:
    """``task.net`` (its LoRA merged) with its matrices stored as ``gguf_type`` stores them and read back (gguf's own
    quantize and dequantize); vectors (norms, biases) and the position table stay float32, as the export keeps them."""
    net = copy.deepcopy(task.net)
    merge_network(net, converters_of(task.hparams))
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            kind = stored_type(tuple(parameter.shape), gguf_type, "pos" in name)
            if kind != gguf.GGMLQuantizationType.F32:
                packed = gguf.quants.quantize(parameter.numpy(), kind)
                parameter.copy_(torch.from_numpy(gguf.quants.dequantize(packed, kind).reshape(parameter.shape)))
    return net.eval()


def exported(family: str, tmp_path: Path, gguf_type: str | None,
             lora: dict[str, Any] | None = None) -> tuple[LanguageModelTask, Path]:
    task = checkpoint_from(hf_directory(tmp_path / family, family), tmp_path / "model.ckpt", lora)
    out = tmp_path / "out"
    main([str(tmp_path / "model.ckpt"), "--format", "gguf", "--out", str(out),
          *(["--gguf-type", gguf_type] if gguf_type else [])])
    return task, out


@pytest.mark.parametrize(("family", "gguf_type"), [("gpt2", "f32"), ("gpt2", None), ("llama", "f32"),
                                                   ("llama", "bf16"), ("llama", "q8_0"), ("qwen2", "f16"),
                                                   ("qwen3", "f16"), ("gpt2", "q8_0"), ("mistral", "f32"),
                                                   ("gemma2", "f32"), ("gemma3", "q8_0")])
def test_transformers_reads_the_gguf_file_with_the_models_logits_and_the_runs_token_ids(
        family: str, gguf_type: str | None, tmp_path: Path) -> None:
    task, out = exported(family, tmp_path, gguf_type)
    assert_stored_as_llama_cpp_stores(out / "model.gguf", gguf_type or "f16", task)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf").eval()
    ids = torch.randint(0, task.hparams.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    reference = rounded(task, gguf_type or "f16")
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(logits, reference(ids), atol=1e-4, rtol=1e-4)
        if gguf_type == "q8_0":
            exact = task.net(ids)
            assert (logits - exact).abs().max() < 0.05 * (exact.max() - exact.min())
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    assert tokenizer(SAMPLE)["input_ids"] == task.tokenizer.encode(SAMPLE).ids
    # Stated either way, for llama.cpp, whose default for Llama 3's split adds a bos.
    adds_bos = task.tokenizer.encode("a").ids != task.tokenizer.encode("a", add_special_tokens=False).ids
    assert gguf.GGUFReader(out / "model.gguf").fields["tokenizer.ggml.add_bos_token"].contents() is adds_bos
    if family != "gpt2":
        assert tokenizer.chat_template == CHATML
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|begin_of_text|>"


def assert_stored_as_llama_cpp_stores(path: Path, gguf_type: str, task: LanguageModelTask) -> None:
    """Each tensor of the file in the type llama.cpp's converter stores it in, a tied head not written but GPT-2's
    (which llama.cpp builds before 2025 require)."""
    reader = gguf.GGUFReader(path)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists a shape innermost first
        vector = tensor.name.endswith("_norm.weight") or tensor.name.startswith("position_embd.")
        assert tensor.tensor_type == stored_type(shape, gguf_type, vector), tensor.name
    tied = task.net.head.weight is task.net.embed.weight
    gpt2 = gguf.GGUFReader(path).fields["general.architecture"].contents() == "gpt2"
    assert ("output.weight" in {tensor.name for tensor in reader.tensors}) is (gpt2 or not tied)


def test_a_lora_run_is_exported_merged(tmp_path: Path) -> None:
    task, out = exported("llama", tmp_path, "f32", lora={"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q", "v"]})
    model = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf").eval()
    ids = torch.randint(0, task.hparams.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, task.net(ids), atol=1e-4, rtol=1e-4)  # the adapters applied


@pytest.mark.slow
def test_a_run_initialised_from_a_llama_directory_exports_what_it_trained(tmp_path: Path) -> None:
    """Through train.py's pipeline: init_from a Llama directory, two steps on text files, trident-export of the run
    directory: transformers reads the trained weights (trident.load's logits), the tokenizer and the template."""
    hf_directory(tmp_path / "llama", "llama", vocab=300)  # train.py takes a tokenizer as long as the embedding
    (tmp_path / "corpus.txt").write_text(CORPUS)
    run = tmp_path / "run"
    train(compose_config([*(o for o in SMALL if o != "model=nano"), "logger=none", "test=false", "trainer.max_steps=2",
                          f"init_from={tmp_path / 'llama'}", "data=text_files", f"data.files=[{tmp_path / 'corpus.txt'}]"],
                         output_dir=run))
    main([str(run), "--format", "gguf", "--out", str(tmp_path / "out")])
    task = trident.load(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    ids = torch.tensor([task.tokenizer.encode(SAMPLE).ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, rounded(task, "f16")(ids), atol=1e-4, rtol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="model.gguf")
    assert tokenizer(SAMPLE)["input_ids"] == ids[0].tolist() and tokenizer.chat_template == CHATML


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what building the inputs printed (transformers' save_pretrained)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_bad_gguf_exports_are_one_line_and_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    hf_directory(tmp_path / "gpt2", "gpt2")
    checkpoint_from(tmp_path / "gpt2", tmp_path / "gpt2.ckpt")
    out = tmp_path / "out"
    assert "--gguf-type='q4_k' is not supported: choose one of f16, bf16, f32, q8_0" in refused(
        [str(tmp_path / "gpt2.ckpt"), "--format", "gguf", "--gguf-type", "q4_k", "--out", str(out)], capsys)
    assert "--gguf-type=q8_0 applies to --format gguf only" in refused(
        [str(tmp_path / "gpt2.ckpt"), "--format", "hf", "--gguf-type", "q8_0", "--out", str(out)], capsys)
    with monkeypatch.context() as hidden:
        hidden.setitem(sys.modules, "gguf", None)  # how importlib sees a package that is not installed
        assert "the GGUF export (trident-export --format gguf) needs trident's [gguf] extra" in refused(
            [str(tmp_path / "gpt2.ckpt"), "--format", "gguf", "--out", str(out)], capsys)
    tokenizer = train_tokenizer("char", [CORPUS])
    char = LanguageModelTask({"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 128, "max_seq_len": 1024,
                              "pos_encoding": "learned", "activation": "gelu_tanh"}, tokenizer.get_vocab_size(),
                             **TRAINING, tokenizer_json=tokenizer.to_str())
    assert "the run's tokenizer is a character-level tokenizer" in refused(
        [str(saved(char, tmp_path / "char.ckpt")), "--format", "gguf", "--out", str(out)], capsys)
    bpe = byte_level_bpe(GPT2_SPLIT, [END_OF_TEXT])
    short = LanguageModelTask({"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 128, "max_seq_len": 64,
                               "pos_encoding": "learned", "activation": "gelu_tanh"}, 300, **TRAINING,
                              tokenizer_json=bpe.to_str())
    assert "data.max_seq_len=64 has no GGUF (gpt2) equivalent" in refused(
        [str(saved(short, tmp_path / "short.ckpt")), "--format", "gguf", "--out", str(out)], capsys)
    from trident.tasks.mlm import MaskedLanguageModelTask

    bert = MaskedLanguageModelTask({"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "max_seq_len": 16,
                                    "pos_encoding": "learned", "activation": "gelu", "norm_first": False,
                                    "embedding_norm": True}, tokenizer.get_vocab_size(), **TRAINING, mask_id=1,
                                   pad_id=2, num_regular_tokens=3, tokenizer_json=tokenizer.to_str())
    assert "a MaskedLM has no GGUF export: it writes GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3" in refused(
        [str(saved(bert, tmp_path / "bert.ckpt")), "--format", "gguf", "--out", str(out)], capsys)
    rope = {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "max_seq_len": 64, "pos_encoding": "rope",
            "norm": "rmsnorm", "activation": "swiglu"}
    biased = LanguageModelTask({**rope, "bias": True}, 300, **TRAINING, tokenizer_json=bpe.to_str())
    assert "model.bias=True has no GGUF (llama) equivalent: transformers' GGUF reader reads biases on Qwen2's" in refused(
        [str(saved(biased, tmp_path / "biased.ckpt")), "--format", "gguf", "--out", str(out)], capsys)
    qwen3 = LanguageModelTask({**rope, "bias": False, "qk_norm": True}, 300, **TRAINING, tokenizer_json=bpe.to_str())
    assert "model.head_dim=16 has no GGUF (qwen3) equivalent: transformers' GGUF reader takes Qwen3's head width as 128" \
        in refused([str(saved(qwen3, tmp_path / "qwen3.ckpt")), "--format", "gguf", "--out", str(out)], capsys)
    assert list(tmp_path.glob("*out*")) == []  # no output, no temporary directory left behind


def saved(task: Any, path: Path) -> Path:
    checkpoint: dict[str, Any] = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams),
                                  "pytorch-lightning_version": L.__version__}
    task.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path
