"""The Triton requantization kernels on CPU, bit for bit against the torch path.

The kernels of ``megamoe.core.kernels.requant_triton`` in Triton's interpreter, rounding as
the GPU does (``conftest.py``), against ``quant.requantize(..., use_triton=False)``: every
conversion the kernels run, on model-like weights of tiny and huge magnitudes, on random
bit patterns, on the tables of edge cases (``testing/requant_cases.py``, which the GPU tests
run too), every E4M3, E2M1 and bf16 value, a persistent grid, and non-finite inputs. MXFP4
is encoded by the kernels' integer path (the interpreter runs no inline PTX; the GPU tests
run both encoders). Without the conftest's rounding, the FP8 targets' bits differ here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import requant_cases as cases
import torch

from megamoe.core.errors import NonFiniteError
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import WeightFormat as W

# Triton 3.6's interpreter reads one-element arrays with int() (numpy < 2.4 only warns).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)
SHAPE = (3, 200, 352)  # partial row tiles and 128-column blocks


@pytest.fixture(scope="module")
def kernels(gpu_like_interpreter: ModuleType) -> ModuleType:
    from megamoe.core.kernels import requant_triton

    assert not requant_triton.KernelConfig().e2m1_ptx, "the interpreter's default encoder"
    return requant_triton


def launched(kernels: ModuleType, **config: Any) -> cases.Requantize:
    """The kernels' launch (``config`` over the default launch shape), its flag checked."""

    def requantize(*call: Any) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = call[2], call[3]
        cfg = kernels.KernelConfig(**{**vars(kernels.default_config(src, dst)), **config})
        got_w, got_s, flag = kernels.requantize_triton_async(*call, config=cfg)
        assert int(flag) == 0, f"{src.value}->{dst.value}: non-finite flag set"
        return got_w, got_s

    return requantize


@pytest.fixture(scope="module")
def assert_same(kernels: ModuleType) -> Callable[..., None]:
    """``assert_matches_torch`` of the kernels' default launch."""
    return functools.partial(cases.assert_matches_torch, launched(kernels))


@pytest.mark.parametrize("std", [1e-6, 2e4], ids=["tiny", "huge"])
@pytest.mark.parametrize("src, dst", cases.PAIRS, ids=cases.PAIR_IDS)
def test_model_like_weights(assert_same: Callable[..., None], src: W, dst: W, std: float) -> None:
    weight, scale = cases.model_like(src, SHAPE, std, seed=7, device="cpu")
    assert_same(weight, scale, src, dst, f"{src.value}->{dst.value} std={std}")


@pytest.mark.parametrize("src, dst", cases.PAIRS, ids=cases.PAIR_IDS)
def test_random_bit_patterns_on_a_persistent_grid(
    kernels: ModuleType, assert_same: Callable[..., None], src: W, dst: W
) -> None:
    """Random encodings, once with a program per tile, once with two programs looping."""
    weight, scale = cases.random_bits(src, (2, 256, 320), seed=1, device="cpu")
    what = f"{src.value}->{dst.value} random bits"
    assert_same(weight, scale, src, dst, what)
    persistent = launched(kernels, programs_per_sm=2)
    cases.assert_matches_torch(persistent, weight, scale, src, dst, f"{what}, persistent")


@pytest.mark.parametrize("dst", [W.MXFP8, W.MXFP4, W.FP8_BLOCK], ids=lambda f: f.value)
def test_edge_case_rows(assert_same: Callable[..., None], dst: W) -> None:
    for case in cases.EDGE_ROWS:
        x = cases.edge_case_rows(case)
        assert_same(x, None, W.BF16, dst, case, block=(1, 32))
        assert_same(x.repeat(1, 32, 4), None, W.BF16, dst, f"{case} in 128x128 blocks")


@pytest.mark.parametrize("src", [W.BF16, W.MXFP8, W.FP8_BLOCK], ids=lambda f: f.value)
def test_fp4_ties_round_to_even(
    kernels: ModuleType, assert_same: Callable[..., None], src: W
) -> None:
    """Sources that hold the ties exactly, at several scales: Triton == torch == the table."""
    weight, scale, exps = cases.fp4_tie_inputs(src)
    assert_same(weight, scale, src, W.MXFP4, f"{src.value} ties", block=(1, 32))
    got_w, got_s, _ = kernels.requantize_triton_async(weight, scale, src, W.MXFP4, (1, 32))
    assert quant.unpack_e2m1(got_w)[:, 0, :15].tolist() == [cases.FP4_TIE_CODES] * 8
    assert got_s.flatten().tolist() == exps.tolist()


@pytest.mark.parametrize("exponent", [1, 127, 245])
def test_every_e4m3_and_e2m1_byte(assert_same: Callable[..., None], exponent: int) -> None:
    weight, scale, block_scale = cases.every_e4m3_byte(exponent)
    for dst in (W.MXFP4, W.FP8_BLOCK):
        assert_same(weight, scale, W.MXFP8, dst, f"E4M3 bytes, 2^{exponent - 127}")
    for dst in (W.MXFP8, W.MXFP4):
        assert_same(weight, block_scale, W.FP8_BLOCK, dst, f"E4M3 bytes, {exponent}")
    packed, scale = cases.every_e2m1_byte(exponent)
    for dst in (W.MXFP8, W.FP8_BLOCK):
        assert_same(packed, scale, W.MXFP4, dst, f"E2M1 bytes, 2^{exponent - 127}")


def test_every_bf16_value(kernels: ModuleType, assert_same: Callable[..., None]) -> None:
    x = cases.every_bf16_value()
    for dst in (W.MXFP8, W.MXFP4, W.FP8_BLOCK):
        assert_same(x, None, W.BF16, dst, f"every bf16 value -> {dst.value}")


# numpy warns where the kernels compute with the NaN or inf (the GPU computes silently)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "src, role, index, bad", cases.POISON, ids=[f"{p[0].value}-{p[1]}-{p[3]}" for p in cases.POISON]
)
def test_non_finite_input_is_flagged_and_located(
    kernels: ModuleType, src: W, role: str, index: tuple[int, int, int], bad: float
) -> None:
    """The kernel's flag is set, and the synchronous call names the first bad element as
    the torch path does."""
    weight, scale = cases.poisoned(src, role, index, bad, device="cpu")
    for dst in [d for s, d in cases.PAIRS if s is src]:
        _, _, flag = kernels.requantize_triton_async(weight, scale, src, dst)
        assert int(flag) == 1, f"{src.value}->{dst.value}: flag not set"
        with pytest.raises(NonFiniteError) as torch_error:
            quant.requantize(weight, scale, src, dst, name="layers.3.w13", use_triton=False)
        with pytest.raises(NonFiniteError) as triton_error:
            kernels.requantize_triton(weight, scale, src, dst, name="layers.3.w13")
        assert str(triton_error.value) == str(torch_error.value)
