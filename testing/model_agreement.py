"""Two runs of one transformers model compared on inputs away from near-ties (tests only).

Two correct implementations of a model's experts differ by bfloat16 rounding. Where a
router's top-k choice or the next-token choice is nearly tied, that difference can flip
it, and a flipped expert or token changes everything after it: such inputs say nothing
about the implementation. So the comparisons here choose their inputs first, from the
reference run alone (never from the run under test):

- routing: a prompt counts when, at every MoE layer and position, the gap between the
  k-th chosen and the best unchosen selection score (``transformers_oracle``'s margin,
  computed in float64 on the reference run's block inputs) is at least a threshold;
- generation: also when, at every generated step, the top-2 logit gap of the reference
  run is at least a threshold.

The thresholds are the largest differences the two runs showed where they were measured
(the selection scores' for the routing margin, the logits' for the top-2 gap), kept as
constants (the CPU runs' shared ones here). Logits are compared by relative Frobenius error
per prompt, ``||a - b|| / ||b||``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers_oracle import TinyModel, reference_moe

# The CPU runs' BF16 thresholds (test_transformers_experts' docstring gives the measurements;
# its float32 models run within them too: test_transformers_float32).
LOGITS_TOL = 1e-2
# The largest selection-score difference measured between the runs.
ROUTING_MARGIN = {"qwen4_exp": 2e-3, "glm5_next": 6e-3}
MIN_PROMPTS = 3  # fewer prompts away from ties than this fails the test (too thin)


def candidate_prompts(count: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """(count, length) random token ids, seeded; never id 0 (GLM's pad token)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (count, length), generator=gen)


def routing_margins(
    tiny: TinyModel, model: torch.nn.Module, input_ids: torch.Tensor
) -> torch.Tensor:
    """Per prompt, the smallest routing margin over every MoE layer and position.

    Args:
        tiny: the tiny model the checkpoint was written from (its routers in float64).
        model: the reference run, a model with the same weights (its MoE blocks named as
            ``tiny.moe_blocks``).
        input_ids: (B, L) prompts.

    Returns:
        (B,) float64 margins.
    """
    batch, length = input_ids.shape
    margins = torch.full((batch,), torch.inf, dtype=torch.float64)
    for prefix, x in _block_inputs(tiny, model, input_ids).items():
        margin = reference_moe(tiny, prefix, x).margin
        margins = torch.minimum(margins, margin.reshape(batch, length).amin(dim=1))
    return margins


def _block_inputs(
    tiny: TinyModel, model: torch.nn.Module, input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The (B * L, H) input of every MoE block of ``model`` in one forward, on the CPU."""
    inputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    hooks = [
        modules[prefix].register_forward_pre_hook(
            lambda _m, args, prefix=prefix: inputs.__setitem__(prefix, args[0].detach())
        )
        for prefix in tiny.moe_blocks
        if prefix in modules
    ]
    try:
        with torch.no_grad():
            model(input_ids.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    if not inputs:
        raise ValueError(f"none of the MoE blocks {sorted(tiny.moe_blocks)} ran in the model")
    return {p: x.reshape(-1, x.shape[-1]).cpu() for p, x in inputs.items()}


def same_routing(
    tiny: TinyModel, reference: torch.nn.Module, other: torch.nn.Module, input_ids: torch.Tensor
) -> torch.Tensor:
    """Per prompt, whether both runs choose the same experts at every MoE layer and position.

    Each run's choice is the float64 router's on that run's own block inputs. For runs whose
    selection scores differ by more than most margins (FP8 activations against BF16), where
    ``away_from_ties`` would keep no prompt: a prompt routed alike compares the experts'
    arithmetic, one routed apart compares different experts.

    Returns:
        (B,) bool.
    """
    batch, length = input_ids.shape
    a, b = _block_inputs(tiny, reference, input_ids), _block_inputs(tiny, other, input_ids)
    same = torch.ones(batch, dtype=torch.bool)
    for prefix in a:
        router = copy.deepcopy(tiny.moe_blocks[prefix].gate).to(torch.float64)
        ids_a, ids_b = (_chosen_experts(router, x[prefix]) for x in (a, b))
        same &= (ids_a == ids_b).all(dim=-1).reshape(batch, length).all(dim=1)
    return same


def _chosen_experts(router: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(T, k) expert ids a float64 router chooses for (T, H) inputs, sorted per row."""
    with torch.no_grad():
        _, _, ids = router(x.to(torch.float64).reshape(1, -1, x.shape[-1]))
    return ids.reshape(x.shape[0], -1).sort(dim=-1).values


def logits_error(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """(B,) relative Frobenius error of (B, L, V) logits, per prompt."""
    diff = actual.double() - expected.double()
    return diff.flatten(1).norm(dim=1) / expected.double().flatten(1).norm(dim=1)


@dataclass(frozen=True)
class Greedy:
    """A greedy generation.

    Attributes:
        tokens: (B, n) generated token ids.
        top2_margins: (B,) smallest top-2 logit gap over the generated steps.
        sequences: (B, L + n) prompts followed by the generated tokens.
    """

    tokens: torch.Tensor
    top2_margins: torch.Tensor
    sequences: torch.Tensor


def greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> Greedy:
    """Generate ``new_tokens`` greedily (no sampling, no early stop) and keep the logits."""
    with torch.no_grad():
        out = model.generate(
            input_ids.to(model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    steps = torch.stack([step.float().cpu() for step in out.logits], dim=1)  # (B, n, V)
    top2 = steps.topk(2, dim=-1).values
    sequences = out.sequences.cpu()
    return Greedy(
        tokens=sequences[:, input_ids.shape[1] :],
        top2_margins=(top2[..., 0] - top2[..., 1]).amin(dim=1).double(),
        sequences=sequences,
    )


def away_from_ties(
    margins: torch.Tensor, threshold: float, at_least: int, what: str
) -> torch.Tensor:
    """Indices of the prompts whose margin is at least ``threshold``; at least ``at_least``.

    Raises:
        AssertionError: fewer prompts qualify (the comparison would be too thin).
    """
    rows = (margins >= threshold).nonzero().flatten()
    assert rows.numel() >= at_least, (
        f"only {rows.numel()} of {margins.numel()} prompts have a {what} margin >= {threshold} "
        f"(need {at_least}); margins: {margins.tolist()}"
    )
    return rows


# Two decoder layers, both MoE (each model needs one attention layer beside its linear
# attention): a bfloat16 difference grows through every layer of these random models, and
# two layers keep it near what one layer adds while still chaining MoE layers.
TWO_MOE_LAYERS: dict[str, dict[str, object]] = {
    "qwen4_exp": dict(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"]),
    "glm5_next": dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        indexer_types=["full", "full"],
        mlp_layer_types=["sparse", "sparse"],
    ),
}
