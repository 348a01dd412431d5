"""The router's Triton kernel against the torch path on a GPU: ids bit for bit, weights
within 1e-6 (bit for bit without renormalization), ties and non-finite logits included;
transformers' router on CUDA, torch.compile, CUDA-graph replay and a sync-free forward.

Run with ``nox -s gpu_tests`` (needs Triton, which CUDA builds of torch ship).
"""

from __future__ import annotations

import pytest
import torch
from bitcheck import assert_bitwise_equal
from gpu_marks import COMPILED_GPU_MARKS
from router_cases import (
    ROUTER_SHAPES,
    by_id,
    grid_case,
    route_settings,
    tie_case,
    tie_kinds,
    transformers_router,
)
from sync_check import assert_no_host_sync

from megamoe.glm5next.config import Glm5NextConfig
from megamoe.glm5next.router import Glm5NextRouter, grouped_topk, route_logits

pytestmark = COMPILED_GPU_MARKS

WEIGHT_TOLERANCE = 1e-6  # the renormalizing sum may add in another order


def _random_case(shape: tuple[int, int, int, int], tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, shape[0], generator=gen) * 3
    return logits, torch.randn(shape[0], generator=gen) * 0.05


def _nonfinite_case(shape: tuple[int, int, int, int], tokens: int, seed: int):
    logits, bias = _random_case(shape, tokens, seed)
    logits[0::4, 1::7] = torch.nan
    logits[1::4, 2::5] = torch.inf
    logits[2::4, 3::3] = -torch.inf
    logits[3::4] = torch.nan
    return logits, bias


CASES = {"random": _random_case, "ties": tie_case, "grid": grid_case, "nonfinite": _nonfinite_case}


def _both_paths(logits: torch.Tensor, bias: torch.Tensor, route: dict):
    logits, bias = logits.cuda(), bias.cuda()
    want = route_logits(logits, bias, use_triton=False, **route)
    got = route_logits(logits, bias, use_triton=True, **route)
    return got, want


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(ROUTER_SHAPES))
def test_triton_path_equals_torch_path(name: str, case: str, norm: bool) -> None:
    shape = ROUTER_SHAPES[name]
    route = route_settings(shape, norm)
    logits, bias = CASES[case](shape, 512, 3)
    (weights, ids), (want_w, want_ids) = _both_paths(logits, bias, route)
    assert_bitwise_equal(ids, want_ids, f"{name} {case} ids")
    if norm:
        torch.testing.assert_close(weights, want_w, rtol=0, atol=WEIGHT_TOLERANCE, equal_nan=True)
    else:  # no sum: the same float32 operations in the same order
        assert_bitwise_equal(weights, want_w, f"{name} {case} weights")


def test_kernel_sigmoid_has_torch_bits_over_the_float_range() -> None:
    """Every expert chosen, no renormalization, scale 1: the weights are the kernel's
    sigmoids, compared with torch.sigmoid's bits on 2^20 logits from -120 to 120 plus
    signed zeros, infinities, NaN and subnormals."""
    special = torch.tensor([0.0, -0.0, torch.inf, -torch.inf, torch.nan, 1e-45, -1e-45, 1e-38])
    sweep = torch.linspace(-120.0, 120.0, 2**20 - special.numel())
    logits = torch.cat([special, sweep]).view(-1, 16).cuda()
    route = {"top_k": 16, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}
    weights, ids = route_logits(
        logits, torch.zeros(16, device="cuda"), use_triton=True, routed_scaling_factor=1.0, **route
    )
    assert_bitwise_equal(weights, torch.sigmoid(logits).gather(1, ids.long()), "sigmoid")


@pytest.mark.parametrize("name", list(ROUTER_SHAPES))
def test_triton_path_matches_transformers_on_cuda_ties_included(name: str) -> None:
    """On CUDA torch.topk takes the lowest ids among values tied across the cut, as ours
    do: every token's ids equal transformers', and each weight within float32 rounding."""
    shape = ROUTER_SHAPES[name]
    route = route_settings(shape, norm=True)
    logits, bias = tie_case(shape, 512, 9)
    across, _ = tie_kinds(logits, bias, route)
    assert int(across.sum()) >= 8, "too few tokens with ties across the cut"
    oracle = transformers_router(shape[0], route, torch.eye(shape[0], device="cuda"), bias.cuda())
    _, want_w, want_ids = oracle(logits.cuda())
    weights, ids = route_logits(logits.cuda(), bias.cuda(), use_triton=True, **route)
    got_w, got_ids = by_id(weights, ids)
    want_w, want_ids = by_id(want_w, want_ids)
    assert_bitwise_equal(got_ids, want_ids, f"{name} ids vs transformers")
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)


def _cuda_router(
    shape: tuple[int, int, int, int], hidden: int = 512, seed: int = 1, max_num_tokens: int = 8192
):
    route = route_settings(shape, norm=True)
    config = Glm5NextConfig.from_dict(
        {
            "model_type": "glm5_next_text",
            "hidden_size": hidden,
            "n_routed_experts": shape[0],
            "num_experts_per_tok": route["top_k"],
            "n_group": route["n_group"],
            "topk_group": route["topk_group"],
            "routed_scaling_factor": route["routed_scaling_factor"],
        }
    )
    gen = torch.Generator().manual_seed(seed)
    router = Glm5NextRouter(config, device="cuda", max_num_tokens=max_num_tokens)
    with torch.no_grad():
        router.weight.copy_(torch.randn(shape[0], hidden, generator=gen) * 0.05)
        router.e_score_correction_bias.copy_(torch.randn(shape[0], generator=gen) * 0.05)
    return router, route


def test_forward_takes_the_kernel_for_covered_shapes() -> None:
    """The forward is the kernel's call with the weight's parts (at 64 tokens, cuBLAS's
    logits for E=288), and selects on the logits as the torch path would; the logits are
    float32 sums of the exact products (vs float64)."""
    router, route = _cuda_router(ROUTER_SHAPES["glm5.3-flash"])
    assert router.kernel is not None
    x = torch.randn(64, 512, device="cuda").to(torch.bfloat16)
    bias = router.e_score_correction_bias
    weights, ids = router(x)
    kernel_w, kernel_ids, logits = router.kernel.route(
        x, router.weight, router.tickets, bias, router.weight_planes
    )
    assert_bitwise_equal(ids, kernel_ids, "forward ids")
    assert_bitwise_equal(weights, kernel_w, "forward weights")
    exact = x.double() @ router.weight.double().t()
    scale = x.double().abs() @ router.weight.double().abs().t()
    assert float(((logits.double() - exact).abs() / scale).max()) <= 1e-5
    torch_w, torch_ids = grouped_topk(torch.sigmoid(logits), bias, **route)
    assert_bitwise_equal(ids, torch_ids.to(torch.int32), "forward vs torch path")
    torch.testing.assert_close(weights, torch_w, rtol=0, atol=WEIGHT_TOLERANCE)


@pytest.mark.parametrize("tokens", [17, 300])
def test_calls_take_the_weight_planes_which_follow_the_weight(tokens: int) -> None:
    """The router's kernel takes its weight's bf16 parts (its own tiles under 64 tokens,
    cuBLAS's GEMM from 64); they follow a ``weight.copy_()`` on the next call and a
    ``.data`` write after ``refresh_planes()``."""
    from megamoe.core.numerics.router_logits import weight_planes

    router, _ = _cuda_router(ROUTER_SHAPES["glm5.3-flash"])
    assert router.weight_planes is not None
    x = torch.randn(tokens, 512, device="cuda").to(torch.bfloat16)
    bias = router.e_score_correction_bias

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, _ = router.kernel.route(
            x, router.weight, router.tickets, bias, weight_planes(router.weight)
        )
        return weights, ids

    for write in ("copy_", "data"):
        got_w, got_ids = router(x)
        want_w, want_ids = fresh()
        assert_bitwise_equal(got_ids, want_ids, f"ids before the {write} write")
        assert_bitwise_equal(got_w, want_w, f"weights before the {write} write")
        new = torch.randn_like(router.weight) * 0.05
        with torch.no_grad():
            if write == "copy_":
                router.weight.copy_(new)
            else:
                router.weight.data.copy_(new)
                router.refresh_planes()
        got_w, got_ids = router(x)
        want_w, want_ids = fresh()
        assert_bitwise_equal(got_ids, want_ids, f"ids after the {write} write")
        assert_bitwise_equal(got_w, want_w, f"weights after the {write} write")


def test_routers_that_never_reach_cublas_calls_keep_no_planes() -> None:
    """GLM-5.3-Flash's 288 experts take cuBLAS's logits from 64 tokens (E >= 256)."""
    shape = ROUTER_SHAPES["glm5.3-flash"]
    assert _cuda_router(shape)[0].kernel.matmul_tokens == 64
    assert _cuda_router(shape, max_num_tokens=63)[0].weight_planes is None
    assert _cuda_router(shape, max_num_tokens=64)[0].weight_planes is not None


def test_uncovered_shapes_run_the_torch_path() -> None:
    route = {"top_k": 17, "n_group": 1, "topk_group": 1, "norm_topk_prob": True}
    logits = torch.randn(4, 64, device="cuda")
    bias = torch.zeros(64, device="cuda")
    weights, ids = route_logits(logits, bias, routed_scaling_factor=1.0, **route)
    want_w, want_ids = grouped_topk(torch.sigmoid(logits), bias, routed_scaling_factor=1.0, **route)
    assert_bitwise_equal(ids, want_ids.to(torch.int32), "fallback ids")
    assert_bitwise_equal(weights, want_w, "fallback weights")
    with pytest.raises(ValueError, match=r"top_k=17, n_group=1 exceed the kernel's .* top_k <= 16"):
        route_logits(logits, bias, use_triton=True, routed_scaling_factor=1.0, **route)


def test_zero_tokens() -> None:
    route = route_settings(ROUTER_SHAPES["deepseek-v3"], norm=True)
    weights, ids = route_logits(
        torch.zeros(0, 256, device="cuda"),
        torch.zeros(256, device="cuda"),
        use_triton=True,
        **route,
    )
    assert weights.shape == ids.shape == (0, 8)


@pytest.mark.parametrize("name", ["glm5.3-flash", "deepseek-v3"])
def test_compiled_router_is_one_graph_like_eager(name: str) -> None:
    router, _ = _cuda_router(ROUTER_SHAPES[name])
    torch._dynamo.reset()
    compiled = torch.compile(router, fullgraph=True)  # a graph break raises
    for tokens in (1, 16, 300):
        x = torch.randn(tokens, 512, device="cuda").to(torch.bfloat16)
        want_w, want_ids = router(x)
        weights, ids = compiled(x)
        assert_bitwise_equal(ids, want_ids, f"compiled ids, {tokens} tokens")
        torch.testing.assert_close(weights, want_w, rtol=0, atol=WEIGHT_TOLERANCE)


def test_cuda_graph_replay_equals_eager() -> None:
    router, _ = _cuda_router(ROUTER_SHAPES["deepseek-v3"])
    static_x = torch.randn(128, 512, device="cuda").to(torch.bfloat16)
    router(static_x)  # compile the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_w, static_ids = router(static_x)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(static_x.shape, device="cuda", generator=gen))
        graph.replay()
        want_w, want_ids = router(static_x)
        assert_bitwise_equal(static_ids, want_ids, f"replayed ids, seed {seed}")
        assert_bitwise_equal(static_w, want_w, f"replayed weights, seed {seed}")


def test_forward_makes_no_host_sync() -> None:
    router, _ = _cuda_router(ROUTER_SHAPES["deepseek-v3"])
    x = torch.randn(32, 512, device="cuda").to(torch.bfloat16)
    assert_no_host_sync(lambda: router(x))
