"""``torch.compile(block, fullgraph=True)``: one graph around the opaque experts op.

Engines compile their models; a graph break or a host sync in the block's forward would
split or stall it. The reference backend on the CPU (DeepGEMM on the H200: gpu tests).
"""

from __future__ import annotations

import pytest
from compile_check import (
    assert_compiles_like_eager,
    assert_layers_compiled_one_by_one_share_graphs,
)

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_layer_tensors
from megamoe.qwen4exp import ADAPTER, Qwen4ExpMegaMoeBlock

SIZES = SyntheticSizes(
    num_layers=1, hidden_size=128, intermediate_size=128, num_experts=8, top_k=2,
    shared_intermediate_size=128,
)  # fmt: skip
PREFIX = "model.language_model.layers.0.mlp"


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")  # inductor's own imports
def test_the_compiled_block_is_one_graph_and_matches_eager(parallel: ParallelSettings) -> None:
    config = ADAPTER.synthetic_config(WeightFormat.FP8_BLOCK, SIZES)
    block = Qwen4ExpMegaMoeBlock(config, prefix=PREFIX, parallel=parallel, backend="reference")
    block.load_weights(synthetic_layer_tensors(ADAPTER, config, PREFIX, seed=3).items())
    block.finalize()
    assert_compiles_like_eager(block, SIZES.hidden_size)


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")
def test_layers_compiled_one_by_one_share_their_graphs(parallel: ParallelSettings) -> None:
    config = ADAPTER.synthetic_config(WeightFormat.FP8_BLOCK, SIZES)
    assert_layers_compiled_one_by_one_share_graphs(ADAPTER, config, PREFIX, parallel)
