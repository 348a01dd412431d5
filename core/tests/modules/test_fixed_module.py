"""What torch.nn.Module would do to kernel tensors: casts keep them, the rest is refused."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import one_rank_experts, synthetic_expert_tensors

E, H, INTER = 4, 256, 256
LABEL = "layers.0.experts"


def _served(fmt: WeightFormat) -> MegaMoEExperts:
    experts = one_rank_experts(
        E, H, INTER, weight_format=fmt, checkpoint_format=fmt, backend="reference", prefix=LABEL
    )
    experts.load_weights(synthetic_expert_tensors(fmt, E, H, INTER, seed=1))
    experts.finalize()
    return experts


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    return x, torch.rand(6, 2, generator=gen), torch.randint(0, E, (6, 2), generator=gen)


CASTS: dict[str, Callable[[torch.nn.Module], object]] = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "half()": lambda m: m.half(),
    "float()": lambda m: m.float(),
    "to(cpu)": lambda m: m.to("cpu"),
    "cpu()": lambda m: m.cpu(),
}


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.BF16])
@pytest.mark.parametrize("cast", list(CASTS))
def test_casts_and_same_device_moves_leave_kernel_tensors_as_they_are(
    fmt: WeightFormat, cast: str
) -> None:
    experts = _served(fmt)
    before = {name: p.detach().clone() for name, p in experts.kernel_params.items()}
    out = experts(*_inputs())
    assert CASTS[cast](experts) is experts
    for name, param in experts.kernel_params.items():
        assert_bitwise_equal(param, before[name], name)
    assert_bitwise_equal(experts(*_inputs()), out, "forward after the cast")


def test_a_move_to_another_device_is_refused_by_name() -> None:
    experts = _served(WeightFormat.FP8_BLOCK)
    with pytest.raises(ValueError, match=rf"{LABEL}: cannot move it from cpu to meta: .*device="):
        experts.to("meta")


def test_load_state_dict_is_refused_naming_load_weights() -> None:
    experts = _served(WeightFormat.FP8_BLOCK)
    with pytest.raises(NotImplementedError, match=rf"{LABEL}: load_state_dict\(\) .*load_weights"):
        experts.load_state_dict(experts.state_dict())
    assert not experts.load_state_dict({}, strict=False).unexpected_keys  # nothing of ours


@pytest.mark.parametrize(
    "copier", [copy.deepcopy, copy.copy, pickle.dumps], ids=["deepcopy", "copy", "pickle"]
)
def test_copies_and_pickles_are_refused(copier: Callable[[object], object]) -> None:
    experts = _served(WeightFormat.FP8_BLOCK)
    with pytest.raises(TypeError, match=rf"{LABEL}: cannot be copied or pickled: .*load_weights"):
        copier(experts)
