"""``resume=<run dir>`` and ``resume=auto``: continue a run in its own directory, same config,
same W&B run, from its newest checkpoint.

``train.py`` rewrites its command line before Hydra starts: the run's saved overrides
(``.hydra/overrides.yaml``) come first, the new command line's overrides after them (so
``trainer.max_steps=...`` can extend a run), and ``hydra.run.dir`` points at the old directory.
``resume=auto`` picks, under ``paths.output_root``/runs, the newest run directory with the same
``run_name`` and the same settings on its command line that has a checkpoint, preferring one started by the same SLURM job (a requeued
job); with none, it starts a new run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trident.errors import ConfigError
from trident.launch.requeue import RUN_INFO, latest_checkpoint, requeued_attempt, slurm_job, write_json
from trident.runs.compose import compose_train_config
from trident.weights.run_config import RUN_CONFIG, run_config_of

log = logging.getLogger(__name__)

MULTIRUN_FLAGS = ("-m", "--multirun")


def run_identity(run_dir: Path) -> dict[str, Any]:
    """``run.json`` of a run directory: the W&B run id (kept across resumes) and the SLURM job
    that last ran it. Created on the first start, by the rank-zero process only (it alone logs)."""
    # Imported here: train.py expands resume=... with this module before Lightning (and torch) load.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    path = run_dir / RUN_INFO
    info: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    info.setdefault("run_id", secrets.token_hex(6))  # a sweep job's run.json may hold only its sweep so far
    if rank_zero_only.rank != 0:  # type: ignore[attr-defined]  # set by Lightning from the launch environment
        return info
    info["slurm_job"] = slurm_job()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, info, indent=1)
    return info


def find_run_to_resume(output_root: Path, run_name: str, overrides: Sequence[str] = ()) -> Path | None:
    """For ``resume=auto``: the run directory (under ``output_root/runs``) to continue, or None: the newest run of
    ``run_name`` with a checkpoint whose command line chose the same settings as ``overrides`` (see
    :func:`settings_differ`)."""
    runs = [run_dir for run_dir in _named_runs(output_root, run_name)
            if latest_checkpoint(run_dir) is not None and not settings_differ(run_dir, overrides)]
    if not runs:
        return None
    job = slurm_job()

    def same_job(run_dir: Path) -> bool:
        info = run_dir / RUN_INFO
        return job is not None and info.is_file() and json.loads(info.read_text()).get("slurm_job") == job

    # Directory names are <date>/<time>_<run_name>: the path order is the start order.
    return max(runs, key=lambda d: (same_job(d), str(d.relative_to(output_root))))


def _named_runs(output_root: Path, run_name: str) -> list[Path]:
    return [config.parent for config in output_root.glob(f"runs/*/*/{RUN_CONFIG}") if run_name in run_names(config.parent)]


# Settings a resume may change (``resume=<run> trainer.max_steps=...`` extends a run; where it logs, its callbacks
# and how batches are loaded do not change what is trained): ``resume=auto`` matches a run on every other override.
RESUMABLE_SETTINGS = ("resume", "ckpt_path", "hydra", "paths", "logger", "callbacks", "test", "print_config",
                      "trainer.max_steps", "trainer.max_epochs", "trainer.max_time",
                      *(f"data.{key}" for key in ("batch_size", "num_workers", "pin_memory", "persistent_workers")))


def _settings(overrides: Sequence[str]) -> dict[str, str]:
    """The command line's choices as key -> value (a later value for a key wins), without :data:`RESUMABLE_SETTINGS`."""
    chosen: dict[str, str] = {}
    for override in overrides:
        key = _key(override)
        if override.startswith("-"):
            continue  # a flag (-m, --config-name ...), not a setting
        if not any(key == kept or key.startswith((f"{kept}.", f"{kept}/")) for kept in RESUMABLE_SETTINGS):
            chosen[key] = override.partition("=")[2]
    return chosen


def settings_differ(run_dir: Path, overrides: Sequence[str]) -> str | None:
    """The first setting (``key=there`` vs here) in which the command line that started ``run_dir`` (its
    ``.hydra/overrides.yaml``) and ``overrides`` differ, or None. The run name leaves out most settings (``lr``,
    ``distill``, ``finetune``, ``objective``...): without this check ``resume=auto`` would continue a run of
    other settings under this command line's name."""
    saved = run_dir / ".hydra" / "overrides.yaml"
    there = _settings([str(o) for o in OmegaConf.load(saved)]) if saved.is_file() else {}
    here = _settings(overrides)
    for key in sorted(there.keys() | here.keys()):
        if there.get(key) != here.get(key):
            return f"{key}={there.get(key, '(default)')} there, {here.get(key, '(default)')} here"
    return None


def run_names(run_dir: Path) -> set[str]:
    """The names a run answers to: its own (``config_resolved.yaml``: an ``init_from`` source may have
    fixed its settings, e.g. learned positions) and the command line's that named its directory
    (Hydra's ``.hydra/config.yaml``, composed before the source was read)."""
    names = set()
    for config in (run_dir / RUN_CONFIG, run_dir / ".hydra" / "config.yaml"):
        saved = OmegaConf.load(config) if config.is_file() else None
        if isinstance(saved, DictConfig):
            with contextlib.suppress(OmegaConfBaseException):  # a run_name that needs Hydra's resolvers
                names.add(str(saved.get("run_name")))
    return names


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _resume_value(argv: Sequence[str]) -> str:
    resume_args = [a for a in argv if _key(a) == "resume"]
    return resume_args[-1].partition("=")[2] if resume_args else "null"


def resumed_run_dir(argv: Sequence[str]) -> str | None:
    """The run directory a ``resume=<run dir>`` command line names (None: no resume, or ``resume=auto``)."""
    value = _resume_value(argv)
    return None if value in ("null", "", "auto") else value


def resume_arguments(argv: Sequence[str], cfg: DictConfig | None, conf_dir: Path) -> list[str]:
    """``train.py``'s command line with ``resume=...`` turned into the resumed run's overrides;
    ``cfg`` is the config composed with that command line, if it was (for ``resume=auto``)."""
    value = _resume_value(argv)
    if value in ("null", ""):
        return list(argv)
    if any(a in MULTIRUN_FLAGS for a in argv):
        raise ConfigError("resume continues one run: drop -m/--multirun (resume each run of a sweep by its directory)")
    overrides = [a for a in argv if _key(a) != "resume"]
    if value == "auto":
        run_dir = _auto_run_dir(overrides, cfg, conf_dir)
        if run_dir is None:
            return overrides
    else:
        run_dir = Path(value)
    saved_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not saved_overrides.is_file():
        raise ConfigError(
            f"resume={value} is not a run directory of train.py (no .hydra/overrides.yaml): pass "
            f"outputs/runs/<date>/<time>_<run_name> or resume=auto"
        )
    merged: dict[str, str] = {}
    for override in [*OmegaConf.load(saved_overrides), *overrides]:
        if _key(override) not in ("resume", "hydra.run.dir"):
            merged[_key(override)] = override  # a later value for the same key wins
    run_dir = run_dir.resolve()
    return [*merged.values(), f"hydra.run.dir={run_dir}", f"resume={run_dir}"]


# What Hydra writes into a run directory as the job starts, before train.py can check anything.
_HYDRA_WRITES = (".hydra/overrides.yaml", ".hydra/config.yaml", ".hydra/hydra.yaml", "train.log")


@contextlib.contextmanager
def kept_on_refusal(arguments: Sequence[str]) -> Iterator[None]:
    """For a ``resume=<run dir>`` command line (as :func:`resume_arguments` writes it): when the job
    is refused (exit status 2), put back the files Hydra rewrote in the run directory as it started,
    so a refused resume changes nothing on disk and later resumes see the run's own overrides."""
    resumed = [a.partition("=")[2] for a in arguments if _key(a) == "resume"]
    run_dir = Path(resumed[-1]) if resumed and resumed[-1] not in ("null", "", "auto") else None
    saved = {} if run_dir is None else {name: _read(run_dir / name) for name in _HYDRA_WRITES}
    try:
        yield
    except SystemExit as stop:
        if run_dir is not None and stop.code == 2:
            _put_back(run_dir, saved)
        raise


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _put_back(run_dir: Path, saved: dict[str, bytes | None]) -> None:
    # Hydra's handler for train.log stays on the root logger: closed first, or it writes on.
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == (run_dir / "train.log").absolute():
            root.removeHandler(handler)
            handler.close()
    for name, content in saved.items():
        if content is not None:
            (run_dir / name).write_bytes(content)
        else:
            (run_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # kept when the run had it or it holds other files
        (run_dir / ".hydra").rmdir()


def _auto_run_dir(overrides: list[str], cfg: DictConfig | None, conf_dir: Path) -> Path | None:
    """The run to continue, by the ``run_name`` and ``paths.output_root`` of the composed config
    (composed here when the command line holds flags that train.py leaves to Hydra)."""
    if cfg is None:
        config_overrides = [a for a in overrides if not a.startswith(("-", "hydra.", "hydra/"))]
        cfg = compose_train_config(config_overrides, conf_dir=conf_dir)
    output_root, run_name = Path(cfg.paths.output_root), str(cfg.run_name)
    run_dir = find_run_to_resume(output_root, run_name, overrides)
    if run_dir is None:
        named = _named_runs(output_root, run_name)
        started = [d for d in named if latest_checkpoint(d) is not None]
        if started:
            newest = max(started, key=lambda d: str(d.relative_to(output_root)))
            why = (f"{len(started)} run(s) of {run_name} under {output_root}/runs, none with these settings (the newest, "
                   f"{newest}: {settings_differ(newest, overrides)}; resume={newest} continues it with yours on top)")
        elif named:
            why = f"{len(named)} run(s) of {run_name} under {output_root}/runs, none with a checkpoint yet"
        else:
            why = f"no run of {run_name} under {output_root}/runs"
        print(f"resume=auto: {why}: starting a new run")
    else:
        print(f"resume=auto: continuing {run_dir}")
    return run_dir


def checkpoint_to_resume(resume: str | None, ckpt_path: str | None, run_dir: Path) -> str | None:
    """What ``trainer.fit`` resumes from: an explicit ``ckpt_path``, else with ``resume`` (set by
    :func:`resume_arguments` to this run's own directory) or in a requeued SLURM job that runs this
    directory again, its newest checkpoint."""
    if ckpt_path:
        return ckpt_path
    if not resume and requeued_attempt(run_dir):
        checkpoint = latest_checkpoint(run_dir)
        log.warning("requeued SLURM job %s: resuming %s", slurm_job(), checkpoint or "from the start (no checkpoint yet)")
        return None if checkpoint is None else str(checkpoint)
    if not resume:
        return None
    if resume == "auto" or Path(resume).resolve() != run_dir.resolve():
        raise ConfigError(f"resume={resume} continues a run in its own directory: run it as `python train.py resume={resume}`")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(f"resume={resume}: the run has no checkpoint under {run_dir}/checkpoints: start a new run instead")
    return str(checkpoint)


# Data settings that say how batches are loaded, not which data: a resumed run may change them.
LOADING_SETTINGS = frozenset({"batch_size", "block_size", "num_workers", "pin_memory", "persistent_workers", "cache_dir", "max_tokens",
                              "eval_max_tokens", "length_multiple", "augment", "sample_prompts", "seed", "max_seq_len", "tokenizer"})


def check_resume_continues(checkpoint: dict[str, Any], path: Path, data: DictConfig, vocabulary: dict[str, int] | None) -> None:
    """Resuming continues the same training: refuse, in one line, a checkpoint written on other data
    (its run's config) or with another tokenizer (``vocabulary``: this run's); ``init_from`` fine-tunes."""
    from trident.converters.weight_only import refuse_quantized  # here: train.py reads this module before torch

    refuse_quantized(checkpoint, path, "training goes on from float weights and its optimizer state")
    fix = f"to train these weights on new data, start a new run with init_from={path} (weights only, step 0)"
    saved_tokenizer = checkpoint.get("tokenizer_json")
    if saved_tokenizer and vocabulary is not None:
        from tokenizers import Tokenizer  # here: train.py imports this module before its heavy libraries

        if Tokenizer.from_str(saved_tokenizer).get_vocab() != vocabulary:
            raise ConfigError(f"ckpt_path={path} was trained with another tokenizer than this run's data gives: {fix}")

    config = run_config_of(path)
    saved = OmegaConf.load(config) if config is not None else None
    if not isinstance(saved, DictConfig) or "data" not in saved:
        return
    there, here = OmegaConf.to_container(saved.data, resolve=True), OmegaConf.to_container(data, resolve=True)
    assert isinstance(there, dict) and isinstance(here, dict)
    for key in sorted((there.keys() | here.keys()) - LOADING_SETTINGS):
        if not _same_data(there.get(key), here.get(key)):
            raise ConfigError(f"ckpt_path={path} was trained on other data (data.{key}={there.get(key)} there, "
                              f"{here.get(key)} here): {fix}")


def _same_data(there: Any, here: Any) -> bool:
    """Equal values, or paths (one or a list) to files of equal content: ``corpus.txt`` is
    ``/home/me/corpus.txt`` when the run started in /home/me."""
    if there == here:
        return True
    first, second = (v if isinstance(v, list) else [v] for v in (there, here))
    if len(first) != len(second) or not all(isinstance(p, str) and Path(p).is_file() for p in [*first, *second]):
        return False
    return all(Path(a).read_bytes() == Path(b).read_bytes() for a, b in zip(first, second))
