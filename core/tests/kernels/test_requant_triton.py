"""Triton requantization kernels vs. the torch path: bit for bit, on a CUDA device.

Every conversion the kernels run (any source to MXFP8, MXFP4 or FP8_BLOCK) is compared
with ``quant.requantize(..., use_triton=False)`` on the same device: on random data of
several magnitudes and shapes (magnitudes differ per expert and per 128x128 block), on
random bit patterns that cover every element encoding, and on edge-case tables. The
torch path is itself checked against independent oracles in ``test_quant.py``.

On CPU, ``core/kernel_tests/test_requant_interpreted.py`` runs the same cases
(``testing/requant_cases.py``) in Triton's interpreter, made to round as the GPU does, with
the integer E2M1 encoder (the interpreter runs no inline PTX); these tests run both encoders
on the GPU, the default launch configurations, the public ``quant.requantize`` path and the
``out=`` slices. E2M1 ties round to even in both encoders (PTX and integer):
``test_fp4_ties_round_to_even`` checks them against a table written by hand.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import pytest
import torch
from bitcheck import assert_bitwise_equal
from requant_cases import (
    EDGE_ROWS,
    FP4_TIE_CODES,
    PAIR_IDS,
    PAIRS,
    POISON,
    W,
    assert_matches_torch,
    edge_case_rows,
    every_bf16_value,
    every_e2m1_byte,
    every_e4m3_byte,
    fp4_tie_inputs,
    model_like,
    poisoned,
    random_bits,
)  # fmt: skip

from megamoe.core.errors import NonFiniteError
from megamoe.core.numerics import quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (experts, rows, cols): aligned, partial row tiles and blocks, K not a multiple of 128,
# K not a multiple of 32, one row.
SHAPES = [(4, 256, 512), (3, 200, 352), (2, 130, 96), (2, 64, 80), (1, 1, 64)]


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from megamoe.core.kernels import requant_triton

    return requant_triton


def _model_like(src: W, shape: tuple[int, int, int], std: float, seed: int) -> tuple[Any, ...]:
    return model_like(src, shape, std, seed, device="cuda")


def _random_bits(src: W, shape: tuple[int, int, int], seed: int) -> tuple[Any, ...]:
    return random_bits(src, shape, seed, device="cuda")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _public_triton_path(
    weight: torch.Tensor, scale: Any, src: W, dst: W, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    got = quant.requantize(weight, scale, src, dst, block, use_triton=True)
    assert got[0].is_cuda and got[1].is_cuda
    return got


_assert_same = functools.partial(assert_matches_torch, _public_triton_path)


@pytest.mark.parametrize("std", [1e-6, 3e-2, 50.0, 2e4], ids=["tiny", "typical", "large", "huge"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("src, dst", PAIRS, ids=PAIR_IDS)
def test_model_like_weights(src: W, dst: W, shape: tuple[int, int, int], std: float) -> None:
    weight, scale = _model_like(src, shape, std, seed=7)
    _assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} {shape} std={std}")


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("src, dst", PAIRS, ids=PAIR_IDS)
def test_random_bit_patterns(src: W, dst: W, seed: int) -> None:
    weight, scale = _random_bits(src, (3, 384, 640), seed)
    _assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} random bits")


@pytest.mark.parametrize(
    "block", [(64, 128), (128, 64), (32, 256), (1, 32)], ids=lambda b: f"{b[0]}x{b[1]}"
)
@pytest.mark.parametrize(
    "src, dst",
    [(W.FP8_BLOCK, W.MXFP8), (W.FP8_BLOCK, W.MXFP4), (W.BF16, W.FP8_BLOCK), (W.MXFP8, W.FP8_BLOCK)],
)
def test_other_block_sizes(src: W, dst: W, block: tuple[int, int]) -> None:
    dense, _ = _model_like(W.BF16, (2, 192, 320), 0.05, seed=3)
    if src is W.FP8_BLOCK:
        weight, scale = quant.quantize_fp8_block(dense, block)
    elif src is W.MXFP8:
        weight, scale = quant.quantize_mx(dense, src)
    else:
        weight, scale = dense, None
    _assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} block {block}", block)


@pytest.mark.parametrize("block", [(96, 128), (128, 48)], ids=["rows96", "cols48"])
def test_layouts_outside_the_kernels_use_the_torch_path(
    kernels: ModuleType, block: tuple[int, int]
) -> None:
    dense, _ = _model_like(W.BF16, (2, 192, 192), 0.05, seed=4)
    src, dst = (W.BF16, W.FP8_BLOCK) if block[0] == 96 else (W.FP8_BLOCK, W.MXFP8)
    weight, scale = (dense, None) if src is W.BF16 else quant.quantize_fp8_block(dense, block)
    with pytest.raises(ValueError, match="do not cover"):
        kernels.requantize_triton_async(weight, scale, src, dst, block)
    _assert_same(weight, scale, src, dst, f"fallback {block}", block)


@pytest.mark.parametrize(
    "config",
    [
        dict(programs_per_sm=2, num_stages=1),
        dict(programs_per_sm=4, num_stages=3),
        dict(rows=64, groups=4, num_warps=8),
        dict(rows=8, groups=16, num_warps=2, programs_per_sm=1, num_stages=2),
        dict(e2m1_ptx=False),
        dict(rows=16),
        dict(num_warps=2),
    ],
    ids=["persistent", "pipelined", "tall", "wide-pipelined", "integer-e2m1", "rows16", "w2"],
)
@pytest.mark.parametrize("src, dst", PAIRS, ids=PAIR_IDS)
def test_launch_configs_give_the_same_bits(
    kernels: ModuleType, src: W, dst: W, config: dict[str, Any]
) -> None:
    weight, scale = _model_like(src, (3, 256, 384), 0.1, seed=5)
    want_w, want_s = quant.requantize(weight, scale, src, dst, use_triton=False)
    cfg = kernels.KernelConfig(**config)
    got_w, got_s, flag = kernels.requantize_triton_async(weight, scale, src, dst, config=cfg)
    assert int(flag.item()) == 0
    assert_bitwise_equal(_bytes(got_w), _bytes(want_w), f"{config} weight")
    assert_bitwise_equal(got_s, want_s, f"{config} scale")


@pytest.mark.parametrize("src, dst", [(W.FP8_BLOCK, W.MXFP4), (W.MXFP4, W.FP8_BLOCK)])
def test_out_writes_into_slices_of_kernel_tensors(kernels: ModuleType, src: W, dst: W) -> None:
    weight, scale = _model_like(src, (4, 256, 256), 0.1, seed=6)
    want_w, want_s = quant.requantize(weight, scale, src, dst, use_triton=False)
    big_w = torch.full((6, *want_w.shape[1:]), 0x55, dtype=torch.uint8, device="cuda")
    big_s = torch.full((6, *want_s.shape[1:]), 7.0, device="cuda").to(want_s.dtype)
    big_w = big_w.view(want_w.dtype)
    out = (big_w[1:5], big_s[1:5])
    got_w, got_s, flag = kernels.requantize_triton_async(weight, scale, src, dst, out=out)
    assert int(flag.item()) == 0 and got_w.data_ptr() == big_w[1].data_ptr()
    assert got_s.data_ptr() == big_s[1].data_ptr()
    assert_bitwise_equal(_bytes(big_w[1:5]), _bytes(want_w), "out weight")
    assert_bitwise_equal(big_s[1:5], want_s, "out scale")
    assert bool((_bytes(big_w[0]) == 0x55).all()) and bool((_bytes(big_w[5]) == 0x55).all())
    with pytest.raises(ValueError, match="out weight"):
        kernels.requantize_triton_async(weight, scale, src, dst, out=(big_w[1:4], big_s[1:4]))


@pytest.mark.parametrize("dst", [W.MXFP8, W.MXFP4, W.FP8_BLOCK], ids=lambda f: f.value)
@pytest.mark.parametrize("case", list(EDGE_ROWS), ids=list(EDGE_ROWS))
def test_edge_case_rows(case: str, dst: W) -> None:
    x = edge_case_rows(case).cuda()
    _assert_same(x, None, W.BF16, dst, case, block=(1, 32))
    _assert_same(x.repeat(1, 32, 4), None, W.BF16, dst, f"{case} in 128x128 blocks")


@pytest.mark.parametrize("e2m1_ptx", [True, False], ids=["ptx", "integer"])
@pytest.mark.parametrize("src", [W.BF16, W.MXFP8, W.FP8_BLOCK], ids=lambda f: f.value)
def test_fp4_ties_round_to_even(kernels: ModuleType, src: W, e2m1_ptx: bool) -> None:
    """Sources that hold the ties exactly, at several scales: Triton == torch == the table."""
    weight, scale, exps = fp4_tie_inputs(src)
    weight, scale = weight.cuda(), None if scale is None else scale.cuda()
    block = (1, 32)
    want_w, want_s = quant.requantize(weight, scale, src, W.MXFP4, block, use_triton=False)
    cfg = kernels.KernelConfig(e2m1_ptx=e2m1_ptx)
    got_w, got_s, flag = kernels.requantize_triton_async(
        weight, scale, src, W.MXFP4, block, config=cfg
    )
    assert int(flag.item()) == 0
    assert_bitwise_equal(got_w, want_w, f"{src.value} ties: Triton vs torch")
    assert_bitwise_equal(got_s, want_s, f"{src.value} tie scales")
    codes = quant.unpack_e2m1(got_w.cpu())[:, 0, :15]
    assert codes.tolist() == [FP4_TIE_CODES] * 8
    assert got_s.cpu().flatten().tolist() == exps.tolist()


@pytest.mark.parametrize("exponent", [0, 1, 30, 117, 127, 140, 245])
def test_every_e4m3_byte(exponent: int) -> None:
    weight, scale, block_scale = (t.cuda() for t in every_e4m3_byte(exponent))
    for dst in (W.MXFP4, W.FP8_BLOCK):
        _assert_same(weight, scale, W.MXFP8, dst, f"all E4M3 bytes, scale 2^{exponent - 127}")
    for dst in (W.MXFP8, W.MXFP4):
        _assert_same(weight, block_scale, W.FP8_BLOCK, dst, f"all E4M3 bytes, block {exponent}")


@pytest.mark.parametrize("exponent", [0, 1, 2, 64, 127, 200, 250])
def test_every_e2m1_byte(exponent: int) -> None:
    packed, scale = (t.cuda() for t in every_e2m1_byte(exponent))
    for dst in (W.MXFP8, W.FP8_BLOCK):
        _assert_same(packed, scale, W.MXFP4, dst, f"all E2M1 bytes, scale 2^{exponent - 127}")


def test_every_bf16_value() -> None:
    x = every_bf16_value().cuda()
    for dst in (W.MXFP8, W.MXFP4, W.FP8_BLOCK):
        _assert_same(x, None, W.BF16, dst, f"every bf16 value -> {dst.value}")


@pytest.mark.parametrize(
    "src, role, index, bad", POISON, ids=[f"{p[0].value}-{p[1]}-{p[3]}" for p in POISON]
)
def test_non_finite_input_is_detected_and_located(
    kernels: ModuleType, src: W, role: str, index: tuple[int, int, int], bad: float
) -> None:
    weight, scale = poisoned(src, role, index, bad, device="cuda")
    dsts = [d for s, d in PAIRS if s is src]
    for dst in dsts:
        _, _, flag = kernels.requantize_triton_async(weight, scale, src, dst)
        assert int(flag.item()) == 1, f"{src.value}->{dst.value}: flag not set"
        with pytest.raises(NonFiniteError) as torch_error:
            quant.requantize(weight, scale, src, dst, name="layers.3.w13", use_triton=False)
        with pytest.raises(NonFiniteError) as triton_error:
            kernels.requantize_triton(weight, scale, src, dst, name="layers.3.w13")
        assert str(triton_error.value) == str(torch_error.value)
        with pytest.raises(NonFiniteError):
            quant.requantize(weight, scale, src, dst, use_triton=True)


def test_clean_input_leaves_the_flag_clear(kernels: ModuleType) -> None:
    for src, dst in PAIRS:
        weight, scale = _random_bits(src, (2, 128, 256), seed=11)
        _, _, flag = kernels.requantize_triton_async(weight, scale, src, dst)
        assert int(flag.item()) == 0, f"{src.value}->{dst.value}"


def test_empty_and_non_contiguous_inputs(kernels: ModuleType) -> None:
    dense, _ = _model_like(W.BF16, (2, 128, 256), 0.05, seed=12)
    got_w, got_s = kernels.requantize_triton(dense[:0], None, W.BF16, W.MXFP8)
    assert got_w.shape == (0, 128, 256) and got_s.shape == (0, 128, 8)
    strided = dense.transpose(1, 2)
    _assert_same(strided, None, W.BF16, W.MXFP4, "transposed bf16")


def test_bad_calls_are_rejected(kernels: ModuleType) -> None:
    dense, _ = _model_like(W.BF16, (1, 128, 128), 0.05, seed=13)
    with pytest.raises(ValueError, match="different formats"):
        kernels.requantize_triton_async(dense, None, W.BF16, W.BF16)
    with pytest.raises(ValueError, match="need a scale"):
        kernels.requantize_triton_async(dense.to(torch.float8_e4m3fn), None, W.MXFP8, W.MXFP4)
    with pytest.raises(ValueError, match=r"\(\.\.\., N, K\)"):
        kernels.requantize_triton_async(dense[0, 0], None, W.BF16, W.MXFP8)
