"""The Qwen4Exp model adapter, registered under the ``megamoe.adapters`` entry points."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megamoe.core.adapters import ModelAdapter, MoELayer, SyntheticSizes
from megamoe.core.formats import WeightFormat
from megamoe.core.parallel import ParallelSettings
from megamoe.core.quant_config import detect_expert_format, mark_converted
from megamoe.qwen4exp import reference, synthetic
from megamoe.qwen4exp.block import Qwen4ExpMegaMoeBlock
from megamoe.qwen4exp.config import ARCHITECTURE, MODEL_TYPE, Qwen4ExpConfig

if TYPE_CHECKING:
    from megamoe.core.checkpoint import CheckpointReader


class Qwen4ExpAdapter(ModelAdapter):
    """Qwen4Exp (Qwen3-Next-style MoE) checkpoints on megamoe."""

    name: ClassVar[str] = "qwen4exp"
    distribution: ClassVar[str] = "megamoe-qwen4exp"
    model_types: ClassVar[tuple[str, ...]] = (MODEL_TYPE,)
    architectures: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    checkpoint_formats: ClassVar[tuple[WeightFormat, ...]] = (
        WeightFormat.BF16,
        WeightFormat.FP8_BLOCK,
        WeightFormat.MXFP8,
        WeightFormat.MXFP4,
    )

    def moe_layers(self, config: Mapping[str, Any]) -> list[MoELayer]:
        """Every MoE layer: ``model.layers.{i}.mlp``, then the MTP drafter's layers.

        Main-model layers follow ``decoder_sparse_step`` and ``mlp_only_layers``; the MTP
        drafter's ``num_nextn_predict_layers`` layers are ``mtp.layers.{j}.mlp``
        (``is_mtp=True``).

        Raises:
            ValueError: an invalid config key (named).
            NotImplementedError: a quantization config megamoe cannot load, naming it and
                the layer prefix.
        """
        cfg = Qwen4ExpConfig.from_dict(config)
        found = [
            (i, f"model.layers.{i}.mlp", False)
            for i in range(cfg.num_hidden_layers)
            if cfg.is_moe_layer(i)
        ]
        found += [(j, f"mtp.layers.{j}.mlp", True) for j in range(cfg.num_nextn_predict_layers)]
        return [
            MoELayer(
                index=index,
                prefix=prefix,
                checkpoint_format=detect_expert_format(
                    cfg.quantization_config, f"{prefix}.experts", num_experts=cfg.num_experts
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
    ) -> Qwen4ExpMegaMoeBlock:
        """The block of ``layer``, weights unloaded (``load_from_checkpoint`` loads them).

        ``moe_format`` forces the run format of the main model's layers; the MTP drafter's
        layers take the default. See ``Qwen4ExpMegaMoeBlock`` for the errors.
        """
        return Qwen4ExpMegaMoeBlock(
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
        """A small Qwen4Exp ``config.json`` storing its experts as ``fmt`` (with one MTP layer)."""
        return synthetic.synthetic_config(fmt, sizes)

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

    def converted_config(self, config: Mapping[str, Any], fmt: WeightFormat) -> dict[str, Any]:
        """``config.json`` after ``megamoe convert`` turned every routed expert into ``fmt``.

        The router, the shared expert and every other module keep their format; the
        converted expert modules are listed in ``quantization_config`` (see
        ``megamoe.core.quant_config.mark_converted``).
        """
        prefixes = [p for layer in self.moe_layers(config) for p in self.expert_prefixes(layer)]
        converted = dict(config)
        converted["quantization_config"] = mark_converted(
            config.get("quantization_config"), fmt, prefixes
        )
        return converted


ADAPTER = Qwen4ExpAdapter()
