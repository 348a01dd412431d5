"""How the shared expert is ordered around the MegaMoE launch, and its one-clamp SwiGLU.

``AuxStream.schedule`` without a CUDA stream (the default, and always on the CPU) must call
the router, then the experts, then the shared expert: the shared expert's launches then
queue behind the MegaMoE kernel. ``swiglu_gate_up`` clamps a stacked ``[gate | up]`` once
with per-column bounds; it must give :func:`swiglu`'s bits for every limit, including
limits that the activation dtype cannot represent.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.core.bitcheck import assert_bitwise_equal
from megamoe.core.shared_expert import AuxStream
from megamoe.core.swiglu import gate_up_bounds, swiglu, swiglu_gate_up


def test_serial_schedule_launches_the_experts_before_the_shared_expert() -> None:
    calls: list[str] = []
    ids, weights = torch.tensor([[1]]), torch.tensor([[1.0]])

    def route() -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("route")
        return weights, ids

    def experts(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        assert w is weights and i is ids
        calls.append("experts")
        return torch.ones(1)

    def shared() -> tuple[torch.Tensor, ...]:
        calls.append("shared")
        return (torch.full((1,), 2.0),)

    routed, (side,) = AuxStream("cpu", enabled=True).schedule(shared, route, experts)
    assert calls == ["route", "experts", "shared"]
    assert routed.item() == 1.0 and side.item() == 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [None, 1.5, 7.3, 10.0, 1e-3])
def test_one_clamp_swiglu_matches_two_clamps_bit_for_bit(
    dtype: torch.dtype, limit: float | None
) -> None:
    inter = 96
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(40, 2 * inter, generator=gen) * 6).to(dtype)
    scale = 1.0 if limit is None else limit
    # values at and around the limit, where a wrongly rounded bound would show
    edges = torch.tensor([scale, -scale, scale * 1.001, -scale * 1.001, scale * 0.999])
    gate_up[0, : len(edges)] = edges.to(dtype)
    gate_up[0, inter : inter + len(edges)] = edges.to(dtype)
    bounds = gate_up_bounds(limit, inter, dtype, "cpu")
    assert (bounds is None) is (limit is None)
    want = swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
    got = swiglu_gate_up(gate_up, bounds)
    assert_bitwise_equal(got, want, f"swiglu_gate_up, limit {limit}, {dtype}")
    if limit is not None:  # the clamp did act: without it the output differs
        assert not torch.equal(swiglu_gate_up(gate_up, None), want)
