"""DenseUpdate: a block's unquantized tensors are written straight in on the first load, then
staged, checked and committed in place; ``discard_on_error`` drops one block's update."""

from __future__ import annotations

import pytest
import torch

from megamoe.core.errors import IncompleteShardsError
from megamoe.core.loading.dense_update import DenseUpdate, discard_on_error

LABEL = "x"


def _param(shape: tuple[int, ...] = (4, 8)) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)


def _value(scale: float) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).reshape(4, 8) * scale


def test_checks_name_the_tensor_and_leave_the_parameter() -> None:
    update, param = DenseUpdate(LABEL), _param()
    value = _value(0.125)
    update.load("gate.weight", param, value, shape_note="E=4, H=8")
    assert torch.equal(param.float(), value)
    with pytest.raises(ValueError, match=r"x\.gate\.weight has shape \(8, 4\), expected \(4, 8\) "):
        update.load("gate.weight", param, value.T.contiguous(), shape_note="E=4, H=8")
    for dtype in (torch.float8_e4m3fn, torch.int32, torch.float64):
        with pytest.raises(ValueError, match=r"expected bf16/fp16/fp32: megamoe loads it"):
            update.load("gate.weight", param, value.to(dtype), shape_note="")
    bad = value.clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"x\.gate\.weight holds NaN or infinity"):
        update.load("gate.weight", param, bad, shape_note="")
    with pytest.raises(ValueError, match=r"x\.down_proj holds NaN or infinity"):
        update.write("down_proj", param, torch.full((4, 8), float("inf")), shape_note="")
    meta = torch.empty((4, 8), device="meta")
    with pytest.raises(ValueError, match=r"x\.gate\.weight is a meta tensor .*load the"):
        update.load("gate.weight", param, meta, shape_note="")
    assert torch.equal(param.float(), value)  # refused tensors leave it as it was


@pytest.mark.parametrize("serving", [False, True], ids=["first load", "reload"])
def test_finite_values_that_overflow_the_parameter_dtype_are_refused(serving: bool) -> None:
    """Checked as they would be served: 3.4e38 is a finite float32 but infinity in bf16."""
    update, param = DenseUpdate(LABEL), _param()
    update.load("gate.weight", param, _value(0.125), shape_note="")
    if serving:
        update.commit()
    big = _value(0.125)
    big[1, 2] = 3.4e38
    with pytest.raises(
        ValueError,
        match=r"x\.gate\.weight holds values beyond torch\.bfloat16's range \(largest \|x\| 3\.4e",
    ):
        update.load("gate.weight", param, big, shape_note="")
    update.commit()
    assert torch.equal(param.float(), _value(0.125))


def test_first_load_writes_straight_in_then_reloads_wait_for_commit() -> None:
    update, param = DenseUpdate(LABEL), _param()
    address = param.data_ptr()
    first, second = _value(0.125), _value(-0.5)
    update.load("gate.weight", param, first, shape_note="")
    assert torch.equal(param.float(), first) and update.pending_bytes == 0  # no copy held
    update.commit()
    update.load("gate.weight", param, second, shape_note="")
    assert torch.equal(param.float(), first)  # still serving the first
    assert update.pending_bytes == param.nbytes  # one parameter's size, cast to its dtype
    update.load("gate.weight", param, second * 2, shape_note="")  # replaces the staged one
    assert update.pending_bytes == param.nbytes
    update.commit()
    assert torch.equal(param.float(), second * 2) and param.data_ptr() == address
    assert update.pending_bytes == 0


def test_a_staged_copy_does_not_alias_the_source() -> None:
    update, param = DenseUpdate(LABEL), _param()
    update.load("gate.weight", param, _value(1.0), shape_note="")
    update.commit()
    source = _value(2.0).to(torch.bfloat16)
    update.load("gate.weight", param, source, shape_note="")
    source.fill_(7.0)  # the caller reuses its buffer before finalize
    update.commit()
    assert torch.equal(param.float(), _value(2.0))


def test_discard_drops_staged_tensors_and_forgets_unserved_ones() -> None:
    update, param, bias = DenseUpdate(LABEL), _param(), _param((4,))
    update.load("gate.weight", param, _value(1.0), shape_note="")
    update.discard_pending()  # a failed first load: the tensor must come again
    with pytest.raises(ValueError, match=r"x: never loaded: gate\.weight, bias"):
        update.check_loaded(["gate.weight", "bias"])
    update.load("gate.weight", param, _value(1.0), shape_note="")
    update.load("bias", bias, torch.ones(4), shape_note="")
    update.check_loaded(["gate.weight", "bias"])
    update.commit()
    update.load("gate.weight", param, _value(3.0), shape_note="")
    update.discard_pending()
    update.commit()
    assert torch.equal(param.float(), _value(1.0)) and update.missing(["gate.weight"]) == []


class _Holder:
    def __init__(self) -> None:
        self.discarded = 0

    def discard_pending(self) -> None:
        self.discarded += 1


def test_discard_on_error_drops_every_part_unless_the_error_is_kept() -> None:
    a, b = _Holder(), _Holder()
    with discard_on_error(a, b):
        pass
    assert (a.discarded, b.discarded) == (0, 0)
    with pytest.raises(ValueError, match="bad"), discard_on_error(a, b):
        raise ValueError("bad")
    assert (a.discarded, b.discarded) == (1, 1)
    with (
        pytest.raises(IncompleteShardsError),
        discard_on_error(a, b, keep=(IncompleteShardsError,)),
    ):
        raise IncompleteShardsError(LABEL, {(0, "w1"): ("weight_scale",)})
    assert (a.discarded, b.discarded) == (1, 1)
