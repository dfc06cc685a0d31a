"""Benchmarks: trident against the models a researcher would otherwise pick (``python -m trident.bench``)."""
