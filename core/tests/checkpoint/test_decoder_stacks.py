"""A checkpoint with decoder layers under both layouts is refused, naming both prefixes.

``model.language_model.layers`` (composite saves) and ``model.layers`` (text-only saves):
one checkpoint holds one. With both, which copy the model reads depends on its config and
class, and loading one while the engine runs the other would serve the wrong weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.core.adapters import SyntheticSizes, open_checkpoint
from megamoe.core.checkpoint.layers import COMPOSITE_DECODER, TEXT_DECODER, decoder_prefix
from megamoe.core.checkpoint.reader import INDEX_FILE
from megamoe.core.cli import main as cli
from megamoe.core.errors import CheckpointError
from megamoe.core.testing import write_synthetic_checkpoint

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=256, num_experts=4)
MESSAGE = f"holds decoder layers under both '{COMPOSITE_DECODER}' and '{TEXT_DECODER}': two copies"


def test_decoder_prefix_takes_the_layout_the_tensors_have() -> None:
    composite = {"text_config": {"model_type": "toy"}}
    assert decoder_prefix({}, [f"{TEXT_DECODER}.0.mlp.gate.weight"]) == TEXT_DECODER
    assert decoder_prefix({}, [f"{COMPOSITE_DECODER}.0.mlp.gate.weight"]) == COMPOSITE_DECODER
    assert decoder_prefix(composite, []) == COMPOSITE_DECODER  # no tensors: the config says
    both = [f"{COMPOSITE_DECODER}.0.mlp.gate.weight", f"{TEXT_DECODER}.0.mlp.gate.weight"]
    with pytest.raises(CheckpointError, match=MESSAGE):
        decoder_prefix({}, both)


def test_a_second_copy_of_the_layers_is_refused_by_loading_and_inspect(
    tmp_path: Path, toy_adapter, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", "toymoe", "bf16", SIZES)
    index_path = ckpt / INDEX_FILE
    if index_path.exists():
        shard = ckpt / json.loads(index_path.read_text())["weight_map"]["model.norm.weight"]
    else:
        shard = ckpt / "model.safetensors"
    tensors = load_file(shard)
    copy = f"{COMPOSITE_DECODER}.1.mlp.gate.weight"
    tensors[copy] = torch.zeros(SIZES.num_experts, SIZES.hidden_size, dtype=torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"][copy] = shard.name
        index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=MESSAGE):
        open_checkpoint(ckpt)
    assert cli.main(["inspect", str(ckpt)]) == 1
    assert MESSAGE in capsys.readouterr().err
