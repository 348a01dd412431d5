"""NVFP4: E2M1 elements with one E4M3 scale per 16 values and one float32 scale per tensor.

A value is ``E2M1 code x E4M3 block scale x global scale``. Checkpoints store it in two
layouts (per projection, e.g. ``experts.3.gate_proj.*``):

- ModelOpt (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``): ``weight`` (uint8, two
  codes per byte, even column in the low nibble), ``weight_scale`` (float8_e4m3fn, one per
  1x16), ``weight_scale_2`` (float32, one element: the global scale, a multiplier) and
  ``input_scale`` (float32, one element: the activations' global scale for W4A4 kernels).
- compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale`` and
  ``weight_global_scale`` (float32, one element: a divisor, 1 / ``weight_scale_2``), plus
  ``input_global_scale`` for activations.

megamoe uses the weights only (its kernels quantize activations themselves), so the input
scales are accepted and ignored. Loading keeps the global scale under one kind,
``weight_scale_2``, as a multiplier: a compressed-tensors divisor becomes its float64
reciprocal (``loaded_half``). The casts take an NVFP4 weight with float32 block scales
(``nvfp4_block_scale``): ``float32(E4M3 x multiplier)``, one rounding. That equals both
libraries' own ``float32(E4M3 x weight_scale_2)`` and ``float32(E4M3 / weight_global_scale)``
bit for bit: the float64 product of a 4-bit E4M3 value and a float32 multiplier is exact;
with the float64 reciprocal of a float32 divisor it is within 2^-52 (relative) of the true
quotient, which is at least 2^-49 away from any float32 rounding midpoint, so the single
rounding to float32 lands where the division's does.

``quantize_nvfp4`` is sgl-deep-gemm 0.2.5's ``per_token_cast_to_nvfp4`` (``gran_k=16``, no
global scale). Requantizing NVFP4 to the run formats loses precision: ``warn_requantized``
says so once per layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from megamoe.core.checkpoint.expert_names import CT_GLOBAL_SCALE, GLOBAL_SCALE, INPUT_SCALES
from megamoe.core.errors import InvalidScaleError, NonFiniteError
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.numerics.mx_codes import E2M1_MAX, float32_to_e2m1, pack_e2m1
from megamoe.core.numerics.quant import E4M3_MAX, NVFP4_GROUP

# Checkpoint kinds of one NVFP4 projection besides its weight and block scale.
_EXTRA_KINDS = (GLOBAL_SCALE, CT_GLOBAL_SCALE, *INPUT_SCALES)

# torch on CUDA divides by a Python scalar as x * float32(1/scalar), and so does DeepGEMM's
# reference cast there; the product keeps CPU == CUDA bit for bit.
_RECIP_E2M1_MAX = 0.1666666716337204  # float32(1/6), exactly


def loaded_half(kind: str, tensor: Tensor, what: str) -> tuple[str, Tensor] | None:
    """The ``(kind, tensor)`` an NVFP4 projection's checkpoint tensor is paired as.

    The global scale comes back as kind ``weight_scale_2`` holding a one-element
    multiplier of shape ``()``: ModelOpt's float32 as it is, compressed-tensors'
    ``weight_global_scale`` divisor as its float64 reciprocal. Input scales come back as
    None (weights-only use ignores them); other kinds unchanged.

    Args:
        kind: the tensor's kind (``weight_scale_2``, ``weight_global_scale``, ...).
        tensor: the checkpoint tensor.
        what: the tensor named for messages.

    Raises:
        ValueError: a global or input scale that is not a float32 tensor of one element.
    """
    if kind not in _EXTRA_KINDS:
        return kind, tensor
    _check_one_float32(kind, tensor, what)
    if kind in INPUT_SCALES:
        return None
    return GLOBAL_SCALE, global_multiplier(kind, tensor, what)


def global_multiplier(kind: str, tensor: Tensor, what: str) -> Tensor:
    """The global scale as a multiplier of shape ``()``, from either checkpoint layout.

    Args:
        kind: ``weight_scale_2`` (ModelOpt, a multiplier: returned as it is) or
            ``weight_global_scale`` (compressed-tensors, a divisor: its float64 reciprocal).
        tensor: the checkpoint tensor, one float32 value.
        what: the tensor named for messages.

    Raises:
        ValueError: another kind, or not one float32 value.
    """
    if kind not in (GLOBAL_SCALE, CT_GLOBAL_SCALE):
        raise ValueError(
            f"{what}: {kind!r} is no NVFP4 global scale; expected {GLOBAL_SCALE} or "
            f"{CT_GLOBAL_SCALE}"
        )
    _check_one_float32(kind, tensor, what)
    scalar = tensor.reshape(())
    if kind == GLOBAL_SCALE:
        return scalar
    divisor = scalar.double()
    # A zero divisor stays 0 (not inf), so nvfp4_block_scale names it as a scale <= 0.
    return torch.where(divisor == 0, divisor, torch.reciprocal(divisor))


def _check_one_float32(kind: str, tensor: Tensor, what: str) -> None:
    """Raise unless ``tensor`` is one float32 value, as NVFP4's per-tensor scales are."""
    if tensor.dtype != torch.float32 or tensor.numel() != 1:
        raise ValueError(
            f"{what}: NVFP4 {kind} has dtype {tensor.dtype} and shape {tuple(tensor.shape)}; "
            "expected one float32 value (shape () or (1,)) per projection: check the "
            "checkpoint's quantization layout"
        )


def nvfp4_block_scale(weight_scale: Tensor, global_scale: Tensor, what: str) -> Tensor:
    """float32 scale per 16 values: ``float32(weight_scale x global_scale)``, one rounding.

    Args:
        weight_scale: float8_e4m3fn block scales (..., N, K/16), all >= 0.
        global_scale: the one-element multiplier ``loaded_half`` gives (float32 or float64).
        what: the projection named for messages.

    Returns:
        float32 tensor, shape of ``weight_scale``, on its device.

    Raises:
        TypeError: ``weight_scale`` is not float8_e4m3fn.
        NonFiniteError: a NaN block scale, or a global scale that is not finite.
        InvalidScaleError: a negative block scale, or a global scale that is not > 0.
    """
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{what}: NVFP4 weight_scale has dtype {weight_scale.dtype}; expected "
            "torch.float8_e4m3fn (one E4M3 scale per 16 values)"
        )
    g = float(global_scale.reshape(()).double())
    if g != g or g in (float("inf"), float("-inf")):
        raise NonFiniteError(f"{what}: NVFP4 global scale is {g}; fix the checkpoint tensor")
    if g <= 0.0:
        raise InvalidScaleError(
            f"{what}: NVFP4 global scale is {g}; it must be > 0 (weight_scale_2 > 0, "
            "weight_global_scale > 0): fix the checkpoint tensor"
        )
    block = weight_scale.float()
    if bool(torch.isnan(block).any()):
        raise NonFiniteError(f"{what}: NVFP4 weight_scale holds NaN; fix the checkpoint tensor")
    if bool((block < 0).any()):
        bad = float(block[block < 0].flatten()[0])
        raise InvalidScaleError(
            f"{what}: NVFP4 weight_scale holds {bad}; E4M3 block scales must be >= 0: fix "
            "the checkpoint tensor"
        )
    return (block.double() * g).float()


def shard_scale(fmt: WeightFormat, parts: Mapping[str, Tensor], what: str) -> Tensor | None:
    """The ``scale`` that ``quant.requantize`` / ``quant.dequantize`` take for one projection.

    Args:
        fmt: the checkpoint format.
        parts: the projection's checkpoint tensors by kind (the global scale as
            ``loaded_half`` gives it, for NVFP4).
        what: the projection named for messages.

    Returns:
        None for BF16; the format's scale tensor; for NVFP4 its float32 block scales.
    """
    if fmt is WeightFormat.NVFP4:
        return nvfp4_block_scale(parts["weight_scale"], parts[GLOBAL_SCALE], what)
    return None if fmt.scale_name is None else parts[fmt.scale_name]


def quantize_nvfp4(x: Tensor, *, name: str = "x") -> tuple[Tensor, Tensor]:
    """Cast ``x`` to NVFP4 exactly as sgl-deep-gemm 0.2.5's ``per_token_cast_to_nvfp4``.

    Per row, groups of 16 columns: ``scale = E4M3(amax * float32(1/6))`` (no lower clamp:
    an all-zero group gets scale 0 and codes 0), codes = E2M1 of ``x * (1/scale)`` rounded
    to nearest, ties to even (0 where the scale is 0). No global scale (it is 1).

    Args:
        x: bf16 / float16 / float32 tensor (..., K), K a multiple of 16 (DeepGEMM's rule).
        name: tensor name used in error messages.

    Returns:
        ``(packed, scale)``: uint8 (..., K/2), even column in the low nibble; float8_e4m3fn
        (..., K/16) (DeepGEMM returns the same scales as float32).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf.
        TypeError: another dtype.
        ValueError: K not a multiple of 16, or a group whose scale E4M3 cannot hold
            (amax above 6 x 448: scale ``x`` by a global scale first).
    """
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: dtype {x.dtype}; quantize_nvfp4 takes bf16, float16 or float32")
    if x.dim() == 0 or x.shape[-1] % NVFP4_GROUP:
        raise ValueError(
            f"{name}: shape {tuple(x.shape)}; NVFP4 needs a last dimension that is a multiple "
            f"of {NVFP4_GROUP} (one E4M3 scale per {NVFP4_GROUP} values): pad it with zeros"
        )
    groups = x.float().unflatten(-1, (-1, NVFP4_GROUP))
    if not bool(torch.isfinite(groups).all()):
        raise NonFiniteError(f"{name}: holds NaN or inf; it cannot be cast to NVFP4")
    scale_f32 = groups.abs().amax(-1) * _RECIP_E2M1_MAX
    if bool((scale_f32 >= E4M3_MAX + 16.0).any()):  # E4M3 rounds 464 and above to NaN
        raise ValueError(
            f"{name}: a group's amax exceeds {E2M1_MAX:g} x {E4M3_MAX:g}, which an E4M3 block "
            "scale cannot reach; divide x by a global scale (amax / 2688) first"
        )
    scale_e4m3 = scale_f32.to(torch.float8_e4m3fn)
    block = scale_e4m3.float()
    inverse = torch.where(block > 0, torch.reciprocal(block), torch.zeros_like(block))
    codes = float32_to_e2m1(groups * inverse.unsqueeze(-1)).flatten(-2)
    return pack_e2m1(codes), scale_e4m3


_warned_requantized: set[tuple[str, WeightFormat]] = set()


def warn_requantized(
    prefix: str, src: WeightFormat, dst: WeightFormat, option: str = "moe_format"
) -> bool:
    """Warn once per ``(prefix, dst)`` that requantizing NVFP4 experts to ``dst`` loses precision.

    Args:
        prefix: the layer's experts, named in the message.
        src: their checkpoint format; anything but NVFP4 gives no warning.
        dst: the format they are requantized to.
        option: the option that chooses ``dst`` (``moe_format``, ``--to``).

    Returns:
        True when this call warned.
    """
    key = (prefix, dst)
    if src is not WeightFormat.NVFP4 or key in _warned_requantized:
        return False
    _warned_requantized.add(key)
    warnings.warn(
        f"{prefix}: NVFP4 experts requantized to {dst.value} lose precision: {_LOSS[dst]} "
        "(docs/formats.md has the measured errors). megamoe's kernels do not run NVFP4; "
        f"{option} chooses the format (mxfp8 loses least; fp8_block for Hopper).",
        UserWarning,
        stacklevel=2,
    )
    return True


# What each run format loses from NVFP4, with the errors measured in docs/formats.md.
_LOSS = {
    WeightFormat.MXFP8: "E2M1 x E4M3 products get one power-of-two scale per 32 and 4 bits",
    WeightFormat.MXFP4: "the E4M3 scales per 16 become powers of two per 32, values re-round",
    WeightFormat.FP8_BLOCK: "one float32 scale per 128x128 block replaces the scales per 16",
    WeightFormat.BF16: "E2M1 x E4M3 x global products are rounded to 8 significant bits",
}
