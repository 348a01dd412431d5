"""The compile check both adapters' tests share: one graph, and the eager numbers.

``torch.compile(block, fullgraph=True)`` raises on any graph break, so compiling is the
check that the block's forward traces whole around the opaque experts op; the compiled
block must then compute what eager does (inductor fuses the router's float32 math, a few
ulps apart).
"""

from __future__ import annotations

from typing import Any

import torch
from bitcheck import relative_error

from megamoe.core.adapters import ModelAdapter, MoEBlock
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.testing import synthetic_layer_tensors

COMPILED_TOLERANCE = 1e-2


def assert_compiles_like_eager(block: MoEBlock, hidden_size: int, tokens: int = 16) -> None:
    """Compile ``block`` with ``fullgraph=True`` and compare it with eager on random tokens."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)  # a graph break raises
    with torch.no_grad():
        eager, once = block(x), compiled(x)
        again = compiled(x)
    assert relative_error(once, eager) <= COMPILED_TOLERANCE
    assert torch.equal(again, once)  # the compiled graph is reused and deterministic


def reference_block(
    adapter: ModelAdapter,
    config: dict[str, Any],
    prefix: str,
    parallel: ParallelSettings,
    seed: int,
) -> MoEBlock:
    """The adapter's block at ``prefix`` on the reference backend, loaded with seeded tensors."""
    block = adapter.block_class(config, prefix=prefix, parallel=parallel, backend="reference")
    block.load_weights(synthetic_layer_tensors(adapter, config, prefix, seed=seed).items())
    block.finalize()
    return block


# More layers than dynamo's default recompile limit (8): a per-layer constant in the traced
# forward would recompile each layer and fail at the ninth under fullgraph=True.
SEPARATELY_COMPILED_LAYERS = 9


def assert_layers_compiled_one_by_one_share_graphs(
    adapter: ModelAdapter,
    config: dict[str, Any],
    prefix: str,
    parallel: ParallelSettings,
    token_counts: tuple[int, ...] = (1, 7, 64),
) -> None:
    """Compile each of ``SEPARATELY_COMPILED_LAYERS`` blocks alone; all reuse the first's graphs.

    An engine may compile layer by layer. Dynamo compiles one graph for a single token and
    one for dynamic token counts; each compiled layer must match its own eager forward (the
    opaque experts op must run that layer's weights).
    """
    blocks = [
        reference_block(adapter, config, prefix, parallel, seed)
        for seed in range(SEPARATELY_COMPILED_LAYERS)
    ]
    hidden_size = blocks[0].experts.hidden_size
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = [torch.compile(block, fullgraph=True) for block in blocks]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tokens in token_counts:
            x = torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16)
            for block, fn in zip(blocks, compiled, strict=True):
                assert relative_error(fn(x), block(x)) <= COMPILED_TOLERANCE
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
