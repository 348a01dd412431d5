"""GLM router test cases: router shapes, tie-heavy logits, and transformers' own router.

Tests only (transformers is a test dependency). Shared by the router's CPU tests (torch
path against transformers) and GPU tests (Triton path against the torch path and
transformers on CUDA).
"""

from __future__ import annotations

import torch

# (E, top_k, n_group, topk_group). GLM-5.3-Flash has no group limit (n_group 1);
# DeepSeek-V3 keeps 4 of 8 groups; the others stretch the group logic (groups of 4
# experts, 3 groups, the kernel's largest router).
ROUTER_SHAPES = {
    "glm5.3-flash": (288, 8, 1, 1),
    "deepseek-v3": (256, 8, 8, 4),
    "uneven-groups": (12, 3, 3, 2),
    "largest": (512, 16, 16, 3),
}
SCALE = 2.5  # routed_scaling_factor (GLM-5.3-Flash's and DeepSeek-V3's)


def route_settings(shape: tuple[int, int, int, int], norm: bool) -> dict:
    """The keyword arguments of ``grouped_topk`` / ``route_logits`` for ``shape``."""
    _, top_k, n_group, topk_group = shape
    return {
        "top_k": top_k,
        "n_group": n_group,
        "topk_group": topk_group,
        "norm_topk_prob": norm,
        "routed_scaling_factor": SCALE,
    }


def transformers_router(
    num_experts: int, route: dict, weight: torch.Tensor, bias: torch.Tensor
) -> torch.nn.Module:
    """Build transformers 5.24's ``Glm5NextTextTopkRouter`` holding ``weight`` and ``bias``."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

    config = Glm5NextTextConfig(
        hidden_size=weight.shape[1],
        n_routed_experts=num_experts,
        num_experts_per_tok=route["top_k"],
        n_group=route["n_group"],
        topk_group=route["topk_group"],
        norm_topk_prob=route["norm_topk_prob"],
        routed_scaling_factor=route["routed_scaling_factor"],
    )
    router = Glm5NextTextTopkRouter(config).to(weight.device)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    return router


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ids ascending, with their weights (transformers' order is unsorted)."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def tie_case(
    shape: tuple[int, int, int, int], tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and bias with exact ties planted in the biased scores and group sums.

    The bias depends only on an expert's position within its group (three levels), so a
    copied logit ties exactly: each token copies three of its top-k experts' logits onto
    other experts of the same bias level, and every other token with groups copies one
    whole group onto another (equal group sums). Some ties land inside the choice, some
    across its cut.
    """
    num_experts, top_k, n_group, _ = shape
    per_group = num_experts // n_group
    gen = torch.Generator().manual_seed(seed)
    level = torch.arange(num_experts) % per_group % 3
    bias = (level - 1).float() / 16
    logits = torch.randn(tokens, num_experts, generator=gen)
    for t in range(tokens):
        if n_group > 1 and t % 2 == 0:
            src, dst = torch.randperm(n_group, generator=gen)[:2].tolist()
            logits[t, dst * per_group : (dst + 1) * per_group] = logits[
                t, src * per_group : (src + 1) * per_group
            ]
        order = (torch.sigmoid(logits[t]) + bias).argsort(descending=True)
        for _ in range(3):
            src = int(order[int(torch.randint(0, top_k, (1,), generator=gen))])
            peers = (level == level[src]).nonzero().flatten()
            dst = int(peers[int(torch.randint(0, len(peers), (1,), generator=gen))])
            logits[t, dst] = logits[t, src]
    return logits, bias


def grid_case(
    shape: tuple[int, int, int, int], tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and bias on coarse grids: almost every comparison is an exact tie."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (tokens, shape[0]), generator=gen).float() / 2
    bias = torch.randint(-1, 2, (shape[0],), generator=gen).float() / 8
    return logits, bias


def tie_kinds(
    logits: torch.Tensor, bias: torch.Tensor, route: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: whether an exact tie straddles a cut, and whether one lies inside.

    Straddling: the group or the top-k cut separates equal values (the choice then
    depends on tie-breaking). Inside: the chosen experts or the kept groups hold an exact
    tie among themselves.
    """
    tokens, num_experts = logits.shape
    n_group, topk_group, top_k = route["n_group"], route["topk_group"], route["top_k"]
    biased = torch.sigmoid(logits.float().cpu()) + bias.cpu()
    group_sums = biased.view(tokens, n_group, -1).topk(2, dim=-1).values.sum(-1)
    group_sorted, group_order = group_sums.sort(dim=-1, descending=True, stable=True)
    across = torch.zeros(tokens, dtype=torch.bool)
    if topk_group < n_group:
        across = group_sorted[:, topk_group - 1] == group_sorted[:, topk_group]
    kept = torch.zeros_like(group_sums, dtype=torch.bool)
    kept.scatter_(1, group_order[:, :topk_group], True)
    per_group = num_experts // n_group
    allowed = biased.masked_fill(~kept.repeat_interleave(per_group, dim=1), -torch.inf)
    ranked = allowed.sort(dim=-1, descending=True).values
    across |= ranked[:, top_k - 1] == ranked[:, top_k]
    inside = (ranked[:, 1:top_k] == ranked[:, : top_k - 1]).any(-1)
    inside |= (group_sorted[:, 1:topk_group] == group_sorted[:, : topk_group - 1]).any(-1)
    return across, inside
