"""The GLM-5.3-Flash router: sigmoid scores and group-limited top-k (SPEC §4.2).

Ties are broken deterministically, toward the lower index: among groups whose scores
are equal the lower group id is kept first, and among experts whose biased scores are
equal the lower expert id is chosen first. The chosen experts come in order of
decreasing biased score (ties: lower id first).
"""

from __future__ import annotations

import torch

from megamoe.glm5next.config import ROUTER_TOP2, Glm5NextConfig

NORM_EPS = 1e-20  # added to the renormalization's denominator, as the model does


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row, ties toward the lower index."""
    # A stable descending sort keeps equal values in index order; torch.topk does not
    # promise any order among ties.
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def router_logits(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Router logits ``x @ gate_weight^T`` in float32.

    Args:
        hidden_states: (tokens, H).
        gate_weight: (E, H).

    Returns:
        (tokens, E) float32.
    """
    return hidden_states.float() @ gate_weight.float().t()


def grouped_topk(
    scores: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's experts among its best groups, and their weights.

    Selection uses the biased scores ``scores + correction_bias``: each of ``n_group``
    equal groups scores the sum of its best two biased scores, the ``topk_group`` best
    groups are kept, and the ``top_k`` best biased scores among their experts are chosen.
    The weights are the unbiased ``scores`` of the chosen experts, divided by their sum
    (plus ``NORM_EPS``) when ``norm_topk_prob``, times ``routed_scaling_factor`` (with or
    without the renormalization).

    Args:
        scores: (tokens, E) sigmoid scores; the computation keeps their dtype (float32 in
            the block, float64 in references).
        correction_bias: (E,) selection bias (``e_score_correction_bias``).
        top_k: experts per token.
        n_group: router groups (E must be a multiple).
        topk_group: groups kept per token.
        norm_topk_prob: renormalize the chosen weights.
        routed_scaling_factor: weight multiplier.

    Returns:
        ``(topk_weights, topk_ids int64)``, each (tokens, top_k); the weights in the dtype
        of ``scores``.

    Raises:
        ValueError: shapes that do not match the group settings.
    """
    tokens, num_experts = scores.shape
    if num_experts % n_group or correction_bias.shape != (num_experts,):
        raise ValueError(
            f"router: scores have {num_experts} experts and the bias shape "
            f"{tuple(correction_bias.shape)}; expected ({num_experts},) and a multiple of "
            f"n_group={n_group}"
        )
    biased = scores + correction_bias.to(scores.dtype)
    grouped = biased.view(tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(ROUTER_TOP2, dim=-1).values.sum(dim=-1)
    kept_groups = _top_indices(group_scores, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    allowed = biased.masked_fill(~keep.repeat_interleave(num_experts // n_group, dim=1), -torch.inf)
    topk_ids = _top_indices(allowed, top_k)
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return topk_weights * routed_scaling_factor, topk_ids


class Glm5NextRouter(torch.nn.Module):
    """The router of one MoE layer; its parameters are named as in the checkpoint.

    Attributes:
        weight: (E, H) float32 router weight (``gate.weight``; bf16 in checkpoints is
            widened exactly).
        e_score_correction_bias: (E,) float32 selection bias.

    Args:
        config: the model's MoE settings.
        device: where the parameters live.
    """

    def __init__(self, config: Glm5NextConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        num_experts, hidden = config.n_routed_experts, config.hidden_size
        self.weight = torch.nn.Parameter(
            torch.zeros((num_experts, hidden), dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.e_score_correction_bias = torch.nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights (float32) and expert ids (int32) of each token, (tokens, top_k)."""
        cfg = self.config
        scores = torch.sigmoid(router_logits(hidden_states, self.weight))
        topk_weights, topk_ids = grouped_topk(
            scores,
            self.e_score_correction_bias,
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        return topk_weights, topk_ids.to(torch.int32)
