"""Bit-exact casts between expert weight formats (SPEC §3.2).

Every cast rounds exactly as DeepGEMM's reference casts (``per_token_cast_to_fp8`` /
``per_token_cast_to_fp4`` with ``use_ue8m0=True, gran_k=32``; ``per_block_cast_to_fp8``
with ``use_ue8m0=False``) compute them on CUDA, on every device; E2M1 rounds to nearest
with ties to even, as sgl-deep-gemm 0.2.5 and the OCP MX rule do (0.1.4.post1 rounded
ties toward zero). NVFP4 is a source format: its weights come with float32 block scales
per 16 values (``megamoe.core.checkpoint.nvfp4``). Each cast is "dequantize
a chunk to float32, then cast": the private ``_cast_mxfp8`` / ``_cast_mxfp4`` /
``_cast_fp8_block`` take float32 chunks and are the oracle a GPU kernel must match bit for
bit. Notes for such a kernel: ``1/scale`` is a correctly rounded reciprocal (exact for the
power-of-two MX scales); values are ``x * (1/scale)``, a multiplication, never a division;
a scale is ``amax * float32(1/max)`` (see ``_scale_from_amax``).
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from megamoe.core.errors import NonFiniteError
from megamoe.core.numerics.formats import BLOCK_FP8_DEFAULT, NVFP4_BLOCK, WeightFormat
from megamoe.core.numerics.mx_codes import (
    E2M1_MAX,
    E2M1_VALUES,
    FP4_THRESHOLDS,
    UE8M0_BIAS,
    as_ue8m0_bytes,
    ceil_to_ue8m0,
    e2m1_to_float32,
    float32_to_e2m1,
    float32_to_ue8m0,
    pack_e2m1,
    ue8m0_to_float32,
    unpack_e2m1,
)

__all__ = [
    "AMAX_FLOOR",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP4_THRESHOLDS",
    "MX_GROUP",
    "NVFP4_GROUP",
    "TARGET_FORMATS",
    "UE8M0_BIAS",
    "WORKSPACE_BYTES",
    "ceil_to_ue8m0",
    "dequantize",
    "e2m1_to_float32",
    "float32_to_e2m1",
    "float32_to_ue8m0",
    "is_power_of_two",
    "pack_e2m1",
    "quantize_fp8_block",
    "quantize_mx",
    "requantize",
    "ue8m0_to_float32",
    "unpack_e2m1",
    "warn_not_power_of_two",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn magnitude
AMAX_FLOOR = 1e-4  # a group's / block's amax is clamped below to this, as DeepGEMM does
MX_GROUP = 32  # columns per UE8M0 scale (1x32)
WORKSPACE_BYTES = 64 << 20  # float32 chunk that requantize dequantizes at a time (64 MiB)
TARGET_FORMATS = (WeightFormat.MXFP8, WeightFormat.MXFP4, WeightFormat.FP8_BLOCK)
NVFP4_GROUP = NVFP4_BLOCK[1]  # columns per NVFP4 block scale (16)

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
_TRITON_MODULE = "megamoe.core.kernels.requant_triton"


# torch on CUDA divides by a Python scalar as x * float32(1/scalar); so does DeepGEMM's
# reference there. Using the product on every device keeps CPU == CUDA bit for bit.
_RECIP_E4M3_MAX = 0.0022321429569274187  # float32(1/448), exactly
_RECIP_E2M1_MAX = 0.1666666716337204  # float32(1/6), exactly


# ---------------------------------------------------------------------------- casts
def _scale_from_amax(amax: Tensor, recip_max: float) -> Tensor:
    """float32 ``max(amax, AMAX_FLOOR) * float32(1/max)``: DeepGEMM's ``amax / max`` on CUDA."""
    return amax.clamp(min=AMAX_FLOOR) * recip_max


def _mx_groups(x: Tensor) -> Tensor:
    """float32 (..., K) zero-padded to a multiple of 32 columns, viewed (..., G, 32)."""
    pad = -x.shape[-1] % MX_GROUP
    return (F.pad(x, (0, pad)) if pad else x).unflatten(-1, (-1, MX_GROUP))


def _cast_mxfp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (..., K) -> (E4M3 (..., K), UE8M0 bytes (..., ceil(K/32)))."""
    groups = _mx_groups(x)
    scale = ceil_to_ue8m0(_scale_from_amax(groups.abs().amax(-1, keepdim=True), _RECIP_E4M3_MAX))
    values = (groups * (1.0 / scale)).to(torch.float8_e4m3fn)
    return values.flatten(-2)[..., : x.shape[-1]], float32_to_ue8m0(scale.squeeze(-1), check=False)


def _cast_mxfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (..., K), K even -> (packed E2M1 uint8 (..., K/2), UE8M0 bytes)."""
    groups = _mx_groups(x)
    scale = ceil_to_ue8m0(_scale_from_amax(groups.abs().amax(-1, keepdim=True), _RECIP_E2M1_MAX))
    codes = float32_to_e2m1(groups * (1.0 / scale)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even column in the low nibble
    return packed[..., : x.shape[-1] // 2], float32_to_ue8m0(scale.squeeze(-1), check=False)


def _cast_fp8_block(x: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """float32 (..., R, K) -> (E4M3 (..., R, K), float32 scale (..., ceil(R/bn), ceil(K/bk)))."""
    (bn, bk), (r, k) = block, x.shape[-2:]
    pad_r, pad_k = -r % bn, -k % bk
    padded = F.pad(x, (0, pad_k, 0, pad_r)) if pad_r or pad_k else x
    blocks = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # (..., RB, bn, KB, bk)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    scale = _scale_from_amax(amax, _RECIP_E4M3_MAX)
    values = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn).flatten(-2).flatten(-3, -2)
    return values[..., :r, :k], scale.squeeze(-1).squeeze(-2)


def _cast_to(x: Tensor, dst: WeightFormat, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Cast a float32 chunk to ``dst``."""
    if dst is WeightFormat.MXFP8:
        return _cast_mxfp8(x)
    if dst is WeightFormat.MXFP4:
        return _cast_mxfp4(x)
    return _cast_fp8_block(x, block)


# ---------------------------------------------------------------------------- validation
def _check_block(block_size: tuple[int, int]) -> tuple[int, int]:
    """Validate a (rows, columns) block size."""
    ok = len(block_size) == 2 and all(isinstance(b, int) and b > 0 for b in block_size)
    if not ok:
        raise ValueError(f"block_size={block_size!r}; expected two positive ints like (128, 128)")
    return int(block_size[0]), int(block_size[1])


def _scale_shape(shape: torch.Size, fmt: WeightFormat, block: tuple[int, int]) -> tuple[int, ...]:
    """Scale shape of a weight of stored ``shape`` in ``fmt``."""
    k = shape[-1] * fmt.values_per_byte
    if fmt is WeightFormat.FP8_BLOCK:
        return (*shape[:-2], -(-shape[-2] // block[0]), -(-k // block[1]))
    group = NVFP4_GROUP if fmt is WeightFormat.NVFP4 else MX_GROUP
    return (*shape[:-1], -(-k // group))


def _checked(
    weight: Tensor, scale: Tensor | None, fmt: WeightFormat, block: tuple[int, int], name: str
) -> Tensor | None:
    """Validate a (weight, scale) pair in ``fmt``; the scale as float32 or uint8 bytes."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(weight).__name__}")
    want = _FLOAT_INPUTS if fmt is WeightFormat.BF16 else (fmt.element_dtype,)
    if weight.dtype not in want:
        raise TypeError(
            f"{name}: weight dtype {weight.dtype} does not match format {fmt.value!r} "
            f"(stores {', '.join(map(str, want))}); pass the format the tensor is stored in"
        )
    min_dim = 2 if fmt is WeightFormat.FP8_BLOCK else 1
    if weight.dim() < min_dim or weight.shape[-1] == 0:
        raise ValueError(
            f"{name}: weight has shape {tuple(weight.shape)}; {fmt.value} needs at least "
            f"{min_dim} dimension(s) and a non-empty last (column) dimension"
        )
    if fmt is WeightFormat.BF16:
        if scale is not None:
            raise ValueError(f"{name}: bf16 weights have no scale; pass scale=None")
        return None
    if scale is None:
        raise ValueError(f"{name}: {fmt.value} needs its scale tensor ({fmt.scale_name}), got None")
    if fmt is WeightFormat.FP8_BLOCK:
        if scale.dtype not in _FLOAT_INPUTS:
            raise TypeError(f"{name}: fp8_block scale has dtype {scale.dtype}; expected float32")
        scale = scale.float()
    elif fmt is WeightFormat.NVFP4:
        if scale.dtype not in (torch.float32, torch.float8_e4m3fn):
            raise TypeError(
                f"{name}: nvfp4 scale has dtype {scale.dtype}; expected the float32 block scales "
                "of nvfp4.nvfp4_block_scale (or float8_e4m3fn scales, global scale 1)"
            )
        scale = scale.float()
    else:
        scale = as_ue8m0_bytes(scale, f"{name}: {fmt.value} scale")
    expected = _scale_shape(weight.shape, fmt, block)
    if tuple(scale.shape) != expected:
        granularity = {
            WeightFormat.FP8_BLOCK: f"{block[0]}x{block[1]} float32",
            WeightFormat.NVFP4: "1x16 float32",
        }.get(fmt, "1x32")
        raise ValueError(
            f"{name}: scale has shape {tuple(scale.shape)}, expected {expected} for a "
            f"{fmt.value} weight of shape {tuple(weight.shape)} ({granularity} scales); check "
            "the source format and block_size"
        )
    if scale.device != weight.device:
        raise ValueError(f"{name}: scale is on {scale.device}, weight on {weight.device}")
    return scale


# ---------------------------------------------------------------------------- dequantize
def _dequantize(
    values: Tensor, scale: Tensor | None, fmt: WeightFormat, block: tuple[int, int]
) -> Tensor:
    """float32 of a validated (values, scale) pair; the scale already float32 or uint8."""
    if fmt is WeightFormat.BF16 or scale is None:
        return values.float()
    if fmt is WeightFormat.FP8_BLOCK:
        (bn, bk), (r, k) = block, values.shape[-2:]
        full = scale.repeat_interleave(bn, dim=-2)[..., :r, :].repeat_interleave(bk, dim=-1)
        return values.float() * full[..., :k]
    x = values.float() if fmt is WeightFormat.MXFP8 else e2m1_to_float32(unpack_e2m1(values))
    if fmt is WeightFormat.NVFP4:
        return x * scale.repeat_interleave(NVFP4_GROUP, dim=-1)[..., : x.shape[-1]]
    return x * ue8m0_to_float32(scale).repeat_interleave(MX_GROUP, dim=-1)[..., : x.shape[-1]]


def dequantize(
    values: Tensor,
    scales: Tensor | None,
    fmt: WeightFormat | str,
    block_size: tuple[int, int] = BLOCK_FP8_DEFAULT,
    *,
    name: str = "values",
) -> Tensor:
    """Decode weights stored in ``fmt`` to float32 (non-finite values pass through).

    Args:
        values: stored elements: bf16/float (BF16), float8_e4m3fn (FP8_BLOCK, MXFP8; at
            least 2-D for FP8_BLOCK), packed uint8 (..., K/2) (MXFP4, NVFP4).
        scales: None (BF16); float32 (..., ceil(N/bn), ceil(K/bk)) (FP8_BLOCK); UE8M0
            uint8 (..., ceil(K/32)) (MX); NVFP4: float32 block scales (..., ceil(K/16)),
            the E4M3 scale times the global scale (``nvfp4.nvfp4_block_scale``), or the
            float8_e4m3fn scales themselves for a global scale of 1.
        fmt: the stored format.
        block_size: FP8_BLOCK block (rows, columns).
        name: the tensor named in errors.

    Returns:
        float32 tensor (..., K) (K = 2 x bytes for MXFP4).

    Raises:
        TypeError: a dtype that does not match ``fmt``.
        ValueError: a missing, unexpected or mis-shaped scale.
    """
    fmt, block = WeightFormat.parse(fmt), _check_block(block_size)
    return _dequantize(values, _checked(values, scales, fmt, block, name), fmt, block)


# ---------------------------------------------------------------------------- requantize
def _triton_requantize_or_none() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """``requantize_triton`` when its module (and triton) imports, else None."""
    try:
        module = importlib.import_module(_TRITON_MODULE)
    except ImportError:
        return None
    fn: Callable[..., tuple[Tensor, Tensor]] = module.requantize_triton
    return fn


def _select_triton(
    use_triton: bool | None, device: torch.device, name: str
) -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The Triton requantizer to use on ``device``, None for the torch path.

    Contract of ``requantize_triton(weight, scale, src, dst, block_size)``: it gets the
    validated pair (scale float32 for FP8_BLOCK, uint8 for MX, None for BF16), returns
    what the torch path returns bit for bit, and raises NonFiniteError as it does; ``name``
    is passed as a keyword, and ``flags`` too when the caller collects the non-finite
    flags instead (then it appends its flag there and does not read it).
    """
    if use_triton is False:
        return None
    fn = _triton_requantize_or_none() if device.type == "cuda" else None
    if use_triton and fn is None:
        if device.type != "cuda":
            raise ValueError(f"{name}: use_triton=True needs a CUDA tensor, got {device}")
        raise ImportError(
            f"use_triton=True but {_TRITON_MODULE} cannot be imported: pip install triton "
            "(or pass use_triton=None to fall back to torch)"
        )
    return fn


def _chunks(lead: int, rows: int, chunk_rows: int) -> Iterator[tuple[int, int, int, int]]:
    """(l0, l1, r0, r1) covering a (lead, rows) grid: whole matrices when they fit."""
    if lead == 0 or rows == 0:
        return
    if chunk_rows >= rows:
        per = chunk_rows // rows
        for l0 in range(0, lead, per):
            yield l0, min(lead, l0 + per), 0, rows
        return
    for lead_idx in range(lead):
        for r0 in range(0, rows, chunk_rows):
            yield lead_idx, lead_idx + 1, r0, min(rows, r0 + chunk_rows)


def _scale_rows(
    scale: Tensor, fmt: WeightFormat, block: tuple[int, int], r0: int, r1: int
) -> Tensor:
    """The scale rows (a view) that cover weight rows r0:r1 of every matrix."""
    if fmt is WeightFormat.FP8_BLOCK:
        return scale[:, r0 // block[0] : -(-r1 // block[0])]
    return scale[:, r0:r1]


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Index tuple of a flat row-major position."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _raise_at_first(
    name: str, role: str, bad: Tensor, values: Tensor, offset: tuple[int, int], full: torch.Size
) -> None:
    """Raise NonFiniteError at the first True of ``bad``, a (lead, rows, cols) chunk of ``full``."""
    if not bool(bad.any()):
        return
    local = _unravel(int(bad.flatten().nonzero()[0]), tuple(bad.shape))
    value: object = values[local].item()
    if role == "scale" and values.dtype == torch.uint8:
        value = f"UE8M0 byte {value} = NaN"
    index = (*_unravel(offset[0] + local[0], tuple(full[:-2])), offset[1] + local[1], local[2])
    raise NonFiniteError(
        f"{name}: {role} holds a non-finite value ({value}) at index {index} of shape "
        f"{tuple(full)}; requantizing it would poison the expert: fix the checkpoint tensor"
    )


def _raise_nonfinite(
    name: str,
    chunk: tuple[Tensor, Tensor | None, Tensor],
    fmt: WeightFormat,
    block: tuple[int, int],
    at: tuple[int, int],
    shapes: tuple[torch.Size, torch.Size | None, torch.Size],
) -> None:
    """Name the first bad scale, else weight, else overflowing product of a chunk."""
    weight, scale, x = chunk
    if scale is not None and shapes[1] is not None:
        bad = scale == 255 if scale.dtype == torch.uint8 else ~torch.isfinite(scale)
        scale_row = at[1] // block[0] if fmt is WeightFormat.FP8_BLOCK else at[1]
        _raise_at_first(name, "scale", bad, scale, (at[0], scale_row), shapes[1])
    if weight.dtype != torch.uint8:  # packed E2M1 is always finite
        _raise_at_first(name, "weight", ~torch.isfinite(weight.float()), weight, at, shapes[0])
    role = "dequantized weight (weight x scale overflows float32)"
    _raise_at_first(name, role, ~torch.isfinite(x), x, at, shapes[2])


def requantize(
    weight: Tensor,
    scale: Tensor | None,
    src: WeightFormat | str,
    dst: WeightFormat | str,
    block_size: tuple[int, int] = BLOCK_FP8_DEFAULT,
    chunk_rows: int | None = None,
    *,
    name: str = "weight",
    use_triton: bool | None = None,
    nonfinite_flags: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Convert weights stored in ``src`` to ``dst`` bit-exactly (SPEC §3.2).

    Dequantizes chunks of rows to float32 and casts them. Batched over the leading
    dimensions (e.g. (E, N, K) experts); runs on the tensors' device. Block-FP8 with
    power-of-two block scales requantizes to MXFP8 exactly (same dequantized values).

    Args:
        weight: stored weight (..., N, K) (K/2 bytes for MXFP4 and NVFP4) in ``src``; a
            non-contiguous one is copied once to flatten its leading dimensions.
        scale: its scale as ``dequantize`` takes it (None for BF16; NVFP4: float32 block
            scales, ``nvfp4.shard_scale``).
        src: stored format (any; NVFP4 runs the torch path on every device).
        dst: MXFP8, MXFP4 or FP8_BLOCK; ``dst == src`` validates, checks for non-finite
            values and returns ``weight`` and ``scale`` themselves (no copy).
        block_size: FP8_BLOCK block (rows, columns), for a source or target in it.
        chunk_rows: rows of the flattened (leading x N) dimension per chunk; None sizes
            chunks to ``WORKSPACE_BYTES`` of float32 (temporaries peak at a few times
            that). Rounded down to a multiple of the block rows when FP8_BLOCK is involved.
        name: tensor name used in error messages.
        use_triton: None uses the Triton kernel for CUDA tensors when it imports; False
            forces torch; True requires Triton.
        nonfinite_flags: when given, a Triton conversion appends its one-element int32
            flag here instead of reading it (no host sync): nonzero means the input held
            NaN/inf (or weight x scale overflowed) and the result is meaningless; the
            caller must check it. The torch path raises as usual and appends nothing.

    Returns:
        ``(weight, scale)`` in ``dst``: float8_e4m3fn (..., N, K) or packed uint8
        (..., N, K/2); uint8 UE8M0 (..., N, ceil(K/32)) or float32
        (..., ceil(N/bn), ceil(K/bk)).

    Raises:
        NonFiniteError: NaN/inf in the weight or scale (or their product overflows); the
            message names the tensor, its role and the index of the first bad element.
        TypeError: dtypes that do not match ``src``.
        ValueError: shapes, formats or options that do not fit (MXFP4 needs an even K).
        ImportError: ``use_triton=True`` and the Triton kernel cannot be imported.
    """
    src, dst, block = WeightFormat.parse(src), WeightFormat.parse(dst), _check_block(block_size)
    if dst not in TARGET_FORMATS:
        targets = ", ".join(f.value for f in TARGET_FORMATS)
        raise ValueError(f"{name}: cannot requantize to {dst.value}; targets are {targets}")
    checked_scale = _checked(weight, scale, src, block, name)
    if weight.dim() < 2:
        raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}; expected (..., N, K)")
    *lead, n, k = (*weight.shape[:-1], weight.shape[-1] * src.values_per_byte)
    if dst is WeightFormat.MXFP4 and k % 2:
        raise ValueError(f"{name}: mxfp4 packs column pairs, but K={k} is odd; pad K to even")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"{name}: chunk_rows={chunk_rows}; expected a positive row count")
    convert = dst is not src
    triton_fn = _select_triton(use_triton, weight.device, name) if convert else None
    if triton_fn is not None:
        if nonfinite_flags is None:
            return triton_fn(weight, checked_scale, src, dst, block, name=name)
        return triton_fn(weight, checked_scale, src, dst, block, name=name, flags=nonfinite_flags)

    unit = block[0] if WeightFormat.FP8_BLOCK in (src, dst) else 1
    rows = chunk_rows if chunk_rows is not None else max(1, WORKSPACE_BYTES // (4 * k))
    rows = max(unit, rows // unit * unit)
    count, device = math.prod(lead), weight.device
    w3 = weight.reshape(count, n, weight.shape[-1])
    s3 = None if checked_scale is None else checked_scale.reshape(count, *checked_scale.shape[-2:])
    shapes = (
        weight.shape,
        None if checked_scale is None else checked_scale.shape,
        torch.Size((*lead, n, k)),
    )
    out_shape = torch.Size((count, n, k // dst.values_per_byte) if convert else (0, 0, 1))
    out_w = torch.empty(out_shape, dtype=dst.element_dtype, device=device)
    out_s = torch.empty(_scale_shape(out_shape, dst, block), dtype=dst.scale_dtype, device=device)
    for l0, l1, r0, r1 in _chunks(count, n, rows):
        w_chunk = w3[l0:l1, r0:r1]
        s_chunk = None if s3 is None else _scale_rows(s3, src, block, r0, r1)[l0:l1]
        x = _dequantize(w_chunk, s_chunk, src, block)
        if not bool(torch.isfinite(x).all()):
            _raise_nonfinite(name, (w_chunk, s_chunk, x), src, block, (l0, r0), shapes)
        if convert:
            values, new_scale = _cast_to(x, dst, block)
            out_w[l0:l1, r0:r1] = values
            _scale_rows(out_s, dst, block, r0, r1)[l0:l1] = new_scale
    if not convert:
        return weight, cast(Tensor, scale)
    return out_w.view(*lead, *out_w.shape[1:]), out_s.view(*lead, *out_s.shape[1:])


def quantize_mx(x: Tensor, fmt: WeightFormat | str, *, name: str = "x") -> tuple[Tensor, Tensor]:
    """Cast float ``x`` to MXFP8 or MXFP4 exactly as DeepGEMM's ``per_token_cast_to_fp8/fp4``.

    Args:
        x: bf16 / float16 / float32 tensor (..., K); MXFP4 needs an even K (DeepGEMM's
            rule; pad with a zero column otherwise).
        fmt: MXFP8 or MXFP4.
        name: tensor name used in error messages.

    Returns:
        ``(values, scales)``: float8_e4m3fn (..., K) or packed uint8 (..., K/2), and
        UE8M0 uint8 (..., ceil(K/32)).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf.
        TypeError: another dtype.
        ValueError: a non-MX format, a 0-d tensor or an odd K for MXFP4.
    """
    fmt = WeightFormat.parse(fmt)
    if not fmt.is_mx:
        raise ValueError(f"{name}: quantize_mx casts to mxfp8 or mxfp4, got {fmt.value}")
    if x.dim() == 1:
        values, scale = quantize_mx(x.unsqueeze(0), fmt, name=name)
        return values.squeeze(0), scale.squeeze(0)
    return requantize(x, None, WeightFormat.BF16, fmt, name=name, use_triton=False)


def quantize_fp8_block(
    x: Tensor, block_size: tuple[int, int] = BLOCK_FP8_DEFAULT, *, name: str = "x"
) -> tuple[Tensor, Tensor]:
    """Cast float ``x`` (..., N, K) to block-FP8 as DeepGEMM's ``per_block_cast_to_fp8``.

    Scale per block = max(amax, 1e-4) * float32(1/448) (float32; DeepGEMM's ``amax / 448``
    as torch computes it on CUDA), values = E4M3(x * (1/scale)), round to nearest even.

    Args:
        x: bf16 / float16 / float32 tensor with at least 2 dimensions.
        block_size: (rows, columns) per scale.
        name: tensor name used in error messages.

    Returns:
        ``(values, scale)``: float8_e4m3fn (..., N, K), float32 (..., ceil(N/bn), ceil(K/bk)).

    Raises:
        NonFiniteError: ``x`` holds NaN or inf.
        TypeError: another dtype.
        ValueError: fewer than 2 dimensions or a bad block size.
    """
    return requantize(
        x, None, WeightFormat.BF16, WeightFormat.FP8_BLOCK, block_size, name=name, use_triton=False
    )


# ---------------------------------------------------------------------------- scale checks
def is_power_of_two(scale: Tensor) -> bool:
    """True when every element is a positive, finite power of two (vacuously for empty).

    Args:
        scale: float tensor (e.g. block-FP8 ``weight_scale_inv``).

    Raises:
        TypeError: not a floating-point tensor.
    """
    if not scale.is_floating_point():
        raise TypeError(f"scale has dtype {scale.dtype}; expected a floating-point tensor")
    mantissa, _ = torch.frexp(scale)
    return bool((mantissa == 0.5).all())


_warned_not_power_of_two: set[str] = set()


def warn_not_power_of_two(
    prefix: str,
    option_hint: str = 'moe_format="fp8_block"',
    target: WeightFormat = WeightFormat.MXFP8,
) -> bool:
    """Warn once per ``option_hint`` that rounding block scales to UE8M0 changes the weights.

    Args:
        prefix: where the scales were found (e.g. the layer prefix), named in the message.
        option_hint: the option that keeps block-FP8.
        target: the MX format the weights are requantized to, named in the message.

    Returns:
        True when this call warned, False when the warning was already given.
    """
    if option_hint in _warned_not_power_of_two:
        return False
    _warned_not_power_of_two.add(option_hint)
    warnings.warn(
        f"{prefix}: the block-FP8 scales are not powers of two, so rounding them to UE8M0 "
        f"({target.value.upper()}, 1x32) changes the weights slightly. Pass "
        f"{option_hint} to keep block-FP8 (runs on Hopper and on the reference backend).",
        UserWarning,
        stacklevel=2,
    )
    return True
