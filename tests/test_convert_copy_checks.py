"""``convert`` checks the expert tensors it copies unchanged as loading checks them.

A tensor convert leaves as stored (experts already in the target format, or a shared expert
that runs apart) must not pass into the output when loading would refuse it: NaN or
infinity in a weight or scale, or a block-FP8 scale that is not > 0. Both adapters, the
routed experts and the shared expert (Qwen4Exp's sits beside the experts, GLM's under
them), each refused naming the file and the tensor, with no output left behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.core.adapters import SyntheticSizes, installed_adapters
from megamoe.core.checkpoint.reader import INDEX_FILE, CheckpointReader
from megamoe.core.convert import convert_checkpoint
from megamoe.core.errors import InvalidScaleError, NonFiniteError
from megamoe.core.testing import write_synthetic_checkpoint

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)
ADAPTERS = installed_adapters()
FP8_NAN = 0x7F  # float8_e4m3fn NaN byte


def _nan_byte(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(torch.uint8).view(-1)[5] = FP8_NAN
    return out


def _nan(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[0] = float("nan")
    return out


def _negative(t: torch.Tensor) -> torch.Tensor:
    return -t


# (what, the tensor under the MoE block's prefix, damage, error, message)
CASES = [
    ("routed weight", "experts.2.up_proj.weight", _nan_byte, NonFiniteError,
     r"experts\.2\.up_proj\.weight holds 1 non-finite value\(s\)"),
    ("routed scale", "experts.1.down_proj.weight_scale_inv", _nan, NonFiniteError,
     r"experts\.1\.down_proj\.weight_scale_inv holds 1 non-finite value\(s\)"),
    ("shared weight", "{shared}.gate_proj.weight", _nan_byte, NonFiniteError,
     r"{shared}\.gate_proj\.weight holds 1 non-finite value\(s\)"),
    ("shared scale", "{shared}.up_proj.weight_scale_inv", _negative, InvalidScaleError,
     r"{shared}\.up_proj\.weight_scale_inv: block \(0, 0\) has scale -"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "rel", "damage", "error", "message"), CASES, ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_a_tensor_copied_unchanged_is_checked(
    tmp_path: Path, name: str, what: str, rel: str, damage: object, error: type, message: str
) -> None:
    adapter = ADAPTERS[name]
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", adapter, "fp8_block", SIZES, max_shard_bytes=100_000
    )
    reader = CheckpointReader(ckpt, adapter)
    layer = reader.layers[-1]
    shared = adapter.shared_expert(reader.config, layer)
    assert shared is not None
    short = shared.prefix.removeprefix(f"{layer.prefix}.")
    tensor = f"{layer.prefix}.{rel.format(shared=short)}"
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shard = ckpt / index["weight_map"][tensor]
    tensors = load_file(shard)
    tensors[tensor] = damage(tensors[tensor])  # type: ignore[operator]
    save_file(tensors, shard)
    out = tmp_path / "out"
    with pytest.raises(error, match=message.format(shared=short.replace(".", r"\."))):
        convert_checkpoint(ckpt, out, "fp8_block", progress=False)  # every expert copied
    assert not out.exists() and not list(tmp_path.glob("out.partial-*"))


@pytest.mark.parametrize(("fmt", "byte"), [("mxfp8", 247), ("mxfp4", 253)])
def test_an_mx_scale_whose_block_overflows_is_not_copied(
    tmp_path: Path, fmt: str, byte: int
) -> None:
    """A finite UE8M0 byte that takes the format's largest element past float32 (448 or 6
    times 2^(byte - 127)) decodes its block to infinity: loading refuses it, so does convert."""
    adapter = ADAPTERS["qwen4exp"]  # MX checkpoints are Qwen's
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", adapter, fmt, SIZES, max_shard_bytes=100_000
    )
    reader = CheckpointReader(ckpt, adapter)
    tensor = f"{reader.layers[0].prefix}.experts.3.gate_proj.weight_scale"
    shard = ckpt / json.loads((ckpt / INDEX_FILE).read_text())["weight_map"][tensor]
    tensors = load_file(shard)
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor].view(torch.uint8).view(-1)[7] = byte
    save_file(tensors, shard)
    out = tmp_path / "out"
    pattern = re.escape(f"{tensor} holds 1 non-finite value(s) (NaN/inf, or a scale")
    with pytest.raises(NonFiniteError, match=pattern):
        convert_checkpoint(ckpt, out, fmt, progress=False)  # every expert copied
    assert not out.exists() and not list(tmp_path.glob("out.partial-*"))
