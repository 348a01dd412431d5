"""The GLM-5.3-Flash model adapter, registered under the ``megamoe.adapters`` entry points."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megamoe.core.adapters import ModelAdapter, MoELayer, SyntheticSizes
from megamoe.core.formats import WeightFormat
from megamoe.core.parallel import ParallelSettings
from megamoe.core.quant_config import detect_expert_format, mark_converted
from megamoe.glm5next import reference, synthetic
from megamoe.glm5next.block import Glm5NextMegaMoeBlock
from megamoe.glm5next.config import Glm5NextConfig

if TYPE_CHECKING:
    from megamoe.core.checkpoint import CheckpointReader


class Glm5NextAdapter(ModelAdapter):
    """GLM-5.3-Flash (DeepSeek-V3-style MoE, block-FP8 experts) checkpoints on megamoe."""

    name: ClassVar[str] = "glm5next"
    distribution: ClassVar[str] = "megamoe-glm5next"
    model_types: ClassVar[tuple[str, ...]] = (synthetic.MODEL_TYPE,)
    architectures: ClassVar[tuple[str, ...]] = (synthetic.ARCHITECTURE,)
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]] = (
        WeightFormat.FP8_BLOCK,
        WeightFormat.BF16,
    )

    def moe_layers(self, config: Mapping[str, Any]) -> list[MoELayer]:
        """Every MoE layer: sparse decoder layers, then the MTP drafter's layers.

        ``model.layers.{L}.mlp`` for every sparse layer (the first ``first_k_dense_replace``
        are dense), then ``mtp.layers.{i}.mlp`` for each of ``num_nextn_predict_layers``.

        Raises:
            ValueError: an invalid config key (named).
            NotImplementedError: a quantization config megamoe cannot load, naming it and
                the layer prefix.
        """
        cfg = Glm5NextConfig.from_dict(config)
        found = [
            (i, f"model.layers.{i}.mlp", False)
            for i in range(cfg.num_hidden_layers)
            if cfg.is_moe_layer(i)
        ]
        found += [(i, f"mtp.layers.{i}.mlp", True) for i in range(cfg.num_nextn_predict_layers)]
        return [
            MoELayer(
                index=index,
                prefix=prefix,
                checkpoint_format=detect_expert_format(
                    cfg.quantization_config, f"{prefix}.experts", num_experts=cfg.n_routed_experts
                ),
                is_mtp=is_mtp,
            )
            for index, prefix, is_mtp in found
        ]

    def build_block(
        self,
        config: Mapping[str, Any],
        layer: MoELayer,
        *,
        parallel: ParallelSettings,
        moe_format: WeightFormat | str | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        max_num_tokens: int = 256,
    ) -> Glm5NextMegaMoeBlock:
        """The block of ``layer``, weights unloaded (``load_from_checkpoint`` loads them).

        ``moe_format`` forces the run format of the main model's layers; the MTP drafter's
        layers take the default. See ``Glm5NextMegaMoeBlock`` for the errors.
        """
        return Glm5NextMegaMoeBlock(
            config,
            prefix=layer.prefix,
            parallel=parallel,
            moe_format=moe_format,
            is_mtp=layer.is_mtp,
            backend=backend,
            device=device,
            max_num_tokens=max_num_tokens,
        )

    def reference_forward(
        self, reader: CheckpointReader, layer: MoELayer, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """Float64 output of ``layer`` from the checkpoint's dequantized tensors."""
        return reference.reference_forward(reader, layer.prefix, hidden_states)

    def synthetic_config(self, fmt: WeightFormat, sizes: SyntheticSizes) -> dict[str, Any]:
        """A small GLM-5.3-Flash ``config.json`` storing its experts as ``fmt``."""
        return synthetic.synthetic_config(fmt, sizes)

    def synthetic_tensors(
        self, config: Mapping[str, Any], seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of a synthetic checkpoint for ``config``.

        Dense-layer MLPs, then per MoE layer: router, bias, shared experts, routed experts.
        """
        return synthetic.synthetic_tensors(config, self.moe_layers(config), seed)

    def converted_config(self, config: Mapping[str, Any], fmt: WeightFormat) -> dict[str, Any]:
        """``config.json`` after ``megamoe convert`` turned the experts into ``fmt``.

        The routed and the shared experts are converted (the kernel runs the shared expert
        as one more expert, so both must share a format); the router and every other
        module keep theirs.
        """
        prefixes = [p for layer in self.moe_layers(config) for p in self.expert_prefixes(layer)]
        converted = dict(config)
        converted["quantization_config"] = mark_converted(
            config.get("quantization_config"), fmt, prefixes
        )
        return converted

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        """Routed experts, then the shared expert (fused into the kernel as one more)."""
        return (f"{layer.prefix}.experts", f"{layer.prefix}.shared_experts")


ADAPTER = Glm5NextAdapter()
