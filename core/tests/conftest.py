"""A toy adapter for checkpoint, convert and CLI tests that must not depend on real adapters."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megamoe.core import adapters as adapter_registry
from megamoe.core.adapters import ModelAdapter, MoEBlock, SyntheticSizes
from megamoe.core.checkpoint.layers import MoELayer, SharedExpert
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_dense, synthetic_expert_tensors

TOY_QUANT = {
    WeightFormat.FP8_BLOCK: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    WeightFormat.MXFP8: {"quant_method": "mxfp8"},
    WeightFormat.MXFP4: {"quant_method": "mxfp4"},
}


@dataclass(frozen=True)
class ToyConfig:
    """Every decoder layer is an MoE layer; no MTP drafter."""

    hidden_size: int
    moe_intermediate_size: int
    num_routed_experts: int
    num_hidden_layers: int
    quantization_config: Mapping[str, Any] | None
    num_experts_per_tok: int = 2
    num_nextn_predict_layers: int = 0
    swiglu_limit: float | None = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ToyConfig:
        return cls(
            hidden_size=config["hidden_size"],
            moe_intermediate_size=config["moe_intermediate_size"],
            num_routed_experts=config["num_experts"],
            num_hidden_layers=config["num_hidden_layers"],
            quantization_config=config.get("quantization_config"),
        )

    def is_moe_layer(self, index: int) -> bool:
        return 0 <= index < self.num_hidden_layers


class ToyAdapter(ModelAdapter):
    """Layers ``model.layers.{i}.mlp``: router, routed and shared experts; no forward."""

    name = "toymoe"
    distribution = "megamoe-toymoe"
    model_types = ("toy_moe",)
    architectures = ("ToyMoeForCausalLM",)
    checkpoint_formats = tuple(WeightFormat)
    fusing_run_formats = frozenset(WeightFormat)
    config_class = ToyConfig

    def build_block(self, *args: Any, **kwargs: Any) -> MoEBlock:
        raise NotImplementedError("the toy adapter has no MoE block")

    def reference_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the toy adapter has no reference forward")

    def synthetic_config(self, fmt: WeightFormat, sizes: SyntheticSizes) -> dict[str, Any]:
        config: dict[str, Any] = {
            "model_type": "toy_moe",
            "architectures": ["ToyMoeForCausalLM"],
            "hidden_size": sizes.hidden_size,
            "moe_intermediate_size": sizes.intermediate_size,
            "num_experts": sizes.num_experts,
            "num_hidden_layers": sizes.num_layers,
        }
        if fmt in TOY_QUANT:
            config["quantization_config"] = dict(TOY_QUANT[fmt])
        return config

    def synthetic_tensors(
        self, config: Mapping[str, Any], seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        hidden, experts = config["hidden_size"], config["num_experts"]
        fmt = self.moe_layers(config)[0].checkpoint_format
        yield "model.embed_tokens.weight", synthetic_dense((384, hidden), 0.02, seed)
        for layer in self.moe_layers(config):
            yield f"{layer.prefix}.gate.weight", synthetic_dense((experts, hidden), 0.05, seed + 1)
            for rel, tensor in synthetic_expert_tensors(
                fmt,
                experts,
                hidden,
                config["moe_intermediate_size"],
                seed=seed + 100 * layer.index,
                fused_bf16=bool(config.get("toy_fused")),
            ):
                yield f"{layer.prefix}.experts.{rel}", tensor
            shared = synthetic_expert_tensors(
                fmt, 1, hidden, config["moe_intermediate_size"], seed=seed + 7
            )
            for rel, tensor in shared:
                yield f"{layer.prefix}.shared_experts.{rel.removeprefix('0.')}", tensor
        yield "model.norm.weight", synthetic_dense((hidden,), 1.0, seed + 2)

    def expert_prefixes(self, layer: MoELayer) -> tuple[str, ...]:
        return (f"{layer.prefix}.experts", f"{layer.prefix}.shared_experts")

    def shared_expert(self, config: Mapping[str, Any], layer: MoELayer) -> SharedExpert | None:
        """One expert's width, stored as the routed experts are (``toy_shared: false``: none)."""
        if not config.get("toy_shared", True):
            return None
        prefix = f"{layer.prefix}.shared_experts"
        return SharedExpert(prefix, layer.checkpoint_format, config["moe_intermediate_size"])

    def mtp_block_prefix(self, config: Any, decoder: str, index: int) -> str:
        return f"mtp.layers.{index}.mlp"

    def converted_config(
        self, config: Mapping[str, Any], fmt: WeightFormat, layers: Any = None
    ) -> dict[str, Any]:
        new = {k: v for k, v in config.items() if k != "toy_fused"}
        new["quantization_config"] = dict(TOY_QUANT[fmt])
        return new


TOY = ToyAdapter()


@pytest.fixture
def toy_adapter(monkeypatch: pytest.MonkeyPatch) -> ToyAdapter:
    """Make the toy adapter the only installed one."""
    monkeypatch.setattr(adapter_registry, "installed_adapters", lambda: {TOY.name: TOY})
    return TOY
