"""The ``qlora`` benchmark rows (issue 56): the three variants are trident's own (the task's converters), their bytes
agree with an independent count, and the bigram data is what the rows say."""

from __future__ import annotations

import pytest
import torch

from trident.bench import qlora
from trident.converters.nf4 import is_nf4, nf4_bytes

pytest.importorskip("torchao")


def test_the_variants_are_the_tasks_converters_on_one_base() -> None:
    nets = {variant: qlora.build(variant, quick=True).net for variant in qlora.VARIANTS}
    assert not any(is_nf4(p) for p in nets["lora"].parameters())
    assert sum(is_nf4(p) for p in nets["qlora"].parameters()) == 4 * qlora.QUICK["n_layers"]
    # The same base: LoRA's frozen weights are full's, QLoRA's their NF4.
    full = nets["full"].state_dict()
    for name, param in nets["qlora"].named_parameters():
        if is_nf4(param):
            assert torch.equal(nets["lora"].state_dict()[name], full[name])
            assert (param.get_original_weight() - full[name]).abs().max() < full[name].abs().max() / 4


def test_the_weight_bytes_count_nf4_as_stored() -> None:
    net = qlora.build("qlora", quick=True).net
    stored, _ = nf4_bytes(net)
    plain = sum(p.numel() * p.element_size() for p in net.parameters() if not is_nf4(p))
    assert qlora.held_bytes(net) == stored + plain
    full = qlora.build("full", quick=True).net
    assert qlora.held_bytes(full) == sum(p.numel() * 4 for p in full.parameters())


def test_the_bigram_data_follows_its_chain() -> None:
    ids = qlora.bigram_batches(quick=True, count=3)
    assert ids.shape == (3, qlora.QUICK_BATCH, qlora.QUICK_LENGTH + 1)
    pairs = torch.stack([ids[..., :-1].flatten(), ids[..., 1:].flatten()], dim=1).unique(dim=0)
    assert torch.bincount(pairs[:, 0]).max() <= qlora.SUCCESSORS  # each token has at most 4 successors
