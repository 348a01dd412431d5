"""NVFP4: DeepGEMM 0.2.5's cast, the block scales of both checkpoint layouts, requantization.

The oracles are written here from the format definitions in pure Python, independent of
megamoe's torch code: E4M3 and E2M1 by enumerating their magnitudes and picking the nearest
(ties to the even code), float32 rounding of exact quotients with ``fractions``. Where
sgl-deep-gemm 0.2.5's ``deep_gemm/utils/math.py`` is on disk (``MEGAMOE_DG025``, default
``/tmp/dg025``), its ``per_token_cast_to_nvfp4`` is run as plain Python on the CPU too.
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
import sys
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.checkpoint import nvfp4
from megamoe.core.errors import InvalidScaleError, NonFiniteError
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat

W = WeightFormat
TARGETS = (W.MXFP8, W.MXFP4, W.FP8_BLOCK)
E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ------------------------------------------------------------------ independent oracles
def f32(v: float) -> float:
    """A Python float rounded to float32."""
    return float(struct.unpack("<f", struct.pack("<f", v))[0])


def f32_bits(v: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", v))[0])


def bits_f32(b: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", b))[0])


def f32_of(q: Fraction) -> float:
    """The float32 nearest the exact positive rational ``q``, ties to the even mantissa."""
    near = f32_bits(f32(float(q)))
    candidates = [bits_f32(b) for b in (near - 1, near, near + 1) if 0 <= b < 0x7F800000]
    return min(candidates, key=lambda c: (abs(Fraction(c) - q), f32_bits(c) % 2))


def _e4m3_magnitudes() -> list[float]:
    """Values of E4M3 bytes 0x00..0x7E (0x7F is NaN), increasing."""
    return [
        math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7)
        for e, m in ((code >> 3, code & 7) for code in range(0x7F))
    ]


E4M3_MAGS = _e4m3_magnitudes()


def oracle_e4m3(a: float) -> float:
    """Nearest E4M3 magnitude of ``a >= 0`` (below 464), ties to the even code."""
    best = min(range(len(E4M3_MAGS)), key=lambda c: (abs(E4M3_MAGS[c] - a), c % 2))
    return E4M3_MAGS[best]


def oracle_e2m1(y: float) -> int:
    """E2M1 code of y: nearest magnitude, ties to the even code, no negative zero."""
    code = min(range(8), key=lambda c: (abs(E2M1_MAGS[c] - abs(y)), c % 2))
    return code | (8 if y < 0 and code else 0)


def oracle_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed bytes, E4M3 scales as float32) of a 2-D float32 ``x``, element by element.

    Per 16 columns: ``scale = E4M3(f32(amax * f32(1/6)))`` (DeepGEMM's ``amax / 6.0`` on
    CUDA), codes = E2M1(f32(x * f32(1 / scale))), 0 where the scale is 0.
    """
    recip6 = f32(1 / 6)
    packed, scales = [], []
    for row in x.float().tolist():
        codes, row_scales = [], []
        for g0 in range(0, len(row), 16):
            group = row[g0 : g0 + 16]
            scale = oracle_e4m3(f32(max(abs(v) for v in group) * recip6))
            inv = f32(1.0 / scale) if scale > 0 else 0.0
            codes += [oracle_e2m1(f32(v * inv)) for v in group]
            row_scales.append(scale)
        packed.append([codes[j] | (codes[j + 1] << 4) for j in range(0, len(codes), 2)])
        scales.append(row_scales)
    return torch.tensor(packed, dtype=torch.uint8), torch.tensor(scales, dtype=torch.float32)


def oracle_dequantize(packed: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """float64 value of packed NVFP4 codes times their float32 block scales (exact)."""
    out = []
    for codes, scales in zip(packed.tolist(), block.double().tolist(), strict=True):
        row = []
        for j, byte in enumerate(codes):
            for code in (byte & 15, byte >> 4):
                value = E2M1_MAGS[code & 7] * (-1 if code & 8 else 1)
                row.append(value * scales[(2 * j) // 16])
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


# ------------------------------------------------------------------ test data
def varied(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 weights whose magnitude changes per row and per 16 columns over 1e-4 .. 1e3."""
    gen = torch.Generator().manual_seed(seed)
    gain = 10 ** torch.empty(rows, cols // 16).uniform_(-4, 3, generator=gen)
    x = torch.randn(rows, cols, generator=gen) * gain.repeat_interleave(16, -1)
    x[0, :16] = 0.0  # an all-zero group
    return x.to(torch.bfloat16)


FP4_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _edge_rows() -> dict[str, list[float]]:
    """16-value groups, each meeting one rule of the cast."""
    ties = list(FP4_TIES)
    return {
        "zeros": [0.0] * 16,
        "ties_scale_1": [6.0, *ties, *(-t for t in ties), 0.0],
        "ties_scale_2^-5": [6.0 / 32, *(t / 32 for t in ties), *(-t / 32 for t in ties), 0.0],
        "ties_scale_1.5": [9.0, *(1.5 * t for t in ties), *(-1.5 * t for t in ties), 0.0],
        "above_ties": [6.0, *(bits_f32(f32_bits(t) + 1) for t in ties)] + [0.0] * 8,
        "below_ties": [-6.0, *(-bits_f32(f32_bits(t) - 1) for t in ties)] + [0.0] * 8,
        # amax / 6 at E4M3 midpoints: 1.0625 (-> 1.0), 1.1875 (-> 1.25), 0.0029296875
        # (subnormal midpoint 1.5 x 2^-9 -> 2^-8 even).
        "scale_tie_down": [6.375, 1.0, -2.0] + [0.5] * 13,
        "scale_tie_up": [7.125, 3.0] + [-1.0] * 14,
        "scale_subnormal_tie": [6 * 0.0029296875, 1e-3] + [0.0] * 14,
        "scale_subnormal": [3e-4, -1e-4, 2e-5] + [0.0] * 13,
        "scale_rounds_to_zero": [1e-5, -5e-6] + [1e-6] * 14,
        "scale_448": [2688.0, -1000.0, 1.0] + [0.0] * 13,
        "scale_rounds_down_to_448": [2760.0, 2700.0, -2688.0] + [100.0] * 13,
        "signs": [(-1) ** i * (i + 1) / 3 for i in range(16)],
        "negative_zero": [-0.0, 0.0, -0.0, 1.0] + [-0.0] * 12,
    }


EDGE_ROWS = _edge_rows()


# ------------------------------------------------------------------ the cast
def test_quantize_nvfp4_matches_oracle_on_varied_weights() -> None:
    x = varied(24, 256, seed=1)
    packed, scale = nvfp4.quantize_nvfp4(x)
    want_packed, want_scale = oracle_nvfp4(x)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
    assert packed.shape == (24, 128) and scale.shape == (24, 16)
    assert_bitwise_equal(scale.float(), want_scale, "E4M3 scales")
    assert_bitwise_equal(packed, want_packed, "E2M1 codes")


@pytest.mark.parametrize("case", list(EDGE_ROWS), ids=list(EDGE_ROWS))
def test_quantize_nvfp4_edge_cases(case: str) -> None:
    row = torch.tensor([EDGE_ROWS[case]], dtype=torch.float32)
    x = torch.cat([row, -row, row.roll(3, -1)])
    packed, scale = nvfp4.quantize_nvfp4(x)
    want_packed, want_scale = oracle_nvfp4(x)
    assert_bitwise_equal(scale.float(), want_scale, f"{case} scales")
    assert_bitwise_equal(packed, want_packed, f"{case} codes")


def test_nvfp4_edge_expectations_by_hand() -> None:
    """A few oracle answers spelled out, so the oracle itself is checked."""
    packed, scale = nvfp4.quantize_nvfp4(torch.tensor([EDGE_ROWS["ties_scale_1"]]))
    codes = quant.unpack_e2m1(packed)[0].tolist()
    assert scale.float().item() == 1.0
    assert codes[:8] == [7, 0, 2, 2, 4, 4, 6, 6] and codes[8:15] == [0, 10, 10, 12, 12, 14, 14]
    for case, want in (("scale_tie_down", 1.0), ("scale_tie_up", 1.25), ("scale_448", 448.0)):
        _, scale = nvfp4.quantize_nvfp4(torch.tensor([EDGE_ROWS[case]]))
        assert scale.float().item() == want, case
    packed, scale = nvfp4.quantize_nvfp4(torch.tensor([EDGE_ROWS["scale_rounds_to_zero"]]))
    assert scale.float().item() == 0.0 and not bool(packed.any())
    packed, _ = nvfp4.quantize_nvfp4(torch.tensor([EDGE_ROWS["scale_rounds_down_to_448"]]))
    assert quant.unpack_e2m1(packed)[0, :3].tolist() == [7, 7, 15]  # 6.16, 6.03 saturate


def test_quantize_nvfp4_batched_and_rejections() -> None:
    x = varied(12, 64, seed=2).float().reshape(3, 4, 64)
    packed, scale = nvfp4.quantize_nvfp4(x)
    flat_packed, flat_scale = nvfp4.quantize_nvfp4(x.reshape(12, 64))
    assert_bitwise_equal(packed.reshape(12, 32), flat_packed, "batched codes")
    assert_bitwise_equal(scale.reshape(12, 4).float(), flat_scale.float(), "batched scales")
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.ones(2, 24))
    with pytest.raises(ValueError, match="amax exceeds 6 x 448"):
        nvfp4.quantize_nvfp4(torch.full((1, 16), 2784.0))
    with pytest.raises(NonFiniteError, match="x: holds NaN or inf"):
        nvfp4.quantize_nvfp4(torch.tensor([[math.nan] + [0.0] * 15]))
    with pytest.raises(TypeError, match="quantize_nvfp4 takes bf16"):
        nvfp4.quantize_nvfp4(torch.ones(1, 16, dtype=torch.float64))


DG025_MATH = Path(os.environ.get("MEGAMOE_DG025", "/tmp/dg025")) / "deep_gemm/utils/math.py"


def _dg025_math() -> Any:
    if not DG025_MATH.is_file():
        pytest.skip(f"sgl-deep-gemm 0.2.5's {DG025_MATH} is not on disk (see MEGAMOE_DG025)")
    name = "megamoe_tests_dg025_math"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DG025_MATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def test_quantize_nvfp4_matches_sgl_deep_gemm_025() -> None:
    """0.2.5's ``per_token_cast_to_nvfp4`` on the CPU, bit for bit (bf16 inputs, where its
    ``amax / 6.0`` equals the CUDA product megamoe computes)."""
    dg = _dg025_math()
    edges = torch.tensor([row for row in EDGE_ROWS.values() if max(map(abs, row)) < 2688])
    for x in ((varied(40, 512, seed=3).float() / 4).bfloat16(), edges.to(torch.bfloat16)):
        want_packed, want_sf = dg.per_token_cast_to_nvfp4(x)
        packed, scale = nvfp4.quantize_nvfp4(x)
        assert_bitwise_equal(packed, want_packed.view(torch.uint8), "per_token_cast_to_nvfp4")
        assert_bitwise_equal(scale.float(), want_sf, "per_token_cast_to_nvfp4 sf")


# ------------------------------------------------------------------ block scales
def _random_globals(count: int, seed: int) -> list[float]:
    """Positive float32 global scales over a wide range, mostly not powers of two."""
    gen = torch.Generator().manual_seed(seed)
    values = 2.0 ** torch.empty(count).uniform_(-30, 10, generator=gen)
    return [f32(v) for v in values.tolist()] + [f32(1 / 2688), 1.0, f32(3e-5)]


def test_block_scale_modelopt_is_the_float32_product() -> None:
    """Every E4M3 scale x float32 weight_scale_2: float32(e4m3 x g), one rounding."""
    e4m3 = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    for g in _random_globals(100, seed=4):
        got = nvfp4.nvfp4_block_scale(e4m3, torch.tensor(g), "modelopt")
        want = torch.tensor([f32_of(Fraction(v) * Fraction(g)) for v in E4M3_MAGS])
        assert_bitwise_equal(got, want, f"weight_scale_2={g!r}")


def test_block_scale_compressed_tensors_is_the_float32_quotient() -> None:
    """Every E4M3 scale / float32 weight_global_scale: float32(e4m3 / g), one rounding,
    although loading keeps the global scale as a (float64) multiplier."""
    e4m3 = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    for g in _random_globals(100, seed=5):
        half = nvfp4.loaded_half("weight_global_scale", torch.tensor([g]), "ct")
        assert half is not None and half[0] == "weight_scale_2" and half[1].shape == ()
        got = nvfp4.nvfp4_block_scale(e4m3, half[1], "compressed-tensors")
        want = torch.tensor([f32_of(Fraction(v) / Fraction(g)) for v in E4M3_MAGS])
        assert_bitwise_equal(got, want, f"weight_global_scale={g!r}")


def test_loaded_half_kinds() -> None:
    g = torch.tensor(0.003, dtype=torch.float32)
    kind, kept = nvfp4.loaded_half("weight_scale_2", g, "x") or ("", g)
    assert kind == "weight_scale_2" and kept.dtype == torch.float32 and kept.shape == ()
    assert nvfp4.loaded_half("input_scale", g.reshape(1), "x") is None
    assert nvfp4.loaded_half("input_global_scale", g, "x") is None
    scale = torch.ones(2, 2, dtype=torch.float8_e4m3fn)
    assert nvfp4.loaded_half("weight_scale", scale, "x") == ("weight_scale", scale)
    with pytest.raises(ValueError, match=r"layer 3 expert 1: NVFP4 weight_scale_2 has dtype"):
        nvfp4.loaded_half("weight_scale_2", torch.ones(2), "layer 3 expert 1")
    with pytest.raises(ValueError, match=r"input_scale has dtype torch\.bfloat16"):
        nvfp4.loaded_half("input_scale", torch.ones(1, dtype=torch.bfloat16), "x")


@pytest.mark.parametrize(
    "scale, g, error, match",
    [
        (1.0, 0.0, InvalidScaleError, "global scale is 0.0; it must be > 0"),
        (1.0, -2.0, InvalidScaleError, "global scale is -2.0"),
        (1.0, math.inf, NonFiniteError, "global scale is inf"),
        (-1.0, 1.0, InvalidScaleError, "weight_scale holds -1.0; E4M3 block scales must be >= 0"),
        (math.nan, 1.0, NonFiniteError, "weight_scale holds NaN"),
    ],
)
def test_block_scale_rejects_bad_scales(scale: float, g: float, error: type, match: str) -> None:
    e4m3 = torch.tensor([[0.5, scale]]).to(torch.float8_e4m3fn)
    with pytest.raises(error, match=match):
        nvfp4.nvfp4_block_scale(e4m3, torch.tensor(g), "experts.3.up_proj")
    with pytest.raises(TypeError, match=r"expected torch\.float8_e4m3fn"):
        nvfp4.nvfp4_block_scale(e4m3.float(), torch.tensor(1.0), "experts.3.up_proj")


def test_shard_scale_per_format() -> None:
    scale = torch.ones(4, 2, dtype=torch.uint8)
    assert nvfp4.shard_scale(W.BF16, {}, "x") is None
    assert nvfp4.shard_scale(W.MXFP8, {"weight_scale": scale}, "x") is scale
    e4m3 = torch.full((4, 2), 3.0).to(torch.float8_e4m3fn)
    block = nvfp4.shard_scale(
        W.NVFP4, {"weight_scale": e4m3, "weight_scale_2": torch.tensor(0.5)}, "x"
    )
    assert block is not None and block.dtype == torch.float32 and bool((block == 1.5).all())


# ------------------------------------------------------------------ dequantize / requantize
def _nvfp4_weight(
    rows: int, cols: int, seed: int, global_scale: float = 2.5e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed NVFP4 weight and its float32 block scales (E4M3 scales x a global scale)."""
    packed, e4m3 = nvfp4.quantize_nvfp4(varied(rows, cols, seed).float() / 900.0)
    return packed, nvfp4.nvfp4_block_scale(e4m3, torch.tensor(global_scale), "w")


def test_dequantize_matches_oracle() -> None:
    packed, block = _nvfp4_weight(6, 64, seed=6)
    got = quant.dequantize(packed, block, W.NVFP4)
    assert got.dtype == torch.float32 and got.shape == (6, 64)
    assert_bitwise_equal(got, oracle_dequantize(packed, block).float(), "dequantized")
    e4m3 = torch.full((6, 4), 0.75).to(torch.float8_e4m3fn)  # E4M3 scales: global scale 1
    assert_bitwise_equal(
        quant.dequantize(packed, e4m3, W.NVFP4),
        oracle_dequantize(packed, e4m3.float()).float(),
        "dequantized with E4M3 scales",
    )


@pytest.mark.parametrize("dst", TARGETS, ids=lambda f: f.value)
def test_requantize_equals_casting_the_dequantized_weights(dst: WeightFormat) -> None:
    """NVFP4 -> dst is "dequantize, then cast": batched, chunked and per expert alike."""
    pieces = [_nvfp4_weight(256, 384, seed=7 + e, global_scale=1e-3 * (e + 1)) for e in range(3)]
    packed = torch.stack([p for p, _ in pieces])
    block = torch.stack([b for _, b in pieces])
    got_w, got_s = quant.requantize(packed, block, W.NVFP4, dst)
    dense = quant.dequantize(packed, block, W.NVFP4)
    want_w, want_s = quant.requantize(dense, None, W.BF16, dst)  # float32 dense source
    assert_bitwise_equal(got_w.view(torch.uint8), want_w.view(torch.uint8), "weight")
    assert_bitwise_equal(got_s, want_s, "scale")
    chunk_w, chunk_s = quant.requantize(packed, block, W.NVFP4, dst, chunk_rows=128)
    assert_bitwise_equal(chunk_w.view(torch.uint8), got_w.view(torch.uint8), "chunked weight")
    assert_bitwise_equal(chunk_s, got_s, "chunked scale")
    one_w, one_s = quant.requantize(packed[1], block[1], W.NVFP4, dst)
    assert_bitwise_equal(one_w.view(torch.uint8), got_w[1].view(torch.uint8), "one expert")
    assert_bitwise_equal(one_s, got_s[1], "one expert scale")


# The round trip NVFP4 -> dst -> float: each value's error stays within dst's rounding of
# the value in its scale group (E4M3: half a unit of 3 mantissa bits, or the subnormal step
# 2^-10 of the scale; E2M1: a quarter of the value, or 0.25 of the scale).
ROUND_TRIP = {
    W.MXFP8: (2.0**-4, 2.0**-10),
    W.FP8_BLOCK: (2.0**-4, 2.0**-10),
    W.MXFP4: (0.25, 0.25),
}


@pytest.mark.parametrize("dst", TARGETS, ids=lambda f: f.value)
def test_round_trip_error_is_the_targets_rounding(dst: WeightFormat) -> None:
    packed, block = _nvfp4_weight(256, 512, seed=11)
    x = quant.dequantize(packed, block, W.NVFP4).double()
    weight, scale = quant.requantize(packed, block, W.NVFP4, dst)
    y = quant.dequantize(weight, scale, dst).double()
    if dst is W.FP8_BLOCK:
        unit = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        unit = quant.ue8m0_to_float32(scale).double().repeat_interleave(32, -1)
    relative, absolute = ROUND_TRIP[dst]
    bound = torch.maximum(relative * x.abs(), absolute * unit) * (1 + 2.0**-20)
    worst = float(((y - x).abs() / bound).max())
    assert worst <= 1.0, f"round-trip error {worst:.3f} x the {dst.value} rounding bound"


def test_requantize_nvfp4_validates_its_scale() -> None:
    packed, block = _nvfp4_weight(4, 64, seed=12)
    with pytest.raises(TypeError, match=r"nvfp4 scale has dtype torch\.uint8"):
        quant.requantize(packed, block.to(torch.uint8), W.NVFP4, W.MXFP8)
    with pytest.raises(ValueError, match=r"expected \(4, 4\) .* \(1x16 float32 scales\)"):
        quant.requantize(packed, block[:, :2], W.NVFP4, W.MXFP8)
    poisoned = block.clone()
    poisoned[2, 1] = math.inf
    with pytest.raises(
        NonFiniteError, match=r"scale holds a non-finite value \(inf\) at index \(2, 1\)"
    ):
        quant.requantize(packed, poisoned, W.NVFP4, W.MXFP8, name="expert 5 w1")


def test_warn_requantized_once_per_layer_and_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvfp4, "_warned_requantized", set())
    prefix = "model.layers.4.mlp.experts"
    with pytest.warns(
        UserWarning,
        match=r"layers\.4\.mlp\.experts: NVFP4 experts requantized to "
        r"mxfp8 lose precision: .* moe_format chooses the format",
    ):
        assert nvfp4.warn_requantized(prefix, W.NVFP4, W.MXFP8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not nvfp4.warn_requantized(prefix, W.NVFP4, W.MXFP8)
        assert not nvfp4.warn_requantized(prefix, W.FP8_BLOCK, W.MXFP8)  # not NVFP4: silent
    with pytest.warns(UserWarning, match="--to chooses"):
        assert nvfp4.warn_requantized(prefix, W.NVFP4, W.FP8_BLOCK, option="--to")
    with pytest.warns(UserWarning, match=r"layers\.5\.mlp"):
        assert nvfp4.warn_requantized("model.layers.5.mlp.experts", W.NVFP4, W.MXFP8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dst", TARGETS, ids=lambda f: f.value)
def test_cuda_matches_cpu(dst: WeightFormat) -> None:
    """NVFP4 sources take the torch path on CUDA too (the Triton kernels have no NVFP4 source)."""
    packed, block = _nvfp4_weight(256, 384, seed=13)
    want_w, want_s = quant.requantize(packed, block, W.NVFP4, dst)
    got_w, got_s = quant.requantize(packed.cuda(), block.cuda(), W.NVFP4, dst)
    assert_bitwise_equal(got_w.cpu().view(torch.uint8), want_w.view(torch.uint8), "weight")
    assert_bitwise_equal(got_s.cpu(), want_s, "scale")
    x = varied(32, 256, seed=14).cuda()
    got_packed, got_scale = nvfp4.quantize_nvfp4(x)
    want_packed, want_scale = nvfp4.quantize_nvfp4(x.cpu())
    assert_bitwise_equal(got_packed.cpu(), want_packed, "cast codes")
    assert_bitwise_equal(got_scale.cpu().float(), want_scale.float(), "cast scales")
