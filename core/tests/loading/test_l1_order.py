"""The gate/up row order of first-projection weights: views, round trips, DeepGEMM's order."""

from __future__ import annotations

import pytest
import torch
from fakes import load_fake

from megamoe.core.loading.l1_order import L1RowOrder
from megamoe.core.loading.pairing import SHARD_DOWN, SHARD_GATE, SHARD_UP


@pytest.mark.parametrize("group", [0, 8])
def test_round_trip_and_shard_views(group: int) -> None:
    order = L1RowOrder(group)
    canonical = torch.arange(3 * 32 * 5, dtype=torch.float32).reshape(3, 32, 5)
    stored = order.from_canonical(canonical)
    assert torch.equal(order.to_canonical(stored), canonical)
    assert torch.equal(order.read(stored, SHARD_GATE), canonical[:, :16])
    assert torch.equal(order.read(stored, SHARD_UP), canonical[:, 16:])
    view = order.shard_view(stored, SHARD_UP)
    assert view.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()  # no copy
    order.write(stored[1], SHARD_GATE, torch.zeros(16, 5))
    assert not order.read(stored, SHARD_GATE)[1].any() and order.read(stored, SHARD_UP)[1].all()


def test_interleaved_order_is_deepgemms() -> None:
    canonical = torch.randn(2, 64, 16)
    assert torch.equal(
        L1RowOrder(8).from_canonical(canonical), load_fake("fake_deep_gemm").interleave(canonical)
    )
    assert torch.equal(L1RowOrder().from_canonical(canonical), canonical)


def test_bad_shards_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="no first-projection shard"):
        L1RowOrder(8).shard_view(torch.zeros(32, 4), SHARD_DOWN)
    with pytest.raises(ValueError, match="24 rows do not split into gate/up groups of 8"):
        L1RowOrder(8).shard_view(torch.zeros(24, 4), SHARD_GATE)
