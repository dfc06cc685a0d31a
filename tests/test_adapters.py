"""The adapter registry: every Hugging Face family implements the one interface and is registered once,
for reading (by config.json's model_type) and for export (by the trident network it writes)."""

from __future__ import annotations

import pytest
from torch import nn

from trident.errors import ConfigError
from trident.weights.adapters.base import Adapter
from trident.weights.adapters.registry import ADAPTERS, adapter_for_model_type, adapter_for_network


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda adapter: adapter.FORMAT)
def test_each_adapter_implements_the_interface_and_is_found_both_ways(adapter: Adapter) -> None:
    assert isinstance(adapter, Adapter)
    assert adapter_for_model_type(adapter.MODEL_TYPE) is adapter
    net = adapter.NETWORK.__new__(adapter.NETWORK)  # its class is all the export looks up
    assert adapter_for_network(net) is adapter


def test_one_registration_per_family() -> None:
    for field in ("FORMAT", "MODEL_TYPE", "NETWORK"):
        values = [getattr(adapter, field) for adapter in ADAPTERS]
        assert len(set(values)) == len(values), field


def test_a_network_of_no_family_is_one_line_naming_those_written() -> None:
    assert adapter_for_model_type("t5") is None
    with pytest.raises(ConfigError, match=r"^a Linear has no Hugging Face equivalent: the hf export writes CausalLM "
                                          r"\(GPT2LMHeadModel\), MaskedLM \(BertForMaskedLM\), VisionTransformer"):
        adapter_for_network(nn.Linear(1, 1))
