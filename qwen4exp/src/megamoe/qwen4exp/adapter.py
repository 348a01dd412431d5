"""The Qwen4Exp model adapter, registered under the ``megamoe.adapters`` entry points."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from megamoe.core.adapters import ModelAdapter, MoEBlock
from megamoe.core.checkpoint.hf_config import MoEConfig
from megamoe.core.checkpoint.layers import MoELayer, SharedExpert
from megamoe.core.checkpoint.quant_config import detect_mlp_format
from megamoe.core.numerics.formats import WeightFormat
from megamoe.qwen4exp import reference, synthetic
from megamoe.qwen4exp.block import SHARED_EXPERT, SHARED_GATE, Qwen4ExpMegaMoeBlock
from megamoe.qwen4exp.config import ARCHITECTURES, MODEL_TYPES, MTP_BLOCK_PREFIX, Qwen4ExpConfig


class Qwen4ExpAdapter(ModelAdapter):
    """Qwen4Exp and Qwen3-Next (the same sparse MoE block) checkpoints on megamoe.

    Layouts: composite ``qwen4_exp`` saves (``model.language_model.layers.{L}.mlp``),
    text-only ``qwen4_exp_text`` and ``qwen3_next`` ones (``model.layers.{L}.mlp``); the MTP
    drafter's layers at ``mtp.layers.{j}.mlp``.
    """

    name: ClassVar[str] = "qwen4exp"
    distribution: ClassVar[str] = "megamoe-qwen4exp"
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    config_class: ClassVar[type[MoEConfig]] = Qwen4ExpConfig
    block_class: ClassVar[type[MoEBlock]] = Qwen4ExpMegaMoeBlock
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]] = (
        WeightFormat.BF16,
        WeightFormat.FP8_BLOCK,
        WeightFormat.MXFP8,
        WeightFormat.MXFP4,
        WeightFormat.NVFP4,
    )

    reference_forward = staticmethod(reference.reference_forward)

    def mtp_block_prefix(self, config: MoEConfig, decoder: str, index: int) -> str:
        """``mtp.layers.{index}.mlp``, whatever the decoder prefix."""
        return MTP_BLOCK_PREFIX.format(index)

    def shared_expert(self, config: Mapping[str, Any], layer: MoELayer) -> SharedExpert:
        """``shared_expert``: one MLP of ``shared_expert_intermediate_size`` (gated apart)."""
        cfg = Qwen4ExpConfig.from_dict(config)
        prefix = f"{layer.prefix}.{SHARED_EXPERT}"
        fmt = detect_mlp_format(cfg.quantization_config, prefix)
        return SharedExpert(prefix, fmt, cfg.shared_expert_intermediate_size)

    def dense_tensors(
        self, config: Mapping[str, Any], layer: MoELayer
    ) -> dict[str, tuple[int, ...]]:
        """The router ``gate.weight`` (E, H) and the ``shared_expert_gate`` (1, H)."""
        _, hidden, _ = self.expert_dims(config)
        return {
            **super().dense_tensors(config, layer),
            f"{layer.prefix}.{SHARED_GATE}": (1, hidden),
        }

    synthetic_config = staticmethod(synthetic.synthetic_config)

    def synthetic_tensors(
        self, config: Mapping[str, Any], seed: int = 0, *, fused_experts: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of a synthetic checkpoint for ``config``.

        Args:
            config: from ``synthetic_config``.
            seed: reproducible contents.
            fused_experts: BF16 routed experts in the fused ``gate_up_proj`` / ``down_proj``
                layout instead of per expert.
        """
        return synthetic.synthetic_tensors(
            config, self.moe_layers(config), seed, fused_experts=fused_experts
        )


ADAPTER = Qwen4ExpAdapter()
