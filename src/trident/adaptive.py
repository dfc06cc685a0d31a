"""Seeds until the answer is clear: run a sweep preset with a few seeds, then add seeds only where a
comparison against the best setting is still undecided, up to a maximum (issue #28).

``python -m trident.adaptive experiment=ablation_heads --metric best/val/loss --max-seeds 10
--sweep-dir outputs/ablations/ablation_heads`` runs every setting of the preset (its swept values
without ``seed``) with seeds 1 .. ``--first-seeds``; after each round it reads the sweep directory and
asks a decision (:data:`Decide`: the values per setting -> decided or not) which comparisons are
settled. The undecided settings, and the best one (its mean is the other side of every comparison),
get ``--step`` more seeds, until every comparison is decided or they have ``--max-seeds`` seeds; those
stay "undecided at N seeds". The report (``python -m trident.report``) is written at the end, into
the sweep directory or ``--out``.

Every job is one ``train.py -m`` job into the same sweep directory, numbered after the jobs already
there, so the directory stays one sweep for the report and for W&B. A (setting, seed) with a completed
``status.json`` is reused, never re-run; a failed one is tried once more, and after a second failure
it counts as a missing seed (the report lists both failures) while the loop goes on.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from trident.checks import is_int
from trident.errors import ConfigError, run_with_clear_errors
from trident.runs.compose import CONF_DIR
from trident.runs.sweeps import REPEAT_KEYS, job_dirs, job_statuses, setting_of

log = logging.getLogger(__name__)

# A failed (setting, seed) is run this many times in all before it counts as a missing seed.
ATTEMPTS = 2
SEED_KEY = REPEAT_KEYS[0]

# values of the metric over the completed seeds of each setting, "min" or "max" (which is better)
# -> whether each setting's comparison against the best is decided (the best itself: True).
Decide = Callable[[Mapping[str, Sequence[float]], str], Mapping[str, bool]]
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


@dataclass
class Outcome:
    """How the loop ended: the completed seeds and the decision of each setting."""

    seeds: dict[str, int]
    decided: dict[str, bool]

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


def next_job_number(sweep_dir: Path) -> int:
    """One more than the highest job number in the sweep directory (``<num>_<run name>``)."""
    numbers = [int(d.name.split("_", 1)[0]) for d in job_dirs(sweep_dir)] if sweep_dir.is_dir() else []
    return max((n for n in numbers if n >= 0), default=-1) + 1


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


def seed_values(plan: Plan) -> dict[str, list[float]]:
    """The metric over the completed seeds (1 .. max) of each setting that has one."""
    values: dict[str, list[float]] = {}
    for (label, seed), runs in read_jobs(plan.sweep_dir, plan.swept).items():
        done = [metrics for status, metrics in runs if status == "completed" and plan.metric in metrics]
        if done and seed <= plan.max_seeds:
            values.setdefault(label, []).append(float(done[-1][plan.metric]))
    return values


def add_seeds(plan: Plan, run_job: RunJob, decide: Decide) -> Outcome:
    """The loop of the module docstring; returns when every comparison is decided or the settings
    still undecided have ``max_seeds`` seeds tried."""
    if plan.first_seeds > plan.max_seeds:
        raise ConfigError(f"--first-seeds {plan.first_seeds} is more than --max-seeds {plan.max_seeds}: "
                          "lower --first-seeds or raise --max-seeds")
    tried = {setting.label: plan.first_seeds for setting in plan.settings}
    started: Counter[tuple[str, int]] = Counter()
    while True:
        for setting in plan.settings:
            for seed in range(1, tried[setting.label] + 1):
                ensure_job(plan, setting, seed, run_job, started)
        values = seed_values(plan)
        verdicts = decide(values, plan.better) if values else {}
        decided = {s.label: bool(verdicts.get(s.label, False)) for s in plan.settings}
        growing = [label for label, done in decided.items() if not done and tried[label] < plan.max_seeds]
        if growing and values:
            means = {label: statistics.mean(v) for label, v in values.items()}
            best = (min if plan.better == "min" else max)(means, key=means.__getitem__)
            growing = list(dict.fromkeys([*growing, best] if tried[best] < plan.max_seeds else growing))
        if not growing:
            return Outcome({s.label: len(values.get(s.label, [])) for s in plan.settings}, decided)
        log.info("undecided: %s; adding %d seed(s)", ", ".join(growing), plan.step)
        for label in growing:
            tried[label] = min(plan.max_seeds, tried[label] + plan.step)


def decide_with_report(values: Mapping[str, Sequence[float]], better: str) -> dict[str, bool]:
    """The report's own decision: :func:`trident.report.compare_to_best` (Welch's test, Holm's
    correction over the settings, its ``decided`` column), so the loop stops where the report's
    verdicts say it may."""
    from trident.report import Job, Sweep, compare_to_best  # the report's pandas/scipy: only here

    metric = "value"
    jobs = [Job(dir=Path(label), setting=label, status="completed", metrics={metric: value})
            for label, seeds in values.items() for value in seeds]
    comparison = compare_to_best(Sweep(dir=Path("."), name="adaptive", jobs=jobs, monitor=metric,
                                       monitor_mode=better), metric)
    return {str(label): bool(done) for label, done in comparison["decided"].items()}


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
        command = [sys.executable, "-m", "trident.train", "-m", *overrides, *point, f"{SEED_KEY}=choice({seed})",
                   "hydra.sweeper.params=null", f"hydra.sweep.dir={sweep_dir}",
                   f"hydra.sweep.subdir={number}_${{run_name}}"]
        log.info("job %d: %s seed %d", number, setting.label, seed)
        subprocess.run(command, check=False)  # a failed job writes its status.json; the loop reads it

    return run


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="+", help="the preset and any overrides, e.g. experiment=ablation_heads")
    parser.add_argument("--sweep-dir", type=Path, required=True, help="the sweep directory (reused when it exists)")
    parser.add_argument("--metric", default="best/val/loss", help="the final metric compared (default: best/val/loss)")
    parser.add_argument("--better", choices=("min", "max"), default=None,
                        help="which is better (default: the task's monitor_mode; needed for another metric)")
    parser.add_argument("--first-seeds", type=positive, default=3, help="seeds of every setting (default: 3)")
    parser.add_argument("--max-seeds", type=positive, default=10, help="at most this many seeds (default: 10)")
    parser.add_argument("--step", type=positive, default=1, help="seeds added per round (default: 1)")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: the sweep directory)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run() -> Path:
        plan = preset_plan(args.overrides, args.sweep_dir, args.metric, args.better)
        plan.first_seeds, plan.max_seeds, plan.step = args.first_seeds, args.max_seeds, args.step
        outcome = add_seeds(plan, train_job_runner(args.sweep_dir, args.overrides), decide_with_report)
        print(outcome.summary())
        from trident.report import load_sweep, write_report

        return write_report(load_sweep(plan.sweep_dir), args.out, compare=[plan.metric])

    print(run_with_clear_errors(run))


if __name__ == "__main__":
    main()
