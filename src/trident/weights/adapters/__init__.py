"""Outside formats in and out: one adapter module per format, both directions.

Each adapter implements :class:`trident.weights.adapters.base.Adapter` (its format's names and settings
to trident's and back) and is registered once in :mod:`trident.weights.adapters.registry`, which
``read_pretrained`` reads through and the ``trident-export`` command writes through.
"""
