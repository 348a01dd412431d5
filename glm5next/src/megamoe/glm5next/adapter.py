"""The GLM-5.3-Flash model adapter, registered under the ``megamoe.adapters`` entry points."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from megamoe.core.adapters import ModelAdapter, MoEBlock, MoELayer
from megamoe.core.formats import WeightFormat
from megamoe.core.hf_config import MoEConfig
from megamoe.glm5next import reference, synthetic
from megamoe.glm5next.block import Glm5NextMegaMoeBlock
from megamoe.glm5next.config import Glm5NextConfig


class Glm5NextAdapter(ModelAdapter):
    """GLM-5.3-Flash (DeepSeek-V3-style MoE, block-FP8 experts) checkpoints on megamoe."""

    name: ClassVar[str] = "glm5next"
    distribution: ClassVar[str] = "megamoe-glm5next"
    model_types: ClassVar[tuple[str, ...]] = (synthetic.MODEL_TYPE,)
    architectures: ClassVar[tuple[str, ...]] = (synthetic.ARCHITECTURE,)
    config_class: ClassVar[type[MoEConfig]] = Glm5NextConfig
    block_class: ClassVar[type[MoEBlock]] = Glm5NextMegaMoeBlock
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]] = (
        WeightFormat.FP8_BLOCK,
        WeightFormat.BF16,
    )

    reference_forward = staticmethod(reference.reference_forward)
    synthetic_config = staticmethod(synthetic.synthetic_config)

    def synthetic_tensors(
        self, config: Mapping[str, Any], seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of a synthetic checkpoint for ``config``.

        Dense-layer MLPs, then per MoE layer: router, bias, shared experts, routed experts.
        """
        return synthetic.synthetic_tensors(config, self.moe_layers(config), seed)

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        """Routed experts, then the shared expert (fused into the kernel as one more)."""
        return (f"{layer.prefix}.experts", f"{layer.prefix}.shared_experts")


ADAPTER = Glm5NextAdapter()
