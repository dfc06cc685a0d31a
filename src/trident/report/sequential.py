"""Seeds until decided as a group-sequential design: the rounds of the loop, the level of each look, the
loop itself over any source of values, its record (``adaptive.json``) and the report's table of it.

Round r (1 .. R) looks at n_r = min(max_seeds, first_seeds + (r - 1) step) seeds of every setting still
open, R = 1 + ceil((max_seeds - first_seeds) / step). Each look spends part of alpha (Lan & DeMets 1983,
"Discrete sequential boundaries for clinical trials", Biometrika 70) with the Pocock-type spending
function alpha(t) = alpha ln(1 + (e - 1) t), t_r = n_r / max_seeds: round r tests at the level
alpha(t_r) - alpha(t_{r-1}) (t_0 = 0), and the levels sum to alpha. A look is
:func:`trident.report.statistics.look`: Welch's test and Wellek's equivalence test over every pair of
settings, Holm over the pairs, at that round's level. By Bonferroni's inequality over the looks, the
chance of any false "worse than the best" over the whole loop is at most the sum of the levels, alpha,
whatever the correlation of the looks, and so for a false "within the noise": conservative, since the
looks share seeds. Exact boundaries (Pocock's, O'Brien-Fleming's) assume one normal statistic per look;
for Welch's and Wellek's tests with Holm over the settings they have no closed form. The sample sizes of
a look depend on the earlier looks (decided settings stop), so the bound is checked by simulation
(tests/test_statistics_simulation.py).

Multi-arm, multi-stage: a setting decided (worse, or within the noise) at round r keeps that verdict and
gets no more seeds; it is not tested again at the later, smaller levels. The settings still undecided
and the best one (the other side of their comparisons; chosen among the open settings) get the next
round's seeds. A fixed-seed sweep (first_seeds = max_seeds) is one look at alpha.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from trident.errors import ConfigError, DataError
from trident.report.statistics import ALPHA, Look, comparison_frame, look
from trident.report.sweep import Sweep

ADAPTIVE_FILE = "adaptive.json"
SPENDING = "Lan-DeMets, Pocock type: alpha(t) = alpha ln(1 + (e - 1) t), t = seeds / max_seeds"
# (setting, seed) -> the metric of that seed, or None when it is missing (failed, or not in a table).
Obtain = Callable[[str, int], "float | None"]


@dataclass(frozen=True)
class Design:
    first_seeds: int = 3
    max_seeds: int = 10
    step: int = 1
    alpha: float = ALPHA

    def __post_init__(self) -> None:
        if self.first_seeds > self.max_seeds:
            raise ConfigError(f"--first-seeds {self.first_seeds} is more than --max-seeds {self.max_seeds}: "
                              "lower --first-seeds or raise --max-seeds")

    @property
    def rounds(self) -> int:
        return 1 + math.ceil((self.max_seeds - self.first_seeds) / self.step)

    def seeds(self, number: int) -> int:
        """n_r: the seeds of every open setting at round ``number`` (1 .. rounds)."""
        return min(self.max_seeds, self.first_seeds + (number - 1) * self.step)

    def spent(self, number: int) -> float:
        """alpha(t_r), the alpha spent up to round ``number`` (0 before the first)."""
        fraction = self.seeds(number) / self.max_seeds if number > 0 else 0.0
        return self.alpha * math.log(1 + (math.e - 1) * fraction)

    def level(self, number: int) -> float:
        return self.spent(number) - self.spent(number - 1)

    def describe(self) -> str:
        levels = ", ".join(f"{self.level(r):.3g}" for r in range(1, self.rounds + 1))
        return (f"Seeds until decided: {self.first_seeds} seeds, then {self.step} more a round to the undecided "
                f"settings and the best, up to {self.max_seeds}; {self.rounds} looks at the levels {levels} "
                f"(alpha spending, Lan & DeMets 1983, Pocock type: together {self.alpha:g}); a setting keeps the "
                f"verdict of the round that decided it.")


@dataclass
class Round:
    number: int
    level: float
    seeds: int  # n_r, the seeds of every open setting
    completed: dict[str, int]  # completed seeds of every setting looked at
    best: str
    verdicts: dict[str, str]  # the settings open at this round (the ones decided before keep theirs)


@dataclass
class Sequential:
    """The loop's record: its design, its rounds, and per setting the round, look and values that gave
    its verdict (the undecided ones and the best: the last look)."""

    settings: list[str]
    better: str
    metric: str
    design: Design
    rounds: list[Round] = field(default_factory=list)
    looks: dict[str, tuple[int, Look, dict[str, list[float]]]] = field(default_factory=dict)

    @property
    def verdicts(self) -> dict[str, str]:
        return {s: seen.verdicts[s] for s, (_, seen, _) in self.looks.items()}

    def record(self) -> dict:
        return {"metric": self.metric, "better": self.better, "settings": self.settings, "spending": SPENDING,
                "design": asdict(self.design), "rounds": [asdict(r) for r in self.rounds]}

    def write(self, directory: Path) -> Path:
        path = directory / ADAPTIVE_FILE
        path.write_text(json.dumps(self.record(), indent=1) + "\n")
        return path

    def frame(self) -> pd.DataFrame:
        """The report's table (:func:`trident.report.statistics.compare_to_best`'s columns): each row
        from the look that decided it; ``attrs["design"]`` says the design."""
        values = {s: self.looks[s][2][s] for s in self.settings if s in self.looks}
        frame = comparison_frame(values, self.better, self.metric, self.design.alpha,
                                 self.rounds[-1].level if self.rounds else self.design.alpha, self.looks)
        frame.attrs["design"] = self.design.describe()
        return frame


def run_loop(settings: Sequence[str], better: str, metric: str, design: Design, obtain: Obtain,
             after_round: Callable[[Sequential], None] = lambda record: None) -> Sequential:
    """The rounds of the module docstring; ``obtain`` gives the value of a (setting, seed), running its
    job if it has to. Ends when no open setting but the best is undecided, or after the last round."""
    record = Sequential(list(settings), better, metric, design)
    values: dict[str, list[float]] = {s: [] for s in settings}
    tried = dict.fromkeys(settings, 0)
    open_settings = list(settings)
    for number in range(1, design.rounds + 1):
        seeds = design.seeds(number)
        for setting in open_settings:
            for seed in range(tried[setting] + 1, seeds + 1):
                value = obtain(setting, seed)
                if value is not None:
                    values[setting].append(value)
            tried[setting] = seeds
        current = {s: list(v) for s, v in values.items() if v}
        if not current:
            continue
        candidates = [s for s in open_settings if s in current] or None
        seen = look(current, better, design.level(number), candidates)
        for setting in current:
            if setting in open_settings:
                record.looks[setting] = (number, seen, current)
        open_verdicts = {s: seen.verdicts[s] for s in open_settings if s in current}
        record.rounds.append(Round(number, seen.level, seeds, {s: len(v) for s, v in current.items()}, seen.best,
                                   open_verdicts))
        open_settings = [s for s in open_settings if s == seen.best or open_verdicts.get(s, "").startswith("undecided")
                         or s not in current]
        after_round(record)
        if open_settings == [seen.best]:
            break
    return record


def replay(table: Mapping[tuple[str, int], float], settings: Sequence[str], better: str, metric: str,
           design: Design) -> Sequential:
    """The loop over values already known, e.g. a ``jobs.csv``: a (setting, seed) the table lacks is a
    missing seed (a failed job)."""
    return run_loop(settings, better, metric, design, lambda setting, seed: table.get((setting, seed)))


def seed_table(sweep: Sweep, metric: str) -> dict[tuple[str, int], float]:
    """(setting, seed) -> ``metric`` of its last completed job that recorded it."""
    return {(job.setting, job.seed): job.metrics[metric] for job in sweep.completed
            if job.seed is not None and not math.isnan(job.metrics.get(metric, math.nan))}


def read_record(sweep: Sweep, metric: str) -> Sequential | None:
    """The loop of ``adaptive.json`` beside the sweep, replayed over its jobs, when it decided on
    ``metric``; None for a fixed-seed sweep (no file) or another metric."""
    path = sweep.dir / ADAPTIVE_FILE
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        design = Design(**stored["design"])
        recorded = {s: verdict for r in stored["rounds"] for s, verdict in r["verdicts"].items()}
        if stored["metric"] != metric:
            return None
        replayed = replay(seed_table(sweep, metric), stored["settings"], stored["better"], metric, design)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not a record of trident.report.adaptive ({err!r}): remove it for a fixed-seed "
                        "report or re-make it with `python -m trident.report.adaptive --replay <jobs.csv>`") from err
    if replayed.verdicts != recorded:
        raise DataError(f"{path} records verdicts that the sweep's jobs do not give: the jobs changed since the loop "
                        "ran; re-make it with `python -m trident.report.adaptive --replay <jobs.csv>`")
    return replayed
