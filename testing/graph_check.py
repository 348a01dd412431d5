"""GPU tests' CUDA-graph check: what one replay of a captured call writes."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replayed_output(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Capture ``call`` in a CUDA graph, clear its output, replay it once, return the output.

    ``call`` is warmed on a side stream first (first-call work stays out of the capture).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    out.zero_()
    graph.replay()
    return out
