"""The CI skip rule, a pytest plugin with no heavy imports (tests/conftest.py loads its hooks; tests/test_ci.py
runs it as the conftest of a scratch suite): under CI=true a skip whose reason is not allowed here fails the run,
and every run ends with a summary of its skip reasons."""

from __future__ import annotations

import os

import pytest

# Under CI=true a skipped test fails the run unless its reason is here, with why it may skip there.
GPU_SKIP_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False): run `pytest -m gpu` on a GPU machine (docs/gpu.md)"
ALLOWED_CI_SKIPS = {
    GPU_SKIP_REASON: "CI machines have no GPU: tests/gpu runs with `pytest -m gpu` on one (docs/gpu.md)",
}
_REFUSED_SKIPS = pytest.StashKey[list[pytest.TestReport]]()


def _skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave (pytest stores it as (file, line, "Skipped: reason"))."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI=true, a skip whose reason is not in ALLOWED_CI_SKIPS fails the run: a CI that passes
    without its SLURM, dataset or dependency tests would say nothing about them."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get("CI") != "true" or reporter is None:
        return
    refused = [r for r in reporter.stats.get("skipped", []) if _skip_reason(r) not in ALLOWED_CI_SKIPS]
    if refused and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[_REFUSED_SKIPS] = refused


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The skip summary: every reason with its count, and under CI=true whether it is allowed."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section("skips")
    reasons: dict[str, int] = {}
    for report in skipped:
        reasons[_skip_reason(report)] = reasons.get(_skip_reason(report), 0) + 1
    for reason, count in reasons.items():
        allowed = ALLOWED_CI_SKIPS.get(reason)
        verdict = f"allowed under CI: {allowed}" if allowed else "NOT allowed under CI=true"
        terminalreporter.write_line(f"{count:4d} skipped: {reason}  [{verdict}]")
    refused = terminalreporter.config.stash.get(_REFUSED_SKIPS, [])
    if refused:
        terminalreporter.write_line(
            f"error: CI=true: {len(refused)} tests skipped for a reason not in tests/ci_skips.py's ALLOWED_CI_SKIPS "
            "(first: " + refused[0].nodeid + "): provide what they need, or allow the reason there with why",
            red=True, bold=True)
