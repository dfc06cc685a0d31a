"""T5 (issue 55, item 4): T5ForConditionalGeneration v1.0 (ReLU, tied head scaled by d_model**-0.5) and v1.1 (gated
GELU, its own lm_head, no scaling) read from random-weight directories (every parameter randomised, d_kv * heads !=
d_model): logits within 1e-5 with padding in source and target; greedy and beam (4 beams) decoding token for token
those of transformers' ``generate``; the export loads back in transformers with the same logits and reads back exact;
what trident cannot hold is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.t5_helpers import EOS_ID, padded_pairs, padded_sources, save_t5, t5_net
from trident.errors import ConfigError, DataError
from trident.models.decoding import Decoding, beam_search, greedy_decode
from trident.weights import read_pretrained
from trident.weights.adapters.hf_export import write_hf

transformers = pytest.importorskip("transformers")

# (version, seed, eos_boost): random models whose decoding ends at various lengths, some before the limit.
DECODED = [("v1.0", 1, 3.0), ("v1.1", 0, 3.0)]
LIMIT = 24  # tokens trident generates at most (EOS included); transformers' max_new_tokens is one fewer (no forced EOS)


@pytest.fixture(autouse=True)
def quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()  # its note on the v1.1 files' untied lm_head


@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
def test_t5_logits_equal_those_of_transformers_with_padding(version: str, tmp_path: Path) -> None:
    reference = save_t5(tmp_path, version)
    weights = read_pretrained(tmp_path)
    assert (weights.format, weights.task, weights.model["family"], weights.pos_encoding) == ("hf-t5", "translation", "t5", "relative")
    v10 = version == "v1.0"
    assert weights.task_options == {"tie_embeddings": "all" if v10 else "embeddings", "scale_embeddings": False,
                                    "rescale_head": v10}
    assert weights.data_options == {"decoder_start": "<pad>"}
    assert weights.model["attn_scale_dim"] == 1.0 and weights.model["head_dim"] == 8
    net = t5_net(weights)
    src, src_mask, tgt, tgt_mask = padded_pairs(weights.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                             decoder_attention_mask=tgt_mask.long()).logits
        torch.testing.assert_close(net(src, tgt)[tgt_mask], expected[tgt_mask], atol=1e-5, rtol=1e-5)


def _generated(row: torch.Tensor) -> list[int]:
    """transformers' output row without its decoder start, up to its EOS (it fills finished rows with EOS or pad)."""
    tokens = row.tolist()[1:]
    return tokens[: tokens.index(EOS_ID)] if EOS_ID in tokens else tokens


@pytest.mark.parametrize(("version", "seed", "boost"), DECODED)
def test_greedy_and_beam_decoding_equal_generate(version: str, seed: int, boost: float, tmp_path: Path) -> None:
    """The settings matched explicitly: decoder start <pad>, EOS </s>, <pad> never generated (trident's decoding bans it:
    transformers' suppress_tokens), no length penalty (trident's GNMT penalty and transformers' length ** alpha agree
    at 0) and early_stopping "never". At the length limit trident ends a hypothesis with EOS (fairseq) and transformers
    cuts it off: greedy agrees there too (the same tokens before), beam search only where neither reached it."""
    reference = save_t5(tmp_path, version, seed=seed, eos_boost=boost)
    weights = read_pretrained(tmp_path)
    net = t5_net(weights)
    src, mask = padded_sources(weights.vocab_size, (13, 11, 9, 8, 6, 5, 3, 2))
    decoding = Decoding(bos_id=0, eos_id=EOS_ID, max_len_a=0.0, max_len_b=LIMIT, banned_ids=(0,))
    matched = {"decoder_start_token_id": 0, "eos_token_id": EOS_ID, "pad_token_id": 0, "suppress_tokens": [0],
               "max_new_tokens": LIMIT - 1, "do_sample": False}
    with torch.no_grad():
        greedy = reference.generate(input_ids=src, attention_mask=mask.long(), num_beams=1, **matched)
        beams = reference.generate(input_ids=src, attention_mask=mask.long(), num_beams=4, length_penalty=0.0,
                                   early_stopping="never", **matched)
    assert [h.tokens for h in greedy_decode(net, src, decoding)] == [_generated(row) for row in greedy]
    ours, theirs = [h.tokens for h in beam_search(net, src, decoding, beam_size=4, alpha=0.0)], [_generated(row) for row in beams]
    ended = [i for i in range(len(ours)) if max(len(ours[i]), len(theirs[i])) < LIMIT - 1]
    assert len(ended) >= 4 and max(len(ours[i]) for i in ended) >= 3, "the case decodes translations that end"
    assert [ours[i] for i in ended] == [theirs[i] for i in ended]


@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
def test_the_export_loads_in_transformers_with_equal_logits_and_reads_back_exact(version: str, tmp_path: Path) -> None:
    save_t5(tmp_path / "source", version)
    weights = read_pretrained(tmp_path / "source")
    net = t5_net(weights)
    with torch.no_grad():
        write_hf(net, weights.tokenizer, None, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["decoder_start_token_id"], config["pad_token_id"], config["eos_token_id"]) == \
        (["T5ForConditionalGeneration"], 0, 0, EOS_ID)
    # transformers 4 reads tie_word_embeddings as both the tying and the scaling: v1.1's is false, its lm_head written.
    assert config["tie_word_embeddings"] is (version == "v1.0")
    exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    src, src_mask, tgt, tgt_mask = padded_pairs(weights.vocab_size)
    with torch.no_grad():
        theirs = exported(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                          decoder_attention_mask=tgt_mask.long()).logits
        torch.testing.assert_close(theirs[tgt_mask], net(src, tgt)[tgt_mask], atol=1e-5, rtol=1e-5)
    back = read_pretrained(tmp_path / "hf")
    assert back.task_options == weights.task_options and back.model == weights.model
    own = net.state_dict()
    assert back.state_dict.keys() == own.keys() and all(torch.equal(back.state_dict[k], t) for k, t in own.items())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("the light").input_ids[-1] == EOS_ID


def test_mt5_reads_with_transformers_logits_and_exports_what_save_pretrained_writes(tmp_path: Path) -> None:
    """mT5 (MT5ForConditionalGeneration: T5 v1.1 with its own lm_head, never scaled) reads as model.family=mt5 with
    transformers' logits, and exports as mT5: the weights byte for byte those save_pretrained writes, the config
    theirs but for tie_word_embeddings (false beside the lm_head, as the hub's mT5 files: transformers 5 writes true
    whatever the head, and 4 reads true as a tied head, scaled); read back exactly. A head mT5 cannot state (T5 v1.0's
    scaled one) is one line."""
    reference = save_t5(tmp_path / "source", "mt5")
    weights = read_pretrained(tmp_path / "source")
    assert (weights.format, weights.model["family"], weights.pos_encoding) == ("hf-mt5", "mt5", "relative")
    assert weights.task_options == {"tie_embeddings": "embeddings", "scale_embeddings": False, "rescale_head": False}
    net = t5_net(weights)
    src, src_mask, tgt, tgt_mask = padded_pairs(weights.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                             decoder_attention_mask=tgt_mask.long()).logits
        torch.testing.assert_close(net(src, tgt)[tgt_mask], expected[tgt_mask], atol=1e-5, rtol=1e-5)
        write_hf(net, weights.tokenizer, None, tmp_path / "hf")
    reference.save_pretrained(tmp_path / "transformers")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "transformers" / "model.safetensors").read_bytes()
    ours, theirs = (json.loads((tmp_path / side / "config.json").read_text()) for side in ("hf", "transformers"))
    assert (ours.pop("tie_word_embeddings"), theirs.pop("tie_word_embeddings")) == (False, True)
    assert ours == theirs and ours["architectures"] == ["MT5ForConditionalGeneration"]
    exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == "MT5ForConditionalGeneration"
    with torch.no_grad():
        logits = exported(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                          decoder_attention_mask=tgt_mask.long()).logits
    torch.testing.assert_close(logits[tgt_mask], expected[tgt_mask], atol=1e-5, rtol=1e-5)
    back = read_pretrained(tmp_path / "hf")
    assert back.task_options == weights.task_options and back.model == weights.model
    own = net.state_dict()
    assert back.state_dict.keys() == own.keys() and all(torch.equal(back.state_dict[k], t) for k, t in own.items())
    save_t5(tmp_path / "v1.0", "v1.0")
    v10 = t5_net(read_pretrained(tmp_path / "v1.0"))
    v10.cfg.family = "mt5"  # declared mT5, its head scaled as T5 v1.0's
    with pytest.raises(ConfigError, match=r"has no mT5 \(hf export\) equivalent: it never scales the decoder's output"):
        write_hf(v10, None, None, tmp_path / "refused")


@pytest.mark.parametrize(("settings", "message"), [
    ({"num_decoder_layers": 3}, (r"num_decoder_layers=3 beside num_layers=2 \(trident's encoder and decoder have one "
                                 r"model.n_layers\), which trident cannot reproduce exactly$")),
    ({"feed_forward_proj": "gated-relu"}, (r"feed_forward_proj='gated-relu' \(trident has relu, gelu, gelu_new, "
                                           r"gated-gelu, gated-silu\), which trident cannot reproduce exactly$")),
])
def test_a_t5_trident_cannot_hold_is_one_line_naming_the_key(settings: dict[str, object], message: str, tmp_path: Path) -> None:
    save_t5(tmp_path, "v1.1", **settings)
    with pytest.raises(DataError, match=f"^{tmp_path}: {message}"):
        read_pretrained(tmp_path)


def test_an_encoder_decoder_t5_cannot_state_is_one_line_at_export(tmp_path: Path) -> None:
    save_t5(tmp_path / "source", "v1.0")
    weights = read_pretrained(tmp_path / "source")
    net = t5_net(weights)
    net.src_embed.scale = 2.0  # a run with task.scale_embeddings=true
    with pytest.raises(ConfigError, match=r"^task.scale_embeddings=True has no T5 \(hf export\) equivalent: it does not "
                                          r"scale its embeddings$"):
        write_hf(net, weights.tokenizer, None, tmp_path / "hf")


SENTENCES = [("in the beginning was the word", "am anfang war das wort"), ("god said let there be light", "gott sprach es werde licht"),
             ("and there was light", "und es ward licht"), ("the word was god", "das wort war gott")]
PREFIX = "translate english to german: "


@pytest.mark.slow
@pytest.mark.parametrize(("version", "seed", "boost"), DECODED)
def test_train_init_from_t5_fine_tunes_exports_and_translates_as_generate(
        version: str, seed: int, boost: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """train.py task=translation init_from=<T5 directory> (its tokenizer, its decoder start <pad>, a task prefix): two
    steps, then trident-export --format hf loads in transformers with the run's logits, and trident-translate's greedy
    and beam (4) translations are those of transformers' generate on the export (matched as above)."""
    import trident
    from trident.commands.export import main as export
    from trident.commands.translate import main as translate
    from trident.runs.pipeline import train
    from trident.weights.sources import read_init_source

    from .conftest import compose_config
    from .test_translation_init_from import write_tsv
    from .test_translation_train import SMALL_MT

    save_t5(tmp_path / "t5", version, seed=seed, eos_boost=boost)
    held_out = [("the light was god", "das licht war gott"), ("let there be the word", "es werde das wort")]
    splits = {name: write_tsv(tmp_path / f"{name}.tsv", rows) for name, rows in
              (("train", SENTENCES * 8), ("validation", held_out), ("test", held_out))}
    files = ",".join(f"{name}:{path}" for name, path in splits.items())
    overrides = [o for o in SMALL_MT if o not in ("model=nano", "task.max_len_a=0.5", "task.max_len_b=4", "task.beam_size=2")]
    run = tmp_path / "run"
    train(compose_config([*overrides, "data=parallel_files", f"data.files={{{files}}}", f"init_from={tmp_path / 't5'}",
                          f"data.source_prefix='{PREFIX}'", "trainer.max_steps=2", "test=false", "logger=none",
                          "model.dropout=0.0", "task.label_smoothing=0.0", "optimizer.lr=1e-5",
                          "task.max_len_a=0", f"task.max_len_b={LIMIT}", "task.length_penalty=0"], output_dir=run))
    task = trident.load(run)
    assert (task.bos_id, task.pad_id, task.eos_id, task.source_prefix) == (0, 0, EOS_ID, PREFIX)
    again = read_init_source(str(run))  # the run as a later init_from: its decoder start and head stay T5's
    assert again.data_options == {"decoder_start": "<pad>"}
    assert again.task_options["rescale_head"] is (version == "v1.0")
    export([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = [src for src, _ in SENTENCES] + ["the light", "let there be the word and god", "was"]
    batch = tokenizer([PREFIX + text for text in texts], padding=True, return_tensors="pt")
    matched = {"decoder_start_token_id": 0, "eos_token_id": EOS_ID, "pad_token_id": 0, "suppress_tokens": [0],
               "max_new_tokens": LIMIT - 1, "do_sample": False, **batch}
    with torch.no_grad():
        start = torch.zeros(len(texts), 1, dtype=torch.long)
        torch.testing.assert_close(model(**batch, decoder_input_ids=start).logits,
                                   task.net(batch["input_ids"], start), atol=1e-5, rtol=1e-5)
        greedy = [tokenizer.decode(_generated(row), skip_special_tokens=True) for row in model.generate(num_beams=1, **matched)]
        beams = model.generate(num_beams=4, length_penalty=0.0, early_stopping="never", **matched)
    outputs, _ = {}, capsys.readouterr()  # the training's printout aside
    for size in (1, 4):
        translate([str(run), *texts, "--beam-size", str(size)])
        outputs[size] = capsys.readouterr().out.splitlines()
    assert outputs[1] == greedy
    ended = [i for i, row in enumerate(beams) if len(_generated(row)) < LIMIT - 1]
    assert ended, "some beam translation ends before the limit"
    assert [outputs[4][i] for i in ended] == [tokenizer.decode(_generated(beams[i]), skip_special_tokens=True) for i in ended]


# Run by the oldest transformers the [hf] extra allows: each export's logits on the saved inputs.
OLDER_READER = """
import sys, torch, transformers
for version in sys.argv[2:]:
    src, src_mask, tgt, tgt_mask = torch.load(f"{sys.argv[1]}/{version}/inputs.pt")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(f"{sys.argv[1]}/{version}/hf").eval()
    with torch.no_grad():
        logits = model(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                       decoder_attention_mask=tgt_mask.long()).logits
    torch.save(logits, f"{sys.argv[1]}/{version}/older_logits.pt")
"""


@pytest.mark.slow
def test_the_oldest_allowed_transformers_reads_the_t5_export_as_trident_computes_it(tmp_path: Path) -> None:
    """transformers 4 reads tie_word_embeddings as the tying and the scaling both: v1.0's export (tied, scaled),
    v1.1's and mT5's (their own lm_head, unscaled; mT5's written with tie_word_embeddings false) give trident's
    logits there too."""
    import subprocess

    from tests.test_export_older_transformers import older_python, transformers_floor

    python = older_python(transformers_floor())
    expected = {}
    for version in ("v1.0", "v1.1", "mt5"):
        save_t5(tmp_path / version / "source", version)
        weights = read_pretrained(tmp_path / version / "source")
        net = t5_net(weights)
        inputs = padded_pairs(weights.vocab_size)
        torch.save(inputs, tmp_path / version / "inputs.pt")
        with torch.no_grad():
            write_hf(net, weights.tokenizer, None, tmp_path / version / "hf")
            expected[version] = (net(inputs[0], inputs[2]), inputs[3])
    subprocess.run([str(python), "-c", OLDER_READER, str(tmp_path), *expected], check=True, capture_output=True, timeout=600)
    for version, (logits, mask) in expected.items():
        older = torch.load(tmp_path / version / "older_logits.pt")
        torch.testing.assert_close(older[mask], logits[mask], atol=1e-5, rtol=1e-5)


def test_architecture_t5_trains_from_scratch_into_a_network_the_export_writes_as_t5(tmp_path: Path) -> None:
    """python train.py task=translation architecture=t5: T5 v1.1's switches and embeddings (conf/architecture/t5.yaml,
    task/t5_translation.yaml), a network the hf export writes as T5ForConditionalGeneration with its logits."""
    from tests.conftest import compose_config
    from tests.convert_helpers import randomise
    from trident.backbone import TransformerConfig
    from trident.models.seq2seq import EncoderDecoder
    from trident.runs.pipeline import backbone_options

    cfg = compose_config(["task=translation", "architecture=t5", "model=nano", "model.dropout=0.0"], output_dir=tmp_path)
    settings = {key: cfg.task[key] for key in ("tie_embeddings", "scale_embeddings", "rescale_head")}
    assert settings == {"tie_embeddings": "embeddings", "scale_embeddings": False, "rescale_head": False}
    net = EncoderDecoder(TransformerConfig(**backbone_options(cfg)), 50, pad_id=0, **settings)
    randomise(net, seed=2).eval()
    with torch.no_grad():
        write_hf(net, None, None, tmp_path / "hf")
        exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
        src, src_mask, tgt, tgt_mask = padded_pairs(50)
        theirs = exported(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                          decoder_attention_mask=tgt_mask.long()).logits
        torch.testing.assert_close(theirs[tgt_mask], net(src, tgt)[tgt_mask], atol=1e-5, rtol=1e-5)
    assert type(exported).__name__ == "T5ForConditionalGeneration"
