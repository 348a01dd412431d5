"""Bit-level codes of the microscaling formats: UE8M0 scale exponents and E2M1 elements.

UE8M0: one byte e, the value 2^(e - 127) (OCP MX; 255 is NaN). E2M1: 4 bits, bit 3 the
sign, bits 0..2 an index into ``E2M1_VALUES``; two codes per byte, the even column in
the low nibble. ``megamoe.core.numerics.quant`` re-exports every public name here.
"""

from __future__ import annotations

import torch
from torch import Tensor

UE8M0_BIAS = 127  # UE8M0 byte e encodes 2^(e - 127)
E2M1_MAX = 6.0  # largest E2M1 magnitude
FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between codes k and k+1
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7

UE8M0_DTYPES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
_UE8M0_ZERO_BITS = 0x00400000  # float32 bits of 2^-127 (a subnormal): UE8M0 byte 0
_UE8M0_NAN_BITS = 0x7FC00000  # float32 quiet NaN: UE8M0 byte 255


def ceil_to_ue8m0(s: Tensor) -> Tensor:
    """Round ``|s|`` up to a power of two representable as a UE8M0 scale.

    From the float32 bits of ``|s|``: the exponent field plus one if any mantissa bit is
    set, clamped to [1, 254] (never log2, which rounds values just above a power of two
    down). Zero and subnormals give 2^-126; values above 2^127, inf and NaN give 2^127.

    Args:
        s: scales of any float dtype (converted to float32 first, as DeepGEMM does).

    Returns:
        float32 powers of two, shape of ``s``.
    """
    bits = s.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def as_ue8m0_bytes(scale: Tensor, what: str = "scale") -> Tensor:
    """View a UE8M0 scale tensor as uint8 exponent bytes.

    Args:
        scale: uint8 or ``torch.float8_e8m0fnu`` tensor.
        what: the tensor's name in the error message.

    Returns:
        uint8 view of ``scale``.

    Raises:
        TypeError: another dtype.
    """
    if scale.dtype not in UE8M0_DTYPES:
        raise TypeError(
            f"{what} has dtype {scale.dtype}; UE8M0 scales are uint8 exponent bytes "
            "(or torch.float8_e8m0fnu): pass the checkpoint's weight_scale unchanged"
        )
    return scale.view(torch.uint8)


def ue8m0_to_float32(scale_ue8m0: Tensor) -> Tensor:
    """Decode UE8M0 exponent bytes to float32 (OCP MX semantics).

    Byte e in 0..254 is exactly 2^(e-127) (byte 0 is the float32 subnormal 2^-127);
    byte 255 is NaN. ``float32_to_ue8m0`` inverts this for all 256 bytes.

    Args:
        scale_ue8m0: uint8 (or float8_e8m0fnu) tensor.

    Returns:
        float32 tensor of the same shape.

    Raises:
        TypeError: another dtype.
    """
    e = as_ue8m0_bytes(scale_ue8m0, "scale_ue8m0").to(torch.int32)
    bits = torch.where(e == 0, _UE8M0_ZERO_BITS, e << 23)
    return torch.where(e == 255, _UE8M0_NAN_BITS, bits).view(torch.float32)


def float32_to_ue8m0(pow2: Tensor, *, check: bool = True) -> Tensor:
    """Encode float32 powers of two as UE8M0 exponent bytes (the float32 exponent field).

    Args:
        pow2: float32 positive powers of two 2^-127 .. 2^127, or NaN (-> byte 255).
        check: verify every element is encodable (one reduction); False trusts the caller.

    Returns:
        uint8 tensor of the same shape.

    Raises:
        TypeError: ``pow2`` is not float32.
        ValueError: with ``check``, an element UE8M0 cannot encode (zero, negative, inf,
            not a power of two); the message gives the first such value.
    """
    if pow2.dtype != torch.float32:
        raise TypeError(f"pow2 has dtype {pow2.dtype}; expected float32 powers of two")
    bits = pow2.view(torch.int32)
    if check:
        exp, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        ok = ((bits > 0) & (exp != 255) & (mantissa == 0)) | (bits == _UE8M0_ZERO_BITS)
        ok |= torch.isnan(pow2)
        if not bool(ok.all()):
            bad = pow2.flatten()[(~ok).flatten()][0].item()
            raise ValueError(
                f"pow2 holds {bad!r}, which UE8M0 cannot encode: UE8M0 scales are powers of "
                "two 2^-127..2^127; round with ceil_to_ue8m0 first"
            )
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def float32_to_e2m1(y: Tensor) -> Tensor:
    """Round float32 ``y`` (already multiplied by 1/scale) to E2M1 codes, as DeepGEMM does.

    Round to nearest, ties to even (the OCP MX rule and sgl-deep-gemm 0.2.5's
    ``per_token_cast_to_fp4``): magnitude codes 0..7 are ``E2M1_VALUES``, and a tie between
    two of them goes to the even code (the one whose mantissa bit is clear), so ``|y|`` at
    0.75, 1.75 or 3.5 rounds up and at 0.25, 1.25, 2.5 or 5.0 down. Everything above 5.0
    saturates to 6.0. The sign bit is set only when ``y < 0`` and the code is not zero (no
    negative zero).

    Args:
        y: float32 tensor (finite; NaN gives code 0).

    Returns:
        uint8 codes 0..15, shape of ``y``.
    """
    magnitude = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for upper, threshold in enumerate(FP4_THRESHOLDS, start=1):
        # The tie belongs to the even one of the two neighbouring codes.
        code += (magnitude >= threshold) if upper % 2 == 0 else (magnitude > threshold)
    return code | (((y < 0) & (code != 0)).to(torch.uint8) << 3)


def pack_e2m1(codes_u8: Tensor) -> Tensor:
    """Pack E2M1 codes two per byte, the even column in the low nibble.

    Args:
        codes_u8: uint8 codes 0..15, shape (..., K) with K even.

    Returns:
        uint8 tensor (..., K/2).

    Raises:
        TypeError: not uint8.
        ValueError: an odd last dimension or a code above 15.
    """
    if codes_u8.dtype != torch.uint8:
        raise TypeError(f"codes_u8 has dtype {codes_u8.dtype}; expected uint8 E2M1 codes")
    if codes_u8.dim() == 0 or codes_u8.shape[-1] % 2:
        raise ValueError(
            f"codes_u8 has shape {tuple(codes_u8.shape)}; packing needs an even last dimension"
        )
    if bool((codes_u8 > 15).any()):
        raise ValueError("codes_u8 holds values above 15; E2M1 codes are 4 bits")
    return codes_u8[..., 0::2] | (codes_u8[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Inverse of ``pack_e2m1``.

    Args:
        packed: uint8 tensor (..., K/2).

    Returns:
        uint8 codes (..., K).

    Raises:
        TypeError: not uint8.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint8 (two E2M1 per byte)")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_to_float32(codes: Tensor) -> Tensor:
    """Decode E2M1 codes to float32.

    Code 8 (negative zero, never produced by ``float32_to_e2m1``) decodes to +0.0, as
    DeepGEMM's ``_dequantize_from_fp4_e2m1`` does, so a requantized zero never becomes a
    float8 negative zero.

    Args:
        codes: integer tensor of codes 0..15.

    Returns:
        float32 tensor, shape of ``codes``.
    """
    table = torch.tensor((*E2M1_VALUES, 0.0, *(-v for v in E2M1_VALUES[1:])), device=codes.device)
    return table[codes.to(torch.int32)]
