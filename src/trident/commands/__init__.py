"""The commands: train, evaluate, sample, translate, fill_mask, export, average_checkpoints, each
``python -m trident.commands.<name>`` and a console script (``trident-train``, ``trident-eval``,
``trident-sample``, ...; pyproject.toml's ``[project.scripts]``). The sweeps' report and its
seeds-until-decided loop are the commands of :mod:`trident.report`; the benchmarks, :mod:`trident.bench`.
"""
