"""Triton device functions shared by the requantization kernels: decode, UE8M0, E2M1.

Each function computes exactly what its torch counterpart in ``megamoe.core.numerics.quant``
computes, on float32 bits where rounding could differ:

- the dequantized tile is ``float32(element) * float32(scale)``, one rounding, as
  ``quant._dequantize`` (UE8M0 byte 0 is the subnormal 2^-127, byte 255 is NaN, E2M1 code
  8 decodes to +0.0);
- a group's amax is the integer maximum of the float32 bits of ``|x|``: for non-negative
  floats the bit order is the value order, and NaN or inf bits sort above every finite
  value, so one reduction gives the amax and flags non-finite input;
- ``ceil_to_ue8m0`` and the reciprocal of a power of two are integer operations on the
  exponent field (exact);
- E2M1 rounding (to nearest, ties to the even code) is exact arithmetic on the float32
  bits.

A tile is ``(R, G, 32)``: R rows of one matrix, G groups of 32 logical columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

SRC_FLOAT: tl.constexpr = tl.constexpr(0)  # bf16 / float16 / float32 elements, no scale
SRC_FP8_BLOCK: tl.constexpr = tl.constexpr(1)  # E4M3 elements, float32 scale per block
SRC_MXFP8: tl.constexpr = tl.constexpr(2)  # E4M3 elements, UE8M0 scale per 1x32
SRC_MXFP4: tl.constexpr = tl.constexpr(3)  # packed E2M1 pairs, UE8M0 scale per 1x32

ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)  # float32 bits without the sign
INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)  # float32 inf; NaN bits are above it
UE8M0_ZERO_BITS: tl.constexpr = tl.constexpr(0x00400000)  # float32 2^-127: UE8M0 byte 0
NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)  # float32 quiet NaN: UE8M0 byte 255
TWO_POW_126: tl.constexpr = tl.constexpr(2.0**126)  # E2M1 bits at bit 22 -> value

# E2M1 codes of two float32 (|y| <= 6) packed in one byte, rounded to nearest with ties to
# the even code (as ``mx_codes.float32_to_e2m1``). With v = |y|, the code is
#   min(rint(2v), rint(v) + 2, rint(v/2) + 4, 7)
# where rint rounds half to even: on [0, 2] the codes 0..4 are 2v, on [2, 4] the codes
# 4..6 are v + 2, on [4, 6] the codes 6, 7 are v/2 + 4, and each term is the smallest on its
# own interval; adding an even integer keeps the parity, so each tie goes to the even
# code. 2v, v and v/2 are exact, and so is each rint: adding M = 1.5 * 2^23 (plus 2 or 4)
# in one round-to-nearest-even step (fma, or add) leaves M + rint(term) in the float, with
# the integer in the low mantissa bits (spacing 1 between 2^23 and 2^24). The minimum is
# taken on the float bits as signed integers (positive floats order like their bits).
# Adding 8 for y < -0.25 (negative with a non-zero code) gives the 4-bit code and its sign.
_E2M1_ONE = """
abs.f32 a, {y};
fma.rn.f32 t, a, 0f40000000, 0f4B400000;
add.rn.f32 m, a, 0f4B400002;
fma.rn.f32 n, a, 0f3F000000, 0f4B400004;
min.s32 t, t, m;
min.s32 t, t, n;
min.s32 t, t, 0x4B400007;
setp.lt.f32 p, {y}, 0fBE800000;
selp.b32 k, 8, 0, p;
or.b32 {out}, t, k;
"""
_E2M1_PAIR_PTX: tl.constexpr = tl.constexpr(
    "{\n.reg .pred p;\n.reg .b32 a, m, n, t, k, lo, hi;\n"
    + _E2M1_ONE.format(y="$1", out="lo")
    + _E2M1_ONE.format(y="$2", out="hi")
    + "and.b32 lo, lo, 15;\nshl.b32 hi, hi, 4;\nor.b32 $0, lo, hi;\n}"
)


@triton.jit
def ue8m0_to_f32(e: tl.tensor) -> tl.tensor:
    """UE8M0 exponent bytes (int32) to float32: 2^(e-127); byte 0 -> 2^-127, 255 -> NaN."""
    bits = tl.where(e == 0, UE8M0_ZERO_BITS, e << 23)
    bits = tl.where(e == 255, NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(code: tl.tensor) -> tl.tensor:
    """E2M1 codes 0..15 (int32, bit 3 = sign) to float32, possibly -0.0 for code 8.

    E2M1 is float32 with a 2-bit exponent: the code's magnitude bits placed at bit 22
    form a float32 (a subnormal for codes 0 and 1) that is the value times 2^-126, so one
    exact multiplication by 2^126 decodes it. Callers add +0.0 after scaling to turn code
    8 into +0.0 as ``quant.e2m1_to_float32`` does.
    """
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * TWO_POW_126


@triton.jit
def ceil_ue8m0_exponent(s: tl.tensor) -> tl.tensor:
    """``ceil_to_ue8m0`` of positive finite float32 ``s`` as its exponent byte (int32).

    Adding 2^23 - 1 to the bits carries into the exponent field exactly when a mantissa
    bit is set. The [1, 254] clamp of ``ceil_to_ue8m0`` never binds here: ``s`` is at least
    1e-4 / 448 > 2^-126 and below 2^126 for finite input (non-finite input is flagged and
    its output discarded).
    """
    return (s.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23


@triton.jit
def ue8m0_reciprocal(e: tl.tensor) -> tl.tensor:
    """float32 ``1 / 2^(e-127)`` (exact) for exponent bytes e in [1, 253]."""
    return ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def f32_pair_to_e2m1_byte(y_even: tl.tensor, y_odd: tl.tensor) -> tl.tensor:
    """Packed E2M1 byte (int32, even column in the low nibble) of two float32 tensors.

    Same codes as ``mx_codes.float32_to_e2m1`` for |y| <= 6, in PTX (see ``_E2M1_ONE``).
    """
    return tl.inline_asm_elementwise(
        _E2M1_PAIR_PTX, "=r,r,r", [y_even, y_odd], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def f32_to_e2m1(y: tl.tensor) -> tl.tensor:
    """E2M1 code (int32 0..15) of float32 ``y`` (|y| < 7) with portable integer operations.

    From 1.0 up E2M1 keeps one mantissa bit: adding half its ulp minus one float32 ulp,
    plus the kept bit, and dropping 22 bits rounds to nearest with ties to even (the kept
    bit is the code's parity), and ``(exponent, bit) - 252`` is the code; below 1.0 that
    expression is at most the code, and two comparisons (0.25 rounds down, 0.75 up) give
    0, 1 or 2. Slower than ``f32_pair_to_e2m1_byte`` but needs no PTX (runs in the Triton
    interpreter).
    """
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & ABS_MASK
    kept = (magnitude >> 22) & 1
    large = (magnitude + kept + (0x1FFFFF - (252 << 22))) >> 22
    small = (magnitude > 0x3E800000).to(tl.int32) + (magnitude >= 0x3F400000).to(tl.int32)
    code = tl.maximum(large, small)
    return code | tl.where(code != 0, (bits >> 28) & 8, 0)


@triton.jit
def load_tile_f32(
    w_ptr: tl.tensor,
    s_ptr: tl.tensor,
    row0: tl.tensor,
    group0: tl.tensor,
    n_rows: tl.tensor,
    n_cols: tl.tensor,
    s_stride: tl.tensor,
    SRC: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    BLK_M: tl.constexpr,
    BLK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
) -> tl.tensor:
    """Dequantized float32 tile (R, G, 32) of one matrix; columns past ``n_cols`` read 0.

    Args:
        w_ptr: the matrix's stored elements (row stride ``n_cols``, or ``n_cols / 2``
            bytes for MXFP4).
        s_ptr: the matrix's scales (row stride ``s_stride``); unused for SRC_FLOAT.
        row0: first row of the tile; for SRC_FP8_BLOCK the R rows lie in one block row.
        group0: first 32-column group of the tile.
        n_rows: rows of the matrix.
        n_cols: logical columns of the matrix.
        s_stride: scales per scale row (groups for MX, blocks for FP8_BLOCK).
        SRC: source encoding (``SRC_*``).
        R: rows per tile.
        G: 32-column groups per tile.
        BLK_M: FP8_BLOCK source block rows.
        BLK_K: FP8_BLOCK source block columns (a multiple of 32).
        EVEN_N: the tile lies inside the matrix's rows (no row mask).
        EVEN_K: the tile lies inside the matrix's columns (no column mask).
    """
    rows = row0 + tl.arange(0, R)
    groups = group0 + tl.arange(0, G)
    row_ok = rows[:, None, None] < n_rows
    if SRC == SRC_MXFP4:
        pair = tl.arange(0, 16)
        byte_cols = groups[None, :, None] * 16 + pair[None, None, :]
        offsets = rows[:, None, None] * (n_cols // 2) + byte_cols
        if EVEN_N and EVEN_K:
            packed = tl.load(w_ptr + offsets).to(tl.int32)
        else:
            mask = row_ok & (byte_cols < n_cols // 2)
            packed = tl.load(w_ptr + offsets, mask=mask, other=0).to(tl.int32)
        pairs = tl.join(e2m1_to_f32(packed & 15), e2m1_to_f32(packed >> 4))
        values = tl.reshape(pairs, (R, G, 32))  # possibly -0.0: fixed after scaling
    else:
        lane = tl.arange(0, 32)
        cols = groups[None, :, None] * 32 + lane[None, None, :]
        offsets = rows[:, None, None] * n_cols + cols
        if EVEN_N and EVEN_K:
            values = tl.load(w_ptr + offsets).to(tl.float32)
        else:
            mask = row_ok & (cols < n_cols)
            values = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SRC == SRC_FLOAT:
        return values
    if SRC == SRC_FP8_BLOCK:
        block_cols = groups * 32 // BLK_K
        scale_ptrs = s_ptr + (row0 // BLK_M) * s_stride + block_cols
        if EVEN_K:
            block_scale = tl.load(scale_ptrs)
        else:
            block_scale = tl.load(scale_ptrs, mask=block_cols < s_stride, other=1.0)
        return values * block_scale[None, :, None]
    scale_offsets = rows[:, None] * s_stride + groups[None, :]
    if EVEN_N and EVEN_K:
        exponent = tl.load(s_ptr + scale_offsets).to(tl.int32)
    else:
        scale_mask = (rows[:, None] < n_rows) & (groups[None, :] < s_stride)
        exponent = tl.load(s_ptr + scale_offsets, mask=scale_mask, other=127).to(tl.int32)
    if SRC == SRC_MXFP4:
        # x * s + 0.0 is x * s (one rounding) except that -0.0 becomes +0.0.
        return values * ue8m0_to_f32(exponent)[:, :, None] + 0.0
    return values * ue8m0_to_f32(exponent)[:, :, None]


@triton.jit
def abs_bits(x: tl.tensor) -> tl.tensor:
    """float32 bits of ``|x|`` as int32 (ordered like the values; non-finite >= INF_BITS)."""
    return x.to(tl.int32, bitcast=True) & ABS_MASK
