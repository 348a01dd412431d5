"""A checkpoint's MoE layers and what the reader asks of the model adapter about them.

``MoELayer`` and ``SharedExpert`` are plain records of where a layer's experts lie and how
they are stored. ``ModelRules`` is the part of the adapter contract
(``megamoe.core.adapters.ModelAdapter``) that reading and validating a checkpoint needs:
which layers are MoE (and, through the parsed config, why the others are dense), their sizes,
the tensor prefixes of their experts and of the MTP layers' blocks. ``decoder_prefix`` and
``MLP`` name where a checkpoint keeps its decoder layers and their MLPs. The reader
(``megamoe.core.checkpoint.reader``) takes any object with these methods, so the checkpoint
layer stands below the adapters that implement it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from megamoe.core.checkpoint.expert_names import TensorSpec
from megamoe.core.checkpoint.hf_config import MoEConfig, is_composite
from megamoe.core.errors import CheckpointError
from megamoe.core.numerics.formats import WeightFormat

# Decoder layers of the text model: composite (vision-language) saves nest the text tower
# under ``model.language_model``; text-only saves keep it at ``model``.
COMPOSITE_DECODER = "model.language_model.layers"
TEXT_DECODER = "model.layers"
MLP = "mlp"  # module name of a decoder layer's MLP (the MoE block in sparse layers)


def decoder_prefix(config: Mapping[str, Any], tensor_names: Collection[str] | None = None) -> str:
    """The tensor prefix of the decoder layers, ``model.language_model.layers`` or ``model.layers``.

    With the checkpoint's tensor names, the one that holds tensors (a composite config may
    come with a text-only save and the other way round); else the config's shape decides.

    Raises:
        CheckpointError: tensors under both: two copies of the decoder, of which megamoe
            could only guess which one the model reads.
    """
    if tensor_names is not None:
        held = [
            candidate
            for candidate in (COMPOSITE_DECODER, TEXT_DECODER)
            if any(name.startswith(f"{candidate}.") for name in tensor_names)
        ]
        if len(held) > 1:
            raise CheckpointError(
                f"the checkpoint holds decoder layers under both {held[0]!r} and {held[1]!r}: "
                "two copies of the model's layers, of which megamoe cannot tell which one the "
                "model reads; keep one (the layout config.json describes) and remove the other"
            )
        if held:
            return held[0]
    return COMPOSITE_DECODER if is_composite(config) else TEXT_DECODER


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

    def parse_config(self, config: Mapping[str, Any]) -> MoEConfig:
        """The model's parsed config (its layer rule, layer counts and the keys defaulted)."""
        ...

    def mtp_block_prefix(self, config: MoEConfig, decoder: str, index: int) -> str:
        """Tensor prefix of MTP layer ``index``'s MoE block (``decoder``: ``decoder_prefix``)."""
        ...

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
