"""Score a checkpoint on the test split: `python eval.py ckpt_path=outputs/runs/<date>/<run>/checkpoints/last.ckpt`.

The same command as ``trident-eval`` (installed) and ``python -m trident.commands.evaluate``; see that module."""

from trident.commands.evaluate import main

if __name__ == "__main__":
    main()
