"""Checkpoint names of routed-expert tensors and the dtype and shape each must have.

Names are relative to a layer's experts prefix (``model.layers.3.mlp.experts``):

- per expert: ``{e}.{gate,up,down}_proj.{weight,<scale>}`` (MXFP4 weights may be called
  ``weight_packed``, the compressed-tensors name);
- fused BF16: ``gate_up_proj`` (E, 2I, H), gate rows first, and ``down_proj`` (E, H, I).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megamoe.core.formats import BLOCK_FP8_DEFAULT, WeightFormat

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
FUSED_GATE_UP = "gate_up_proj"
FUSED_DOWN = "down_proj"
WEIGHT = "weight"
WEIGHT_PACKED = "weight_packed"  # compressed-tensors name of packed MXFP4 weights


class TensorSpec(NamedTuple):
    """The dtype and shape a checkpoint tensor must have."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExpertTensorName:
    """A parsed routed-expert tensor name.

    Attributes:
        expert: the expert index, None for a fused tensor holding every expert.
        proj: ``gate_proj``, ``up_proj``, ``down_proj``, or fused ``gate_up_proj`` /
            ``down_proj``.
        kind: ``weight``, ``weight_packed`` or a scale name; empty for fused tensors.
    """

    expert: int | None
    proj: str
    kind: str

    @property
    def is_fused(self) -> bool:
        """True for the fused BF16 tensors."""
        return self.expert is None

    @property
    def is_weight(self) -> bool:
        """True for element tensors (fused ones included), False for scales."""
        return self.kind in ("", WEIGHT, WEIGHT_PACKED)

    def __str__(self) -> str:
        return self.proj if self.expert is None else f"{self.expert}.{self.proj}.{self.kind}"


def parse_expert_name(name: str) -> ExpertTensorName | None:
    """Parse a name relative to the experts prefix; None when it is not an expert tensor."""
    parts = name.split(".")
    if len(parts) == 1 and parts[0] in (FUSED_GATE_UP, FUSED_DOWN):
        return ExpertTensorName(None, parts[0], "")
    if len(parts) == 3 and _is_index(parts[0]) and parts[1] in EXPERT_PROJS:
        return ExpertTensorName(int(parts[0]), parts[1], parts[2])
    return None


def _is_index(text: str) -> bool:
    """An expert index as checkpoints write it: ASCII digits, no leading zero (not ``07``)."""
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


def projection_shape(proj: str, hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """Logical (rows, columns) of one expert projection: (I, H) for gate/up, (H, I) for down."""
    if proj == FUSED_DOWN:
        return hidden_size, intermediate_size
    return intermediate_size, hidden_size


def projection_specs(
    fmt: WeightFormat,
    rows: int,
    cols: int,
    block_size: tuple[int, int] = BLOCK_FP8_DEFAULT,
) -> tuple[TensorSpec, TensorSpec | None]:
    """How ``fmt`` stores a (rows, cols) weight: its element tensor and its scale (or None)."""
    weight = TensorSpec(fmt.element_dtype, (rows, cols // fmt.values_per_byte))
    if fmt is WeightFormat.BF16:
        return weight, None
    if fmt is WeightFormat.FP8_BLOCK:
        blocks = (math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1]))
        return weight, TensorSpec(torch.float32, blocks)
    block_cols = fmt.scale_block[1] if fmt.scale_block else 1
    return weight, TensorSpec(torch.uint8, (rows, math.ceil(cols / block_cols)))


def expert_tensor_spec(
    fmt: WeightFormat,
    name: str,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    block_size: tuple[int, int] = BLOCK_FP8_DEFAULT,
) -> TensorSpec | None:
    """The dtype and shape expert tensor ``name`` must have when experts are stored as ``fmt``.

    Args:
        fmt: the layer's expert checkpoint format.
        name: tensor name relative to the experts prefix.
        num_experts: routed experts E.
        hidden_size: H.
        intermediate_size: I.
        block_size: rows x columns of one FP8_BLOCK scale.

    Returns:
        The spec, or None for a name that is no tensor of this format (an unknown
        name, a scale of another format, an expert index outside ``[0, E)``, a fused
        tensor of quantized experts).
    """
    parsed = parse_expert_name(name)
    if parsed is None:
        return None
    if parsed.is_fused:
        if fmt is not WeightFormat.BF16:
            return None  # quantized experts are stored per expert
        rows = 2 * intermediate_size if parsed.proj == FUSED_GATE_UP else hidden_size
        cols = hidden_size if parsed.proj == FUSED_GATE_UP else intermediate_size
        return TensorSpec(torch.bfloat16, (num_experts, rows, cols))
    if parsed.expert is None or parsed.expert >= num_experts:
        return None
    weight, scale = projection_specs(
        fmt, *projection_shape(parsed.proj, hidden_size, intermediate_size), block_size
    )
    if parsed.kind == WEIGHT or (parsed.kind == WEIGHT_PACKED and fmt is WeightFormat.MXFP4):
        return weight
    if scale is not None and parsed.kind == fmt.scale_name:
        return scale
    return None


def weight_kinds(fmt: WeightFormat) -> tuple[str, ...]:
    """Names the element tensor of a projection may have in ``fmt``."""
    return (WEIGHT, WEIGHT_PACKED) if fmt is WeightFormat.MXFP4 else (WEIGHT,)


def parse_single_name(name: str) -> tuple[str, str] | None:
    """``(proj, kind)`` of a one-expert tensor, e.g. a shared expert's ``up_proj.weight``."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in EXPERT_PROJS:
        return parts[0], parts[1]
    return None
