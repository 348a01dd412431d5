"""Expert checkpoint format detection from ``quantization_config`` (SPEC §3.6)."""

from __future__ import annotations

from typing import Any

import pytest

from megamoe.core.checkpoint import quant_config
from megamoe.core.checkpoint.quant_config import (
    CONVERTED_KEY,
    detect_expert_format,
    detect_mlp_format,
    mark_converted,
)
from megamoe.core.numerics.formats import WeightFormat

PREFIX = "model.layers.3.mlp.experts"
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": None}


def _ct(fmt: str, **extra: Any) -> dict[str, Any]:
    """A compressed-tensors config with one group targeting every Linear."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt}},
        **extra,
    }


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, WeightFormat.BF16),
        ({}, WeightFormat.BF16),
        (FP8, WeightFormat.FP8_BLOCK),
        ({**FP8, "fmt": "e4m3"}, WeightFormat.FP8_BLOCK),
        ({"quant_method": "mxfp8"}, WeightFormat.MXFP8),
        ({"quant_method": "MXFP4"}, WeightFormat.MXFP4),
        (_ct("mxfp4-pack-quantized"), WeightFormat.MXFP4),
        (_ct("mxfp8-quantized"), WeightFormat.MXFP8),
        ({"quant_method": "compressed-tensors", "format": "mxfp8-quantized"}, WeightFormat.MXFP8),
        (_ct("nvfp4-pack-quantized"), WeightFormat.NVFP4),
        (MODELOPT, WeightFormat.NVFP4),
        ({**MODELOPT, "quant_algo": "nvfp4", "group_size": 16}, WeightFormat.NVFP4),
        ({**MODELOPT, "quant_algo": "W4A16_NVFP4"}, WeightFormat.NVFP4),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}, WeightFormat.NVFP4),
    ],
)
def test_detected_format(config: dict[str, Any] | None, expected: WeightFormat) -> None:
    assert detect_expert_format(config, PREFIX, num_experts=4) is expected


@pytest.mark.parametrize(
    "ignore",
    [
        ["lm_head", "model.layers.3.mlp.experts"],
        ["model.layers.3.mlp"],  # an ancestor module
        ["experts"],  # a component of every experts module
    ],
)
@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])
def test_fp8_ignored_experts_are_bf16(ignore: list[str], key: str) -> None:
    assert detect_expert_format({**FP8, key: ignore}, PREFIX) is WeightFormat.BF16


SHARED = "model.layers.3.mlp.shared_experts"


@pytest.mark.parametrize(
    "ignore",
    [
        [SHARED],
        [f"{SHARED}.{proj}" for proj in ("down_proj", "gate_proj", "up_proj")],  # transformers
        ["re:.*shared_experts.*"],
    ],
)
def test_a_shared_expert_ignored_whole_or_by_each_projection_is_bf16(ignore: list[str]) -> None:
    config = {**FP8, "modules_to_not_convert": ["lm_head", *ignore]}
    assert detect_mlp_format(config, SHARED) is WeightFormat.BF16
    assert detect_expert_format(config, PREFIX, num_experts=4) is WeightFormat.FP8_BLOCK


def test_a_shared_expert_ignored_in_part_is_refused_by_name() -> None:
    config = {**FP8, "modules_to_not_convert": [f"{SHARED}.down_proj", f"{SHARED}.up_proj"]}
    with pytest.raises(NotImplementedError, match=rf"{SHARED}: .*only some of its modules"):
        detect_mlp_format(config, SHARED)
    assert detect_mlp_format({**FP8, "modules_to_not_convert": []}, SHARED) is (
        WeightFormat.FP8_BLOCK
    )


def test_fp8_ignore_of_other_layers_or_router_keeps_fp8() -> None:
    ignore = ["model.layers.3.mlp.gate", "model.layers.30.mlp.experts", "lm_head", "gate"]
    config = {**FP8, "modules_to_not_convert": ignore}
    assert detect_expert_format(config, PREFIX, num_experts=4) is WeightFormat.FP8_BLOCK


def test_a_long_ignore_list_of_other_modules_is_not_matched_expert_by_expert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real FP8 save lists each layer's router, gates and attention projections (145
    entries for 48 layers): they cannot name an expert's projection, so they are sorted out
    once instead of being matched against each of 512 x 3 expert modules per layer; entries
    that can still are matched (the experts named one by one are BF16)."""
    others = ["lm_head"] + [
        f"model.layers.{i}.{m}"
        for i in range(48)
        for m in ("linear_attn.in_proj_ba", "mlp.gate", "mlp.shared_expert_gate")
    ]
    calls = 0
    matches_any = quant_config._matches_any

    def counted(*args: Any, **kwargs: Any) -> bool:
        nonlocal calls
        calls += 1
        return matches_any(*args, **kwargs)

    monkeypatch.setattr(quant_config, "_matches_any", counted)
    config = {**FP8, "modules_to_not_convert": others}
    assert detect_expert_format(config, PREFIX, num_experts=512) is WeightFormat.FP8_BLOCK
    assert calls <= 2, calls  # the prefix, not each of the 1536 expert modules
    each = [f"{PREFIX}.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    config = {**FP8, "modules_to_not_convert": others + each}
    assert detect_expert_format(config, PREFIX, num_experts=4) is WeightFormat.BF16


def test_compressed_tensors_ignore_every_expert_linear_is_bf16() -> None:
    config = _ct("mxfp4-pack-quantized", ignore=["lm_head", r"re:.*mlp\.experts\.\d+\..*_proj$"])
    assert detect_expert_format(config, PREFIX, num_experts=4) is WeightFormat.BF16


def test_compressed_tensors_group_targeting_experts_wins() -> None:
    config = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": {
            "attn": {"targets": [r"re:.*self_attn.*"], "format": "float-quantized"},
            "moe": {"targets": [r"re:.*mlp\.experts.*"], "format": "mxfp4-pack-quantized"},
        },
    }
    assert detect_expert_format(config, PREFIX) is WeightFormat.MXFP4


def test_partial_ignore_is_refused_naming_the_modules() -> None:
    config = {**FP8, "modules_to_not_convert": ["model.layers.3.mlp.experts.1.down_proj"]}
    with pytest.raises(NotImplementedError, match=r"ignores only some of its modules"):
        detect_expert_format(config, PREFIX, num_experts=4)
    # Without the expert count a plain name below the prefix still shows.
    with pytest.raises(NotImplementedError, match=r"experts\.1\.down_proj"):
        detect_expert_format(config, PREFIX)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**FP8, "weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\] is not supported"),
        ({**FP8, "weight_block_size": [128, 64]}, r"weight_block_size=\[128, 64\]"),
        ({"quant_method": "fp8"}, r"without weight_block_size"),
        ({**FP8, "fmt": "e5m2"}, r"fmt='e5m2'"),
        ({"quant_method": "awq", "bits": 4}, r"quant_method='awq' is not supported"),
        ({"quant_method": "modelopt"}, r"ModelOpt quant_algo=None is not supported"),
        (_ct("pack-quantized"), r"format 'pack-quantized' is not supported"),
        (_ct("float-quantized"), r"format 'float-quantized'"),
    ],
)
def test_unsupported_is_refused_naming_format_and_prefix(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(NotImplementedError, match=message) as info:
        detect_expert_format(config, PREFIX)
    assert PREFIX in str(info.value)


def test_malformed_configs_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"no string 'quant_method'"):
        detect_expert_format({"weight_block_size": [128, 128]}, PREFIX)
    with pytest.raises(ValueError, match=r"modules_to_not_convert must be a list"):
        detect_expert_format({**FP8, "modules_to_not_convert": "lm_head"}, PREFIX)


def test_groups_not_targeting_a_module_leave_it_bf16() -> None:
    config = {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized",
        "config_groups": {"moe": {"targets": [r"re:.*mlp\.experts\..*"]}},
    }
    assert detect_expert_format(config, PREFIX) is WeightFormat.MXFP8
    assert detect_expert_format(config, "model.layers.3.mlp.shared_expert") is WeightFormat.BF16


@pytest.mark.parametrize("original", [None, FP8])
def test_mark_converted_changes_exactly_the_listed_experts(original: dict[str, Any] | None) -> None:
    other = "model.layers.4.mlp.experts"
    shared = "model.layers.3.mlp.shared_expert"
    config = mark_converted(original, WeightFormat.MXFP4, [PREFIX])
    assert detect_expert_format(config, PREFIX) is WeightFormat.MXFP4
    kept = WeightFormat.BF16 if original is None else WeightFormat.FP8_BLOCK
    assert detect_expert_format(config, other) is kept
    assert detect_expert_format(config, shared) is kept
    again = mark_converted(config, WeightFormat.MXFP4, [other])
    assert detect_expert_format(again, other) is WeightFormat.MXFP4
    assert original is None or CONVERTED_KEY not in original
    with pytest.raises(ValueError, match=r"converted to 'mxfp4'; convert the original"):
        mark_converted(config, WeightFormat.MXFP8, [other])
    with pytest.raises(ValueError, match=rf"{CONVERTED_KEY} must be an object"):
        detect_expert_format({CONVERTED_KEY: ["x"]}, PREFIX)


@pytest.mark.parametrize(
    "ignore",
    [
        ["lm_head", "model.layers.3.mlp.experts"],
        ["model.layers.*.mlp.experts"],  # ModelOpt's wildcards
        ["model.layers.3.mlp*"],
        ["model.layers.3.mlp.experts.*"],  # everything below the experts module
    ],
)
@pytest.mark.parametrize("key", ["ignore", "exclude_modules"])
def test_modelopt_ignored_experts_are_bf16(ignore: list[str], key: str) -> None:
    assert detect_expert_format({**MODELOPT, key: ignore}, PREFIX, num_experts=4) is (
        WeightFormat.BF16
    )
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", key: ignore}}
    assert detect_expert_format(nested, PREFIX, num_experts=4) is WeightFormat.BF16


def test_modelopt_wildcards_of_other_modules_keep_nvfp4() -> None:
    config = {**MODELOPT, "ignore": ["lm_head", "model.layers.*.mlp.gate", "*.shared_expert*"]}
    assert detect_expert_format(config, PREFIX, num_experts=4) is WeightFormat.NVFP4
    shared = "model.layers.3.mlp.shared_expert"
    assert detect_expert_format(config, shared) is WeightFormat.BF16


def test_modelopt_wildcard_over_some_experts_is_refused() -> None:
    config = {**MODELOPT, "ignore": ["model.layers.3.mlp.experts.[01].*"]}
    with pytest.raises(NotImplementedError, match="ignores only some of its modules"):
        detect_expert_format(config, PREFIX, num_experts=4)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**MODELOPT, "quant_algo": "FP8"}, r"ModelOpt quant_algo='FP8' is not supported .* NVFP4"),
        ({**MODELOPT, "group_size": 32}, r"ModelOpt NVFP4 group_size=32 is not supported"),
    ],
)
def test_modelopt_refusals_name_the_setting(config: dict[str, Any], match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        detect_expert_format(config, PREFIX)
