"""A checkpoint's MoE layers and what the reader asks of the model adapter about them.

``MoELayer`` and ``SharedExpert`` are plain records of where a layer's experts lie and how
they are stored. ``ModelRules`` is the part of the adapter contract
(``megamoe.core.adapters.ModelAdapter``) that reading and validating a checkpoint needs:
which layers are MoE, their sizes, and the tensor prefixes of their experts. The reader
(``megamoe.core.checkpoint.reader``) takes any object with these methods, so the checkpoint
layer stands below the adapters that implement it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from megamoe.core.checkpoint.expert_names import TensorSpec
from megamoe.core.numerics.formats import WeightFormat


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a checkpoint.

    Attributes:
        index: layer number (within the main model or the MTP drafter).
        prefix: tensor-name prefix of the MoE block, e.g. ``model.layers.3.mlp``.
        checkpoint_format: how its routed experts are stored.
        is_mtp: the layer belongs to the MTP drafter (it takes the default run format,
            never a forced one).
    """

    index: int
    prefix: str
    checkpoint_format: WeightFormat
    is_mtp: bool = False


@dataclass(frozen=True)
class SharedExpert:
    """A layer's shared expert as the checkpoint stores it: one SwiGLU MLP without an index.

    Attributes:
        prefix: the prefix of its tensors, ``{prefix}.{gate,up,down}_proj.{weight,<scale>}``.
        checkpoint_format: how they are stored.
        intermediate_size: the width of the whole shared MLP (all shared experts together).
    """

    prefix: str
    checkpoint_format: WeightFormat
    intermediate_size: int


class ModelRules(Protocol):
    """What the reader asks of a model adapter (``ModelAdapter`` implements all of it)."""

    def moe_layers(
        self, config: Mapping[str, Any], tensor_names: Collection[str] | None = None
    ) -> list[MoELayer]:
        """The checkpoint's MoE layers."""
        ...

    def expert_dims(self, config: Mapping[str, Any]) -> tuple[int, int, int]:
        """``(num_experts, hidden_size, intermediate_size)`` of the routed experts."""
        ...

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        """Tensor prefixes of the layer's routed experts (and a fused shared expert)."""
        ...

    def shared_expert(self, config: Mapping[str, Any], layer: MoELayer) -> SharedExpert | None:
        """The layer's separately stored shared expert, or None."""
        ...

    def dense_tensors(
        self, config: Mapping[str, Any], layer: MoELayer
    ) -> dict[str, tuple[int, ...]]:
        """The layer's router, bias and gate tensors the reader checks."""
        ...

    def expected_expert_tensor(
        self, config: Mapping[str, Any], layer: MoELayer, name: str
    ) -> TensorSpec | None:
        """Dtype and shape an expert tensor must have, or None for a name not checked."""
        ...
