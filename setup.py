"""The packages of the distribution: everything under ``src/`` (trident, and its Hydra sweeper in the
``hydra_plugins`` namespace package, where Hydra looks for plugins), and ``conf/`` shipped inside the
package as ``trident/conf``, where an installed trident finds its config groups
(:func:`trident.runs.compose.find_conf_dir`); in a checkout ``python train.py`` reads ``conf/`` in place.
Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup

CONF = Path("conf")
# Each config group directory (model/, hydra/launcher/, ...) becomes a data-only package under trident.conf.
groups = sorted({path.parent.relative_to(CONF).parts for path in CONF.rglob("*.yaml")})
conf_packages = [".".join(("trident.conf", *parts)) for parts in groups]

setup(
    packages=[*find_packages("src"), *find_namespace_packages("src", include=["hydra_plugins.*"]), *conf_packages],
    package_dir={"": "src", "trident.conf": "conf"},
    package_data={package: ["*.yaml"] for package in conf_packages},
)
