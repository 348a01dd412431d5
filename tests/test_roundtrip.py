"""Offline equals online: every adapter x format, synthetic -> convert -> load, byte for byte
(every tensor a block computes with: kernel tensors, router, a separate shared expert)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.adapters import ModelAdapter, SyntheticSizes, installed_adapters, open_checkpoint
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.convert import convert_checkpoint
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint

ADAPTERS = installed_adapters()
CASES = [
    (name, fmt, target)
    for name, adapter in ADAPTERS.items()
    for fmt in adapter.checkpoint_formats
    for target in (WeightFormat.MXFP8, WeightFormat.MXFP4, WeightFormat.FP8_BLOCK)
]
SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)


def test_both_adapters_are_installed() -> None:
    assert {"qwen4exp", "glm5next"} <= set(ADAPTERS)


def _kernel_tensors(
    adapter: ModelAdapter, reader: CheckpointReader, run_format: WeightFormat
) -> dict[str, torch.Tensor]:
    parallel = ParallelSettings(ep_group=single_rank_group("cpu"))
    found = {}
    for layer in reader.layers:
        # The MTP drafter ignores a forced run format; force it here to compare like with like.
        forced = dataclasses.replace(layer, is_mtp=False)
        block = adapter.build_block(
            reader.config, forced, parallel=parallel, moe_format=run_format, backend="reference"
        )
        block.load_from_checkpoint(reader)
        assert block.experts.weight_format is run_format
        # Everything the block computes with: kernel tensors, router, separate shared expert.
        for name, tensor in block.state_dict().items():
            found[f"{layer.prefix}.{name}"] = tensor.detach().clone()
    return found


def _raw_digest(reader: CheckpointReader, name: str) -> str:
    tensor = reader.get_tensor(name)
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.mark.parametrize(
    ("adapter_name", "checkpoint_format", "run_format"),
    CASES,
    ids=[f"{a}-{f.value}-to-{t.value}" for a, f, t in CASES],
)
def test_converted_checkpoint_loads_to_the_online_kernel_bytes(
    tmp_path: Path, adapter_name: str, checkpoint_format: WeightFormat, run_format: WeightFormat
) -> None:
    adapter = ADAPTERS[adapter_name]
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, adapter, checkpoint_format, SIZES, max_shard_bytes=400_000)
    with warnings.catch_warnings():  # non-power-of-two block scales warn on both paths
        warnings.simplefilter("ignore")
        convert_checkpoint(src, out, run_format, progress=False)
        online = _kernel_tensors(adapter, CheckpointReader(src, adapter), run_format)
        reader, found = open_checkpoint(out)
        assert found is adapter
        assert {layer.checkpoint_format for layer in reader.layers} == {run_format}
        offline = _kernel_tensors(adapter, reader, run_format)
    assert online.keys() == offline.keys() and online
    for name in online:
        assert_bitwise_equal(offline[name], online[name], name)

    before = CheckpointReader(src, adapter)
    expert_names = {n for n in before.weight_map if before.expert_layer(n) is not None}
    assert expert_names, "no routed-expert tensors found"
    for name in sorted(set(before.weight_map) - expert_names):
        assert _raw_digest(reader, name) == _raw_digest(before, name), f"{name} changed"
        assert reader.weight_map[name] == before.weight_map[name], f"{name} changed shard"


@pytest.mark.parametrize("block", [[64, 64], "ab", 5], ids=["64x64", "string", "int"])
def test_a_weight_block_size_beside_mx_experts_does_not_shape_block_fp8(
    tmp_path: Path, block: object
) -> None:
    """megamoe's block-FP8 is 128x128: the ``weight_block_size`` an MX checkpoint's config
    carries (unused by MX) shapes neither the converted scales nor what loading expects."""
    adapter = ADAPTERS["qwen4exp"]
    src, out = tmp_path / "src", tmp_path / "out"
    write_synthetic_checkpoint(src, adapter, WeightFormat.MXFP8, SIZES)
    config_path = src / "config.json"
    config = json.loads(config_path.read_text())
    quant = config.get("quantization_config") or config["text_config"]["quantization_config"]
    quant["weight_block_size"] = block
    config_path.write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_checkpoint(src, out, WeightFormat.FP8_BLOCK, progress=False)
        online = _kernel_tensors(adapter, CheckpointReader(src, adapter), WeightFormat.FP8_BLOCK)
        offline = _kernel_tensors(adapter, CheckpointReader(out, adapter), WeightFormat.FP8_BLOCK)
    for name in online:
        assert_bitwise_equal(offline[name], online[name], name)
