"""Data preparation rows: peak memory against corpus size, tokenizer throughput, the first step
after a cache hit (trident.bench.first_step), and (``--only data_2gb``) a 2 GB corpus prepared and trained.

Each preparation runs in a fresh child process (``python -m trident.bench.preparation ...``), so
its peak resident memory is its own. Corpora are Shakespeare repeated to the size wanted,
written to a temporary directory and deleted afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trident.backbone import TransformerConfig
from trident.bench.first_step import first_step_rows
from trident.bench.memory import peak_rss_bytes
from trident.bench.results import Row, Settings, verdict
from trident.data.corpora import shakespeare_texts
from trident.data.lm import LMDataModule
from trident.data.streams import list_stream
from trident.data.token_files import Encoder, batches
from trident.data.tokenization import train_tokenizer
from trident.tasks.lm import LanguageModelTask

MB = 10**6


def write_corpus(path: Path, size: int) -> Path:
    """``size`` bytes (or a little more) of Shakespeare plays repeated, one .txt file."""
    text = "\n".join(shakespeare_texts()).encode()
    with path.open("wb") as out:
        for _ in range(-(-size // len(text))):
            out.write(text)
    return path


def run_child(*args: str) -> dict[str, float]:
    """Run this module's ``main`` in a fresh process; its last stdout line is a JSON result."""
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "trident.bench.preparation", *args], check=True, capture_output=True,
                          text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"wall": time.time() - start}


def _peak_mib() -> float:
    return peak_rss_bytes() / 2**20


def _module(corpus: str, cache: str, tokenizer: str, block_size: int = 64) -> LMDataModule:
    return LMDataModule(source="files", files=corpus, tokenizer=tokenizer, vocab_size=4096,
                        block_size=block_size, batch_size=8, cache_dir=cache)


def _train_steps(module: LMDataModule, steps: int) -> float:
    """A few steps of a small LM on the prepared data; the seconds they take."""
    cfg = TransformerConfig(d_model=64, n_heads=2, n_layers=2, d_ff=256, max_seq_len=module.block_size)
    task = LanguageModelTask(backbone=vars(cfg), vocab_size=module.vocab_size, optimizer={"name": "adamw", "lr": 1e-3},
                             scheduler={"name": "constant"})
    optimizer = torch.optim.AdamW(task.net.parameters(), lr=1e-3)
    loader = iter(module.train_dataloader())
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(loader)
        loss = F.cross_entropy(task.net(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    """Child entry: ``prepare CORPUS CACHE TOKENIZER [STEPS]`` (prepare, then train STEPS steps)."""
    command, corpus, cache, tokenizer, *rest = argv
    assert command == "prepare"
    start = time.perf_counter()
    module = _module(corpus, cache, tokenizer)
    module.prepare_data()
    module.setup()
    prepared, prepare_peak = time.perf_counter() - start, _peak_mib()
    steps = int(rest[0]) if rest else 0
    train_seconds = _train_steps(module, steps) if steps else 0.0
    print(json.dumps({"prepare": prepared, "train": train_seconds, "peak_mib": _peak_mib(),
                      "prepare_peak_mib": prepare_peak,
                      "tokens": sum(module.token_counts().values())}))


def memory_rows(settings: Settings) -> list[Row]:
    small, large = (MB, 5 * MB) if settings.quick else (20 * MB, 200 * MB)
    peaks, results = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (small, large):
            corpus = write_corpus(Path(tmp) / f"corpus_{size}.txt", size)
            results[size] = run_child("prepare", str(corpus), str(Path(tmp) / "cache"), "char")
            peaks[size] = results[size]["peak_mib"]
            corpus.unlink()
    ratio = peaks[large] / peaks[small]
    large_rate = large / MB / results[large]["prepare"]
    return [
        Row("data", f"peak memory preparing {large // MB} MB vs {small // MB} MB of text (char tokenizer, own process)",
            f"{peaks[large]:.0f} MiB", f"{peaks[small]:.0f} MiB", f"{ratio:.2f}x", "<= 1.3x", verdict(ratio <= 1.3),
            f"peak RSS of a fresh process (imports included); {large // MB} MB prepared in {results[large]['prepare']:.1f} s "
            f"= {large_rate:.1f} MB/s end to end (read, alphabet, split, tokenize, write)"),
    ]


def throughput_rows(settings: Settings) -> list[Row]:
    text = "\n".join(shakespeare_texts())
    size = (1 if settings.quick else 20) * MB
    corpus = (text * (-(-size // len(text))))[:size]
    pieces = [corpus[i : i + (1 << 18)] for i in range(0, len(corpus), 1 << 18)]
    rows = []
    for kind, target in (("char", 20.0), ("bpe", 2.0)):
        tokenizer = train_tokenizer(kind, iter(pieces[: max(1, len(pieces) // 10)]), vocab_size=4096)
        encoder = Encoder(tokenizer, separator=None)  # one continuous text: no document ends
        start = time.perf_counter()
        count = sum(encoder(batch).size for batch in batches(list_stream(pieces)))
        seconds = time.perf_counter() - start
        rate = len(corpus.encode()) / MB / seconds
        name = "character tokenizer" if kind == "char" else "byte-level BPE (4096) encoding"
        rows.append(Row("data", f"{name}: {size // MB} MB of text -> token ids",
                        f"{rate:.1f} MB/s", "-", f"{count / seconds / 1e6:.1f} M tokens/s", f">= {target:g} MB/s",
                        verdict(rate >= target), f"batches of {len(pieces[0]) // 1024} K-character pieces on "
                        f"{os.cpu_count()} cores; ids as {np.dtype(encoder.dtype).name}"))
    return rows


def preparation_rows(settings: Settings) -> list[Row]:
    return memory_rows(settings) + throughput_rows(settings) + first_step_rows(settings)


def big_corpus_rows(settings: Settings) -> list[Row]:
    size = (50 if settings.quick else 2000) * MB
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        corpus = write_corpus(Path(tmp) / "big.txt", size)
        result = run_child("prepare", str(corpus), str(Path(tmp) / "cache"), "char", "5")
    return [Row("data_2gb", f"{size // MB} MB corpus (char tokenizer): prepare, then 5 steps of a small LM",
                f"{result['prepare']:.0f} s, peak {result['prepare_peak_mib']:.0f} MiB", "-",
                f"{size / MB / result['prepare']:.1f} MB/s, {result['tokens'] / 1e9:.2f} G tokens",
                "prepares and trains", verdict(result["tokens"] > 0 and result["train"] > 0),
                f"5 steps in {result['train']:.1f} s (peak {result['peak_mib']:.0f} MiB with training); "
                f"whole command {result['wall']:.0f} s")]


if __name__ == "__main__":
    main(sys.argv[1:])
