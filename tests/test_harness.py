"""trident-harness (issue 52, item 1): trident's model in EleutherAI's evaluation harness scores and generates as the
harness's own ``hf`` model does on the same model exported to Hugging Face; bad inputs are one line each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.convert_helpers import randomise
from trident.data.tokenization import train_tokenizer
from trident.errors import DataError
from trident.models import generate
from trident.tasks.lm import LanguageModelTask
from trident.tasks.task_in_checkpoint import TASK_KEY
from trident.weights.adapters.hf_export import write_hf

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

CORPUS = [f"Line {i}: the quick brown fox jumps over the lazy dog, and then it rests by the river.\n" for i in range(60)]
QUESTIONS = [
    ("The quick brown", [" fox", " dog", " river", " cat"], 0),
    ("jumps over the", [" lazy dog", " fox", " moon", " quick brown fox"], 0),
    ("and then it", [" rests", " jumps", " runs away", " sleeps by the river"], 0),
    ("Line 3: the", [" quick", " slow", " lazy", " red"], 0),
    ("", [" the quick brown fox", " the lazy dog"], 1),  # an empty context: the prefix token stands before it
]
GENERATE = [{"prompt": "Line 7: the quick", "target": " brown fox"}, {"prompt": "over the", "target": " lazy dog"},
            {"prompt": "the lazy dog, and then it rests by", "target": " the river"}]


def lm_task() -> LanguageModelTask:
    """A GPT-2-shaped trident LM (learned positions, tied head, a byte-level BPE with <|endoftext|>), every weight
    drawn anew: its scores and greedy tokens are far from uniform."""
    tokenizer = train_tokenizer("bpe", CORPUS, vocab_size=300)
    backbone = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 64, "pos_encoding": "learned",
                "activation": "gelu_tanh", "dropout": 0.0}
    task = LanguageModelTask(backbone, tokenizer.get_vocab_size(), {"name": "adamw", "lr": 1e-3}, {"name": "constant"},
                             tokenizer_json=tokenizer.to_str())
    randomise(task.net, seed=0, std=0.3)
    return task.eval()


def write_tasks(folder: Path) -> Path:
    """A multiple-choice task and a generation task over local JSONL files, in the harness's offline form."""
    folder.mkdir()
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (folder / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "gen.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GENERATE))
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (folder / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: [","]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return folder


# Rows in the schemas of the harness's arc_easy (allenai/ai2_arc), hellaswag (Rowan/hellaswag, before its
# process_docs) and lambada_openai (EleutherAI/lambada_openai): numeric labels and 3 or 5 choices as some ARC rows have,
# WikiHow's [header]/[title]/[step] artifacts that hellaswag's preprocess strips, a LAMBADA passage's last word.
ARC = [("Which animal rests by the river?", ["the fox", "the lazy dog", "a quick bird", "the brown cat"], "ABCD", "B"),
       ("What does the quick brown fox do?", ["it jumps over the dog", "it sleeps", "it swims"], "123", "1"),
       ("Where does the lazy dog lie?", ["by the river", "over the fox", "in line 7", "under a tree"], "ABCD", "A"),
       ("Which line comes first?", ["Line 0", "Line 1", "Line 9", "Line 40", "Line 59"], "ABCDE", "A")]
HELLASWAG = [
    ("Walking the dog", "A man walks a lazy dog by the river.", "then the dog",
     ["rests by the river.", "jumps over the quick fox.", "reads a line.", "runs away [title] fast."], "0"),
    ("Home and Garden", "[header] How to rest by a river [title] Find a quiet spot.", "",
     ["[step] Sit by the river and rest.", "Jump over the fox.", "[title] Read line 3.", "Run."], "0"),
    ("Playing fetch", "The quick brown fox jumps over the lazy dog.", "the dog",
     ["sleeps.", "rests by the river, and then it jumps.", "is a fox.", "reads."], "1"),
    ("Resting", "A dog rests by the river.", "then it",
     ["jumps over the fox.", "swims away.", "rests again, by the river.", "sings [step] loudly."], "2"),
]
LAMBADA = ["Line 4: the quick brown fox jumps over the lazy dog, and then it rests by the river",
           "the lazy dog sleeps while the quick brown fox jumps over the dog",
           "and then it rests by the river, where the quick brown fox",
           "Line 12: the quick brown fox jumps over the lazy"]
# task name -> (the harness's own YAML it includes, the split its rows are read as)
REFERENCE_FORMATS = {"arc_easy_local": ("arc/arc_easy.yaml", "test"),
                     "hellaswag_local": ("hellaswag/hellaswag.yaml", "validation"),
                     "lambada_openai_local": ("lambada/lambada_openai.yaml", "test")}


def write_reference_formats(folder: Path) -> None:
    """A few rows in each schema, and a YAML that includes the harness's own task YAML (its prompts, choices, targets,
    metrics and hellaswag's ``process_docs``, resolved beside that file) with only the data read from the local file."""
    import lm_eval.tasks

    rows = {
        "arc_easy_local": [{"id": f"arc{i}", "question": q, "choices": {"text": c, "label": list(labels)}, "answerKey": key}
                           for i, (q, c, labels, key) in enumerate(ARC)],
        "hellaswag_local": [{"ind": i, "activity_label": activity, "ctx_a": a, "ctx_b": b, "ctx": f"{a} {b}".strip(),
                             "endings": endings, "source_id": f"local~{i}", "split": "val", "split_type": "indomain",
                             "label": label} for i, (activity, a, b, endings, label) in enumerate(HELLASWAG)],
        "lambada_openai_local": [{"text": text} for text in LAMBADA],
    }
    harness_tasks = Path(lm_eval.tasks.__file__).parent
    for name, (included, split) in REFERENCE_FORMATS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(f"""include: {harness_tasks / included}
task: {name}
tag: []
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    {split}: {data}
training_split: null
validation_split: {split if split == "validation" else "null"}
test_split: {split if split == "test" else "null"}
""")


SHIPPED = "trident_shakespeare_next_line"
# Every shipped task: multiple choice (next line, which play), LAMBADA's log-likelihood form, generation.
ALL_SHIPPED = [SHIPPED, "trident_shakespeare_play", "trident_shakespeare_last_word", "trident_shakespeare_complete_line"]
SCORED = ["tiny_mc", *ALL_SHIPPED[:3], *REFERENCE_FORMATS]  # the tasks whose requests are log-likelihoods
LIMIT = 8


def evaluate(model: Any, tasks: Path) -> dict[str, Any]:
    """The two local tasks and the three in the harness's formats, whole, and the first LIMIT questions of each shipped
    one (built in the tests' cache)."""
    from lm_eval.tasks import TaskManager

    from trident.runs.harness_tasks import shipped_task_folders

    manager = TaskManager(include_path=[str(tasks), *shipped_task_folders(ALL_SHIPPED)], include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, tasks=["tiny_mc", "tiny_gen", *ALL_SHIPPED, *REFERENCE_FORMATS],
                                      task_manager=manager,
                                      log_samples=True, bootstrap_iters=0, limit=LIMIT)
    assert results is not None
    return results


def same_results(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Identical accuracies, exact matches and chrF; a perplexity (from log-likelihoods within 1e-4) close."""
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value == (pytest.approx(theirs[key], rel=1e-4) if key.startswith("perplexity,") else theirs[key]), key


@pytest.mark.slow  # two harness runs of six small tasks, one through transformers: ~20 s on a shared CPU
def test_trident_and_the_harness_hf_model_agree_request_by_request(tmp_path: Path) -> None:
    from trident.runs.harness import TridentLM

    task = lm_task()
    exported = tmp_path / "hf"
    write_hf(task.net, task.tokenizer, None, exported)
    tasks = write_tasks(tmp_path / "tasks")
    write_reference_formats(tasks)
    eot = task.tokenizer.token_to_id("<|endoftext|>")
    ours = evaluate(TridentLM(task.net, task.tokenizer, eot_token_id=eot, prefix_token_id=eot, batch_size=3), tasks)
    from lm_eval.models.huggingface import HFLM

    theirs = evaluate(HFLM(pretrained=str(exported), device="cpu", batch_size=1), tasks)
    for name in ("tiny_mc", "tiny_gen", *ALL_SHIPPED, *REFERENCE_FORMATS):
        same_results(ours["results"][name], theirs["results"][name])
    assert {"acc,none", "acc_norm,none"} <= ours["results"]["arc_easy_local"].keys() & ours["results"]["hellaswag_local"].keys()
    assert {"acc,none", "perplexity,none"} <= ours["results"]["lambada_openai_local"].keys()
    assert [len(ours["samples"][name]) for name in REFERENCE_FORMATS] == [len(ARC), len(HELLASWAG), len(LAMBADA)]
    query = ours["samples"]["hellaswag_local"][1]["doc"]["query"]  # hellaswag's own preprocess ran
    assert query == "Home and Garden: How to rest by a river. Find a quiet spot." and "[" not in query
    ours_mc = ours["samples"]["tiny_mc"]
    assert len(ours_mc) == len(QUESTIONS) and all(len(ours["samples"][name]) == LIMIT for name in ALL_SHIPPED)
    scored = [row for name in SCORED for row in ours["samples"][name]]
    for a, b in zip(scored, [row for name in SCORED for row in theirs["samples"][name]], strict=True):
        scores_a = [response[0] for response in a["resps"]]
        scores_b = [response[0] for response in b["resps"]]
        assert [greedy for _, greedy in scores_a] == [greedy for _, greedy in scores_b]
        torch.testing.assert_close(torch.tensor([s for s, _ in scores_a], dtype=torch.float64),
                                   torch.tensor([s for s, _ in scores_b], dtype=torch.float64), atol=1e-4, rtol=0)
    assert len({round(s, 3) for a in ours_mc for (s, _), in a["resps"]}) > 10, "scores too uniform to compare"
    for name in ("tiny_gen", "trident_shakespeare_complete_line"):
        generated = [row["filtered_resps"] for row in ours["samples"][name]]
        assert generated == [row["filtered_resps"] for row in theirs["samples"][name]]
        assert any(text[0] for text in generated), f"{name}: nothing generated to compare"


def test_rolling_log_likelihood_is_the_sum_over_windows_of_the_whole_text(tmp_path: Path) -> None:
    """A text longer than the context, scored in windows: each token once, as one pass scores it within the context."""
    from lm_eval.api.instance import Instance

    from trident.runs.harness import TridentLM

    task = lm_task()
    eot = task.tokenizer.token_to_id("<|endoftext|>")
    model = TridentLM(task.net, task.tokenizer, eot_token_id=eot, prefix_token_id=eot, batch_size=2)
    short = "the quick brown fox"
    request = Instance("loglikelihood_rolling", {}, (short,), 0)
    ids = [eot, *task.tokenizer.encode(short).ids]
    with torch.no_grad():
        log_probs = torch.log_softmax(task.net(torch.tensor([ids[:-1]])).float(), -1)[0]
    expected = float(log_probs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
    assert model.loglikelihood_rolling([request]) == pytest.approx([expected], abs=1e-4)
    long = " ".join(CORPUS[:3])
    assert len(task.tokenizer.encode(long).ids) > 64
    (score,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long,), 0)])
    assert score < 0
    with pytest.raises(DataError, match=r"a continuation of \d+ tokens is longer than the model.s context of 64"):
        model.loglikelihood([Instance("loglikelihood", {}, ("The", " fox" * 65), 0)])
    # The same model exported and read back from its Hugging Face directory: the same scores, the same end of text.
    from trident.runs.harness import harness_model

    write_hf(task.net, task.tokenizer, None, tmp_path / "hf")
    read_back = harness_model(tmp_path / "hf", batch_size=2, chat=False)
    assert (read_back.eot_token_id, read_back.prefix_token_id, read_back.max_length) == (eot, eot, 64)
    requests = [Instance("loglikelihood_rolling", {}, (text,), 0) for text in (short, long)]
    assert read_back.loglikelihood_rolling(requests) == pytest.approx(model.loglikelihood_rolling(requests), abs=1e-4)


def test_the_chat_template_renders_the_harness_turns_and_its_absence_is_one_line() -> None:
    from trident.data.chat_template import read_template
    from trident.runs.harness import TridentLM

    task = lm_task()
    eot = task.tokenizer.token_to_id("<|endoftext|>")
    template = read_template("default", "char")
    model = TridentLM(task.net, task.tokenizer, eot_token_id=eot, prefix_token_id=eot, chat=template)
    turns = [{"role": "user", "content": "Which line follows?"}]
    assert model.apply_chat_template(turns) == template.render(turns, add_generation_prompt=True)  # type: ignore[arg-type]
    assert model.chat_template(True) == template.text
    plain = TridentLM(task.net, task.tokenizer, eot_token_id=eot, prefix_token_id=eot)
    with pytest.raises(DataError, match="has no chat template: run trident-harness without --apply_chat_template"):
        plain.apply_chat_template(turns)


def test_generate_until_cuts_at_stop_strings_and_max_tokens_greedy_or_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most max_gen_toks new tokens; greedy: the text before the first stop string, whatever the batch; sampled:
    the same texts from the same seed."""
    from lm_eval.api.instance import Instance

    import trident.runs.harness
    from trident.runs.harness import TridentLM

    task = lm_task()
    eot = task.tokenizer.token_to_id("<|endoftext|>")
    prompts = ["Line 7: the quick", "over the", "and then it rests by the"]
    made: list[int] = []  # the new tokens of each generate call

    def counted(net: Any, ids: torch.Tensor, new_tokens: int, **settings: Any) -> torch.Tensor:
        out = generate(net, ids, new_tokens, **settings)
        made.append(out.size(1) - ids.size(1))
        return out

    monkeypatch.setattr(trident.runs.harness, "generate", counted)

    def run(settings: dict[str, Any], batch_size: int) -> list[str]:
        model = TridentLM(task.net, task.tokenizer, eot_token_id=eot, prefix_token_id=eot, batch_size=batch_size)
        return model.generate_until([Instance("generate_until", {}, (p, dict(settings)), i) for i, p in enumerate(prompts)])

    free = run({"until": [], "max_gen_toks": 12, "do_sample": False}, 1)
    assert made == [12, 12, 12] and all(free)
    stop = next(c for c in free[0][1:] if c.isascii() and c.isalnum())  # a character the first text generates
    stopped = run({"until": [stop], "max_gen_toks": 12, "do_sample": False}, 3)
    assert stopped == [text.split(stop)[0] for text in free]
    sampled = {"until": [], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    torch.manual_seed(3)
    first = run(sampled, 3)
    torch.manual_seed(3)
    assert run(sampled, 3) == first != free


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from trident.commands.harness import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


def test_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    import lm_eval.tasks

    # The harness's own thousands of task files take half a minute to index: the unknown name is looked up without.
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    tasks = write_tasks(tmp_path / "tasks")
    assert "--limit: must be > 0" in refused([str(tmp_path), "--tasks", "tiny_mc", "--limit", "0"], capsys)
    assert "--wandb_args: must be key=value" in refused([str(tmp_path), "--tasks", "tiny_mc", "--wandb_args", "x"], capsys)
    line = refused([str(tmp_path), "--tasks", "tiny_mcq", "--include_path", str(tasks)], capsys)
    assert line.startswith("error: unknown task 'tiny_mcq'") and "did you mean tiny_mc?" in line
    for name, target, other in (("vit", "trident.tasks.vit.ImageClassificationTask", "trident-eval (test accuracy)"),
                                ("translation", "trident.tasks.translation.TranslationTask", "trident-translate")):
        checkpoint = tmp_path / f"{name}.ckpt"
        torch.save({TASK_KEY: target, "hyper_parameters": {}, "state_dict": {}}, checkpoint)  # refused unread
        line = refused([str(checkpoint), "--tasks", "tiny_mc", "--include_path", str(tasks)], capsys)
        assert f"task={name} model, which the harness cannot score" in line and other in line


def test_the_shipped_next_line_questions_come_from_their_text_and_are_built_alike() -> None:
    """Each question: a speaker and up to 4 of its lines, then the line that follows among 4 distinct lines of the
    text; the same seed builds the same questions."""
    import random

    from trident.runs.harness_tasks import next_line_items

    speeches = [f"SPEAKER{s}:\n" + "\n".join(f"line {s}.{j} of speech {s}" for j in range(2 + s % 7)) for s in range(80)]
    text = "the end of a speech cut by the split\n\n" + "\n\n".join(speeches) + "\n"
    items = next_line_items(text, random.Random(0))
    assert len(items) == 200 and items == next_line_items(text, random.Random(0))
    for item in items:
        passage, choices, answer = str(item["passage"]), list(item["choices"]), int(item["answer"])  # type: ignore[call-overload]
        assert len(set(choices)) == 4
        speaker, *lines = passage.rstrip("\n").split("\n")
        assert speaker.startswith("SPEAKER") and speaker.endswith(":") and 1 <= len(lines) <= 4
        assert "\n".join([*lines, choices[answer]]) + "\n" in text  # the line that follows the passage's lines
        assert all(line.endswith(f"of speech {speaker[7:-1]}") for line in [*lines, choices[answer]])  # its speech
    assert {int(item["answer"]) for item in items} == {0, 1, 2, 3}  # type: ignore[call-overload]


@pytest.mark.slow
def test_the_command_writes_the_harness_results_in_the_run(lm_reference_run: tuple[Path, dict[str, float]],
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trident.commands.harness import main

    run, _ = lm_reference_run
    tasks = write_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    main([str(run), "--tasks", "tiny_mc,tiny_gen", "--include_path", str(tasks), "--limit", "3", "--batch_size", "2",
          "--log_samples", "--output_path", str(out), "--wandb_args", "project=trident-tests", "mode=offline"])
    assert "tiny_mc" in capsys.readouterr().out
    (results,) = out.glob("results_*.json")
    written = json.loads(results.read_text())
    assert set(written["results"]) == {"tiny_mc", "tiny_gen"} and "acc,none" in written["results"]["tiny_mc"]
    (samples,) = out.glob("samples_tiny_mc_*.jsonl")
    assert len(samples.read_text().splitlines()) == 3

    # W&B, as the harness's own --wandb_args logs it: metrics in the summary, each task's samples as a table.
    from trident.tracking.wandb_files import wait_for_offline_runs

    (wandb_run,) = wait_for_offline_runs(out)
    assert wandb_run.summary["tiny_mc/acc"] == written["results"]["tiny_mc"]["acc,none"]
    tables = {key: row[key] for row in wandb_run.history for key in row if key.endswith("eval_results")}
    assert set(tables) == {"evaluation/eval_results", "tiny_mc_eval_results", "tiny_gen_eval_results"}
    table = json.loads((wandb_run.path.parent / "files" / tables["tiny_mc_eval_results"]["path"]).read_text())
    assert len(table["data"]) == 3 and "acc" in table["columns"]  # one row per document scored


def test_the_shipped_play_last_word_and_line_questions_come_from_their_text() -> None:
    """Which play: lines of that play (no speaker) among 4 distinct titles; the last word: a line's context and word
    make the line (its punctuation dropped); the rest of a line: prompt and target make the line."""
    import random

    from trident.runs.harness_shakespeare import cloze_items, completion_items, play_items

    def play(name: str) -> str:
        return "\n\n".join(f"{name.upper()}{s}:\n" + "\n".join(f"in {name} speech {s} line {j} ends here, friend{'abcd'[j]}."
                                                              for j in range(2 + s % 3)) for s in range(30)) + "\n"

    plays = [(f"Play {k}", play(f"play{k}")) for k in range(6)]
    items = play_items(plays, random.Random(0), 50, 4, 4)
    assert items == play_items(plays, random.Random(0), 50, 4, 4)
    for item in items:
        passage, choices, answer = str(item["passage"]), list(item["choices"]), int(item["answer"])  # type: ignore[call-overload]
        assert len(set(choices)) == 4 and all(choice.startswith(" Play ") for choice in choices)
        lines = passage.rstrip("\n").split("\n")
        assert 1 <= len(lines) <= 4 and not any(line.endswith(":") for line in lines)
        assert all(line.startswith(f"in play{choices[answer][6:]} ") for line in lines)
    assert {int(item["answer"]) for item in items} == {0, 1, 2, 3}  # type: ignore[call-overload]
    text = plays[0][1]
    cloze = cloze_items(text, random.Random(0), 40, 4)
    assert len(cloze) == 40 and cloze == cloze_items(text, random.Random(0), 40, 4)
    for item in cloze:
        context, word = str(item["context"]), str(item["word"])
        assert word in (" frienda", " friendb", " friendc", " friendd")
        assert context.split("\n")[0].startswith("PLAY0") and len(context.split("\n")) <= 5
        assert context + word + "." in text  # the line, cut before its last word's punctuation
    lines = completion_items(text, random.Random(0), 40, 4)
    assert len(lines) == 40
    for item in lines:
        prompt, target = str(item["prompt"]), str(item["target"])
        assert target.startswith(" ") and target[-9:-2] == " friend"
        assert prompt + target + "\n" in text and len(prompt.split("\n")[-1].split()) == 4  # 4 of a line's 9 words
