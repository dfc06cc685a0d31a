"""Segment-level recurrence (model.memory_length, Transformer-XL): the memory, its data order, its decoding."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from trident.backbone import Encoder, TransformerConfig
from trident.data.lm import LMDataModule
from trident.errors import ConfigError
from trident.models import CausalLM, generate
from trident.runs.pipeline import check_config, train

from .conftest import SMALL, compose_config

SEGMENT = 6
VOCAB = 50


def shape(**settings: Any) -> TransformerConfig:
    options = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "dropout": 0.0, "max_seq_len": SEGMENT,
               "pos_encoding": "rope", **settings}
    return TransformerConfig(**options)


def pair(memory_length: int, **settings: Any) -> tuple[CausalLM, CausalLM]:
    """A float64 model with the memory and the same weights without it."""
    torch.manual_seed(0)
    net = CausalLM(shape(memory_length=memory_length, **settings), VOCAB).double().eval()
    plain = CausalLM(shape(**settings), VOCAB).double().eval()
    plain.load_state_dict(net.state_dict())
    return net, plain


@pytest.mark.parametrize(("pos_encoding", "norm_first"),
                         [("rope", True), ("alibi", True), ("relative", True), ("none", True), ("rope", False)])
def test_logits_with_memory_equal_one_pass_over_the_concatenated_segments(pos_encoding: str, norm_first: bool) -> None:
    net, plain = pair(SEGMENT, pos_encoding=pos_encoding, norm_first=norm_first)
    ids = torch.randint(0, VOCAB, (3, 2 * SEGMENT))
    memory = net.new_memory()
    first, second = net(ids[:, :SEGMENT], memory=memory), net(ids[:, SEGMENT:], memory=memory)
    whole = plain(ids)  # (3, 2S, V): the second segment sees the first, whose states a causal pass never changes
    torch.testing.assert_close(first, whole[:, :SEGMENT], rtol=0, atol=1e-10)
    torch.testing.assert_close(second, whole[:, SEGMENT:], rtol=0, atol=1e-10)
    # Without the memory the second segment reads differently: the test compares something.
    assert (net(ids[:, SEGMENT:]) - whole[:, SEGMENT:]).abs().max() > 1e-3


@pytest.mark.parametrize("pos_encoding", ["rope", "alibi", "relative", "none", "learned", "sinusoidal"])
def test_without_a_memory_none_of_its_code_runs(pos_encoding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """model.memory_length=0 is the model as it was (review): no SegmentMemory is made or read by a pass, a cached
    decoding or the task's stages; and an empty memory (a first segment) gives the very same bits as no memory."""
    from trident.backbone import SegmentMemory
    from trident.tasks.lm import LanguageModelTask

    ids = torch.randint(0, VOCAB, (2, SEGMENT))
    if pos_encoding not in ("learned", "sinusoidal"):  # refused with a memory
        net, plain = pair(SEGMENT, pos_encoding=pos_encoding)
        assert torch.equal(net(ids, memory=net.new_memory()), plain(ids))

    def ran(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the memory's code ran for model.memory_length=0")

    for name in ("__init__", "prefix", "prefix_length", "record", "advance"):
        monkeypatch.setattr(SegmentMemory, name, ran)
    torch.manual_seed(0)
    task = LanguageModelTask(backbone=vars(shape(pos_encoding=pos_encoding)), vocab_size=VOCAB, optimizer={"lr": 1e-3},
                             scheduler={}).eval()
    for stage in ("train", "val", "test"):
        task.outputs((ids, ids), stage)
    assert generate(task.net, ids[:, :2], SEGMENT - 2, temperature=0.0).shape == (2, SEGMENT)
    assert not task.memories and task.net.context_length == SEGMENT


def test_a_memory_longer_than_a_segment_reaches_back_over_several() -> None:
    net, plain = pair(2 * SEGMENT, pos_encoding="alibi")
    ids = torch.randint(0, VOCAB, (2, 3 * SEGMENT))
    memory = net.new_memory()
    pieces = [net(ids[:, i * SEGMENT:(i + 1) * SEGMENT], memory=memory) for i in range(3)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), plain(ids), rtol=0, atol=1e-10)
    assert memory.held == 2 * SEGMENT
    # A memory shorter than the segment keeps the last states only.
    short, _ = pair(SEGMENT // 2)
    kept = short.new_memory()
    short(ids[:, :SEGMENT], memory=kept)
    assert kept.held == SEGMENT // 2 and kept.filled == 0


def test_no_gradient_flows_into_the_memory() -> None:
    net, _ = pair(SEGMENT)
    net.train()
    ids = torch.randint(0, VOCAB, (2, 2 * SEGMENT))
    memory = net.new_memory()
    net(ids[:, :SEGMENT], memory=memory)
    assert all(state is not None and not state.requires_grad for state in memory.states)
    net(ids[:, SEGMENT:], memory=memory).sum().backward()
    with_memory = {name: p.grad.clone() for name, p in net.named_parameters()}
    # The same memory computed without any graph gives the same gradients: nothing reached back into segment 1.
    net.zero_grad()
    again = net.new_memory()
    with torch.no_grad():
        net(ids[:, :SEGMENT], memory=again)
    net(ids[:, SEGMENT:], memory=again).sum().backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, with_memory[name], rtol=0, atol=1e-12)


def test_cached_decoding_agrees_with_reading_in_segments() -> None:
    """A prompt longer than a segment goes in with the cache, then a token at a time: each token's logits are those of
    reading the whole text segment by segment with the memory (the cache restarts from the memory as segments end)."""
    net, _ = pair(SEGMENT // 2 + 1, pos_encoding="relative")
    ids = torch.randint(0, VOCAB, (2, 3 * SEGMENT + 2))
    read = net(ids)  # no cache: segments of S, each on the memory of the ones before
    cache = net.new_cache(ids.size(1))
    prompt = SEGMENT + 2
    pieces = [net(ids[:, :prompt], cache=cache)] + [net(ids[:, t:t + 1], cache=cache) for t in range(prompt, ids.size(1))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), read, rtol=0, atol=1e-10)
    assert net.context_length is None  # any length, segment by segment
    with_cache = generate(net.float(), ids[:, :prompt], SEGMENT, temperature=0.0)  # past the next segment's end
    without = generate(net, ids[:, :prompt], SEGMENT, temperature=0.0, use_cache=False)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize(("settings", "words"), [
    ({"pos_encoding": "learned"}, "absolute positions repeat"),
    ({"pos_encoding": "sinusoidal"}, "absolute positions repeat"),
    ({"attention": "performer"}, "model.attention=softmax"),
    ({"attention_window": 4}, "sliding window"),
    ({"memory_length": -1}, "integer >= 0"),
])
def test_what_a_memory_does_not_compose_with_is_refused_in_one_line(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        shape(**{"memory_length": 4, **settings})


def test_a_memory_serves_a_causal_lm_only() -> None:
    with pytest.raises(ConfigError, match="decoder-only causal LM"):
        Encoder(shape(memory_length=4))
    net, _ = pair(SEGMENT)
    prompt = torch.randint(1, VOCAB, (2, 4))
    padding = torch.zeros(2, 4, dtype=torch.bool)
    padding[0, 0] = True
    with pytest.raises(ConfigError, match="one at a time"):
        generate(net, prompt, 2, padding=padding)


def test_the_task_carries_each_stages_memory_from_batch_to_batch() -> None:
    """Micro-batch k + 1 (of one optimizer step or the next) continues micro-batch k's rows; validation keeps its own
    memory; each epoch starts empty."""
    from trident.tasks.lm import LanguageModelTask

    torch.manual_seed(0)
    task = LanguageModelTask(backbone=vars(shape(memory_length=SEGMENT)), vocab_size=VOCAB, optimizer={"lr": 1e-3},
                             scheduler={}).double().eval()
    plain = CausalLM(shape(), VOCAB).double().eval()
    plain.load_state_dict(task.net.state_dict())
    ids = torch.randint(0, VOCAB, (2, 2 * SEGMENT + 1))
    first, second = ((ids[:, i * SEGMENT:(i + 1) * SEGMENT], ids[:, i * SEGMENT + 1:(i + 1) * SEGMENT + 1]) for i in (0, 1))
    whole = plain(ids[:, :-1])
    task.outputs(first, "train")
    task.outputs(first, "val")  # a validation between the two micro-batches leaves the training memory as it was
    torch.testing.assert_close(task.outputs(second, "train").logits, whole[:, SEGMENT:], rtol=0, atol=1e-10)
    task.on_validation_epoch_start()  # each validation starts with an empty memory of its own
    torch.testing.assert_close(task.outputs(second, "val").logits, plain(second[0]), rtol=0, atol=1e-10)
    task.on_train_epoch_start()
    torch.testing.assert_close(task.outputs(second, "train").logits, plain(second[0]), rtol=0, atol=1e-10)


def test_a_distillation_teacher_with_a_memory_carries_its_own() -> None:
    """distill=kd from a teacher trained with a memory: it reads the contiguous batches with a memory of its own (not
    each batch alone), emptied with the student's at each epoch's start (review)."""
    from trident.tasks.lm import LanguageModelTask
    from trident.tasks.teacher import TEACHER

    torch.manual_seed(0)
    task = LanguageModelTask(backbone=vars(shape(memory_length=SEGMENT)), vocab_size=VOCAB, optimizer={"lr": 1e-3},
                             scheduler={}).double().eval()
    teacher, plain = pair(SEGMENT)
    task.companions[TEACHER] = teacher
    ids = torch.randint(0, VOCAB, (2, 2 * SEGMENT + 1))
    first, second = ((ids[:, i * SEGMENT:(i + 1) * SEGMENT], ids[:, i * SEGMENT + 1:(i + 1) * SEGMENT + 1]) for i in (0, 1))
    task.outputs(first, "train")
    taught = task.outputs(second, "train")
    torch.testing.assert_close(taught.teacher, plain(ids[:, :-1])[:, SEGMENT:], rtol=0, atol=1e-10)
    task.on_train_epoch_start()
    torch.testing.assert_close(task.outputs(second, "train").teacher, plain(second[0]), rtol=0, atol=1e-10)


def test_exports_without_a_memory_refuse_a_model_with_one(tmp_path: Path) -> None:
    from trident.commands.export import export_gguf, export_hf
    from trident.tasks.lm import LanguageModelTask

    llama = shape(memory_length=4, norm="rmsnorm", activation="swiglu", bias=False)
    task = LanguageModelTask(backbone=vars(llama), vocab_size=VOCAB, optimizer={"lr": 1e-3}, scheduler={},
                             tie_embeddings=False)
    for export in (export_hf, export_gguf):
        with pytest.raises(ConfigError, match="model.memory_length=4 has no .* equivalent: it keeps no memory"):
            export(task, tmp_path / export.__name__)


def corpus_module(tmp_path: Path, **options: Any) -> LMDataModule:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line number {i} of a small local corpus.\n" for i in range(300)))
    module = LMDataModule(source="files", files=[str(corpus)], block_size=16, batch_size=3,
                          cache_dir=str(tmp_path / "cache"), contiguous=True, **options)
    module.prepare_data()
    module.setup("fit")
    return module


def test_contiguous_order_continues_each_row_from_batch_to_batch(tmp_path: Path) -> None:
    module = corpus_module(tmp_path)
    stream = torch.from_numpy(module.splits["train"].astype("int64"))
    batches = list(module.train_dataloader())
    assert len(batches) > 2 and all(x.shape == (3, 16) for x, _ in batches)
    for (x, y), (after, _) in itertools.pairwise(batches):
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(after[:, 0], y[:, -1])  # row b's next segment starts where its last one's targets ended
    rows = torch.cat([x for x, _ in batches], dim=1)  # (3, segments * 16): each row one stretch of the text
    stride = (len(stream) - 1) // 3
    for b in range(3):
        assert torch.equal(rows[b], stream[b * stride: b * stride + rows.size(1)])
    assert [x.tolist() for x, _ in module.train_dataloader()] == [x.tolist() for x, _ in batches]  # no shuffling
    # Resumed two batches in, the run reads the batch it would have read.
    module.load_state_dict({"epoch": 0, "batches_done": 2})
    assert torch.equal(next(iter(module.train_dataloader()))[0], batches[2][0])


def test_each_rank_reads_its_own_contiguous_streams(tmp_path: Path) -> None:
    module = corpus_module(tmp_path)
    batches = {}
    for rank in (0, 1):
        module.shard = lambda rank=rank: {"num_replicas": 2, "rank": rank}  # type: ignore[method-assign]
        batches[rank] = [x for x, _ in module.train_dataloader()]
    assert len(batches[0]) == len(batches[1])
    # A DistributedSampler already: Lightning keeps it, not wrapping it in a second sharding of its rows (a 2-process
    # train.py run with model.memory_length read each rank's own streams, each with its own memory: the review).
    assert isinstance(module.train_dataloader().sampler, DistributedSampler)
    stream = torch.from_numpy(module.splits["train"].astype("int64"))
    stride = (len(stream) - 1) // 6  # 2 ranks x 3 rows
    for rank in (0, 1):
        rows = torch.cat(batches[rank], dim=1)
        for b in range(3):
            start = (rank * 3 + b) * stride
            assert torch.equal(rows[b], stream[start: start + rows.size(1)])
    # Evaluation on a split too short for 3 streams per rank reads fewer rows, still contiguous.
    module.shard = lambda: {"num_replicas": 1, "rank": 0}  # type: ignore[method-assign]
    module.splits["validation"] = module.splits["validation"][: 2 * 16 + 1]
    assert [x.shape for x, _ in module.val_dataloader()] == [(2, 16)]


def test_contiguous_data_is_plain_texts(tmp_path: Path) -> None:
    from trident.data.mlm import MLMDataModule

    with pytest.raises(ConfigError, match="data.contiguous=false"):
        MLMDataModule(contiguous=True)


def test_memory_length_sets_the_contiguous_order_and_refuses_what_breaks_it(tmp_path: Path) -> None:
    cfg = compose_config([*SMALL, "model.memory_length=16"], output_dir=tmp_path)
    assert cfg.data.contiguous is True and compose_config(SMALL, output_dir=tmp_path).data.contiguous is False
    check_config(cfg)
    for override, words in [("data.contiguous=false", "data.contiguous=true"),
                            ("data.max_seq_len=64", "set data.block_size=64 .*, or data.max_seq_len=32"),
                            ("pos_encoding=learned", "absolute positions"),
                            ("data=chat", "contiguous segments; data=chat")]:
        with pytest.raises(ConfigError, match=words):
            check_config(compose_config([*SMALL, "model.memory_length=16", override], output_dir=tmp_path))


@pytest.mark.parametrize("task", [["task=classify", "task.stack=decoder", "task.pool=last"], ["task=mlm"],
                                  ["task=translation"]])
def test_a_memory_is_refused_for_other_tasks_before_any_work(task: list[str], tmp_path: Path) -> None:
    """task=classify with task.stack=decoder built a causal stack that took model.memory_length and never used it
    (review): every task but lm refuses it in one line, before the data is prepared."""
    with pytest.raises(ConfigError, match="serves task=lm's causal LM, not task="):
        check_config(compose_config(["model=nano", "pos_encoding=rope", "model.memory_length=16", *task],
                                    output_dir=tmp_path))


def test_another_task_from_an_lm_with_a_memory_reads_without_one(tmp_path: Path) -> None:
    """init_from an LM trained with a memory into task=classify: the memory (no weights of its own) is not carried over,
    where the refusal above would then leave no way to start (review)."""
    from trident.weights.init_from import settings_fixed_by
    from trident.weights.pretrained import PretrainedWeights

    source = PretrainedWeights(source="lm-run", format="trident", task="lm", model={"memory_length": 16},
                               pos_encoding="rope", task_options={}, data_options={}, state_dict={}, tokenizer=None)
    classify = compose_config(["task=classify", "task.stack=decoder", "task.pool=last", "pos_encoding=rope"],
                              output_dir=tmp_path)
    assert "model.memory_length" not in settings_fixed_by(classify, source, [])
    lm = compose_config(["pos_encoding=rope"], output_dir=tmp_path)
    assert settings_fixed_by(lm, source, [])["model.memory_length"] == 16  # task=lm keeps the source's


@pytest.mark.slow
def test_a_run_with_memory_trains_evaluates_and_samples(tmp_path: Path) -> None:
    """train.py's pipeline with a memory: contiguous segments over two micro-batches a step, validation and test read
    with their own memory, samples decoded with it."""
    metrics = train(compose_config([*SMALL, "model.memory_length=16", "pos_encoding=alibi",
                                    "trainer.accumulate_grad_batches=2", "trainer.limit_val_batches=2"],
                                   output_dir=tmp_path / "run"))
    assert all(torch.isfinite(torch.tensor(metrics[key])) for key in ("val/loss", "test/loss", "train/loss"))
