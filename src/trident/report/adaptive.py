"""Seeds until the answer is clear: run a sweep preset with a few seeds, then add seeds only where a
comparison against the best setting is still undecided, up to a maximum (issue #28), as a
group-sequential design that keeps the overall error at alpha over its looks (issue #37).

``python -m trident.report.adaptive experiment=ablation_heads --metric best/val/loss --max-seeds 10
--sweep-dir outputs/ablations/ablation_heads`` runs every setting of the preset (its swept values
without ``seed``) with seeds 1 .. ``--first-seeds``, then looks: the report's tests over every pair of
settings at the level that round spends of alpha (:mod:`trident.report.sequential`: alpha spending,
Lan & DeMets 1983, Pocock type). A setting decided worse or within the noise keeps that verdict and
stops; the undecided settings, and the best one (its mean is the other side of every comparison), get
``--step`` more seeds, until every comparison is decided or they have ``--max-seeds`` seeds; those
stay "undecided at N seeds". The loop records its design and rounds in ``adaptive.json`` in the sweep
directory (after each round), and the report (``python -m trident.report``, written at the end into the
sweep directory or ``--out``) gives the loop's verdicts, each with its round and level.

Every job is one ``train.py -m`` job into the same sweep directory, numbered after the jobs already
there, so the directory stays one sweep for the report and for W&B. A (setting, seed) with a completed
``status.json`` is reused, never re-run; a failed one is tried once more, and after a second failure
it counts as a missing seed (the report lists both failures) while the loop goes on.

``python -m trident.report.adaptive --replay <report dir>/jobs.csv --metric best/val/loss --max-seeds 8`` runs
the same loop over the values of a ``jobs.csv`` instead of jobs (a seed the table lacks is a missing
one), writes ``adaptive.json`` beside it and the report (``--out``, default: the same directory): a
sweep's verdicts re-decided with this design from its committed results.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from trident.errors import ConfigError, is_int, run_with_clear_errors
from trident.report import load_jobs_csv, load_sweep, write_report
from trident.report.sequential import Design, Sequential, replay, run_loop, seed_table
from trident.report.statistics import ALPHA, BEST
from trident.report.sweep import better_is
from trident.runs.compose import CONF_DIR
from trident.runs.sweeps import REPEAT_KEYS, job_statuses, next_job_number, setting_of

log = logging.getLogger(__name__)

# A failed (setting, seed) is run this many times in all before it counts as a missing seed.
ATTEMPTS = 2
SEED_KEY = REPEAT_KEYS[0]

# (setting, seed, job number): run one job into the sweep directory; its outcome is read from there.
RunJob = Callable[["Setting", int, int], None]


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: its swept overrides without the seed, e.g. ``("model.n_heads=2",)``."""

    overrides: tuple[str, ...]

    @property
    def label(self) -> str:
        """As the report names it (:func:`trident.runs.sweeps.setting_of`)."""
        return ",".join(self.overrides)


@dataclass
class Plan:
    sweep_dir: Path
    settings: list[Setting]
    swept: list[str]  # the swept keys in the order sweep.json records them, seed included
    metric: str
    better: str  # "min" or "max"
    first_seeds: int = 3
    max_seeds: int = 10
    step: int = 1
    alpha: float = ALPHA

    @property
    def design(self) -> Design:
        return Design(self.first_seeds, self.max_seeds, self.step, self.alpha)


@dataclass
class Outcome:
    """How the loop ended: the completed seeds and the decision of each setting."""

    seeds: dict[str, int]
    decided: dict[str, bool]

    @classmethod
    def of(cls, record: Sequential) -> Outcome:
        """The best is decided (the other side of every decided comparison)."""
        seeds = {s: len(record.looks[s][2][s]) if s in record.looks else 0 for s in record.settings}
        verdicts = record.verdicts
        return cls(seeds, {s: s in verdicts and (verdicts[s] == BEST or not verdicts[s].startswith("undecided"))
                           for s in record.settings})

    @property
    def undecided(self) -> list[str]:
        return [setting for setting, done in self.decided.items() if not done]

    def summary(self) -> str:
        if not self.undecided:
            return f"every comparison is decided ({', '.join(f'{s}: {n} seeds' for s, n in self.seeds.items())})"
        return "; ".join(f"{s}: undecided at {self.seeds[s]} seeds" for s in self.undecided)


def job_seed(overrides: Sequence[str]) -> int | None:
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    seeds = [o.value() for o in parsed if o.key_or_group == SEED_KEY]
    return int(seeds[0]) if seeds and is_int(seeds[0]) else None


def read_jobs(sweep_dir: Path, swept: Sequence[str]) -> dict[tuple[str, int], list[tuple[str, dict[str, float]]]]:
    """(setting label, seed) -> (status, final metrics) of each of its job directories, in job order."""
    jobs: dict[tuple[str, int], list[tuple[str, dict[str, float]]]] = {}
    if not sweep_dir.is_dir():
        return jobs
    for status in job_statuses(sweep_dir):
        overrides = OmegaConf.to_container(OmegaConf.load(status.dir / ".hydra" / "overrides.yaml"))
        seed = job_seed(overrides)  # type: ignore[arg-type]
        if seed is not None:
            key = (setting_of(overrides, swept), seed)  # type: ignore[arg-type]
            jobs.setdefault(key, []).append((status.status, status.record.get("metrics", {})))
    return jobs


def ensure_job(plan: Plan, setting: Setting, seed: int, run_job: RunJob, started: Counter[tuple[str, int]]) -> None:
    """Run (setting, seed) unless a completed job of it is in the sweep directory or it already
    failed :data:`ATTEMPTS` times; ``started`` counts the runs of this loop (a job that failed before
    Hydra made its directory leaves none)."""
    key = (setting.label, seed)
    while True:
        runs = read_jobs(plan.sweep_dir, plan.swept).get(key, [])
        if any(status == "completed" for status, _ in runs) or max(len(runs), started[key]) >= ATTEMPTS:
            return
        if runs:
            log.warning("%s seed %d failed: running it once more", setting.label, seed)
        started[key] += 1
        run_job(setting, seed, next_job_number(plan.sweep_dir))


def add_seeds(plan: Plan, run_job: RunJob) -> Outcome:
    """The loop of the module docstring (:func:`trident.report.sequential.run_loop` over the jobs of the
    sweep directory); ``adaptive.json`` is written there after each round."""
    design = plan.design  # refuses first_seeds > max_seeds before any job
    settings = {setting.label: setting for setting in plan.settings}
    started: Counter[tuple[str, int]] = Counter()

    def obtain(label: str, seed: int) -> float | None:
        ensure_job(plan, settings[label], seed, run_job, started)
        runs = read_jobs(plan.sweep_dir, plan.swept).get((label, seed), [])
        done = [metrics for status, metrics in runs if status == "completed" and plan.metric in metrics]
        return float(done[-1][plan.metric]) if done else None

    def after_round(record: Sequential) -> None:
        last = record.rounds[-1]
        log.info("round %d (level %.3g): %s", last.number, last.level,
                 ", ".join(f"{s}: {v}" for s, v in last.verdicts.items()))
        record.write(plan.sweep_dir)

    return Outcome.of(run_loop(list(settings), plan.better, plan.metric, design, obtain, after_round))


def axis_values(key: str, text: str) -> list[str]:
    """``key=a,b`` (or ``choice``/``range``) -> ``["key=a", "key=b"]``, as Hydra's basic sweeper lists them."""
    override = OverridesParser.create().parse_override(f"{key}={text}")
    if not override.is_sweep_override():
        return [f"{key}={text}"]
    if not override.is_discrete_sweep():
        raise ConfigError(f"hydra.sweeper.params.{key}={text} is not a list of values: adaptive seeds need the "
                          "settings listed (a,b,c, choice or range), not an interval search")
    return [f"{key}={value}" for value in override.sweep_string_iterator()]


def preset_plan(overrides: Sequence[str], sweep_dir: Path, metric: str, better: str | None) -> Plan:
    """The settings of a sweep preset (``hydra.sweeper.params`` of ``experiment=...``, its values
    crossed), the metric's direction (the task's ``monitor_mode`` for its monitored metric)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    params = dict(cfg.hydra.sweeper.get("params") or {})
    axes = {str(k): str(v) for k, v in params.items() if k != SEED_KEY}
    if not axes:
        raise ConfigError(f"{' '.join(overrides)} sweeps nothing but the seed: choose a sweep preset, "
                          "e.g. experiment=ablation_heads")
    values = [axis_values(key, text) for key, text in axes.items()]
    if better is None:
        monitor = str(cfg.task.monitor)
        if metric not in (monitor, f"best/{monitor}"):
            raise ConfigError(f"--metric {metric} is not the monitored {monitor}: say which is better with "
                              "--better min or --better max")
        better = str(cfg.task.monitor_mode)
    settings = [Setting(tuple(point)) for point in itertools.product(*values)]
    return Plan(sweep_dir, settings, [*axes, SEED_KEY], metric, better)


def train_job_runner(sweep_dir: Path, overrides: Sequence[str]) -> RunJob:
    """One ``train.py -m`` job per (setting, seed): the preset's sweep replaced by this one point
    (``choice(...)`` keeps each key a swept one, so the job's setting reads as in a plain sweep)."""

    def run(setting: Setting, seed: int, number: int) -> None:
        point = [f"{o.split('=', 1)[0]}=choice({o.split('=', 1)[1]})" for o in setting.overrides]
        command = [sys.executable, "-m", "trident.commands.train", "-m", *overrides, *point, f"{SEED_KEY}=choice({seed})",
                   "hydra.sweeper.params=null", f"hydra.sweep.dir={sweep_dir}",
                   f"hydra.sweep.subdir={number}_${{run_name}}"]
        log.info("job %d: %s seed %d", number, setting.label, seed)
        subprocess.run(command, check=False)  # a failed job writes its status.json; the loop reads it

    return run


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def replay_csv(jobs_csv: Path, metric: str, better: str | None, design: Design) -> Sequential:
    """The loop over the values of a report's ``jobs.csv``; its ``adaptive.json`` written beside it."""
    sweep = load_jobs_csv(jobs_csv)
    record = replay(seed_table(sweep, metric), sweep.settings, better or better_is(sweep, metric), metric, design)
    if not record.rounds:
        raise ConfigError(f"--metric {metric}: no completed job of {jobs_csv} recorded it with its seed")
    record.write(jobs_csv.parent)
    return record


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the preset and any overrides, e.g. experiment=ablation_heads")
    parser.add_argument("--sweep-dir", type=Path, default=None, help="the sweep directory (reused when it exists)")
    parser.add_argument("--replay", type=Path, default=None, metavar="JOBS_CSV",
                        help="run the loop over the values of a report's jobs.csv instead of jobs (no preset)")
    parser.add_argument("--metric", default="best/val/loss", help="the final metric compared (default: best/val/loss)")
    parser.add_argument("--better", choices=("min", "max"), default=None,
                        help="which is better (default: the task's monitor_mode; needed for another metric)")
    parser.add_argument("--first-seeds", type=positive, default=3, help="seeds of every setting (default: 3)")
    parser.add_argument("--max-seeds", type=positive, default=10, help="at most this many seeds (default: 10)")
    parser.add_argument("--step", type=positive, default=1, help="seeds added per round (default: 1)")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: the sweep directory)")
    args = parser.parse_args(argv)
    if (args.replay is None) == (args.sweep_dir is None) or (args.replay is None) != bool(args.overrides):
        parser.error("give a preset with --sweep-dir, or --replay <jobs.csv> alone")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run() -> Path:
        design = Design(args.first_seeds, args.max_seeds, args.step)
        if args.replay is not None:
            replay_csv(args.replay, args.metric, args.better, design)
            return write_report(load_jobs_csv(args.replay), args.out or args.replay.parent, compare=[args.metric])
        plan = preset_plan(args.overrides, args.sweep_dir, args.metric, args.better)
        plan.first_seeds, plan.max_seeds, plan.step = design.first_seeds, design.max_seeds, design.step
        outcome = add_seeds(plan, train_job_runner(args.sweep_dir, args.overrides))
        print(outcome.summary())
        return write_report(load_sweep(plan.sweep_dir), args.out, compare=[plan.metric])

    print(run_with_clear_errors(run))


if __name__ == "__main__":
    main()
