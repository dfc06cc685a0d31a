"""The console's table of samples prints what was generated as it is (trident.tracking.text_logging)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trident.tracking.text_logging import log_text_table


def test_a_sample_with_brackets_is_printed_as_text_not_read_as_markup(capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama 2 chat template's prompt ("[INST] ... [/INST]") or any sampled "[/x]" used to end the run at its
    validation (rich's MarkupError: a closing tag that matches nothing); "[bold]" used to vanish from the table."""
    module = SimpleNamespace(loggers=[], global_step=3)
    log_text_table(module, "samples", ["step", "prompt", "sample"],  # type: ignore[arg-type]
                   [[3, "<s>[INST] Say yes. [/INST]", "[bold]SAY[/] YES."]])
    printed = capsys.readouterr().out
    assert "[INST] Say yes. [/INST]" in printed and "[bold]SAY[/] YES." in printed
