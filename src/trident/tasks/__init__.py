"""LightningModules, one per task; each builds its network from the backbone's public API."""
