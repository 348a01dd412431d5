"""The experts forward as one opaque torch custom op: ``torch.ops.megamoe.experts``.

Engines compile their models (``torch.compile(..., fullgraph=True)``) and capture CUDA
graphs. The MegaMoE kernel call (and the reference backend's per-expert loop, which
depends on the routing data) cannot be traced, so ``MegaMoEExperts.forward`` hands its
inputs to this op: dynamo sees one opaque call with a fake implementation (an empty
``(tokens, hidden)`` bf16 tensor), inductor compiles the block around it, and the op's
real implementation runs the module's backend. The module is named by an integer handle
(custom ops take tensors and plain values, not modules): ``register`` assigns it and keeps
only a weak reference, so a layer is freed as soon as the engine drops it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megamoe.core.experts import MegaMoEExperts

_LAYERS: dict[int, weakref.ref[MegaMoEExperts]] = {}
_HANDLES = itertools.count()


def register(module: MegaMoEExperts) -> int:
    """A handle naming ``module`` in ``experts`` calls (released when the module is freed)."""
    handle = next(_HANDLES)
    _LAYERS[handle] = weakref.ref(module, lambda _: _LAYERS.pop(handle, None))
    return handle


@torch.library.custom_op("megamoe::experts", mutates_args=())
def experts(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """Routed (plus fused shared) expert output of layer ``layer``, (tokens, H) bfloat16.

    Raises:
        RuntimeError: the layer was freed.
        FormatMismatchError: its kernel tensors or buffer carry another format's tag.
    """
    found = _LAYERS.get(layer)
    module = None if found is None else found()
    if module is None:
        raise RuntimeError(f"megamoe.experts: layer handle {layer} names no live experts module")
    return module.run_backend(hidden_states, topk_weights, topk_ids)


@experts.register_fake
def _experts_fake(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    del topk_weights, topk_ids, layer
    return hidden_states.new_empty(hidden_states.shape)
