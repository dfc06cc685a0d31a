"""Every test under tests/gpu/ needs a CUDA GPU: it carries the ``gpu`` marker (``pytest -m gpu``
selects them) and is skipped, with the reason, where torch sees no GPU (CI, laptops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ..conftest import GPU_SKIP_REASON

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items: mark only the ones collected from this folder.
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
