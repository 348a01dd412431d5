"""The compile check both adapters' tests share: one graph, and the eager numbers.

``torch.compile(block, fullgraph=True)`` raises on any graph break, so compiling is the
check that the block's forward traces whole around the opaque experts op; the compiled
block must then compute what eager does (inductor fuses the router's float32 math, a few
ulps apart).
"""

from __future__ import annotations

import torch

from megamoe.core.adapters import MoEBlock
from megamoe.core.bitcheck import relative_error

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
