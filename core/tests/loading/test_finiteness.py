"""Non-finite counting and the ledger that reads device counts back once per load call."""

from __future__ import annotations

import pytest
import torch

from megamoe.core.errors import InvalidScaleError, NonFiniteError
from megamoe.core.loading import finiteness
from megamoe.core.loading.finiteness import NonFiniteLedger, count_nonfinite, mx_scale_limit
from megamoe.core.numerics.formats import WeightFormat

E4M3_NAN_BYTES = (0x7F, 0xFF)


def _fp8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Finite E4M3 values of varied magnitude (448 and -448 included)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])).clamp(-448, 448)
    x[0, 0], x[0, 1] = 448.0, -448.0
    return x.to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("tensor", "ue8m0_from", "count"),
    [
        (torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]), None, 3),
        (torch.tensor([0x7E, 0xFE, 0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn),
         None, 2),  # 0x7E = 448 and 0xFE = -448 are finite; 0x7F / 0xFF are NaN
        (torch.tensor([254, 255, 0], dtype=torch.uint8), 255, 1),
        (torch.tensor([246, 247, 0, 255], dtype=torch.uint8), 247, 2),
        (torch.tensor([255, 0x77], dtype=torch.uint8), None, 0),  # packed E2M1: always finite
        (torch.tensor([1.0, float("nan")], dtype=torch.bfloat16), None, 1),
    ],
)  # fmt: skip
def test_count_nonfinite(tensor: torch.Tensor, ue8m0_from: int | None, count: int) -> None:
    assert count_nonfinite(tensor, ue8m0_from=ue8m0_from) == count


@pytest.mark.parametrize(
    ("fmt", "element_max"), [(WeightFormat.MXFP8, 448.0), (WeightFormat.MXFP4, 6.0)]
)
def test_an_mx_scale_is_non_finite_from_the_byte_that_overflows_its_block(
    fmt: WeightFormat, element_max: float
) -> None:
    """The format's largest element times 2^(byte - 127), in float32: finite below the limit,
    infinite from it on (MXFP8 247, MXFP4 253); formats without UE8M0 scales have none."""
    limit = mx_scale_limit(fmt)
    assert limit is not None
    scale = torch.tensor([limit - 1, limit], dtype=torch.int32).sub(127).float().exp2()
    decoded = torch.tensor(element_max) * scale
    assert torch.isfinite(decoded[0]) and torch.isinf(decoded[1])
    assert count_nonfinite(torch.arange(256, dtype=torch.uint8), ue8m0_from=limit) == 256 - limit
    assert mx_scale_limit(WeightFormat.FP8_BLOCK) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_float_counts(dtype: torch.dtype, bad: float) -> None:
    x = torch.randn(64, 48).to(dtype)
    assert count_nonfinite(x) == 0
    x[3, 7] = x[60, 0] = x[10, 47] = bad
    assert count_nonfinite(x) == 3


def test_finite_values_whose_sum_overflows_are_finite() -> None:
    # The float sum overflows to inf: the quick test cannot rule values out, the count can.
    x = torch.full((4, 8), 3.0e38).to(torch.bfloat16)
    assert count_nonfinite(x) == 0
    half = torch.full((4, 8), 60000.0, dtype=torch.float16)
    assert count_nonfinite(half) == 0


@pytest.mark.parametrize("nan_byte", E4M3_NAN_BYTES)
def test_e4m3_counts_both_nan_encodings(nan_byte: int) -> None:
    x = _fp8((32, 64), seed=1)
    assert count_nonfinite(x) == 0
    bits = x.view(torch.uint8).clone()
    bits[5, 9] = bits[31, 63] = nan_byte
    assert count_nonfinite(bits.view(torch.float8_e4m3fn)) == 2


def test_uint8_is_counted_only_as_ue8m0() -> None:
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert count_nonfinite(codes, ue8m0_from=255) == 1  # byte 255 only
    assert count_nonfinite(codes) == 0  # packed E2M1: always finite
    assert count_nonfinite(torch.empty(0, 8, dtype=torch.uint8), ue8m0_from=255) == 0


def test_immediate_ledger_raises_on_a_bad_cpu_tensor() -> None:
    ledger = NonFiniteLedger("layer 3")
    ledger.record("expert 0 w1 weight", torch.ones(4, 4))
    bad = torch.ones(4, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"layer 3: expert 1 w2 weight holds 1 non-finite"):
        ledger.record("expert 1 w2 weight", bad)
    ledger.check()  # nothing pending


def test_deferred_ledger_names_every_bad_tensor_at_check() -> None:
    ledger = NonFiniteLedger("layer 3", defer_cpu=True)
    bits = _fp8((8, 8), seed=2).view(torch.uint8).clone()
    bits[0, :5] = 0x7F
    scale = torch.tensor([[127, 255, 255]], dtype=torch.uint8)
    ledger.record("expert 0 w1 weight", _fp8((8, 8), seed=3))
    ledger.record("expert 4 w3 weight", bits.view(torch.float8_e4m3fn))  # recorded, not read
    ledger.record("expert 5 w2 weight_scale", scale, ue8m0_from=255)
    ledger.record_flag("expert 6 w1 weight x scale", torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NonFiniteError) as info:
        ledger.check()
    message = str(info.value)
    assert message.startswith("layer 3: expert 4 w3 weight holds 5 non-finite value(s)")
    assert "1 more tensor(s) too: 'expert 5 w2 weight_scale'" in message
    assert "expert 0" not in message and "expert 6" not in message
    ledger.check()  # the failed check forgot its counts


def test_deferred_flag_names_the_shard() -> None:
    ledger = NonFiniteLedger("layer 3", defer_cpu=True)
    ledger.record_flag("expert 2 w1 weight x scale", torch.ones(1, dtype=torch.int32))
    with pytest.raises(NonFiniteError, match=r"expert 2 w1 weight x scale holds non-finite"):
        ledger.check()


def test_immediate_flag_raises_at_once() -> None:
    ledger = NonFiniteLedger("layer 3")
    ledger.record_flag("expert 2 w1 weight x scale", torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NonFiniteError, match=r"weight x scale overflows float32"):
        ledger.record_flag("expert 2 w1 weight x scale", torch.ones(1, dtype=torch.int32))


def test_many_counts_are_joined_and_still_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finiteness, "MAX_PENDING_COUNTS", 3)
    ledger = NonFiniteLedger("layer 3", defer_cpu=True)
    for e in range(10):
        x = torch.ones(2, 3) * (e + 1)
        if e == 7:
            x[1, 1] = -float("inf")
        ledger.record(f"expert {e} w2 weight", x)
    assert len(ledger._counts) <= 4  # joined, not one tensor per record
    with pytest.raises(NonFiniteError, match=r"expert 7 w2 weight holds 1 non-finite") as info:
        ledger.check()
    assert "more tensor" not in str(info.value)


def test_clear_drops_pending_counts() -> None:
    ledger = NonFiniteLedger("layer 3", defer_cpu=True)
    ledger.record("expert 0 w1 weight", torch.tensor([float("nan")]))
    ledger.clear()
    ledger.check()


def test_a_block_scale_that_overflows_float32_at_e4m3s_largest_value_is_refused() -> None:
    """448 x scale must stay a float32: 3e38 is finite but its block decodes to infinity."""
    scale = torch.ones(2, 3)
    scale[1, 2] = finiteness.MAX_BLOCK_SCALE  # the largest that decodes finitely
    finiteness.check_block_scales(scale, "w.weight_scale_inv")
    assert torch.isfinite(torch.tensor(448.0) * scale).all()
    scale[0, 1] = 3e38
    with pytest.raises(InvalidScaleError, match=r"w\.weight_scale_inv: block \(0, 1\) has scale 3"):
        finiteness.check_block_scales(scale, "w.weight_scale_inv")
    scale[0, 1] = torch.inf  # the non-finite check's, not this one's
    finiteness.check_block_scales(scale, "w.weight_scale_inv")
