"""The experts forward as one opaque torch custom op: ``torch.ops.megamoe.experts``.

Engines compile their models (``torch.compile(..., fullgraph=True)``) and capture CUDA
graphs. The MegaMoE kernel call (and the reference backend's per-expert loop, which
depends on the routing data) cannot be traced, so ``MegaMoEExperts.forward`` hands its
inputs to this op: dynamo sees one opaque call with a fake implementation (an empty
``(tokens, hidden)`` bf16 tensor), inductor compiles the block around it, and the op's
real implementation runs the module's backend.

The op finds the module from an input: its ``w13_weight`` kernel tensor, whose storage the
module keeps for its whole life (``finalize()`` writes in place). Custom ops take tensors
and plain values, not modules; a tensor input, unlike an integer, is not a constant
dynamo specializes on, so one compiled graph serves every layer of a model and compiling
each layer alone does not recompile per layer. ``register`` keeps only a weak reference,
so a layer is freed as soon as the engine drops it.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch


class RunsBackend(Protocol):
    """What the op calls: ``MegaMoEExperts.run_backend``.

    Named here so that this module, which ``megamoe.core.modules.experts`` imports, does not
    import it back.
    """

    def run_backend(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The backend's forward after the format-tag check."""
        ...


_LAYERS: dict[tuple[torch.device, int], weakref.ref[RunsBackend]] = {}


def _key(layer_weight: torch.Tensor) -> tuple[torch.device, int]:
    return layer_weight.device, layer_weight.data_ptr()


def register(module: RunsBackend, layer_weight: torch.Tensor) -> None:
    """Let ``experts`` calls given ``layer_weight`` run ``module`` (until it is freed)."""
    key = _key(layer_weight)
    _LAYERS[key] = weakref.ref(module, lambda ref: _forget(key, ref))


def _forget(key: tuple[torch.device, int], ref: weakref.ref[RunsBackend]) -> None:
    if _LAYERS.get(key) is ref:
        del _LAYERS[key]


@torch.library.custom_op("megamoe::experts", mutates_args=())
def experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_weight: torch.Tensor,
) -> torch.Tensor:
    """Routed (plus fused shared) expert output of the layer holding ``layer_weight``.

    Args:
        hidden_states: (T, H) bfloat16.
        topk_weights: (T, top_k) float32.
        topk_ids: (T, top_k) physical expert ids.
        layer_weight: the layer's ``w13_weight`` (it names the layer; not read here).

    Returns:
        (T, H) bfloat16.

    Raises:
        RuntimeError: no live experts module holds ``layer_weight``.
        FormatMismatchError: its kernel tensors or buffer carry another format's tag.
    """
    found = _LAYERS.get(_key(layer_weight))
    module = None if found is None else found()
    if module is None:
        raise RuntimeError(
            f"megamoe.experts: no live experts module holds the kernel tensor "
            f"{tuple(layer_weight.shape)} at {layer_weight.data_ptr():#x} on "
            f"{layer_weight.device}; pass the module's own w13_weight"
        )
    return module.run_backend(hidden_states, topk_weights, topk_ids)


@experts.register_fake
def _experts_fake(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_weight: torch.Tensor,
) -> torch.Tensor:
    del topk_weights, topk_ids, layer_weight
    return hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16)
