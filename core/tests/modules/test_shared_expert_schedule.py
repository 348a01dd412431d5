"""How the shared expert is ordered around the MegaMoE launch, and its one-clamp SwiGLU.

``AuxStream.schedule`` without a CUDA stream (the default, and always on the CPU) must call
the router, then the experts, then the shared expert: the shared expert's launches then
queue behind the MegaMoE kernel. ``swiglu_gate_up`` clamps a stacked ``[gate | up]`` once
with per-column bounds; it must give :func:`swiglu`'s bits for every limit, including
limits that the activation dtype cannot represent.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from bitcheck import assert_bitwise_equal

from megamoe.core.modules.gemm_sm_target import SMALL_GEMM_ROWS
from megamoe.core.modules.shared_expert import AUX_IN_GRAPHS, AuxStream
from megamoe.core.numerics.swiglu import gate_up_bounds, swiglu, swiglu_gate_up


def recorded_schedule(
    aux: AuxStream, weights: torch.Tensor, ids: torch.Tensor, tokens: int = 1
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """``aux.schedule`` of three recording parts: the call order and the two outputs.

    The shared part records itself as ``shared@<SM carve-out it ran under>``.
    """
    calls: list[str] = []

    def route() -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("route")
        return weights, ids

    def experts(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        assert w is weights and i is ids
        calls.append("experts")
        return w.reshape(1) * 1.0

    def shared() -> tuple[torch.Tensor, ...]:
        calls.append(f"shared@{torch._C._get_sm_carveout_experimental()}")
        return (weights.reshape(1) * 2.0,)

    routed, (side,) = aux.schedule(shared, route, experts, tokens=tokens)
    return calls, routed, side


def test_serial_schedule_launches_the_experts_before_the_shared_expert() -> None:
    aux = AuxStream("cpu", enabled=True)
    calls, routed, side = recorded_schedule(aux, torch.tensor([[1.0]]), torch.tensor([[1]]))
    assert calls == ["route", "experts", "shared@None"]
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
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert aux.sm_target.carveout == sms // 2
    calls, routed, side = recorded_schedule(aux, weights, ids)
    assert calls == ["route", "experts", "shared@None"]  # eager: serial, cuBLAS's own GEMMs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls, routed, side = recorded_schedule(aux, weights, ids)
    # Captured: shared first, on the aux stream, its GEMMs sized for the other half of the SMs.
    assert calls == ["shared@" + str(sms // 2), "route", "experts"]
    assert torch._C._get_sm_carveout_experimental() is None
    graph.replay()
    torch.cuda.synchronize(device)
    assert routed.item() == 1.0 and side.item() == 2.0
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        calls, _, _ = recorded_schedule(aux, weights, ids, tokens=SMALL_GEMM_ROWS + 1)
    assert calls == ["shared@None", "route", "experts"]  # larger calls: cuBLAS's own GEMMs


NOTICE = "SM carveout"  # in the line torch prints the first time the carve-out is set


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_sm_target_prints_none_of_torchs_notices() -> None:
    """torch prints a notice on the first carve-out of a process; megamoe's target does not
    (a fresh process each: the notices are once per process)."""

    def stderr_of(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stderr

    plain = "import torch; torch._C._set_sm_carveout_experimental(3)"
    assert NOTICE in stderr_of(plain)  # what the target keeps out of the process's log
    targeted = (
        "import torch\n"
        "from megamoe.core.modules.shared_expert import AuxStream\n"
        "aux = AuxStream('cuda', enabled=True)\n"
        "ones = torch.ones(8, 8, device='cuda')\n"
        "aux.sm_target.run(1, lambda: torch.mm(ones, ones))\n"
        "torch.cuda.synchronize()\n"
    )
    printed = stderr_of(targeted)
    assert NOTICE not in printed
    assert "experimental" not in printed  # preferred_blas_library's notice says so too


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
