"""trident's Hydra sweeper (a Hydra plugin must live in the ``hydra_plugins`` namespace package)."""
