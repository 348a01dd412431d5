"""The group-limited top-k router against an exhaustive reference and transformers 5.24's
``Glm5NextTextTopkRouter``, ties included (the torch path; the Triton path against it on
a GPU: ``test_router_triton.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from router_cases import (
    ROUTER_SHAPES,
    by_id,
    grid_case,
    route_settings,
    tie_case,
    tie_kinds,
    transformers_router,
)

from megamoe.core.numerics.router_logits import PLANES, router_logits, weight_planes
from megamoe.glm5next.config import Glm5NextConfig
from megamoe.glm5next.router import Glm5NextRouter, grouped_topk, route_logits


def _best_subset(values: list[float], candidates: list[int], size: int) -> tuple[int, ...]:
    """Exhaustively: the ``size``-subset of ``candidates`` with the largest sum.

    Ties: the lexicographically smallest sorted index tuple (the documented rule "lower
    index first" picks exactly this one).
    """
    best: tuple[float, tuple[int, ...]] | None = None
    for subset in itertools.combinations(sorted(candidates), size):
        total = sum(values[i] for i in subset)
        if best is None or total > best[0]:  # combinations come in lexicographic order
            best = (total, subset)
    assert best is not None
    return best[1]


def _reference_route(
    scores: list[float],
    bias: list[float],
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm: bool,
    scale: float,
) -> tuple[list[int], list[float]]:
    """Brute-force routing of one token, in float64, written from the SPEC text."""
    num_experts = len(scores)
    per_group = num_experts // n_group
    biased = [s + b for s, b in zip(scores, bias, strict=True)]
    group_score = []
    for g in range(n_group):
        members = range(g * per_group, (g + 1) * per_group)
        group_score.append(sum(biased[i] for i in _best_subset(biased, list(members), 2)))
    groups = _best_subset(group_score, list(range(n_group)), topk_group)
    allowed = [i for g in groups for i in range(g * per_group, (g + 1) * per_group)]
    chosen = _best_subset(biased, allowed, top_k)
    # Order: decreasing biased score, equal scores by lower id.
    ordered = sorted(chosen, key=lambda i: (-biased[i], i))
    weights = [scores[i] for i in ordered]
    if norm:
        total = sum(weights)
        weights = [w / total for w in weights]
    return ordered, [w * scale for w in weights]


@st.composite
def _router_case(draw: st.DrawFn) -> dict[str, object]:
    n_group = draw(st.sampled_from([1, 2, 4]))
    per_group = draw(st.sampled_from([2, 3, 4]))
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(4, topk_group * per_group)))
    num_experts = n_group * per_group
    tokens = draw(st.integers(1, 4))
    # Multiples of 1/16 make ties frequent and keep every sum exact in float32.
    levels = draw(st.integers(2, 6))
    grid = st.integers(1, levels).map(lambda v: v / 16)  # sigmoid scores are > 0
    scores = draw(
        st.lists(
            st.lists(grid, min_size=num_experts, max_size=num_experts),
            min_size=tokens,
            max_size=tokens,
        )
    )
    bias = draw(
        st.lists(
            st.integers(-2, 2).map(lambda v: v / 16), min_size=num_experts, max_size=num_experts
        )
    )
    return {
        "scores": scores,
        "bias": bias,
        "top_k": top_k,
        "n_group": n_group,
        "topk_group": topk_group,
        "norm": draw(st.booleans()),
        "scale": draw(st.sampled_from([1.0, 2.5])),
    }


@settings(max_examples=300, deadline=None)
@given(case=_router_case())
def test_grouped_topk_matches_exhaustive_reference(case: dict) -> None:
    scores = torch.tensor(case["scores"], dtype=torch.float32)
    bias = torch.tensor(case["bias"], dtype=torch.float32)
    weights, ids = grouped_topk(
        scores,
        bias,
        top_k=case["top_k"],
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        norm_topk_prob=case["norm"],
        routed_scaling_factor=case["scale"],
    )
    for t, row in enumerate(case["scores"]):
        want_ids, want_w = _reference_route(
            row,
            case["bias"],
            top_k=case["top_k"],
            n_group=case["n_group"],
            topk_group=case["topk_group"],
            norm=case["norm"],
            scale=case["scale"],
        )
        assert ids[t].tolist() == want_ids, (row, case)
        # float32 division/multiplication of exact inputs: within 1 ulp of float64.
        torch.testing.assert_close(
            weights[t].double(), torch.tensor(want_w, dtype=torch.float64), rtol=2e-7, atol=0
        )


def test_all_ties_choose_lowest_ids() -> None:
    scores = torch.full((2, 8), 0.5)
    weights, ids = grouped_topk(
        scores,
        torch.zeros(8),
        top_k=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))


def test_bias_changes_selection_not_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.sigmoid(torch.randn(16, 16, generator=gen))
    kwargs = {
        "top_k": 4,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 2.0,
    }
    w0, ids0 = grouped_topk(scores, torch.zeros(16), **kwargs)
    # A large bias on experts 12..15 (one whole group) pulls every token to them.
    bias = torch.zeros(16)
    bias[12:] = 10.0
    w1, ids1 = grouped_topk(scores, bias, **kwargs)
    assert not torch.equal(ids0, ids1)
    assert torch.equal(ids1.sort(dim=1).values, torch.arange(12, 16).expand(16, 4))
    # Weights are the unbiased scores of the chosen experts (times the scaling factor).
    assert torch.equal(w1, scores.gather(1, ids1) * 2.0)
    assert torch.equal(w0, scores.gather(1, ids0) * 2.0)


def test_group_limit_excludes_a_high_expert_in_a_weak_group() -> None:
    # Group 0 holds the single best expert but a weak partner; group 1 two good ones.
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.5]])
    _, ids = grouped_topk(
        scores,
        torch.zeros(4),
        top_k=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
    assert ids.tolist() == [[2]]


def test_router_logits_are_float32_products() -> None:
    x = torch.randn(3, 128, dtype=torch.float64).to(torch.bfloat16)
    w = torch.randn(8, 128, dtype=torch.float64).to(torch.bfloat16)
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-30, 0.02, 1.0, 1e30])
def test_weight_planes_are_three_bf16_parts_that_sum_to_the_weight(scale: float) -> None:
    """The float32 router weight's parts (the large-call GEMM's operand): bf16, hi first,
    each part at most half an ulp of the one before, and their sum the weight exactly."""
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(0)) * scale
    planes = weight_planes(w)
    assert planes.dtype == torch.bfloat16 and planes.shape == (PLANES * 8, 128)
    hi, mid, lo = planes.double().chunk(PLANES)
    assert torch.equal(hi + mid + lo, w.double())
    assert bool((mid.abs() <= hi.abs() * 2.0**-8).all() and (lo.abs() <= mid.abs() * 2.0**-8).all())


def test_bad_bias_shape_is_named() -> None:
    with pytest.raises(ValueError, match=r"bias shape \(7,\); expected \(8,\)"):
        grouped_topk(
            torch.zeros(1, 8),
            torch.zeros(7),
            top_k=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        )


def _glm_config(num_experts: int, hidden: int, route: dict) -> Glm5NextConfig:
    return Glm5NextConfig.from_dict(
        {
            "model_type": "glm5_next_text",
            "hidden_size": hidden,
            "n_routed_experts": num_experts,
            "num_experts_per_tok": route["top_k"],
            "n_group": route["n_group"],
            "topk_group": route["topk_group"],
            "norm_topk_prob": route["norm_topk_prob"],
            "routed_scaling_factor": route["routed_scaling_factor"],
        }
    )


def _random_router(shape: tuple[int, int, int, int], hidden: int, norm: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    router = Glm5NextRouter(_glm_config(shape[0], hidden, route_settings(shape, norm)))
    with torch.no_grad():
        router.weight.copy_(torch.randn(shape[0], hidden, generator=gen) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(shape[0], generator=gen) * 0.05)
    return router, torch.randn(64, hidden, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("name", list(ROUTER_SHAPES))
def test_router_matches_transformers_on_random_tokens(name: str, norm: bool) -> None:
    shape = ROUTER_SHAPES[name]
    router, x = _random_router(shape, 64, norm, seed=7)
    oracle = transformers_router(
        shape[0], route_settings(shape, norm), router.weight, router.e_score_correction_bias
    )
    weights, ids = router(x)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    _, want_w, want_ids = oracle(x)
    got_w, got_ids = by_id(weights, ids)
    want_w, want_ids = by_id(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    # transformers renormalizes in its own (unsorted) order: float32 rounding apart.
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(ROUTER_SHAPES))
def test_exact_ties_match_transformers_wherever_its_choice_is_defined(name: str) -> None:
    """Exact ties inside the chosen experts or the kept groups: the same ids and weights
    as transformers. A tie across the cut (the k-th and (k+1)-th equal) leaves
    transformers' choice to ``torch.topk``, whose CPU kernel promises no order among ties
    (it picks neither the lowest nor the highest ids); there ours are the lowest ids
    (the exhaustive reference above), and on CUDA transformers' too
    (``test_router_triton.py``)."""
    shape = ROUTER_SHAPES[name]
    route = route_settings(shape, norm=True)
    logits, bias = tie_case(shape, tokens=256, seed=5)
    oracle = transformers_router(shape[0], route, torch.eye(shape[0]), bias)
    _, want_w, want_ids = oracle(logits)  # identity weight: the logits themselves
    weights, ids = route_logits(logits, bias, **route)
    across, inside = tie_kinds(logits, bias, route)
    defined = ~across
    assert int((defined & inside).sum()) >= 32, "too few tokens with ties inside the choice"
    got_w, got_ids = by_id(weights[defined], ids[defined])
    want_w, want_ids = by_id(want_w[defined], want_ids[defined])
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)


def test_route_logits_is_sigmoid_then_grouped_topk() -> None:
    shape = ROUTER_SHAPES["deepseek-v3"]
    route = route_settings(shape, norm=True)
    logits, bias = grid_case(shape, tokens=32, seed=2)
    want_w, want_ids = grouped_topk(torch.sigmoid(logits), bias, **route)
    for use_triton in (None, False):  # no CUDA here: both run the torch path
        weights, ids = route_logits(logits, bias, use_triton=use_triton, **route)
        assert torch.equal(ids, want_ids.to(torch.int32))
        assert torch.equal(weights, want_w)


def test_use_triton_without_cuda_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"use_triton=True needs CUDA logits and Triton; got "):
        route_logits(
            torch.zeros(2, 8), torch.zeros(8), use_triton=True, **route_settings((8, 2, 4, 2), True)
        )


@pytest.mark.parametrize(
    ("num_experts", "top_k", "n_group", "topk_group", "message"),
    [
        (8, 2, 3, 1, r"expected \(8,\) and a multiple of n_group=3"),
        (8, 2, 0, 1, r"multiple of n_group=0"),
        (8, 1, 8, 1, r"each group needs >= 2 experts"),
        (8, 2, 4, 5, r"n_group=4, topk_group=5 .* 1 <= topk_group <= n_group"),
        (8, 2, 4, 0, r"topk_group=0 .* 1 <= topk_group <= n_group"),
        (8, 5, 4, 2, r"top_k=5 outside 1..4, the experts of the topk_group=2 kept groups of 2"),
        (8, 0, 1, 1, r"top_k=0 outside 1..8"),
    ],
)
def test_group_settings_outside_the_rules_are_named(
    num_experts: int, top_k: int, n_group: int, topk_group: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        grouped_topk(
            torch.full((1, num_experts), 0.5),
            torch.zeros(num_experts),
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        )


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")  # inductor's own imports
def test_router_compiles_as_one_graph_like_eager() -> None:
    router, x = _random_router(ROUTER_SHAPES["deepseek-v3"], 128, norm=True, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(router, fullgraph=True, dynamic=False)  # a graph break raises
    want_w, want_ids = router(x)
    weights, ids = compiled(x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)


def test_a_router_given_a_buffer_where_its_kernel_cannot_run_raises() -> None:
    from megamoe.core.adapters import SyntheticSizes
    from megamoe.core.numerics.dispatch import DispatchBuffer
    from megamoe.core.numerics.formats import WeightFormat
    from megamoe.glm5next.config import Glm5NextConfig
    from megamoe.glm5next.router import Glm5NextRouter
    from megamoe.glm5next.synthetic import synthetic_config as glm_config

    sizes = SyntheticSizes(num_layers=1, hidden_size=256, intermediate_size=256, num_experts=8,
                           top_k=2)  # fmt: skip
    config = Glm5NextConfig.from_dict(glm_config(WeightFormat.FP8_BLOCK, sizes))
    router = Glm5NextRouter(config, device="cpu")
    x = torch.zeros(2, config.hidden_size, dtype=torch.bfloat16)
    buffer = DispatchBuffer(*(torch.zeros(1) for _ in range(4)))
    with pytest.raises(ValueError, match="dispatch buffer, but the one-launch kernel"):
        router(x, buffer)
