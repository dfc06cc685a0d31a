"""Score a checkpoint on the test split: ``trident-eval ckpt_path=outputs/runs/<date>/<run>/checkpoints/last.ckpt``
(``python eval.py ...`` in a checkout); ``ckpt_path=<run dir>`` scores its best, else last checkpoint.

The model and data are rebuilt from the run's `config_resolved.yaml` (found in the checkpoint's
run directory), then `trainer.test` runs, for any task (lm, translation, vit, mlm). Further `key=value`
arguments override keys of that config (not config groups), e.g. `task.beam_size=1`,
`trainer.limit_test_batches=10`, `trainer.precision=bf16-mixed`. Metrics are printed and written to
`<run dir>/eval/<checkpoint name>.json` (a checkpoint outside `checkpoints/`, e.g. trident-quantize's
`<run>/quantized-int8/last.ckpt`: `quantized-int8-last.json`). `TRIDENT_CACHE_DIR`, when set, replaces the run's
`data.cache_dir` (the prepared data is rebuilt there if missing).
"""

from __future__ import annotations

import sys

from trident.errors import run_with_clear_errors
from trident.runs.evaluation import evaluate

__all__ = ["evaluate", "main"]


def main() -> None:
    arguments = sys.argv[1:]
    if {"-h", "--help"} & set(arguments):  # key=value arguments otherwise: no argparse, whose help would list none
        print(__doc__)
        return
    run_with_clear_errors(lambda: evaluate(arguments))


if __name__ == "__main__":
    main()
