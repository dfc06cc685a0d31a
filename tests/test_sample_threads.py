"""``python -m trident.commands.sample --threads N``: torch's intra-op threads for decoding (one line when refused)."""

from __future__ import annotations

import pytest
import torch

from trident.commands import sample


def test_sample_threads_sets_torch_threads_and_refuses_zero(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[int] = []

    def load(path: object) -> None:
        seen.append(torch.get_num_threads())
        raise SystemExit(0)

    threads = torch.get_num_threads()
    monkeypatch.setattr(sample, "load_lm_checkpoint", load)
    torch.set_num_threads(2)  # not already the asked-for count
    try:
        with pytest.raises(SystemExit):
            sample.main(["run.ckpt", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert seen == [1]
    with pytest.raises(SystemExit):
        sample.main(["run.ckpt", "--threads", "0"])
    assert "--threads: must be a whole number >= 1, got '0'" in capsys.readouterr().err
