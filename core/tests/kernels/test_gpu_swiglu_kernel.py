"""The shared expert's one-launch SwiGLU (``megamoe.core.kernels.swiglu_triton``) on CUDA.

The oracle is the torch expression it replaces, ``swiglu_gate_up`` with the bf16 bounds of
``gate_up_bounds``: the same bits for every finite input, clamps whose limit bf16 cannot
hold included; NaN where torch gives NaN (its payload is not part of the rule). Also:
shapes (rows that leave a partial column block, no rows, leading dimensions), refused
inputs, the MLP taking it on CUDA, CUDA-graph replay, ``torch.compile(fullgraph=True)``
and no host sync.
"""

from __future__ import annotations

import pytest
import torch
from bitcheck import assert_bitwise_equal
from gpu_marks import COMPILED_GPU_MARKS
from graph_check import replayed_output
from sync_check import assert_no_host_sync

from megamoe.core.modules.shared_expert import SwiGLUMLP
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.numerics.swiglu import gate_up_bounds, swiglu_gate_up

pytestmark = COMPILED_GPU_MARKS

LIMITS = [None, 7.0, 7.3, 1e-3]  # 7.3 and 1e-3 are not bf16 numbers


@pytest.fixture(scope="module")
def kernel():
    from megamoe.core.kernels import swiglu_triton

    return swiglu_triton


def _gate_up(rows: int, intermediate: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * intermediate, generator=gen) * 6).bfloat16().cuda()


def _torch(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    bounds = gate_up_bounds(limit, gate_up.shape[-1] // 2, torch.bfloat16, gate_up.device)
    return swiglu_gate_up(gate_up, bounds)


def _fused(kernel, gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    return kernel.swiglu_rows(gate_up, None if limit is None else kernel.bf16_limit(limit))


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize(("rows", "intermediate"), [(1, 1536), (17, 2048), (300, 100), (0, 64)])
def test_bits_equal_the_torch_expression(kernel, limit, rows: int, intermediate: int) -> None:
    gate_up = _gate_up(rows, intermediate, seed=rows + intermediate)
    want = _torch(gate_up, limit)
    assert_bitwise_equal(_fused(kernel, gate_up, limit), want, f"limit {limit}, {rows} rows")


def test_leading_dimensions_and_strided_inputs(kernel) -> None:
    gate_up = _gate_up(24, 256, seed=3)
    want = _torch(gate_up, 7.0)
    got = _fused(kernel, gate_up.view(2, 12, 512), 7.0)
    assert_bitwise_equal(got, want.view(2, 12, 256), "(2, 12, 2I)")
    wide = torch.cat([gate_up, gate_up], dim=1)[:, :512]  # rows 1024 apart: not contiguous
    assert_bitwise_equal(_fused(kernel, wide, 7.0), want, "strided rows")


@pytest.mark.parametrize("limit", [None, 7.0])
def test_non_finite_inputs_give_torchs_values(kernel, limit) -> None:
    gate_up = _gate_up(8, 64, seed=5)
    gate_up[0::2, 0::5] = torch.nan
    gate_up[1::2, 1::7] = torch.inf
    gate_up[:, 2::9] = -torch.inf
    gate_up[3, 64:] = torch.nan  # up, under the clamp
    want, got = _torch(gate_up, limit), _fused(kernel, gate_up, limit)
    nan = torch.isnan(want)
    assert nan.any()
    assert torch.equal(torch.isnan(got), nan), "NaN where torch gives NaN, nowhere else"
    assert_bitwise_equal(got[~nan], want[~nan], f"finite and infinite values, limit {limit}")


def test_other_inputs_are_refused_by_name(kernel) -> None:
    with pytest.raises(ValueError, match=r"gate_up is torch.float32 \(4, 8\); expected bf16"):
        kernel.swiglu_rows(torch.zeros(4, 8, device="cuda"), None)
    with pytest.raises(ValueError, match=r"\(4, 7\); expected bf16 \[gate \| up\] rows of an even"):
        kernel.swiglu_rows(torch.zeros(4, 7, device="cuda", dtype=torch.bfloat16), None)


@pytest.mark.parametrize("limit", [None, 7.3])
def test_the_bf16_mlp_takes_it_on_cuda_graphed_compiled_and_sync_free(kernel, limit) -> None:
    """The bf16 SwiGLU MLP on CUDA runs the kernel: its output is the torch expression's
    bits (same GEMMs), as replayed from a CUDA graph, compiled, and with no host sync."""
    torch.manual_seed(0)
    hidden, inter = 512, 384
    mlp = SwiGLUMLP(hidden, inter, WeightFormat.BF16, device="cuda", swiglu_limit=limit)
    assert mlp._swiglu_rows is kernel.swiglu_rows
    with torch.no_grad():
        mlp.gate_up_proj.copy_(torch.randn(2 * inter, hidden) * 0.05)
        mlp.down_proj.copy_(torch.randn(hidden, inter) * 0.05)
        x = torch.randn(33, hidden, device="cuda").bfloat16()
        gate_up = torch.nn.functional.linear(x, mlp.gate_up_proj)
        want = torch.nn.functional.linear(_torch(gate_up, limit), mlp.down_proj)
        assert_bitwise_equal(mlp(x), want, "eager MLP")
        assert_bitwise_equal(replayed_output(lambda: mlp(x)), want, "graph replay")
        torch._dynamo.reset()
        compiled = torch.compile(mlp, fullgraph=True)  # a graph break raises
        assert_bitwise_equal(compiled(x), want, "compiled MLP")
        assert_no_host_sync(lambda: mlp(x))
