"""The router kernel filling the Hopper MegaMoE kernel's inputs (``DispatchBuffer``), on CUDA.

What ``mega_moe_pre_dispatch_sm90`` writes, the router kernel must write bit for bit: each
token in FP8 E4M3 with a float32 scale per 128 columns (``max(amax, 1e-10) / 448``,
values ``x * (1 / scale)``, exact divisions), the ids as int64 and the weights, then id -1
and weight 0 in every row after the call's tokens. Oracles: that rule written in torch
here, and DeepGEMM's own pre-dispatch where it imports, both on the router's own routing.
Token counts cover the one launch and cuBLAS's logits with the selection alone (with and
without a float32 weight's bf16 parts), partial token blocks and the padding's end; the
activations span magnitudes from 1e-6 to 1e3 per token and hold exact E4M3 ties, zeros and
a group of zeros (the amax floor). Also: a CUDA-graph replay writes what eager writes, and
buffers that do not fit are refused by name.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from bitcheck import assert_bitwise_equal
from gpu_marks import COMPILED_GPU_MARKS

from megamoe.core.numerics.dispatch import DISPATCH_GROUP, DispatchBuffer

pytestmark = COMPILED_GPU_MARKS

HIDDEN = 1024
ROWS = 1100  # the buffer's rows: more than any call, so that padding shows
TOKENS = (1, 15, 17, 64, 255, 300, 1024)
# name: (score, E, top_k, n_group, weight dtype, with the float32 weight's bf16 parts)
ROUTERS = {
    "softmax-E64-bf16": ("softmax", 64, 8, 1, torch.bfloat16, False),
    "softmax-E512-bf16": ("softmax", 512, 10, 1, torch.bfloat16, False),
    "sigmoid-E288-fp32": ("sigmoid", 288, 8, 8, torch.float32, False),
    "sigmoid-E288-planes": ("sigmoid", 288, 8, 8, torch.float32, True),
    "sigmoid-E64-fp32": ("sigmoid", 64, 4, 1, torch.float32, False),
}
HAS_DEEP_GEMM = importlib.util.find_spec("deep_gemm") is not None


def _router(name: str):
    from megamoe.core.kernels import one_launch_router
    from megamoe.core.numerics.router_logits import weight_planes

    score, experts, top_k, n_group, dtype, planes = ROUTERS[name]
    extra: dict[str, float] = {}
    if score == "sigmoid":
        extra = {
            "n_group": n_group,
            "topk_group": max(1, n_group // 2),
            "routed_scaling_factor": 2.5,
        }
    router, tickets = one_launch_router(
        score, ROWS, "cuda", num_experts=experts, top_k=top_k, norm_topk_prob=True, **extra
    )
    gen = torch.Generator().manual_seed(experts)
    weight = (torch.randn(experts, HIDDEN, generator=gen) * 0.05).to(dtype).cuda()
    bias = (torch.randn(experts, generator=gen) * 0.05).cuda() if score == "sigmoid" else None
    parts = weight_planes(weight) if planes else None
    return router, tickets, weight, bias, parts


def _activations(tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    scale = torch.logspace(-6, 3, tokens)[:, None]
    x = (torch.randn(tokens, HIDDEN, generator=gen) * scale).bfloat16()
    ties = torch.tensor([448.0, -448.0, 1.0, 3.0, 1.5, 0.0, 0.01, 2.0] * 16)  # 128 values
    x[0, :DISPATCH_GROUP] = ties.bfloat16()
    if tokens > 1:
        x[1, DISPATCH_GROUP : 2 * DISPATCH_GROUP] = 0  # amax 0: the floor's scale
    return x.cuda()


def _garbage(top_k: int) -> DispatchBuffer:
    """A buffer whose every byte holds something the kernel must overwrite or keep."""
    return DispatchBuffer(
        torch.full((ROWS, HIDDEN), 0x11, dtype=torch.uint8, device="cuda").view(
            torch.float8_e4m3fn
        ),
        torch.full((ROWS, HIDDEN // DISPATCH_GROUP), 9.0, device="cuda"),
        torch.full((ROWS, top_k), 7, dtype=torch.int64, device="cuda"),
        torch.full((ROWS, top_k), 5.0, device="cuda"),
    )


def _cast_oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values and float32 scales per 128 columns, by the pre-dispatch rule."""
    groups = x.float().reshape(x.shape[0], -1, DISPATCH_GROUP)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    scale = amax / torch.full_like(amax, 448.0)  # tensor / tensor: an exact division
    values = (groups * (torch.ones_like(scale) / scale)).to(torch.float8_e4m3fn)
    return values.reshape(x.shape), scale.squeeze(-1)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", list(ROUTERS))
def test_the_router_writes_the_pre_dispatch_bits(name: str, tokens: int) -> None:
    router, tickets, weight, bias, planes = _router(name)
    top_k = ROUTERS[name][2]
    x = _activations(tokens)
    dispatch = _garbage(top_k)
    weights, ids, _ = router.route(x, weight, tickets, bias, planes)
    routed_w, routed_ids, _ = router.route(x, weight, tickets, bias, planes, dispatch)
    # With a dispatch the routing is written there only and comes back as its rows.
    assert routed_w.data_ptr() == dispatch.topk_weights.data_ptr()
    assert routed_ids.data_ptr() == dispatch.topk_ids.data_ptr()
    assert routed_ids.shape == ids.shape
    values, scale = _cast_oracle(x)
    assert_bitwise_equal(dispatch.x[:tokens], values, "x")
    assert_bitwise_equal(dispatch.x_scale[:tokens], scale, "x_scale")
    assert_bitwise_equal(dispatch.topk_ids[:tokens], ids.long(), "topk_ids")
    assert_bitwise_equal(dispatch.topk_weights[:tokens], weights, "topk_weights")
    assert bool((dispatch.topk_ids[tokens:] == -1).all()), "padding ids must be -1"
    assert bool((dispatch.topk_weights[tokens:] == 0).all()), "padding weights must be 0"
    assert bool((dispatch.x[tokens:].view(torch.uint8) == 0x11).all()), "rows past T untouched"
    assert int(tickets.abs().sum()) == 0
    if HAS_DEEP_GEMM:
        import deep_gemm

        theirs = _garbage(top_k)
        deep_gemm.mega_moe_pre_dispatch_sm90(x, ids, weights, *theirs, tokens)
        for field, ours, expected in zip(DispatchBuffer._fields, dispatch, theirs, strict=True):
            if field == "x":
                ours, expected = (
                    ours[:tokens].view(torch.uint8),
                    expected[:tokens].view(torch.uint8),
                )
            assert_bitwise_equal(ours, expected, f"{field} against DeepGEMM's pre-dispatch")


def test_a_graph_replay_writes_what_eager_writes() -> None:
    router, tickets, weight, bias, planes = _router("sigmoid-E288-fp32")
    x = _activations(17)
    eager = _garbage(8)
    router.route(x, weight, tickets, bias, planes, eager)
    graphed = _garbage(8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        router.route(x, weight, tickets, bias, planes, graphed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        router.route(x, weight, tickets, bias, planes, graphed)
    for tensor in graphed:
        tensor.view(torch.uint8).fill_(
            0x22
        ) if tensor.dtype == torch.float8_e4m3fn else tensor.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(graphed.x[:17], eager.x[:17], "graphed x")  # rows after: untouched
    assert_bitwise_equal(graphed.x_scale[:17], eager.x_scale[:17], "graphed x_scale")
    assert_bitwise_equal(graphed.topk_ids, eager.topk_ids, "graphed topk_ids and padding")
    assert_bitwise_equal(graphed.topk_weights, eager.topk_weights, "graphed weights and padding")


def test_a_buffer_that_does_not_fit_is_refused() -> None:
    router, tickets, weight, bias, planes = _router("softmax-E64-bf16")
    x = _activations(16)
    good = _garbage(8)
    wrong_ids = good._replace(topk_ids=good.topk_ids.int())
    with pytest.raises(ValueError, match=r"dispatch buffer of .*torch.int32"):
        router.route(x, weight, tickets, bias, planes, wrong_ids)
    short = DispatchBuffer(*(t[:8] for t in good))
    with pytest.raises(ValueError, match="for 16 tokens"):
        router.route(x, weight, tickets, bias, planes, short)
    other_k = _garbage(6)
    with pytest.raises(ValueError, match="top_k=8"):
        router.route(x, weight, tickets, bias, planes, other_k)


def test_a_buffer_that_fitted_once_is_still_checked_for_its_rows_and_hidden_size() -> None:
    router, tickets, weight, bias, planes = _router("softmax-E64-bf16")
    good = _garbage(8)
    router.route(_activations(16), weight, tickets, bias, planes, good)  # fits: remembered
    with pytest.raises(ValueError, match=f"for {ROWS + 1} tokens"):
        router.route(_activations(ROWS + 1), weight, tickets, bias, planes, good)
    narrow = _activations(16)[:, : HIDDEN - DISPATCH_GROUP].contiguous()
    with pytest.raises(ValueError, match=f"hidden size {HIDDEN - DISPATCH_GROUP}"):
        router.route(narrow, weight[:, : HIDDEN - DISPATCH_GROUP].contiguous(), tickets, bias,
                     None, good)  # fmt: skip
    wrong_ids = good._replace(topk_ids=good.topk_ids.int())  # a new tuple: checked again
    with pytest.raises(ValueError, match=r"dispatch buffer of .*torch.int32"):
        router.route(_activations(16), weight, tickets, bias, planes, wrong_ids)


@pytest.mark.parametrize("name", ["softmax-E64-bf16", "sigmoid-E288-planes"])
def test_routing_rows_of_a_kept_view_follow_each_call(name: str) -> None:
    """The routing a dispatch call returns is a kept view of the buffer's rows per call size
    (``TritonRouter._routing_views``): sizes coming back in any order get views of their
    own rows holding that call's routing (both paths: one launch, and cuBLAS then the
    selection from 64 tokens for E >= 256)."""
    router, tickets, weight, bias, planes = _router(name)
    dispatch = _garbage(ROUTERS[name][2])
    for tokens in (1, 300, 17, 1, 300):
        x = _activations(tokens)
        fresh_weights, fresh_ids, _ = router.route(x, weight, tickets, bias, planes)
        weights, ids, _ = router.route(x, weight, tickets, bias, planes, dispatch)
        assert weights.shape == ids.shape == (tokens, ROUTERS[name][2])
        assert weights.data_ptr() == dispatch.topk_weights.data_ptr()
        assert_bitwise_equal(weights, fresh_weights, f"{name}, {tokens} tokens, weights")
        assert_bitwise_equal(ids, fresh_ids.long(), f"{name}, {tokens} tokens, ids")
