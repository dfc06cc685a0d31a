"""A DDP worker's command line: Lightning starts the workers of a job (local ranks 1..N-1) by running
the launching command again, which may be a whole sweep; :func:`trident.launch.distributed.workers_follow`
publishes the job in :data:`JOB_VARIABLE`, and :func:`worker_arguments` turns a worker's command line
into that one job. Everything here is read before Hydra starts, so it imports no more than the standard library.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

#: Set by the launching process for the DDP workers it starts: {"overrides": [...], "run_dir": ...}.
JOB_VARIABLE = "TRIDENT_DDP_JOB"
# Hydra options that choose the root config; a worker must compose the same one.
_CONFIG_OPTIONS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")


def is_ddp_worker() -> bool:
    """A DDP worker that a launching trident process started (which checked the command line already)."""
    return os.environ.get(JOB_VARIABLE) is not None and os.environ.get("LOCAL_RANK", "0") != "0"


def worker_arguments(argv: Sequence[str]) -> list[str]:
    """The command line of a DDP worker that Lightning started for a job published by
    :func:`trident.launch.distributed.workers_follow`: that job's own overrides in its run directory
    (no sweep, no second run directory, no second copy of Hydra's files)."""
    spec = json.loads(os.environ[JOB_VARIABLE])
    run_dir = _hydra_quote(spec["run_dir"])
    return [*_config_options(argv), *spec["overrides"], f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]


def _hydra_quote(value: str) -> str:
    """``value`` as one quoted Hydra override value (paths may hold ``,``, ``=`` or spaces)."""
    # Hydra reads a backslash as an escape only before a quote or the closing quote.
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"'{escaped}'"


def _config_options(argv: Sequence[str]) -> list[str]:
    kept: list[str] = []
    for index, arg in enumerate(argv):
        if arg in _CONFIG_OPTIONS:
            kept += argv[index : index + 2]
        elif arg.split("=", 1)[0] in _CONFIG_OPTIONS:
            kept.append(arg)
    return kept
