"""Typed config.json readers and the layer listing, block building and convert config that
``ModelAdapter`` derives from an adapter's config and block classes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megamoe.core.adapters import ModelAdapter, SyntheticSizes
from megamoe.core.checkpoint.hf_config import bool_key, int_key, object_key, swiglu_act
from megamoe.core.checkpoint.layers import MoELayer
from megamoe.core.checkpoint.quant_config import CONVERTED_KEY
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.numerics.formats import WeightFormat

# -- readers ---------------------------------------------------------------------------------


def test_int_key_reads_defaults_and_names_what_is_wrong() -> None:
    config = {"layers": 4, "steps": 0, "flag": True, "width": 2.0, "unset": None}
    assert int_key(config, "layers", model="Toy") == 4
    assert int_key(config, "steps", model="Toy", minimum=0) == 0
    assert int_key(config, "absent", model="Toy", default=7) == 7
    assert int_key(config, "unset", model="Toy", default=3) == 3  # null counts as absent
    with pytest.raises(ValueError, match=r"config\.json: 'absent' is missing; a Toy config"):
        int_key(config, "absent", model="Toy")
    with pytest.raises(ValueError, match=r"config\.json: steps=0 must be an integer >= 1"):
        int_key(config, "steps", model="Toy")
    for key, shown in (("flag", "True"), ("width", "2.0")):
        with pytest.raises(ValueError, match=rf"{key}={shown} must be an integer >= 1"):
            int_key(config, key, model="Toy")


def test_bool_and_object_keys() -> None:
    config = {"norm": False, "bad": "yes", "quant": {"quant_method": "fp8"}, "text": "fp8"}
    assert bool_key(config, "norm", default=True) is False
    assert bool_key(config, "absent", default=True) is True
    with pytest.raises(ValueError, match=r"config\.json: bad='yes' must be true or false"):
        bool_key(config, "bad", default=True)
    assert object_key(config, "quant") == {"quant_method": "fp8"}
    assert object_key(config, "absent") is None
    with pytest.raises(ValueError, match=r"text='fp8' must be an object \(or absent\), got str"):
        object_key(config, "text")


def test_only_swiglu_is_accepted() -> None:
    assert swiglu_act({}) == swiglu_act({"hidden_act": "silu"}) == "silu"
    assert swiglu_act({"hidden_act": "swish"}) == "silu"  # transformers: the same function
    with pytest.raises(NotImplementedError, match=r"hidden_act='gelu' is not supported; Mega"):
        swiglu_act({"hidden_act": "gelu"})


# -- ModelAdapter from a config class and a block class --------------------------------------


@dataclass(frozen=True)
class SparseConfig:
    """Odd decoder layers are MoE layers; ``mtp`` MTP layers follow."""

    hidden_size: int
    moe_intermediate_size: int
    num_routed_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    quantization_config: Mapping[str, Any] | None
    swiglu_limit: float | None = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> SparseConfig:
        return cls(
            256, 256, 8, 2, config["layers"], config["mtp"], config.get("quantization_config")
        )

    def is_moe_layer(self, index: int) -> bool:
        return index % 2 == 1


class RecordingBlock(torch.nn.Module):
    """Keeps the arguments ``build_block`` passes."""

    def __init__(self, config: Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__()
        self.args = {"config": config, **kwargs}


class SparseAdapter(ModelAdapter):
    name = "sparse"
    distribution = "megamoe-sparse"
    model_types = ("sparse",)
    architectures = ()
    checkpoint_formats = tuple(WeightFormat)
    config_class = SparseConfig
    block_class = RecordingBlock

    def reference_forward(
        self, reader: Any, layer: MoELayer, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError("not needed here")

    def mtp_block_prefix(self, config: Any, decoder: str, index: int) -> str:
        return f"mtp.layers.{index}.mlp"

    def synthetic_config(self, fmt: WeightFormat, sizes: SyntheticSizes) -> dict[str, Any]:
        raise NotImplementedError("not needed here")

    def synthetic_tensors(
        self, config: Mapping[str, Any], seed: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError("not needed here")


MXFP8_QUANT = {"quant_method": "mxfp8", "modules_to_not_convert": ["model.layers.3.mlp.experts"]}


def test_moe_layers_list_main_then_mtp_layers_with_their_formats() -> None:
    layers = SparseAdapter().moe_layers({"layers": 4, "mtp": 1, "quantization_config": MXFP8_QUANT})
    assert layers == [
        MoELayer(1, "model.layers.1.mlp", WeightFormat.MXFP8, is_mtp=False),
        MoELayer(3, "model.layers.3.mlp", WeightFormat.BF16, is_mtp=False),
        MoELayer(0, "mtp.layers.0.mlp", WeightFormat.MXFP8, is_mtp=True),
    ]
    assert [m.prefix for m in SparseAdapter().moe_layers({"layers": 3, "mtp": 0})] == [
        "model.layers.1.mlp"
    ]


def test_build_block_constructs_the_block_class_with_the_layer() -> None:
    config = {"layers": 2, "mtp": 1}
    mtp = SparseAdapter().moe_layers(config)[-1]
    parallel = ParallelSettings()
    block = SparseAdapter().build_block(
        config, mtp, parallel=parallel, moe_format="mxfp4", device="cpu", max_num_tokens=64
    )
    assert isinstance(block, RecordingBlock)
    assert block.args == {
        "config": config,
        "prefix": "mtp.layers.0.mlp",
        "parallel": parallel,
        "moe_format": "mxfp4",
        "is_mtp": True,
        "backend": "auto",
        "device": "cpu",
        "max_num_tokens": 64,
    }


def test_converted_config_marks_every_expert_prefix() -> None:
    config = {"layers": 4, "mtp": 1, "quantization_config": MXFP8_QUANT}
    converted = SparseAdapter().converted_config(config, WeightFormat.MXFP4)
    assert converted["layers"] == 4 and CONVERTED_KEY not in config["quantization_config"]
    assert converted["quantization_config"][CONVERTED_KEY] == {
        "format": "mxfp4",
        "modules": [
            "model.layers.1.mlp.experts",
            "model.layers.3.mlp.experts",
            "mtp.layers.0.mlp.experts",
        ],
    }
