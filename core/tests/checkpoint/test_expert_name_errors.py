"""A routed-experts load that cannot be placed says which tensor, which rule and what to do:
an id beyond the model's experts, an id written with a leading zero, a sign or more digits
than an index has (thousands: int() refuses them), and a meta tensor (a shape without
data); the layer then loads the real tensors as if nothing had been sent."""

from __future__ import annotations

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

E, H, INTER = 8, 256, 256
FP8 = WeightFormat.FP8_BLOCK
FIRST = "0.gate_proj.weight"


def _experts():
    return one_rank_experts(
        E, H, INTER, weight_format=FP8, checkpoint_format=FP8, backend="reference",
        prefix="layers.0.experts",
    )  # fmt: skip


def _stream() -> list[tuple[str, torch.Tensor]]:
    return list(synthetic_expert_tensors(FP8, E, H, INTER, seed=0))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("8.gate_proj.weight", r"expert id 8 is out of range \[0, num_logical_experts=8\); "
         r"tensors name experts by their global id"),
        ("07.gate_proj.weight", r"'07\.gate_proj\.weight'; expected .*\(\{expert\}: a decimal "
         r"id in \[0, 8\), no leading zeros\)"),
        ("-1.gate_proj.weight", r"'-1\.gate_proj\.weight'; expected .*in \[0, 8\)"),
        ("1234567890.gate_proj.weight", r"'1234567890\.gate_proj\.weight'; expected .*in \[0, 8\)"),
        ("9" * 5000 + ".gate_proj.weight", r"'9{5000}\.gate_proj\.weight'; expected .*in \[0, 8\)"),
    ],
)  # fmt: skip
def test_an_expert_id_outside_the_rule_is_named(name: str, message: str) -> None:
    experts = _experts()
    weight = dict(_stream())[FIRST]
    with pytest.raises(ValueError, match=message):
        experts.load_weights([(name, weight)])


def test_a_meta_tensor_is_refused_by_name_and_the_real_load_then_works() -> None:
    experts = _experts()
    stream = _stream()
    weight = dict(stream)[FIRST]
    placeholder = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
    with pytest.raises(ValueError, match=r"expert 0 gate_proj\.weight is a meta tensor"):
        experts.load_weights([(FIRST, placeholder)])
    experts.load_weights(stream)
    experts.finalize()
    clean = _experts()
    clean.load_weights(stream)
    clean.finalize()
    for name, param in clean.kernel_params.items():
        assert_bitwise_equal(experts.kernel_params[name], param, name)
