"""Bit-exactness of the casts in megamoe.core.numerics.quant (SPEC §3.2, §6).

The oracles below are written from the format definitions in pure Python (struct, math,
float64), independent of quant's torch code: E4M3 by enumerating all codes and picking
the nearest with ties to the even code, E2M1 likewise over its 8 magnitudes (ties to the
even code, the OCP MX rule and sgl-deep-gemm 0.2.5's), UE8M0 scales as "the smallest power
of two s with amax / s <= max". Where sgl-deep-gemm 0.2.5's ``deep_gemm/utils/math.py`` is
on disk (``DG025_MATH``), its reference casts are run as plain Python on the CPU too.
"""

from __future__ import annotations

import bisect
import importlib.util
import math
import os
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe.core.errors import NonFiniteError
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat

W = WeightFormat
SOURCES = (W.BF16, W.FP8_BLOCK, W.MXFP8, W.MXFP4)
TARGETS = (W.MXFP8, W.MXFP4, W.FP8_BLOCK)
PAIRS = [pytest.param(s, d, id=f"{s.value}->{d.value}") for s in SOURCES for d in TARGETS]


# ------------------------------------------------------------------ independent oracles
def f32(v: float) -> float:
    """Round a Python float to float32 (one correctly rounded step)."""
    return float(struct.unpack("<f", struct.pack("<f", v))[0])


def f32_bits(v: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", v))[0])


def bits_f32(b: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", b))[0])


F32_AMAX_FLOOR = f32(1e-4)


def oracle_ceil_pow2(v: float) -> float:
    """Smallest power of two >= |v|, clamped to [2^-126, 2^127] (NaN -> 2^127)."""
    a = abs(v)
    if math.isnan(a) or a > 2.0**127:
        return 2.0**127
    if a <= 2.0**-126:
        return 2.0**-126
    mantissa, exp = math.frexp(a)
    return 2.0 ** (exp - 1) if mantissa == 0.5 else 2.0**exp


def _e4m3_magnitudes() -> list[float]:
    """Values of codes 0x00..0x7E (0x7F is NaN), increasing."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7))
    return out


E4M3_MAGS = _e4m3_magnitudes()
E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def oracle_e4m3(y: float) -> int:
    """E4M3 byte nearest y; ties to the even code; sign kept (so -tiny -> 0x80)."""
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a >= 464.0:  # would round past 448: never happens in these casts
        raise AssertionError(f"oracle_e4m3: {y} out of range")
    i = bisect.bisect_left(E4M3_MAGS, a)
    candidates = [c for c in (i - 1, i) if 0 <= c < len(E4M3_MAGS)]
    best = min(candidates, key=lambda c: (abs(E4M3_MAGS[c] - a), c % 2))
    return sign | best


def oracle_e2m1(y: float) -> int:
    """E2M1 code of y: nearest magnitude, ties to the even code, no negative zero."""
    a = abs(y)
    code = min(range(8), key=lambda c: (abs(E2M1_MAGS[c] - a), c % 2))
    return code | (8 if y < 0 and code else 0)


def oracle_mx_exp(amax: float, vmax: float) -> int:
    """Exponent e of the smallest power-of-two scale with max(amax, 1e-4) / 2^e <= vmax."""
    amax, e = max(amax, F32_AMAX_FLOOR), -126
    while amax > vmax * 2.0**e and e < 127:
        e += 1
    return e


def oracle_quantize_mx(x: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(values bytes, scale bytes) of x (..., K) in MXFP8 / MXFP4, element by element."""
    k = x.shape[-1]
    rows = x.float().reshape(-1, k).tolist()
    vmax = 448.0 if fmt is W.MXFP8 else 6.0
    out_values, out_scales = [], []
    for row in rows:
        codes, exps = [], []
        for g0 in range(0, k, 32):
            group = row[g0 : g0 + 32]
            e = oracle_mx_exp(max(abs(v) for v in group), vmax)
            exps.append(e + 127)
            codes += [
                oracle_e4m3(v / 2.0**e) if fmt is W.MXFP8 else oracle_e2m1(v / 2.0**e)
                for v in group
            ]
        if fmt is W.MXFP4:
            codes = [codes[j] | (codes[j + 1] << 4) for j in range(0, k, 2)]
        out_values.append(codes)
        out_scales.append(exps)
    lead = tuple(x.shape[:-1])
    values = torch.tensor(out_values, dtype=torch.uint8).reshape(*lead, -1)
    return values, torch.tensor(out_scales, dtype=torch.uint8).reshape(*lead, -1)


def oracle_fp8_block(x: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, float32 scales) of a 2-D x: scale = f32(amax * f32(1/448))."""
    rows = x.float().tolist()
    n, k = len(rows), len(rows[0])
    recip = f32(1 / 448)
    codes = [[0] * k for _ in range(n)]
    scales = []
    for r0 in range(0, n, bn):
        scale_row = []
        for c0 in range(0, k, bk):
            block = [rows[r][c0 : c0 + bk] for r in range(r0, min(n, r0 + bn))]
            amax = max(max(abs(v) for v in line) for line in block)
            s = f32(max(amax, F32_AMAX_FLOOR) * recip)
            inv = f32(1.0 / s)
            scale_row.append(s)
            for dr, line in enumerate(block):
                for dc, v in enumerate(line):
                    codes[r0 + dr][c0 + dc] = oracle_e4m3(f32(v * inv))
        scales.append(scale_row)
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales, dtype=torch.float32)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------------ test data
def varied(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random weights whose magnitude differs per leading index, per 64 rows, per 32 columns.

    Gains span 1e-6 .. 1e4 overall, so a mixed-up expert, row block or scale shows.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    *lead, n, k = shape
    block_gain = 10 ** torch.empty((*lead, -(-n // 64), -(-k // 32))).uniform_(-3, 2, generator=gen)
    block_gain = block_gain.repeat_interleave(64, -2)[..., :n, :].repeat_interleave(32, -1)
    lead_gain = 10 ** torch.empty((*lead, 1, 1)).uniform_(-3, 2, generator=gen)
    return (x * block_gain[..., :k] * lead_gain).to(dtype)


def make_weight(
    src: WeightFormat, shape: tuple[int, ...], seed: int, *, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (weight, scale) pair stored in ``src`` with logical shape (..., N, K)."""
    if src is W.BF16:
        return varied(shape, seed, torch.bfloat16), None
    if src.is_mx:
        return quant.quantize_mx(varied(shape, seed), src)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7
    *lead, n, k = shape
    scale_shape = (*lead, -(-n // 128), -(-k // 128))
    if pow2_scales:
        scale = 2.0 ** torch.randint(-12, -3, scale_shape, generator=gen).float()
    else:
        scale = 10 ** torch.empty(scale_shape).uniform_(-5, -1, generator=gen)
    return codes.view(torch.float8_e4m3fn), scale


# ------------------------------------------------------------------ UE8M0
def test_all_ue8m0_bytes_decode_and_reencode() -> None:
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = quant.ue8m0_to_float32(e)
    want = [f32_bits(math.ldexp(1.0, i - 127)) for i in range(255)] + [0x7FC00000]
    assert_bitwise_equal(
        decoded.view(torch.int32), torch.tensor(want, dtype=torch.int64).to(torch.int32), "decode"
    )
    assert_bitwise_equal(quant.float32_to_ue8m0(decoded), e, "re-encode")
    # ceil is the identity on every UE8M0 value but the two clamped ends: 0 -> 1, 255 -> 254.
    want_ceil = torch.tensor([1, *range(1, 255), 254], dtype=torch.int32).to(torch.uint8)
    assert_bitwise_equal(
        quant.float32_to_ue8m0(quant.ceil_to_ue8m0(decoded)), want_ceil, "ceil of each byte"
    )
    assert_bitwise_equal(
        quant.ue8m0_to_float32(e.view(torch.float8_e8m0fnu)), decoded, "float8_e8m0fnu input"
    )


def _ceil_cases() -> list[float]:
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 0x7F800000, (3000,), generator=gen, dtype=torch.int64).tolist()
    cases = [bits_f32(b) for b in bits]
    for e in range(-149, 128):
        p = math.ldexp(1.0, e)
        cases += [p, -p, math.nextafter(p, math.inf), math.nextafter(p, 0.0)]
    cases += [0.0, -0.0, bits_f32(1), bits_f32(0x007FFFFF), bits_f32(0x7F7FFFFF)]
    cases += [math.inf, -math.inf, math.nan, 1e-4 / 448, 1e-4 / 6, 3.0, 448.0, 449.0]
    return [f32(c) if math.isfinite(c) else c for c in cases]


def test_ceil_to_ue8m0_matches_oracle() -> None:
    cases = _ceil_cases()
    got = quant.ceil_to_ue8m0(torch.tensor(cases, dtype=torch.float32))
    want = torch.tensor([oracle_ceil_pow2(c) for c in cases], dtype=torch.float32)
    assert_bitwise_equal(got, want, "ceil_to_ue8m0")


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_ceil_to_ue8m0_property(v: float) -> None:
    got = quant.ceil_to_ue8m0(torch.tensor([v], dtype=torch.float32))
    assert_bitwise_equal(got, torch.tensor([oracle_ceil_pow2(v)]), f"ceil_to_ue8m0({v!r})")


@pytest.mark.parametrize("bad", [0.0, 3.0, -2.0, math.inf, 2.0**-128])
def test_float32_to_ue8m0_rejects_non_powers_of_two(bad: float) -> None:
    with pytest.raises(ValueError, match="UE8M0 cannot encode"):
        quant.float32_to_ue8m0(torch.tensor([1.0, bad]))


def test_scale_by_reciprocal_product_equals_division_after_ceil() -> None:
    """Why one formula serves every device (quant._scale_from_amax).

    On CUDA torch computes ``amax / 448.0`` as ``amax * float32(1/448)``, on CPU as a true
    division: the raw quotients differ, yet after the ceil to a power of two they agree for
    every float32 in a binade (and so, by scaling, for every normal amax).
    """
    amax = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)
    for vmax in (448.0, 6.0):
        recip = quant._RECIP_E4M3_MAX if vmax == 448.0 else quant._RECIP_E2M1_MAX
        assert recip == f32(1 / vmax)
        assert not torch.equal(amax / vmax, amax * recip)  # the choice matters for FP8_BLOCK
        assert_bitwise_equal(
            quant.ceil_to_ue8m0(amax * recip), quant.ceil_to_ue8m0(amax / vmax), f"/{vmax}"
        )


# ------------------------------------------------------------------ E2M1 codes
def test_e2m1_pack_unpack_all_bytes() -> None:
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = quant.unpack_e2m1(every)
    assert codes[:2].tolist() == [0, 0] and codes[2 * 0x21 : 2 * 0x21 + 2].tolist() == [1, 2]
    assert_bitwise_equal(quant.pack_e2m1(codes), every, "pack(unpack(byte))")
    decoded = quant.e2m1_to_float32(torch.arange(16))
    want = [*E2M1_MAGS, 0.0, *(-m for m in E2M1_MAGS[1:])]  # code 8 -> +0.0
    assert_bitwise_equal(decoded, torch.tensor(want), "e2m1 decode")
    with pytest.raises(ValueError, match="even last dimension"):
        quant.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="above 15"):
        quant.pack_e2m1(torch.tensor([16, 0], dtype=torch.uint8))


# ------------------------------------------------------------------ quantize_mx vs oracle
@pytest.mark.parametrize("fmt", [W.MXFP8, W.MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((6, 64), torch.float32),
        ((2, 3, 70), torch.float32),  # leading batch dims, K not a multiple of 32
        ((5, 2), torch.float32),
        ((4, 96), torch.bfloat16),
        ((3, 34), torch.float16),
        ((50,), torch.float32),
    ],
    ids=["6x64", "2x3x70", "5x2", "4x96-bf16", "3x34-f16", "1d-50"],
)
def test_quantize_mx_matches_oracle(
    fmt: WeightFormat, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    full = (1, *shape) if len(shape) == 1 else shape
    x = varied(full, seed=len(shape) * 100 + shape[-1], dtype=dtype).reshape(shape)
    values, scales = quant.quantize_mx(x, fmt)
    want_values, want_scales = oracle_quantize_mx(x, fmt)
    k_stored = shape[-1] if fmt is W.MXFP8 else shape[-1] // 2
    assert values.shape == (*shape[:-1], k_stored)
    assert values.dtype == fmt.element_dtype and scales.dtype == torch.uint8
    assert_bitwise_equal(scales, want_scales, f"{fmt.value} scales")
    assert_bitwise_equal(as_bytes(values), want_values, f"{fmt.value} values")


def _tie_row(ties: list[float]) -> list[float]:
    """One 32-group whose amax pins the FP4 scale to 1 (6.0), then the ties."""
    return ([6.0, *ties] + [0.0] * 32)[:32]


T = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
EDGE_CASES: dict[str, list[float]] = {
    "zero_group": [0.0] * 32,
    "fp4_ties_positive": _tie_row(list(T)),
    "fp4_ties_negative": _tie_row([-t for t in T]),
    "fp4_just_above_ties": _tie_row([bits_f32(f32_bits(t) + 1) for t in T]),
    "fp4_just_below_ties": _tie_row([-bits_f32(f32_bits(t) - 1) for t in T]),
    "saturation_448": [448.0, -448.0, 447.0, 1.0] + [0.5] * 28,
    "just_above_448": [f32(math.nextafter(448.0, 1e9)), 1.0] + [0.0] * 30,
    "saturation_6": [6.0, -6.0, 5.0, 5.5, -5.0001] + [0.0] * 27,
    "signs": [(-1) ** i * (i + 1) / 7 for i in range(32)],
    "negative_zero": [-0.0, 0.0, -0.0, 1.0] + [-0.0] * 28,
    "subnormal_inputs": [bits_f32(1), -bits_f32(0x00012345), bits_f32(0x007FFFFF)] + [0.0] * 29,
    "subnormal_beside_large": [1e-40, -1e-42, 3.0, -2.0] + [1e-39] * 28,
    "at_amax_floor": [F32_AMAX_FLOOR, -F32_AMAX_FLOOR / 3] + [0.0] * 30,
    "below_amax_floor": [f32(0.99e-4), -f32(0.5e-4)] + [2e-5] * 30,
    "above_amax_floor": [f32(1.01e-4), -f32(0.7e-4)] + [3e-5] * 30,
    "power_of_two_amax": [448.0 / 8, 1.0, -3.0] + [0.125] * 29,
    "pow2_amax_plus_ulp": [f32(math.nextafter(56.0, 1e9)), 1.0] + [0.0] * 30,
    "e4m3_ties_to_even": [448.0, 1.0625, 1.1875, -1.3125, 2**-10, 3 * 2**-10, 5 * 2**-10]
    + [0.0] * 25,
    "huge": [3.0e38, -1.0e38, 1.0] + [2.0e37] * 29,
    "partial_group_k40": [1.0] * 32 + [1e-3, -2e-3, 0.0, 5e-4, 1e-5, 0.0, 0.0, 7e-4],
}


@pytest.mark.parametrize("fmt", [W.MXFP8, W.MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_quantize_mx_edge_cases(case: str, fmt: WeightFormat) -> None:
    x = torch.tensor([EDGE_CASES[case]], dtype=torch.float32)
    values, scales = quant.quantize_mx(x, fmt)
    want_values, want_scales = oracle_quantize_mx(x, fmt)
    assert_bitwise_equal(scales, want_scales, f"{case} scales")
    assert_bitwise_equal(as_bytes(values), want_values, f"{case} values")


def test_edge_case_expectations_by_hand() -> None:
    """A few oracle answers spelled out, so the oracle itself is checked."""
    _, s8 = quant.quantize_mx(torch.zeros(1, 32), W.MXFP8)
    _, s4 = quant.quantize_mx(torch.zeros(1, 32), W.MXFP4)
    assert s8.item() == 127 - 22 and s4.item() == 127 - 15  # 1e-4/448 -> 2^-22, 1e-4/6 -> 2^-15
    packed, s = quant.quantize_mx(torch.tensor([_tie_row([-t for t in T])]), W.MXFP4)
    codes = quant.unpack_e2m1(packed)[0, :8].tolist()
    assert s.item() == 127 and codes == [7, 0, 10, 10, 12, 12, 14, 14]  # -0.25 -> +0
    v, s = quant.quantize_mx(torch.tensor([EDGE_CASES["e4m3_ties_to_even"]]), W.MXFP8)
    assert s.item() == 127 and v[0, :7].float().tolist() == [448, 1.0, 1.25, -1.25, 0, 2**-8, 2**-8]
    v, _ = quant.quantize_mx(torch.tensor([EDGE_CASES["negative_zero"]]), W.MXFP8)
    assert as_bytes(v)[0, :3].tolist() == [0x80, 0x00, 0x80]


# Each tie t between E2M1 magnitudes, the code it rounds to (the even one) and the codes
# just below and just above it. Written out by hand from the rule, not from any code.
FP4_TIES = {
    0.25: (0, 0, 1),
    0.75: (2, 1, 2),
    1.25: (2, 2, 3),
    1.75: (4, 3, 4),
    2.5: (4, 4, 5),
    3.5: (6, 5, 6),
    5.0: (6, 6, 7),
}


@pytest.mark.parametrize("exponent", [-14, -9, -1, 0, 1, 7, 60, 124])  # 1e-4 floors amax
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_fp4_ties_round_to_even_at_every_scale(exponent: int, sign: float) -> None:
    """Every tie, its float32 neighbours, both signs, in groups whose scale is 2^exponent."""
    scale = math.ldexp(1.0, exponent)
    ties = list(FP4_TIES)
    row = [6.0 * scale]  # the amax: pins the group's scale to 2^exponent
    for t in ties:  # the tie, then its float32 neighbours below and above
        below, above = bits_f32(f32_bits(t) - 1), bits_f32(f32_bits(t) + 1)
        row += [sign * t * scale, sign * below * scale, sign * above * scale]
    x = torch.tensor([row + [0.0] * (32 - len(row))], dtype=torch.float64).float()
    packed, scales = quant.quantize_mx(x, W.MXFP4)
    assert scales.item() == exponent + 127
    codes = quant.unpack_e2m1(packed)[0].tolist()
    negative = 8 if sign < 0 else 0
    for j, t in enumerate(ties):
        at, below, above = (c | negative if c else 0 for c in FP4_TIES[t])
        got = codes[1 + 3 * j : 4 + 3 * j]
        assert got == [at, below, above], f"tie {sign * t} x 2^{exponent}: codes {got}"
    want, _ = oracle_quantize_mx(x, W.MXFP4)
    assert_bitwise_equal(packed, want, f"ties x 2^{exponent} vs oracle")


def test_fp4_ties_from_every_source_format() -> None:
    """Sources that dequantize exactly onto the ties requantize them to even, too."""
    ties = torch.tensor(list(FP4_TIES))
    row = torch.cat([torch.tensor([6.0]), ties, -ties, torch.zeros(17)]).reshape(1, 32)
    want = [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14]
    fp8 = (row * 8.0).to(torch.float8_e4m3fn)  # 0.25 .. 6 times 8 are all E4M3 values
    sources = {
        W.BF16: (row.to(torch.bfloat16), None),
        W.MXFP8: (fp8, torch.full((1, 1), 127 - 3, dtype=torch.uint8)),
        W.FP8_BLOCK: (fp8, torch.full((1, 1), 0.125)),
    }
    for src, (weight, scale) in sources.items():
        packed, scales = quant.requantize(weight, scale, src, W.MXFP4)
        got = quant.unpack_e2m1(packed)[0, :15].tolist()
        assert scales.item() == 127 and got == want, f"{src.value}: {got}"


# ------------------------------------------------------------------ sgl-deep-gemm 0.2.5
# The wheel's pure-Python reference casts (no CUDA extension needed): `pip download
# sgl-deep-gemm==0.2.5 --no-deps -d /tmp/dg025` and unzip the wheel there.
DG025_MATH = Path(os.environ.get("MEGAMOE_DG025", "/tmp/dg025")) / "deep_gemm/utils/math.py"


def dg025_math() -> Any:
    """sgl-deep-gemm 0.2.5's ``deep_gemm/utils/math.py``, loaded on its own."""
    if not DG025_MATH.is_file():
        pytest.skip(f"sgl-deep-gemm 0.2.5's {DG025_MATH} is not on disk (see DG025_MATH)")
    name = "megamoe_tests_dg025_math"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DG025_MATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def test_fp4_cast_matches_sgl_deep_gemm_025() -> None:
    """``per_token_cast_to_fp4(use_ue8m0=True, gran_k=32)`` of 0.2.5 on the CPU, bit for bit.

    bf16 inputs: there the CPU's ``amax / 6.0`` and the CUDA reciprocal product megamoe
    computes give the same scales (``test_scale_by_reciprocal_product_equals_division``).
    """
    dg = dg025_math()
    ties = [t * 2.0**e for t in FP4_TIES for e in (-3, 0, 5)]
    tie_rows = torch.tensor([[6.0, *ties[:31]], [-6.0, *(-t for t in ties[:31])]])
    for x in (varied((96, 448), seed=31, dtype=torch.bfloat16), tie_rows.to(torch.bfloat16)):
        want_packed, want_sf = dg.per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32)
        packed, scales = quant.quantize_mx(x, W.MXFP4)
        assert_bitwise_equal(packed, want_packed.view(torch.uint8), "per_token_cast_to_fp4")
        assert_bitwise_equal(quant.ue8m0_to_float32(scales), want_sf, "per_token_cast_to_fp4 sf")


# ------------------------------------------------------------------ block FP8 vs oracle
@pytest.mark.parametrize("block", [(128, 128), (32, 64)], ids=["128x128", "32x64"])
def test_quantize_fp8_block_matches_oracle(block: tuple[int, int]) -> None:
    x = varied((2, 150, 136), seed=11)
    values, scale = quant.quantize_fp8_block(x, block)
    assert scale.shape == (2, -(-150 // block[0]), -(-136 // block[1]))
    for e in range(2):
        want_values, want_scale = oracle_fp8_block(x[e], *block)
        assert_bitwise_equal(scale[e], want_scale, f"expert {e} block scales")
        assert_bitwise_equal(as_bytes(values[e]), want_values, f"expert {e} values")


# ------------------------------------------------------------------ requantize
SHAPE = (3, 192, 176)  # experts x rows x cols: partial 128-blocks, K not a multiple of 32


def _decoded_scale_per_element(
    scale: torch.Tensor, fmt: WeightFormat, n: int, k: int
) -> torch.Tensor:
    """Each element's scale as float64, decoded independently of quant."""
    if fmt is W.FP8_BLOCK:
        full = scale.double().repeat_interleave(128, -2).repeat_interleave(128, -1)
        return full[..., :n, :k]
    return (2.0 ** (scale.double() - 127)).repeat_interleave(32, -1)[..., :k]


@pytest.mark.parametrize("src, dst", PAIRS)
def test_requantize_pairs(src: WeightFormat, dst: WeightFormat, monkeypatch: Any) -> None:
    weight, scale = make_weight(src, SHAPE, seed=3)
    out_w, out_s = quant.requantize(weight, scale, src, dst)
    e, n, k = SHAPE
    assert out_w.dtype == dst.element_dtype and out_s.dtype == dst.scale_dtype
    assert out_w.shape == (e, n, k // dst.values_per_byte)
    assert out_s.shape == ((e, 2, 2) if dst is W.FP8_BLOCK else (e, n, 6))
    if src is dst:
        assert out_w is weight and out_s is scale
        return

    # Round trip: x = source values, y = requantized values, bound per element.
    x = quant.dequantize(weight, scale, src).double()
    y = quant.dequantize(out_w, out_s, dst).double()
    s = _decoded_scale_per_element(out_s, dst, n, k)
    err = (y - x).abs()
    if dst is W.MXFP4:
        bound = torch.maximum(0.25 * s, x.abs() / 4)
    elif dst is W.MXFP8:
        bound = 2.0**-4 * x.abs() + 2.0**-10 * s
    else:
        bound = 0.0626 * x.abs() + 2.0**-10 * s
    worst = int((err - bound).flatten().argmax())
    assert bool((err <= bound).all()), f"error {err.flatten()[worst]} > {bound.flatten()[worst]}"
    if dst.is_mx:  # the scale is tight: amax/max <= s < 2 * max(amax, floor)/max
        vmax = 448.0 if dst is W.MXFP8 else 6.0
        pad = -k % 32
        amax = torch.nn.functional.pad(x.abs(), (0, pad)).unflatten(-1, (-1, 32)).amax(-1)
        sg = 2.0 ** (out_s.double() - 127)
        assert bool((amax / sg <= vmax * (1 + 2**-20)).all())
        assert bool((sg < 2 * amax.clamp(min=1e-4) / vmax).all())

    # Chunking (explicit rows, a tiny default budget) and batching change nothing.
    runs = {
        "chunk_rows=5": quant.requantize(weight, scale, src, dst, chunk_rows=5),
        "chunk_rows=2N+3": quant.requantize(weight, scale, src, dst, chunk_rows=2 * n + 3),
    }
    monkeypatch.setattr(quant, "WORKSPACE_BYTES", 4 * k * 3)
    runs["tiny budget"] = quant.requantize(weight, scale, src, dst)
    for label, (w2, s2) in runs.items():
        assert_bitwise_equal(as_bytes(w2), as_bytes(out_w), f"{label} weight")
        assert_bitwise_equal(s2, out_s, f"{label} scale")
    for i in range(e):
        w1, s1 = quant.requantize(weight[i], None if scale is None else scale[i], src, dst)
        assert_bitwise_equal(as_bytes(w1), as_bytes(out_w[i]), f"expert {i} alone: weight")
        assert_bitwise_equal(s1, out_s[i], f"expert {i} alone: scale")


@pytest.mark.parametrize("shape", [(0, 64, 64), (2, 0, 64)], ids=["no-experts", "no-rows"])
@pytest.mark.parametrize("dst", TARGETS, ids=lambda f: f.value)
def test_requantize_empty(shape: tuple[int, ...], dst: WeightFormat) -> None:
    w, s = quant.requantize(torch.ones(shape), None, W.BF16, dst)
    assert w.shape == (*shape[:2], 64 // dst.values_per_byte)
    assert s.shape == (
        (shape[0], -(-shape[1] // 128), 1) if dst is W.FP8_BLOCK else (*shape[:2], 2)
    )


def test_requantize_bf16_equals_quantize_mx_and_fp8_block() -> None:
    x = varied(SHAPE, seed=5, dtype=torch.bfloat16)
    for fmt in (W.MXFP8, W.MXFP4):
        got, want = quant.requantize(x, None, W.BF16, fmt), quant.quantize_mx(x, fmt)
        assert_bitwise_equal(as_bytes(got[0]), as_bytes(want[0]), f"{fmt.value} values")
    got, want = quant.requantize(x, None, W.BF16, W.FP8_BLOCK), quant.quantize_fp8_block(x)
    assert_bitwise_equal(got[1], want[1], "fp8_block scales")


def test_power_of_two_block_fp8_requantizes_to_mxfp8_exactly() -> None:
    weight, scale = make_weight(W.FP8_BLOCK, SHAPE, seed=9, pow2_scales=True)
    assert scale is not None and quant.is_power_of_two(scale)
    out_w, out_s = quant.requantize(weight, scale, W.FP8_BLOCK, W.MXFP8)
    assert_bitwise_equal(
        quant.dequantize(out_w, out_s, W.MXFP8),
        quant.dequantize(weight, scale, W.FP8_BLOCK),
        "dequantized mxfp8 vs block fp8",
    )
    # With +-448 in every 1x32 group, even the bytes stay and the scale is the block's.
    codes = as_bytes(weight).clone()
    codes[..., ::32] = 0x7E | (codes[..., ::32] & 0x80)
    weight448 = codes.view(torch.float8_e4m3fn)
    out_w, out_s = quant.requantize(weight448, scale, W.FP8_BLOCK, W.MXFP8)
    assert_bitwise_equal(as_bytes(out_w), codes, "values keep their bytes")
    exps = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)
    want = exps.repeat_interleave(128, -2)[:, : SHAPE[1]].repeat_interleave(4, -1)[..., :6]
    assert_bitwise_equal(out_s, want, "mx scale = block scale exponent")


def test_mxfp4_to_mxfp8_is_lossless() -> None:
    weight, scale = make_weight(W.MXFP4, SHAPE, seed=13)
    out_w, out_s = quant.requantize(weight, scale, W.MXFP4, W.MXFP8)
    assert_bitwise_equal(
        quant.dequantize(out_w, out_s, W.MXFP8),
        quant.dequantize(weight, scale, W.MXFP4),
        "mxfp4 -> mxfp8 values",
    )


def test_dequantize_matches_independent_decode() -> None:
    weight, scale = make_weight(W.FP8_BLOCK, (2, 130, 140), seed=17)
    assert scale is not None
    got = quant.dequantize(weight, scale, W.FP8_BLOCK)
    want = weight.float() * _decoded_scale_per_element(scale, W.FP8_BLOCK, 130, 140).float()
    assert_bitwise_equal(got, want, "fp8_block dequantize")
    for fmt in (W.MXFP8, W.MXFP4):
        w, s = quant.quantize_mx(varied((2, 5, 40), seed=19), fmt)
        if fmt is W.MXFP8:
            elems = w.float()
        else:
            b = as_bytes(w).to(torch.int64)
            nib = torch.stack((b & 15, b >> 4), -1).flatten(-2)
            table = torch.tensor([*E2M1_MAGS, 0.0, *(-m for m in E2M1_MAGS[1:])])
            elems = table[nib]
        want = elems * _decoded_scale_per_element(s, fmt, 5, 40).float()
        assert_bitwise_equal(quant.dequantize(w, s, fmt), want, f"{fmt.value} dequantize")


# ------------------------------------------------------------------ non-finite input
def _poison(src: WeightFormat, role: str, index: tuple[int, int, int]) -> tuple[Any, ...]:
    weight, scale = make_weight(src, SHAPE, seed=21)
    if role == "weight" and src is W.BF16:
        weight[index] = math.inf
    elif role == "weight":
        codes = as_bytes(weight)
        codes[index] = 0x7F  # E4M3 NaN
    elif src is W.FP8_BLOCK:
        assert scale is not None
        scale[index] = math.nan
    else:
        assert scale is not None
        scale[index] = 255  # UE8M0 NaN
    return weight, scale


@pytest.mark.parametrize(
    "src, role, index, shown",
    [
        (W.BF16, "weight", (2, 131, 7), "inf"),
        (W.FP8_BLOCK, "weight", (1, 5, 170), "nan"),
        (W.MXFP8, "weight", (2, 191, 0), "nan"),
        (W.FP8_BLOCK, "scale", (2, 1, 0), "nan"),
        (W.MXFP8, "scale", (1, 64, 5), "byte 255"),
        (W.MXFP4, "scale", (0, 100, 3), "byte 255"),
    ],
    ids=["bf16-weight", "fp8-weight", "mxfp8-weight", "fp8-scale", "mxfp8-scale", "mxfp4-scale"],
)
@pytest.mark.parametrize("chunk_rows", [None, 1], ids=["whole", "chunked"])
def test_non_finite_input_raises_with_location(
    src: WeightFormat, role: str, index: tuple[int, int, int], shown: str, chunk_rows: int | None
) -> None:
    weight, scale = _poison(src, role, index)
    for dst in TARGETS:
        with pytest.raises(NonFiniteError) as info:
            quant.requantize(weight, scale, src, dst, chunk_rows=chunk_rows, name="layers.3.w13")
        msg = str(info.value)
        assert msg.startswith("layers.3.w13: ") and f"{role} holds" in msg, msg
        assert str(index) in msg and shown in msg, msg


def test_overflowing_scale_and_quantize_nan() -> None:
    weight, scale = make_weight(W.FP8_BLOCK, SHAPE, seed=23)
    assert scale is not None
    scale[0, 1, 1] = 3e38
    with pytest.raises(NonFiniteError, match="overflows float32"):
        quant.requantize(weight, scale, W.FP8_BLOCK, W.MXFP8)
    x = torch.ones(4, 64)
    x[3, 40] = math.nan
    for fn in (lambda: quant.quantize_mx(x, "mxfp4"), lambda: quant.quantize_fp8_block(x)):
        with pytest.raises(NonFiniteError, match=r"x: weight holds a non-finite value \(nan\)"):
            fn()


# ------------------------------------------------------------------ validation
def _fp8(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float8_e4m3fn)


BAD_CALLS: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "fp8_block scale shape": (
        lambda: quant.requantize(_fp8((2, 256, 256)), torch.ones(2, 2, 3), "fp8_block", "mxfp8"),
        ValueError,
        "scale has shape (2, 2, 3), expected (2, 2, 2)",
    ),
    "mx scale shape": (
        lambda: quant.requantize(
            _fp8((4, 64)), torch.zeros(4, 3, dtype=torch.uint8), "mxfp8", "mxfp4"
        ),
        ValueError,
        "expected (4, 2) for a mxfp8 weight of shape (4, 64) (1x32 scales)",
    ),
    "weight dtype": (
        lambda: quant.requantize(torch.ones(4, 64), torch.ones(1, 1), "fp8_block", "mxfp8"),
        TypeError,
        "weight dtype torch.float32 does not match format 'fp8_block'",
    ),
    "mx scale dtype": (
        lambda: quant.requantize(_fp8((4, 64)), torch.ones(4, 2), "mxfp8", "mxfp4"),
        TypeError,
        "UE8M0 scales are uint8",
    ),
    "bf16 with scale": (
        lambda: quant.requantize(torch.ones(4, 64), torch.ones(1), "bf16", "mxfp8"),
        ValueError,
        "pass scale=None",
    ),
    "missing scale": (
        lambda: quant.requantize(_fp8((4, 64)), None, "fp8_block", "mxfp8"),
        ValueError,
        "needs its scale tensor (weight_scale_inv)",
    ),
    "bf16 target": (
        lambda: quant.requantize(torch.ones(4, 64), None, "bf16", "bf16"),
        ValueError,
        "cannot requantize to bf16",
    ),
    "odd K to mxfp4": (
        lambda: quant.requantize(torch.ones(4, 33), None, "bf16", "mxfp4"),
        ValueError,
        "K=33 is odd",
    ),
    "1-d weight": (
        lambda: quant.requantize(torch.ones(64), None, "bf16", "mxfp8"),
        ValueError,
        "expected (..., N, K)",
    ),
    "block size": (
        lambda: quant.requantize(torch.ones(4, 64), None, "bf16", "fp8_block", (0, 128)),
        ValueError,
        "block_size=(0, 128)",
    ),
    "chunk rows": (
        lambda: quant.requantize(torch.ones(4, 64), None, "bf16", "mxfp8", chunk_rows=0),
        ValueError,
        "chunk_rows=0",
    ),
    "triton on cpu": (
        lambda: quant.requantize(torch.ones(4, 64), None, "bf16", "mxfp8", use_triton=True),
        ValueError,
        "use_triton=True needs a CUDA tensor",
    ),
    "quantize_mx format": (
        lambda: quant.quantize_mx(torch.ones(4, 64), "fp8_block"),
        ValueError,
        "casts to mxfp8 or mxfp4",
    ),
    "quantize_mx float64": (
        lambda: quant.quantize_mx(torch.ones(4, 64, dtype=torch.float64), "mxfp8"),
        TypeError,
        "torch.float64 does not match",
    ),
    "dequantize scale shape": (
        lambda: quant.dequantize(_fp8((4, 64)), torch.zeros(4, 1, dtype=torch.uint8), "mxfp8"),
        ValueError,
        "expected (4, 2)",
    ),
    "unknown format": (
        lambda: quant.requantize(torch.ones(4, 64), None, "bf16", "fp6"),
        ValueError,
        "unknown weight format 'fp6'",
    ),
    "nvfp4 target": (
        lambda: quant.requantize(torch.ones(4, 64), None, "bf16", "nvfp4"),
        ValueError,
        "cannot requantize to nvfp4; targets are mxfp8, mxfp4, fp8_block",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_input_errors(case: str) -> None:
    call, error, fragment = BAD_CALLS[case]
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value), str(info.value)


# ------------------------------------------------------------------ triton hook
def test_triton_dispatch(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, quant._TRITON_MODULE, None)  # import raises ImportError
    assert quant._triton_requantize_or_none() is None
    cuda = torch.device("cuda")
    with pytest.raises(ImportError, match="pip install triton"):
        quant._select_triton(True, cuda, "w")
    assert quant._select_triton(None, cuda, "w") is None

    def fake(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("the Triton path must not run for CPU tensors")

    monkeypatch.setattr(quant, "_triton_requantize_or_none", lambda: fake)
    assert quant._select_triton(None, cuda, "w") is fake
    assert quant._select_triton(False, cuda, "w") is None
    assert quant._select_triton(None, torch.device("cpu"), "w") is None
    quant.requantize(torch.ones(4, 64), None, "bf16", "mxfp8")  # torch path, fake not called


# ------------------------------------------------------------------ power-of-two scales
@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 0.5, 2.0**-20, 2.0**100], True),
        ([2.0**-140], True),  # a subnormal power of two
        ([1.0, 3.0], False),
        ([1.0, -2.0], False),
        ([0.0], False),
        ([math.inf], False),
        ([math.nan], False),
        ([1.0, 1.0 + 2.0**-23], False),
        ([], True),
    ],
    ids=["pow2", "subnormal", "three", "negative", "zero", "inf", "nan", "ulp-above", "empty"],
)
def test_is_power_of_two(values: list[float], expected: bool) -> None:
    assert quant.is_power_of_two(torch.tensor(values, dtype=torch.float32)) is expected


def test_warn_not_power_of_two_once(monkeypatch: Any) -> None:
    monkeypatch.setattr(quant, "_warned_not_power_of_two", set())
    with pytest.warns(UserWarning) as record:
        assert quant.warn_not_power_of_two("model.layers.3.mlp.experts") is True
    msg = str(record[0].message)
    assert "model.layers.3.mlp.experts" in msg and "not powers of two" in msg
    assert "changes the weights" in msg and 'moe_format="fp8_block"' in msg
    assert "(MXFP8, 1x32)" in msg
    with pytest.warns(UserWarning, match=r"\(MXFP4, 1x32\).* Pass --to fp8_block"):
        quant.warn_not_power_of_two("layer", "--to fp8_block", WeightFormat.MXFP4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quant.warn_not_power_of_two("model.layers.4.mlp.experts") is False


# ------------------------------------------------------------------ GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_triton", [False, None], ids=["torch-cuda", "auto"])
@pytest.mark.parametrize("src, dst", PAIRS)
def test_cuda_matches_cpu(src: WeightFormat, dst: WeightFormat, use_triton: bool | None) -> None:
    weight, scale = make_weight(src, (4, 320, 448), seed=29)
    cpu_w, cpu_s = quant.requantize(weight, scale, src, dst)
    gpu_w, gpu_s = quant.requantize(
        weight.cuda(), None if scale is None else scale.cuda(), src, dst, use_triton=use_triton
    )
    assert gpu_w.is_cuda and gpu_s.is_cuda
    assert_bitwise_equal(as_bytes(gpu_w), as_bytes(cpu_w), "cuda vs cpu weight")
    assert_bitwise_equal(gpu_s, cpu_s, "cuda vs cpu scale")


def _installed_fp4_ties_to_even(fn: Callable[..., Any]) -> bool:
    """Whether the installed ``per_token_cast_to_fp4`` rounds E2M1 ties to even (0.2.5 on).

    sgl-deep-gemm 0.1.4.post1 rounds every tie toward zero; it is told apart by 0.75.
    """
    probe = torch.tensor([[6.0, 0.75] + [0.0] * 30], device="cuda")
    packed, _ = fn(probe, use_ue8m0=True, gran_k=32)
    code = int(packed.view(torch.uint8)[0, 0].item()) >> 4
    if code not in (1, 2):
        raise AssertionError(f"per_token_cast_to_fp4 rounds 0.75 to code {code}; expected 1 or 2")
    return code == 2


@pytest.mark.gpu
@needs_cuda
def test_matches_deep_gemm_reference_casts() -> None:
    """The installed DeepGEMM's casts; 0.1.4.post1's FP4 ties differ, and only there."""
    dg = pytest.importorskip("deep_gemm.utils.math", reason="DeepGEMM is not installed")
    ties = torch.tensor([[6.0, *FP4_TIES, *(-t for t in FP4_TIES)] + [0.0] * 17])
    x = torch.cat([varied((96, 448), seed=31), ties.repeat(1, 14) * 4.0]).cuda()
    for fn_name, fmt in (("per_token_cast_to_fp8", W.MXFP8), ("per_token_cast_to_fp4", W.MXFP4)):
        fn = getattr(dg, fn_name, None)
        if fn is None:
            pytest.skip(f"deep_gemm.utils.math has no {fn_name}")
        dg_values, dg_scale = fn(x, use_ue8m0=True, gran_k=32)
        values, scales = quant.quantize_mx(x, fmt)
        assert_bitwise_equal(quant.ue8m0_to_float32(scales), dg_scale.float(), f"{fn_name} sf")
        got, want = as_bytes(values), as_bytes(dg_values.contiguous())
        if fmt is W.MXFP4 and not _installed_fp4_ties_to_even(fn):
            # Toward zero (0.1.4.post1): equal away from ties; at 0.75, 1.75, 3.5 one code up.
            codes, dg_codes = quant.unpack_e2m1(got), quant.unpack_e2m1(want)
            y = (x / quant.ue8m0_to_float32(scales).repeat_interleave(32, -1)).abs()
            up_ties = (y == 0.75) | (y == 1.75) | (y == 3.5)
            assert bool(up_ties.any())
            assert_bitwise_equal(codes[~up_ties], dg_codes[~up_ties], f"{fn_name} off the ties")
            assert bool(((codes[up_ties] & 7) == (dg_codes[up_ties] & 7) + 1).all())
            continue
        assert_bitwise_equal(got, want, fn_name)
    block_fn = getattr(dg, "per_block_cast_to_fp8", None)
    if block_fn is None:
        pytest.skip("deep_gemm.utils.math has no per_block_cast_to_fp8")
    dg_values, dg_scale = block_fn(x, use_ue8m0=False)
    values, scale = quant.quantize_fp8_block(x)
    assert_bitwise_equal(as_bytes(values), as_bytes(dg_values), "per_block_cast_to_fp8")
    assert_bitwise_equal(scale, dg_scale, "per_block_cast_to_fp8 scale")
