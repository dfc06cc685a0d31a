"""The weights room names no task and no task or data setting (issue 51, item 5): which settings an ``init_from`` source
fixes, and what only it holds (a tokenizer, a chat template), each task and data module says for itself
(``TridentTask.settings_from_source``, ``TridentDataModule.settings_from_source`` / ``stage_source``); weights/ only
calls those hooks. The adapters of outside formats included: they say what a family's files hold in the words of
networks (trident.models.properties), and the task that holds such a network maps that onto its settings
(``TridentTask.OUTSIDE_NETWORK``, ``FROM_NETWORK``). The scan reads the code of ``src/trident/weights`` (string literals,
f-strings, ``cfg.task.<key>`` / ``cfg.data.<key>`` attributes and keyword arguments; not docstrings or comments) for a
task's name, a task's or data module's setting, or a config path into either group naming one.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import trident
import trident.data.chat  # (a data module no task names as its DATA_MODULE: data=chat)
from trident.data.base import TridentDataModule
from trident.tasks.base import TridentTask
from trident.tasks.registry import TASKS

WEIGHTS = Path(trident.__file__).parent / "weights"
# Words that are a task's name or a task's or data module's setting and something generic in the weights room too, each
# with its reason. Alone, such a word is the generic thing; a config path into the task or data group (``data.std``,
# ``task=vit``) still names the setting or the task, whatever the word.
GENERIC = {
    "max_seq_len": "the backbone's context length (a TransformerConfig field): a bounded position table has one row a "
                   "position, whatever the task",
    "source": "what a source of weights was read from (PretrainedWeights.source), not data.source",
    "tokenizer": "the tokenizer a source of weights comes with (PretrainedWeights.tokenizer), not data.tokenizer",
    "max_length": "a tokenizer's own truncation and padding length (tokenizers' truncation/padding, transformers' "
                  "tokenizer_config.json key), not data.max_length",
    "seed": "no setting of the weights room is called so; a run's seed is no task's or data's own",
    "vocab_size": "the rows of a network's token embedding (CausalLM's and MaskedLM's own argument and attribute, and "
                  "the key Hugging Face's config.json gives them), whatever the task; data.vocab_size is the size a "
                  "tokenizer is trained to",
    "image_size": "the image side a ViT's learned position grid was built for (grid side x patch side: one row a patch, "
                  "as max_seq_len's one row a position), and the key Hugging Face's ViTConfig gives it",
    "patch_size": "the side of a ViT's patch embedding kernel (VisionTransformer's own argument, a shape of its weights), "
                  "and the key Hugging Face's ViTConfig gives it",
    "mean": "the key timm's pretrained_cfg gives the per-channel pixel mean a network was trained with (a format's word; "
            "the task maps the property onto data.mean)",
    "std": "the key timm's pretrained_cfg gives the per-channel pixel std a network was trained with (as mean)",
    "vit": "Hugging Face's model_type of a ViT and trident's model family of it (conf/architecture/vit.yaml): a format's "
           "and the backbone's word, which the task took its name from",
    "clip": "Hugging Face's model_type of a CLIPModel (a format's word), which the task took its name from, as vit",
    "electra": "Hugging Face's model_type of ELECTRA and trident's model family of it (conf/architecture/electra.yaml), "
               "which the task took its name from, as vit",
    "logits_bias": "EncoderDecoder's buffer of BART's final_logits_bias (a key of its state dict, as transformers' "
                   "final_logits_bias is of BART's); the task maps the property onto task.logits_bias",
    "embed_dim": "the key timm's model_args give a ViT's width and open_clip's model_cfg the projection width (a "
                 "format's word; the task maps the property onto task.embed_dim)",
}


def _parameters(cls: type, base: type) -> set[str]:
    """The constructor arguments of ``cls`` that ``base``'s constructor does not take."""
    return set(inspect.signature(cls.__init__).parameters) - set(inspect.signature(base.__init__).parameters)


def _data_modules() -> set[type[TridentDataModule]]:
    found: set[type[TridentDataModule]] = set()
    todo: list[type[TridentDataModule]] = [TridentDataModule]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return found


def _words() -> tuple[set[str], set[str]]:
    """The task names, and every task's and data module's own settings."""
    names = set(TASKS)
    keys = set().union(*(_parameters(task, TridentTask) for task in TASKS.values()))
    keys |= set().union(*(_parameters(data, TridentDataModule) for data in _data_modules()))
    return names, keys


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the nodes that are docstrings (a module's, a class's, a function's first statement)."""
    owners = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))]
    return {id(owner.body[0].value) for owner in owners if owner.body and isinstance(owner.body[0], ast.Expr)
            and isinstance(owner.body[0].value, ast.Constant) and isinstance(owner.body[0].value.value, str)}


def findings(path: Path, names: set[str], keys: set[str], root: Path = WEIGHTS) -> list[str]:
    """Each place in ``path`` (under ``root``) that names a task or a task's or data module's setting."""
    tree = ast.parse(path.read_text())
    skipped = _docstrings(tree)
    alone = (names | keys) - set(GENERIC)  # what a word names by itself
    found = []
    for node in ast.walk(tree):
        words: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            text = node.value
            words += [text] if text in alone else []
            words += [f"{m[0]}.{m[1]}" for m in re.findall(r"\b(task|data)\.(\w+)", text) if m[1] in keys]
            words += [f"task={m}" for m in re.findall(r"\btask=(\w+)", text) if m in names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr in ("task", "data"):
            words += [f"{node.value.attr}.{node.attr}"] if node.attr in keys else []
        elif isinstance(node, ast.keyword) and node.arg in alone:
            words.append(f"{node.arg}=")
        elif (isinstance(node, ast.keyword) and node.arg == "task" and isinstance(node.value, ast.Constant)
              and node.value.value in names):  # a task named as one, generic word or not: task="vit"
            words.append(f"task={node.value.value}")
        found += [f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}: {word}" for word in words]
    return found


def scanned() -> list[Path]:
    return sorted(WEIGHTS.rglob("*.py"))


def test_the_weights_room_names_no_task_and_no_task_or_data_setting() -> None:
    names, keys = _words()
    found = [line for path in scanned() for line in findings(path, names, keys)]
    assert not found, "weights/ names what a task's or data's hook should say:\n" + "\n".join(found)


def test_the_scan_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The words it looks for are there (a registry that lost its tasks would find nothing), and a file that names a
    task, a task setting and a data path is caught each way, a generic word too where it is a path into the task or
    data group; a docstring is prose, and a generic word alone is its generic thing."""
    names, keys = _words()
    assert {"lm", "vit", "classify"} <= names and {"pool", "stack", "patch_size", "image_size", "template"} <= keys
    planted = tmp_path / "planted.py"
    planted.write_text('X = ("pool", "stack", "patch_size")\n'
                       'def f(cfg, source):\n'
                       '    """task=lm and data.template in a docstring are prose."""\n'
                       '    if source.task == "mlm":\n'
                       '        return {"data.template": cfg.data.cache_dir, "task": f"task=classify", "vit": "task=vit"}\n'
                       '    return g(num_classes=16, vocab_size=8, x=cfg.data.patch_size, task="vit")\n')
    found = sorted(line.partition(": ")[2] for line in findings(planted, names, keys, tmp_path))
    assert found == sorted(["pool", "stack", "mlm", "data.template", "data.cache_dir", "task=classify", "task=vit",
                            "num_classes=", "data.patch_size", "task=vit"])


def test_each_task_states_settings_it_has_and_its_data_takes() -> None:
    """What a task says a checkpoint of it fixes as a source are its own constructor arguments, and its data settings
    are its data module's too: a renamed setting cannot leave a declaration that fixes nothing."""
    for name, task in TASKS.items():
        arguments = _parameters(task, TridentTask)
        assert set(task.SOURCE_SETTINGS) <= arguments, name
        assert set(task.SOURCE_DATA_SETTINGS) <= arguments & _parameters(task.DATA_MODULE, TridentDataModule), name


def test_a_run_record_written_before_the_head_rows_were_renamed_still_reads(tmp_path: Path) -> None:
    """``<run>/init/source.json`` of an earlier version names the head's rows ``num_classes`` (now ``classes``, the
    network's word): the record still reads, that field dropped (nothing reads it after the source's settings are
    fixed)."""
    import json

    from trident.weights.sources import read_source_copy

    record = {"source": "vit_dir", "format": "hf-vit", "task": "vit", "model": {"d_model": 8}, "pos_encoding": "learned",
              "task_options": {"pool": "cls"}, "data_options": {"patch_size": 4}, "num_classes": 7, "vocab_size": None}
    (tmp_path / "source.json").write_text(json.dumps(record))
    source = read_source_copy(tmp_path, weights=False)
    assert (source.task, source.task_options, source.data_options, source.classes) == ("vit", {"pool": "cls"},
                                                                                        {"patch_size": 4}, None)


def test_each_outside_network_has_one_holder_whose_settings_its_properties_fix() -> None:
    """``holder`` picks the first task whose OUTSIDE_NETWORK a network is: two would make the other unreachable. Each
    FROM_NETWORK entry maps a property of trident.models.properties onto a setting the task or its data takes (a renamed
    setting cannot leave a mapping that fixes nothing)."""
    from trident.models import properties
    from trident.weights.adapters.outside_network import holder

    names = {value for key, value in vars(properties).items() if key.isupper()}
    held = [task for task in TASKS.values() if task.OUTSIDE_NETWORK is not None]
    assert len({task.OUTSIDE_NETWORK for task in held}) == len(held)
    for task in held:
        assert holder(task.OUTSIDE_NETWORK) is task
        assert set(task.FROM_NETWORK) <= names, task.NAME
        # data.max_seq_len: the pipeline reads it (conf/data/*.yaml), no data module takes it.
        takes = {"task": _parameters(task, TridentTask),
                 "data": _parameters(task.DATA_MODULE, TridentDataModule) | {"max_seq_len"}}
        for target in task.FROM_NETWORK.values():
            group, _, key = target.partition(".")
            assert key in takes[group], (task.NAME, target)
