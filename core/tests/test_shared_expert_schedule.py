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
from megamoe.core.shared_expert import AUX_IN_GRAPHS, AuxStream
from megamoe.core.swiglu import gate_up_bounds, swiglu, swiglu_gate_up


def recorded_schedule(
    aux: AuxStream, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """``aux.schedule`` of three recording parts: the call order and the two outputs."""
    calls: list[str] = []

    def route() -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("route")
        return weights, ids

    def experts(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        assert w is weights and i is ids
        calls.append("experts")
        return w.reshape(1) * 1.0

    def shared() -> tuple[torch.Tensor, ...]:
        calls.append("shared")
        return (weights.reshape(1) * 2.0,)

    routed, (side,) = aux.schedule(shared, route, experts)
    return calls, routed, side


def test_serial_schedule_launches_the_experts_before_the_shared_expert() -> None:
    aux = AuxStream("cpu", enabled=True)
    calls, routed, side = recorded_schedule(aux, torch.tensor([[1.0]]), torch.tensor([[1]]))
    assert calls == ["route", "experts", "shared"]
    assert routed.item() == 1.0 and side.item() == 2.0


def test_aux_stream_setting_is_checked() -> None:
    assert AuxStream("cpu", enabled=AUX_IN_GRAPHS).only_in_graphs
    with pytest.raises(ValueError, match=r"use_aux_stream='always': expected True, False or"):
        AuxStream("cpu", enabled="always")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_setting_takes_the_aux_stream_only_while_capturing() -> None:
    device = torch.device("cuda", 0)
    aux = AuxStream(device, enabled=AUX_IN_GRAPHS)
    weights, ids = torch.tensor([[1.0]], device=device), torch.tensor([[1]], device=device)
    calls, routed, side = recorded_schedule(aux, weights, ids)
    assert calls == ["route", "experts", "shared"]  # eager: serial
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls, routed, side = recorded_schedule(aux, weights, ids)
    assert calls == ["shared", "route", "experts"]  # captured: shared first, on the aux stream
    graph.replay()
    torch.cuda.synchronize(device)
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
