"""The group-limited top-k router against an exhaustive reference, ties included."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe.glm5next.router import grouped_topk, router_logits


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
