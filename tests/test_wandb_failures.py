"""W&B not logged in, unreachable or not answering: the run logs offline with a warning and
completes; an API key never reaches a file of the run directory."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig

from trident.runs.pipeline import train
from trident.tracking.wandb_files import wait_for_offline_runs

SECRET = "trident-test-secret-0123456789abcdef0123456789abcdef"


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``WANDB_MODE=online`` with no login anywhere (no key, no netrc, no W&B settings file)."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers (a W&B host behind a broken proxy)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for connection in accepted:
        connection.close()


def run_completes_offline(cfg: DictConfig, run_dir: Path, caplog: pytest.LogCaptureFixture, warning: str) -> float:
    """Train ``cfg``; check it finished, logged one offline W&B run and warned; returns the seconds taken."""
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="trident.tracking.loggers"):
        metrics = train(cfg)
    seconds = time.perf_counter() - start
    assert "test/loss" in metrics
    runs = wait_for_offline_runs(run_dir)
    assert len(runs) == 1 and runs[0].metric("train/loss"), "the run logged offline"
    assert any(warning in record.getMessage() and "logging offline" in record.getMessage() for record in caplog.records)
    return seconds


def assert_secret_written_nowhere(run_dir: Path) -> None:
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert [str(p) for p in files if SECRET.encode() in p.read_bytes()] == []


def test_online_without_login_logs_offline(
    online: None, make_config: Callable[..., DictConfig], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_completes_offline(make_config("trainer.max_steps=2"), tmp_path / "run", caplog, "needs a login")


def test_unreachable_server_logs_offline_at_once(
    online: None, monkeypatch: pytest.MonkeyPatch, make_config: Callable[..., DictConfig], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    cfg = make_config("trainer.max_steps=2", "logger.wandb.init_timeout=600")
    seconds = run_completes_offline(cfg, tmp_path / "run", caplog, "cannot be reached")
    assert seconds < 60, "no waiting for the W&B server's timeouts"
    assert_secret_written_nowhere(tmp_path / "run")


def test_server_that_never_answers_logs_offline_after_the_init_timeout(
    online: None, silent_server: str, monkeypatch: pytest.MonkeyPatch, make_config: Callable[..., DictConfig],
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_BASE_URL", silent_server)
    cfg = make_config("trainer.max_steps=2", "logger.wandb.init_timeout=3")
    seconds = run_completes_offline(cfg, tmp_path / "run", caplog, "could not start an online run")
    assert seconds < 3 + 60, "wandb.init gave up after logger.wandb.init_timeout"
    assert_secret_written_nowhere(tmp_path / "run")
