"""Every notebook under notebooks/ runs top to bottom on nano settings, so none can silently rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

from .conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL_NAME = "trident-tests"
# Tiny settings for every notebook; each notebook reads what it needs from these variables.
NOTEBOOK_ENV = {"TRIDENT_NOTEBOOK_STEPS": "2", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel spec running this interpreter (sys.executable), so the notebooks import the trident
    under test whatever kernels the machine has installed."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    spec = Path(write_kernel_spec(jupyter_dir / "kernels" / KERNEL_NAME))
    assert json.loads((spec / "kernel.json").read_text())["argv"][0] == sys.executable
    return jupyter_dir


def test_the_notebooks_are_found() -> None:
    assert {"attention_maps.ipynb", "positional_encodings.ipynb"} <= {p.name for p in NOTEBOOKS}


def test_notebooks_are_committed_without_outputs() -> None:
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(
    path: Path, kernel_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("TRIDENT_NOTEBOOK_OUTPUT_ROOT", str(tmp_path / "outputs"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    for key, value in NOTEBOOK_ENV.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(path, as_version=4)
    # Run from the notebook's folder, as Jupyter does; nothing is written there.
    client = NotebookClient(
        notebook, kernel_name=KERNEL_NAME, timeout=240, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell and its traceback
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    figures = [o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert figures, f"{path.name} shows no figure"
    assert not list(path.parent.glob("outputs")), "notebooks write under TRIDENT_NOTEBOOK_OUTPUT_ROOT only"
