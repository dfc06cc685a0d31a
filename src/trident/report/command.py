"""``python -m trident.report`` (``trident-report``): its arguments are parsed before pandas, scipy and matplotlib
load, so ``--help`` answers at once."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from trident.errors import run_with_clear_errors


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Report on a sweep: report.md, plots and jobs.csv.")
    parser.add_argument("source", type=Path,
                        help="a multirun directory (outputs/multirun/<date>/<time>) or a report's jobs.csv")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the sweep's directory)")
    parser.add_argument("--metric", default=None, help="the metric to plot (default: the monitored one)")
    parser.add_argument("--compare", nargs="+", default=(), metavar="METRIC",
                        help="metrics to test between settings (default: the plotted final one), e.g. test/ppl val/loss")
    args = parser.parse_args(argv)
    from trident.report.sweep import load
    from trident.report.write import write_report

    report = run_with_clear_errors(lambda: write_report(load(args.source), args.out, args.metric, args.compare))
    print(report)
