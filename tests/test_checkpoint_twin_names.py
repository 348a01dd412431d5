"""A projection that holds both names of one tensor is refused when the checkpoint opens.

MXFP4 weights may be stored as ``weight`` or ``weight_packed``, NVFP4 global scales as
``weight_scale_2`` or ``weight_global_scale``. A checkpoint with both for one projection
is ambiguous (the loader and the float64 reference could each read another), so it is
refused from the headers, by every command alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megamoe.core.adapters import SyntheticSizes, open_checkpoint
from megamoe.core.checkpoint.reader import INDEX_FILE
from megamoe.core.errors import CheckpointError
from megamoe.core.testing import write_synthetic_checkpoint
from megamoe.qwen4exp import ADAPTER

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)


@pytest.mark.parametrize(
    ("fmt", "kind", "twin"),
    [("mxfp4", "weight_packed", "weight"), ("nvfp4", "weight_scale_2", "weight_global_scale")],
)
def test_two_names_for_one_tensor_of_a_projection_are_refused(
    tmp_path: Path, fmt: str, kind: str, twin: str
) -> None:
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", ADAPTER, fmt, SIZES, max_shard_bytes=100_000
    )
    index = json.loads((ckpt / INDEX_FILE).read_text())
    name = next(n for n in index["weight_map"] if n.endswith(f"experts.1.up_proj.{kind}"))
    shard = index["weight_map"][name]
    tensors = load_file(ckpt / shard)
    twin_name = name.removesuffix(kind) + twin
    tensors[twin_name] = tensors[name].clone()
    save_file(tensors, ckpt / shard)
    index["weight_map"][twin_name] = shard
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"experts\.1\.up_proj has both .*two names for one"):
        open_checkpoint(ckpt)
