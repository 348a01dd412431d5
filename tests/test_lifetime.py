"""Both adapters' MoE blocks are freed by reference counting alone: ``del`` frees at once.

With the cyclic garbage collector off, each block is built through its adapter on a
one-rank gloo group, loaded, finalized, run, reloaded (staged) and run again, then
dropped: a reference cycle through the block, its experts, shared MLP, router or aux
stream would keep it (and its weights) alive.
"""

from __future__ import annotations

import pytest
import torch
from lifetime import assert_freed_without_gc

from megamoe.core.adapters import MoEBlock, SyntheticSizes, installed_adapters
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_layer_tensors

ADAPTERS = installed_adapters()
SIZES = SyntheticSizes(
    num_layers=1, hidden_size=128, intermediate_size=128, num_experts=4, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
CASES = [
    (name, fmt)
    for name in ("qwen4exp", "glm5next")
    for fmt in (WeightFormat.BF16, WeightFormat.FP8_BLOCK)
]


def _exercised(adapter_name: str, checkpoint_format: WeightFormat) -> MoEBlock:
    adapter = ADAPTERS[adapter_name]
    config = adapter.synthetic_config(checkpoint_format, SIZES)
    layer = adapter.moe_layers(config)[0]
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    block = adapter.build_block(config, layer, parallel=parallel, backend="reference")
    x = torch.randn(5, SIZES.hidden_size, generator=torch.Generator().manual_seed(0))
    for seed in (1, 2):  # the first load writes in place, the second is staged
        block.load_weights(synthetic_layer_tensors(adapter, config, layer.prefix, seed).items())
        block.finalize()
        out = block(x.to(torch.bfloat16))
        assert out.shape == x.shape
        assert bool(torch.isfinite(out.float()).all())
    return block


@pytest.mark.parametrize(("adapter_name", "checkpoint_format"), CASES)
def test_blocks_are_freed_on_del_without_the_garbage_collector(
    adapter_name: str, checkpoint_format: WeightFormat
) -> None:
    assert_freed_without_gc(
        lambda: _exercised(adapter_name, checkpoint_format),
        f"{adapter_name} MoE block ({checkpoint_format.value} checkpoint)",
    )
