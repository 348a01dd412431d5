"""A tensor that fails to load names the shard it was read from (both adapters, our
synthetic checkpoints and transformers 5.24.0's own, fused experts included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers_oracle import build_tiny_model, save_checkpoint

from megamoe.core.adapters import SyntheticSizes, open_checkpoint
from megamoe.core.checkpoint.reader import INDEX_FILE
from megamoe.core.errors import NonFiniteError
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)


def _poison(path: Path, needle: str) -> tuple[str, Path]:
    """Write a NaN into the first tensor whose name ends with ``needle``; its name and shard."""
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    name = next(n for n in sorted(weight_map) if n.endswith(needle))
    shard = path / weight_map[name]
    tensors = load_file(shard)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return name, shard


def _load_error(path: Path, name: str) -> NonFiniteError:
    """The error loading the MoE layer holding tensor ``name`` raises (on the CPU)."""
    reader, adapter = open_checkpoint(path)
    layer = next(layer for layer in reader.layers if name.startswith(layer.prefix + "."))
    block = adapter.build_block(
        reader.config, layer, parallel=ParallelSettings(ep_group=single_rank_group("cpu")),
        backend="reference",
    )  # fmt: skip
    with pytest.raises(NonFiniteError, match="non-finite") as caught:
        block.load_from_checkpoint(reader)
    return caught.value


@pytest.mark.parametrize("adapter_name", ["qwen4exp", "glm5next"])
def test_a_non_finite_expert_tensor_names_its_shard(tmp_path: Path, adapter_name: str) -> None:
    write_synthetic_checkpoint(
        tmp_path, adapter_name, WeightFormat.BF16, SIZES, max_shard_bytes=200_000
    )
    name, shard = _poison(tmp_path, ".experts.1.down_proj.weight")
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2, "expected a sharded checkpoint"
    assert _load_error(tmp_path, name).__notes__ == [f"{name} was read from {shard}"]


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_a_fused_transformers_checkpoint_names_the_shard_of_the_fused_tensor(
    tmp_path: Path, family: str
) -> None:
    tiny = build_tiny_model(family, seed=3)
    path = save_checkpoint(tiny, tmp_path / "ckpt", fused=True)
    fused, shard = _poison(path, ".experts.gate_up_proj")  # expert 0's gate rows
    piece = fused.removesuffix("gate_up_proj") + "0.gate_proj.weight"
    assert _load_error(path, fused).__notes__ == [f"{piece} was read from {shard}"]
