"""A block's ``load_weights`` is one load call for its experts: the non-finite counts of
every expert tensor in it are read back once (one host sync on a GPU), as for one
``experts.load_weights`` call, and a non-finite tensor anywhere in it drops the call."""

from __future__ import annotations

import pytest
import torch

from megamoe.core.adapters import SyntheticSizes, installed_adapters
from megamoe.core.errors import NonFiniteError
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_layer_tensors

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)
ADAPTERS = installed_adapters()


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_one_block_load_call_reads_the_counts_back_once(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = ADAPTERS[name]
    config = adapter.synthetic_config(WeightFormat.FP8_BLOCK, SIZES)
    layer = next(m for m in adapter.moe_layers(config) if not m.is_mtp)
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    block = adapter.build_block(config, layer, parallel=parallel, backend="reference")
    ledger = block.experts._arrival.ledger
    checks = 0
    check = ledger.check

    def counted() -> None:
        nonlocal checks
        checks += 1
        check()

    monkeypatch.setattr(ledger, "check", counted)
    tensors = list(synthetic_layer_tensors(adapter, config, layer.prefix).items())
    block.load_weights(tensors)
    assert checks == 1
    block.finalize()
    bad = [(n, t) for n, t in tensors if n.startswith("experts.")]
    last, value = bad[-1]
    if value.dtype == torch.float8_e4m3fn:  # an E4M3 weight: its NaN byte
        bad[-1] = (last, value.view(torch.uint8).clone().fill_(0x7F).view(value.dtype))
    else:
        bad[-1] = (last, torch.full_like(value, float("nan")))
    with pytest.raises(NonFiniteError):
        block.load_weights(bad)
    assert not block.experts.pending_bytes  # the whole call was dropped
