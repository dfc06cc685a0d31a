"""The hf export read by the oldest transformers that trident's ``[hf]`` extra allows (issue 50, item 6): in an
environment of its own (that transformers and the packages it pins, over this environment's torch), the Llama-style
families exported with a rope base and scalings give trident's logits, and the chat template and end of turn of a
chat run read the same. transformers 4 reads no ``rope_parameters``; the export writes ``rope_theta`` and
``rope_scaling`` beside it.

The environment is built once per transformers floor and Python version under the temporary directory (seconds from
uv's cache; the first build downloads transformers and its pins from the package registry)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT
from tests.test_convert_gemma import WRITE_CASES, gemma_lm
from tests.test_convert_llama_family import trident_lm
from tests.test_export_chat import CHATML, MESSAGES, chat_task, chatml_tokenizer
from trident.commands.export import export_hf
from trident.data.chat_template import ChatTemplate
from trident.weights.adapters.hf_export import write_hf

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

# name -> trident settings of a Llama-style network whose export older transformers must read as trident computes it.
CASES: dict[str, dict[str, Any]] = {
    "llama-theta": {"pos_encoding_options": {"base": 500000.0}},
    "llama-llama3": {"pos_encoding_options": {"base": 500000.0, "scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}},
    "llama-linear": {"pos_encoding_options": {"base": 500000.0, "scaling": {"type": "linear", "factor": 4.0}}},
    "llama-dynamic": {"pos_encoding_options": {"base": 500000.0, "scaling": {
        "type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 24}}},
    "mistral-yarn": {"attention_window": 16, "n_kv_heads": 2, "pos_encoding_options": {"base": 10000.0, "scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24, "beta_fast": 16.0}}},
    "qwen2": {"qkv_bias": True, "attn_out_bias": False, "n_kv_heads": 2, "pos_encoding_options": {"base": 1000000.0}},
    "qwen3": {"qk_norm": True, "head_dim": 32, "n_kv_heads": 2, "pos_encoding_options": {"base": 1000000.0}},
}
# Gemma 2 (sliding layers first, alternating: what 4.x before layer_types builds) and Gemma 3 (every 4th layer global,
# its sliding_window_pattern; two ropes, the global one scaled), past their window of 16. Gemma 3 layer_types that
# follow no pattern need a transformers that reads layer_types (docs/weights.md).
GEMMA_CASES = {f"{family}-{i}": (family, settings) for i, (family, settings) in enumerate(WRITE_CASES) if "layers" in settings}
# Run by the older transformers: each exported directory's logits on the shared ids, and the chat export's template.
READER = """
import json, sys, torch, transformers
out = sys.argv[1]
ids = torch.load(f"{out}/ids.pt")
found = {"version": transformers.__version__}
for name in json.loads(sys.argv[2]):
    # transformers 4's SDPA drops Gemma 2's score soft-capping: it asks for eager attention (5 picks it itself).
    eager = {"attn_implementation": "eager"} if name.startswith("gemma") else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/{name}", **eager).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, f"{out}/{name}/older_logits.pt")
tokenizer = transformers.AutoTokenizer.from_pretrained(f"{out}/chat")
messages = json.loads(sys.argv[3])
found["rendered"] = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
found["eos"] = [tokenizer.eos_token, transformers.AutoConfig.from_pretrained(f"{out}/chat").eos_token_id,
                transformers.GenerationConfig.from_pretrained(f"{out}/chat").eos_token_id]
print(json.dumps(found))
"""


def transformers_floor() -> str:
    """The lowest transformers version the ``[hf]`` extra of pyproject.toml allows (``transformers>=X.Y``)."""
    found = re.search(r'"transformers>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml's [hf] extra should state a transformers floor (transformers>=X.Y)"
    return found.group(1)


def older_python(version: str) -> Path:
    """The python of a venv holding ``transformers=={version}.*`` with its own pins (tokenizers, huggingface_hub...),
    reading this environment's packages (torch) after its own; built once, kept under the temporary directory."""
    python_tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    home = Path(os.environ.get("TRIDENT_TEST_ENVS", Path(tempfile.gettempdir()) / "trident-test-envs"))
    venv = home / f"transformers-{version}-{python_tag}"
    if (venv / "ready").is_file():
        return venv / "bin" / "python"
    home.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{venv.name}.", dir=home))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(scratch)], check=True)
    python = scratch / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "trident_test_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", str(python),
                                f"transformers=={version}.*"], capture_output=True, text=True, timeout=600, check=False)
    if installed.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        pytest.skip(f"transformers {version} cannot be installed here (is the package registry reachable?): "
                    f"{installed.stderr[-300:]}")
    (scratch / "ready").touch()
    try:
        scratch.rename(venv)  # the venv's python finds its site-packages relative to itself: it may move
    except OSError:  # another run built it meanwhile
        shutil.rmtree(scratch, ignore_errors=True)
    return venv / "bin" / "python"


def test_the_oldest_allowed_transformers_reads_the_hf_export_as_trident_computes_it(tmp_path: Path) -> None:
    version = transformers_floor()
    python = older_python(version)
    ids = torch.randint(0, 150, (2, 40), generator=torch.Generator().manual_seed(0))  # past every original length
    torch.save(ids, tmp_path / "ids.pt")
    expected = {}
    for name, settings in CASES.items():
        net = trident_lm(settings)
        write_hf(net, None, None, tmp_path / name)
        with torch.no_grad():
            expected[name] = net(ids)
    for name, (family, settings) in GEMMA_CASES.items():
        net = gemma_lm(family, **settings)
        write_hf(net, None, None, tmp_path / name)
        with torch.no_grad():
            expected[name] = net(ids)
    template = ChatTemplate("chatml.jinja", CHATML, {})
    tokenizer = chatml_tokenizer()
    export_hf(chat_task(tokenizer, template), tmp_path / "chat")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    names = json.dumps([*CASES, *GEMMA_CASES])
    read = subprocess.run([str(python), "-c", READER, str(tmp_path), names, json.dumps(MESSAGES)],
                          capture_output=True, text=True, timeout=600, check=False, env=env)
    assert read.returncode == 0, read.stderr[-3000:]
    found = json.loads(read.stdout.strip().splitlines()[-1])
    assert found["version"].startswith(f"{version}.")
    for name, logits in expected.items():
        torch.testing.assert_close(torch.load(tmp_path / name / "older_logits.pt"), logits, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert found["rendered"] == template.render(MESSAGES, add_generation_prompt=True)
    end = tokenizer.token_to_id("<|im_end|>")
    assert found["eos"] == ["<|im_end|>", end, end]
