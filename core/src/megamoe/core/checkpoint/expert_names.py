"""Checkpoint names of routed-expert tensors and the dtype and shape each must have.

Names are relative to a layer's experts prefix (``model.layers.3.mlp.experts``):

- per expert: ``{e}.{gate,up,down}_proj.{weight,<scale>}`` (MXFP4 and NVFP4 weights may be
  called ``weight_packed``, the compressed-tensors name); NVFP4 projections also hold a
  global scale, ``weight_scale_2`` (ModelOpt) or ``weight_global_scale``
  (compressed-tensors), and may hold an activation scale (``input_scale`` /
  ``input_global_scale``), each one float32 value;
- fused BF16: ``gate_up_proj`` (E, 2I, H), gate rows first, and ``down_proj`` (E, H, I).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, WeightFormat

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
FUSED_GATE_UP = "gate_up_proj"
FUSED_DOWN = "down_proj"
WEIGHT = "weight"
WEIGHT_PACKED = "weight_packed"  # compressed-tensors name of packed E2M1 weights
GLOBAL_SCALE = "weight_scale_2"  # NVFP4 global scale, a multiplier (ModelOpt)
CT_GLOBAL_SCALE = "weight_global_scale"  # NVFP4 global scale, a divisor (compressed-tensors)
INPUT_SCALES = ("input_scale", "input_global_scale")  # NVFP4 activation scales, unused
# Digits of a layer or expert index in a tensor name (below a billion): a bound checked
# before int(), which raises on strings of over 4300 digits.
MAX_INDEX_DIGITS = 9


class TensorSpec(NamedTuple):
    """The dtype and shape a checkpoint tensor must have."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies."""
        return math.prod(self.shape) * self.dtype.itemsize

    def accepts(self, other: TensorSpec) -> bool:
        """Same dtype and shape; a one-value spec (shape ``()``) also takes shape ``(1,)``."""
        if other.dtype != self.dtype:
            return False
        return other.shape == self.shape or (self.shape == () and other.shape == (1,))


ONE_FLOAT32 = TensorSpec(torch.float32, ())  # an NVFP4 global or activation scale


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
    """An expert index as checkpoints write it: ASCII digits, no leading zero (not ``07``).

    At most ``MAX_INDEX_DIGITS`` digits: a longer one is no expert's, and ``int()`` of
    thousands of digits raises.
    """
    return (
        len(text) <= MAX_INDEX_DIGITS
        and text.isascii()
        and text.isdigit()
        and (text == "0" or not text.startswith("0"))
    )


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
    scale_dtype = fmt.scale_dtype or torch.uint8
    return weight, TensorSpec(scale_dtype, (rows, math.ceil(cols / block_cols)))


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
    if parsed.kind in weight_kinds(fmt):
        return weight
    if scale is not None and parsed.kind == fmt.scale_name:
        return scale
    if parsed.kind in checkpoint_kinds(fmt):
        return ONE_FLOAT32  # NVFP4's global and activation scales
    return None


def weight_kinds(fmt: WeightFormat) -> tuple[str, ...]:
    """Names the element tensor of a projection may have in ``fmt``."""
    packed = fmt in (WeightFormat.MXFP4, WeightFormat.NVFP4)
    return (WEIGHT, WEIGHT_PACKED) if packed else (WEIGHT,)


def required_kinds(fmt: WeightFormat) -> tuple[tuple[str, ...], ...]:
    """The tensors every projection needs in ``fmt``: each entry lists the names it may have."""
    scales = () if fmt.scale_name is None else ((fmt.scale_name,),)
    globals_ = ((GLOBAL_SCALE, CT_GLOBAL_SCALE),) if fmt is WeightFormat.NVFP4 else ()
    return (weight_kinds(fmt), *scales, *globals_)


def pairing_kinds(fmt: WeightFormat) -> tuple[str, ...]:
    """The kinds that complete one projection when loading pairs them.

    ``weight``, then each scale under its first name (NVFP4's global scale as
    ``weight_scale_2``, whichever name the checkpoint gives it).
    """
    return (WEIGHT, *(names[0] for names in required_kinds(fmt)[1:]))


def checkpoint_kinds(fmt: WeightFormat) -> tuple[str, ...]:
    """Every tensor kind a projection may have in ``fmt`` (NVFP4: its input scales too)."""
    kinds = tuple(k for names in required_kinds(fmt) for k in names)
    return (*kinds, *INPUT_SCALES) if fmt is WeightFormat.NVFP4 else kinds


def parse_single_name(name: str) -> tuple[str, str] | None:
    """``(proj, kind)`` of a one-expert tensor, e.g. a shared expert's ``up_proj.weight``."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in EXPERT_PROJS:
        return parts[0], parts[1]
    return None
