"""Both blocks on the Hopper kernel inside an engine: compiled, graphed, no host syncs.

Run with ``nox -s gpu_tests`` on an H200. Each adapter's block (block-FP8, E=32, top-8,
H=2048, I=768, shared 768, DeepGEMM) must:

- compile whole: ``torch.compile(block, fullgraph=True)`` (the experts are one opaque
  custom op), matching eager within 1e-2;
- capture into a CUDA graph whose replay equals eager bit for bit (and within 1e-3 with
  the shared expert on the auxiliary stream);
- run its forward under ``torch.cuda.set_sync_debug_mode("error")``: no host sync;
- let its router kernel write the kernel's inputs (no pre-dispatch launch) with the
  output of DeepGEMM's pre-dispatch, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bitcheck import relative_error
from gpu_marks import COMPILED_GPU_MARKS
from sync_check import assert_no_host_sync

from megamoe.core.adapters import MoEBlock, SyntheticSizes
from megamoe.core.backends.deepgemm import DeepGemmBackend
from megamoe.core.backends.symm_buffer import resolve_group
from megamoe.core.modules.parallel import ParallelSettings
from megamoe.core.modules.shared_expert import AUX_IN_GRAPHS, AuxStream
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import synthetic_layer_tensors
from megamoe.glm5next import ADAPTER as GLM
from megamoe.qwen4exp import ADAPTER as QWEN

SIZES = SyntheticSizes(
    num_layers=2, hidden_size=2048, intermediate_size=768, num_experts=32, top_k=8,
    shared_intermediate_size=768,
)  # fmt: skip
FMT = WeightFormat.FP8_BLOCK
TOKENS = 64
COMPILED_TOLERANCE = 1e-2

pytestmark = COMPILED_GPU_MARKS


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    reason = DeepGemmBackend.unsupported_reason(FMT, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"DeepGEMM cannot run {FMT.value} here: {reason}")


@pytest.fixture(scope="module", params=[QWEN, GLM], ids=lambda a: a.name)
def block(request: pytest.FixtureRequest) -> MoEBlock:
    adapter = request.param
    config: dict[str, Any] = adapter.synthetic_config(FMT, SIZES)
    layer = next(m for m in adapter.moe_layers(config) if not m.is_mtp)
    device = torch.device("cuda", 0)
    built = adapter.build_block(
        config, layer, parallel=ParallelSettings(ep_group=resolve_group(None, device)),
        backend="deepgemm", device=device, max_num_tokens=TOKENS, use_aux_stream=False,
    )  # fmt: skip
    built.load_weights(synthetic_layer_tensors(adapter, config, layer.prefix, seed=1).items())
    built.finalize()
    assert built.experts.backend.name == "deepgemm"
    return built


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(TOKENS, SIZES.hidden_size, generator=gen).to(torch.bfloat16).cuda()


def test_the_compiled_block_matches_eager(block: MoEBlock) -> None:
    x = _tokens()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager, once = block(x), compiled(x)
    assert relative_error(once, eager) <= COMPILED_TOLERANCE


def test_a_captured_graph_replays_eager_bit_for_bit(block: MoEBlock) -> None:
    x = _tokens()
    with torch.no_grad():
        eager = block(x)
        captured = captured_replay(block, x)
    assert torch.equal(captured.view(torch.int16), eager.view(torch.int16))


def captured_replay(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The output of one replay of a CUDA graph of ``block(x)`` (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block(x)
    graph.replay()
    torch.cuda.synchronize()
    return captured


@pytest.mark.parametrize("aux", [True, AUX_IN_GRAPHS])
def test_a_graph_captured_with_the_aux_stream_replays_eager(block: MoEBlock, aux: object) -> None:
    """The shared expert on the auxiliary stream inside a graph: the replay equals the
    serial eager forward within 1e-3 (the MegaMoE combine may add in another order once
    its launch waits on two streams, and up to ``gemm_sm_target.SMALL_GEMM_ROWS`` tokens
    the shared expert's GEMMs are cuBLASLt's half-the-SMs kernels, summing in another
    order than the serial split-K ones)."""
    x = _tokens()
    serial = block.aux_stream  # type: ignore[attr-defined]
    with torch.no_grad():
        eager = block(x)
        block.aux_stream = AuxStream(x.device, enabled=aux)  # type: ignore[arg-type]
        try:
            captured = captured_replay(block, x)
        finally:
            block.aux_stream = serial
    err = relative_error(captured, eager)
    print(f"{aux!r}: graphed with the aux stream vs serial eager {err:.2e}")
    assert err <= 1e-3


def test_the_forward_never_syncs_the_host(block: MoEBlock) -> None:
    x = _tokens()
    with torch.no_grad():
        assert_no_host_sync(lambda: block(x))


@pytest.mark.parametrize("tokens", [1, 17, TOKENS])
def test_the_router_kernel_fills_the_kernel_inputs_bit_for_bit(
    block: MoEBlock, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router kernel writes the Hopper kernel's inputs itself (no pre-dispatch launch):
    the block's output equals the one through DeepGEMM's pre-dispatch bit for bit."""
    x = _tokens()[:tokens]
    experts = block.experts
    assert experts.dispatch_buffer(x) is not None, "the fused dispatch must run here"
    with torch.no_grad():
        fused = block(x)
        monkeypatch.setattr(experts, "dispatch_buffer", lambda hidden_states: None)
        through_pre_dispatch = block(x)
    assert torch.equal(fused.view(torch.int16), through_pre_dispatch.view(torch.int16))
