"""Seeded simulations of the report's error rates (issue #37): thousands of sweeps drawn with known
truths, the rate of a false verdict bounded by its one-sided 95 % Clopper-Pearson interval, for the
numbers of settings and seeds the presets use (2 to 6 settings, 3 seeds fixed, up to 8 or 10 with
seeds until decided). Each test also runs the old procedure and shows that it fails the same bound."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from trident.report.sequential import Design, Sequential, run_loop
from trident.report.statistics import ALPHA, WITHIN_NOISE, WORSE, Look, best_of, holm, look, pair_tests


def upper_bound(events: int, trials: int) -> float:
    """One-sided 95 % Clopper-Pearson upper bound of a rate."""
    return 1.0 if events == trials else float(stats.beta.ppf(0.95, events + 1, trials - events))


def lower_bound(events: int, trials: int) -> float:
    return 0.0 if events == 0 else float(stats.beta.ppf(0.05, events, trials - events + 1))


def equal_sweep(rng: np.random.Generator, settings: int, seeds: int, shift: float = 0.0) -> dict[str, list[float]]:
    """Normal values, every setting N(0, 1) but the first, N(shift, 1)."""
    values = rng.normal(size=(settings, seeds))  # (settings, seeds)
    values[0] += shift
    return {f"s{i}": row.tolist() for i, row in enumerate(values)}


def old_worse(values: dict[str, list[float]], better: str = "min") -> set[str]:
    """The procedure before issue #37: Welch against the best mean, Holm over those k - 1 comparisons."""
    best = best_of(values, better)
    pairs, p, _ = pair_tests(values)
    against = {(a if b == best else b): q for (a, b), q in zip(pairs, p, strict=True) if best in (a, b)}
    return {s for s, q in zip(against, holm(list(against.values())), strict=True) if q < ALPHA}


def false_within_noise(seen: Look) -> bool:
    """Whether a look calls s0 (one seed sd away from every other setting) within the noise of the
    best, or another setting within the noise of s0 as the best."""
    if seen.best == "s0":
        return WITHIN_NOISE in seen.verdicts.values()
    return seen.verdicts["s0"] == WITHIN_NOISE


# 2 settings are one pair: Welch's test at alpha and Wellek's exact test at its margin, rates of 5 % (less
# Welch's small conservatism) that no number of sweeps bounds below 5 %. The family starts at 3 settings.
# Sweeps: enough for the bound to decide (3 x 8, the closest to 5 %, needs the most).
@pytest.mark.parametrize(("settings", "seeds", "sweeps"), [(3, 3, 1000), (3, 8, 3000), (5, 3, 1000), (5, 8, 1500),
                                                           (6, 3, 1000), (6, 8, 1500)])
def test_equal_settings_are_called_worse_in_at_most_5_percent_of_sweeps(settings: int, seeds: int, sweeps: int) -> None:
    rng = np.random.default_rng([37, settings, seeds])
    false_worse = sum(WORSE in look(equal_sweep(rng, settings, seeds), "min").verdicts.values() for _ in range(sweeps))
    assert upper_bound(false_worse, sweeps) <= ALPHA, f"{false_worse} of {sweeps} sweeps called an equal setting worse"


@pytest.mark.parametrize("settings", [5, 6])
def test_the_old_family_against_the_chosen_best_fails_the_same_bound(settings: int) -> None:
    """Holm over the k - 1 comparisons against the best: 7-8 % at 5 and 6 settings x 8 seeds."""
    rng = np.random.default_rng([37, settings])
    sweeps = 1000
    false_worse = sum(bool(old_worse(equal_sweep(rng, settings, 8))) for _ in range(sweeps))
    assert lower_bound(false_worse, sweeps) > ALPHA


@pytest.mark.parametrize("settings", [3, 5])
@pytest.mark.parametrize("seeds", [3, 8])
def test_a_setting_one_seed_sd_away_is_called_within_the_noise_in_at_most_5_percent(settings: int, seeds: int) -> None:
    """The first setting is worse by exactly the margin (one seed standard deviation): "within the
    noise" of it is false."""
    rng = np.random.default_rng([37, 1, settings, seeds])
    sweeps = 1000
    false_noise = sum(false_within_noise(look(equal_sweep(rng, settings, seeds, shift=1.0), "min"))
                      for _ in range(sweeps))
    assert upper_bound(false_noise, sweeps) <= ALPHA


def loop(rng: np.random.Generator, settings: int, design: Design, shift: float = 0.0) -> Sequential:
    """The seeds-until-decided loop with an in-memory job runner: seed s of a setting is row s of its draws."""
    values = equal_sweep(rng, settings, design.max_seeds, shift)
    return run_loop(list(values), "min", "value", design, lambda setting, seed: values[setting][seed - 1])


def old_loop(rng: np.random.Generator, settings: int, first_seeds: int, max_seeds: int) -> bool:
    """The loop before issue #37, on its "worse" verdicts (its "within the noise" stops, rare at these
    seeds, left out): every setting re-tested at alpha after each seed, a setting called worse stops,
    the rest and the best get one more seed; whether its last look calls an equal setting worse."""
    draws = equal_sweep(rng, settings, max_seeds)
    seeds = dict.fromkeys(draws, first_seeds)
    while True:
        current = {s: draws[s][:n] for s, n in seeds.items()}
        worse, best = old_worse(current), best_of(current, "min")
        growing = [s for s in current if s not in worse and s != best and seeds[s] < max_seeds]
        if not growing:
            return bool(worse)
        for setting in {*growing, best}:
            seeds[setting] = min(max_seeds, seeds[setting] + 1)


@pytest.mark.parametrize("settings", [3, 5])
@pytest.mark.parametrize("max_seeds", [8, 10])
def test_the_loop_calls_equal_settings_worse_in_at_most_5_percent_of_runs(settings: int, max_seeds: int) -> None:
    """3 seeds, then one at a time up to 8 (the docs' runs) or 10 (the command's default), every look
    counted: the rate of any false "worse" over the whole loop (about 1-2 %: Bonferroni over the looks
    is conservative)."""
    rng = np.random.default_rng([37, 2, settings, max_seeds])
    runs = 400
    false_worse = sum(WORSE in loop(rng, settings, Design(3, max_seeds)).verdicts.values() for _ in range(runs))
    assert upper_bound(false_worse, runs) <= ALPHA


@pytest.mark.parametrize("settings", [3, 5])
def test_the_old_loop_fails_the_same_bound(settings: int) -> None:
    """Issue #37 measured 10.7 % (3 settings) and 12 % (5) for 3 seeds then up to 8."""
    rng = np.random.default_rng([37, 3, settings])
    runs = 200
    false_worse = sum(old_loop(rng, settings, 3, 8) for _ in range(runs))
    assert lower_bound(false_worse, runs) > ALPHA


@pytest.mark.parametrize("settings", [3, 5])
def test_the_loop_calls_a_setting_one_seed_sd_away_within_the_noise_in_at_most_5_percent(settings: int) -> None:
    rng = np.random.default_rng([37, 4, settings])
    runs = 400
    false_noise = 0
    for _ in range(runs):
        record = loop(rng, settings, Design(3, 8), shift=1.0)
        # s0 within the noise of the best, or another setting within the noise of s0 as the best.
        false_noise += any(verdict == WITHIN_NOISE and "s0" in (setting, record.looks[setting][1].best)
                           for setting, verdict in record.verdicts.items())
    assert upper_bound(false_noise, runs) <= ALPHA
