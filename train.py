"""Train a Transformer: `python train.py task=lm pos_encoding=rope` (see docs/configuration.md for all options).

The same command as ``trident-train`` (installed) and ``python -m trident.commands.train``."""

from trident.commands.train import main

if __name__ == "__main__":
    main()
