"""open_clip, the reference of task=clip's tests (trident's [clip] extra), imported in this shared environment."""

from __future__ import annotations

import codecs
import sys
from types import ModuleType

import pytest


def import_open_clip() -> ModuleType:
    """open_clip, or the test skipped where the [clip] extra is not installed. An environment that still holds
    future_typing's ``.pth`` hook (installed with trident's old corpus dependency, since removed) answers every
    unknown codec name with its own codec, which breaks ``import ftfy`` (open_clip's tokenizer): its search function
    is unregistered first (the hook registers it twice)."""
    hook = sys.modules.get("future_typing.codec")
    for _ in range(8):
        if hook is None:
            break
        try:
            codecs.lookup("trident-no-such-codec")
        except LookupError:
            break
        codecs.unregister(hook.search_function)
    return pytest.importorskip("open_clip")
