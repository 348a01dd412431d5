"""The GLM-5.3-Flash model adapter, registered under the ``megamoe.adapters`` entry points."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from megamoe.core.adapters import ModelAdapter, MoEBlock
from megamoe.core.checkpoint.hf_config import MoEConfig
from megamoe.core.checkpoint.layers import MLP, MoELayer, SharedExpert
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.numerics.formats import WeightFormat
from megamoe.glm5next import reference, synthetic
from megamoe.glm5next.block import (
    FUSABLE_RUN_FORMATS,
    ROUTER_BIAS,
    SHARED_EXPERTS,
    Glm5NextMegaMoeBlock,
)
from megamoe.glm5next.config import ARCHITECTURES, MODEL_TYPES, Glm5NextConfig


class Glm5NextAdapter(ModelAdapter):
    """GLM-5.3-Flash (DeepSeek-V3-style MoE, block-FP8 experts) checkpoints on megamoe.

    Also DeepSeek-V3 and GLM-4.5/4.6 (``deepseek_v3``, ``glm4_moe``): the same router and
    experts without the SwiGLU clamp. Layouts: composite ``glm5_next`` saves
    (``model.language_model.layers.{L}.mlp``) and flat ones (``model.layers.{L}.mlp``); the
    MTP layers follow the decoder layers, at decoder index ``num_hidden_layers + j``.
    """

    name: ClassVar[str] = "glm5next"
    distribution: ClassVar[str] = "megamoe-glm5next"
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    config_class: ClassVar[type[MoEConfig]] = Glm5NextConfig
    block_class: ClassVar[type[MoEBlock]] = Glm5NextMegaMoeBlock
    fusing_run_formats: ClassVar[frozenset[WeightFormat]] = FUSABLE_RUN_FORMATS
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]] = (
        WeightFormat.FP8_BLOCK,
        WeightFormat.BF16,
        WeightFormat.NVFP4,
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

    def mtp_block_prefix(self, config: MoEConfig, decoder: str, index: int) -> str:
        """``{decoder}.{num_hidden_layers + index}.mlp``: MTP layers extend the decoder stack."""
        return f"{decoder}.{config.num_hidden_layers + index}.{MLP}"

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        """Routed experts, then the shared expert (fused into the kernel as one more)."""
        return (f"{layer.prefix}.experts", f"{layer.prefix}.{SHARED_EXPERTS}")

    def shared_expert(self, config: Mapping[str, Any], layer: MoELayer) -> SharedExpert | None:
        """``shared_experts``: one MLP of ``n_shared_experts * moe_intermediate_size``."""
        cfg = Glm5NextConfig.from_dict(config)
        if not cfg.n_shared_experts:
            return None
        prefix = f"{layer.prefix}.{SHARED_EXPERTS}"
        fmt = detect_mlp_format(cfg.quantization_config, prefix)
        return SharedExpert(prefix, fmt, cfg.shared_intermediate_size)

    def dense_tensors(
        self, config: Mapping[str, Any], layer: MoELayer
    ) -> dict[str, tuple[int, ...]]:
        """The router ``gate.weight`` (E, H) and its ``e_score_correction_bias`` (E,)."""
        experts, _, _ = self.expert_dims(config)
        return {
            **super().dense_tensors(config, layer),
            f"{layer.prefix}.{ROUTER_BIAS}": (experts,),
        }


ADAPTER = Glm5NextAdapter()
