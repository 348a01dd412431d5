"""Qwen4-Exp and GLM-5.3-Flash in transformers on the Hopper MegaMoE kernel, vs eager.

Run with ``nox -s gpu_tests``. ``tests/test_transformers_experts.py`` on the GPU: a tiny
random model with two MoE layers at sizes the kernel runs (H=2048, I=768, 32 experts,
top-8; GLM clamps SwiGLU at 1.5), written as a block-FP8 checkpoint and loaded with
``from_pretrained(..., device_map="cuda")``, which keeps transformers' ``FP8Experts``
(float8 weights, 128x128 float32 scales). ``experts_implementation="megamoe"`` runs them
through DeepGEMM's ``fp8_mega_moe`` as stored (checked), ``"eager"`` through transformers'
own loop of FP8 GEMMs. Both round activations to FP8, differently (the kernel also rounds
the SwiGLU output to FP8 with power-of-two scales per 64 columns), so the bounds are
wider than on the CPU. Prompts are chosen away from near-ties as there
(``model_agreement``), from the eager run's margins, with thresholds taken from the two
runs' differences on the forward's prompts (no H200 measurement fixed them yet): the
largest selection-score difference, and twice the largest logit difference for the top-2
gap (at equal inputs no greedy token can flip then). Prompts of 4 tokens keep the number
of routing choices per prompt low (32 experts, top-8 has small gaps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megamoe.core.experts import MegaMoEExperts
from megamoe.core.formats import WeightFormat, detect_arch, resolve_formats

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FAMILIES = ("qwen4_exp", "glm5_next")
SWIGLU_LIMIT = 1.5
KERNEL_SIZES = {  # the sizes tests/test_gpu_deepgemm.py runs the kernel at
    "qwen4_exp": dict(
        hidden_size=2048,
        moe_intermediate_size=768,
        shared_expert_intermediate_size=768,
        num_experts=32,
        num_experts_per_tok=8,
    ),
    "glm5_next": dict(
        hidden_size=2048,
        moe_intermediate_size=768,
        n_routed_experts=32,
        num_experts_per_tok=8,
        n_group=4,
        topk_group=2,
    ),
}
# The kernel is 0.045 from a float64 layer (docs/gpu.md) and transformers' FP8 loop rounds
# too: a bound of about that per layer, not yet measured on whole models.
LOGITS_TOL = 5e-2
PROMPTS, GENERATION_PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 256, 4, 8
MIN_PROMPTS = 3


def _kernel_or_skip() -> None:
    """Skip where DeepGEMM's kernel cannot run transformers' block-FP8 experts as stored."""
    pytest.importorskip("transformers", minversion="5.24.0")
    pytest.importorskip("accelerate")  # transformers loads FP8 checkpoints through it
    from megamoe.core.backends.deepgemm import DeepGemmBackend

    run_format = resolve_formats(WeightFormat.FP8_BLOCK, None, detect_arch("cuda"))[1]
    if run_format is not WeightFormat.FP8_BLOCK:
        pytest.skip(
            f"this GPU runs block-FP8 experts as {run_format.value}, not on the Hopper kernel"
        )
    reason = DeepGemmBackend.unsupported_reason(WeightFormat.FP8_BLOCK, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"DeepGEMM cannot run fp8_block here: {reason}")


@pytest.mark.parametrize("family", FAMILIES)
def test_block_fp8_model_on_the_kernel_matches_eager(tmp_path: Path, family: str) -> None:
    _kernel_or_skip()
    from model_agreement import (
        TWO_MOE_LAYERS,
        away_from_ties,
        candidate_prompts,
        greedy,
        logits_error,
        routing_margins,
        routing_score_gap,
    )
    from transformers_oracle import build_tiny_model, save_checkpoint

    import megamoe.transformers

    limit = {"swiglu_limit": SWIGLU_LIMIT} if family == "glm5_next" else {}
    tiny = build_tiny_model(
        family, seed=0, **limit, **TWO_MOE_LAYERS[family], **KERNEL_SIZES[family]
    )
    path = save_checkpoint(tiny, tmp_path / family, fp8_block=True)
    cls = type(tiny.model)
    eager, ours = (
        cls.from_pretrained(
            path, dtype=torch.bfloat16, device_map="cuda", experts_implementation=impl
        ).eval()
        for impl in ("eager", megamoe.transformers.IMPLEMENTATION)
    )
    vocab = tiny.text_config.vocab_size

    prompts = candidate_prompts(PROMPTS, PROMPT_LEN, vocab, seed=1)
    score_gap = routing_score_gap(tiny, eager, ours, prompts)
    rows = away_from_ties(routing_margins(tiny, eager, prompts), score_gap, MIN_PROMPTS, "routing")
    with torch.no_grad():
        expected = eager(prompts[rows].cuda()).logits.cpu()
        actual = ours(prompts[rows].cuda()).logits.cpu()
    errors = logits_error(actual, expected)
    logit_gap = float((actual.float() - expected.float()).abs().max())
    print(
        f"[transformers gpu {family}] selection scores differ by up to {score_gap:.4g}; "
        f"{rows.numel()} of {PROMPTS} prompts away from routing ties: logits error "
        f"{errors.min():.4f}..{errors.max():.4f}, largest logit difference {logit_gap:.4f}"
    )
    assert errors.max() <= LOGITS_TOL, errors.tolist()
    children = [m for m in ours.modules() if isinstance(m, MegaMoEExperts)]
    assert len(children) == len(tiny.moe_blocks)
    for experts in children:
        assert experts.backend.name == "deepgemm"
        assert experts.checkpoint_format is experts.weight_format is WeightFormat.FP8_BLOCK
        assert experts.swiglu_limit == (SWIGLU_LIMIT if family == "glm5_next" else None)

    reference = greedy(
        eager, candidate_prompts(GENERATION_PROMPTS, PROMPT_LEN, vocab, 2), NEW_TOKENS
    )
    routing = routing_margins(tiny, eager, reference.sequences)
    rows = away_from_ties(
        torch.where(routing >= score_gap, reference.top2_margins, -1.0),
        2 * logit_gap,
        MIN_PROMPTS,
        "routing and top-2 logit",
    )
    generated = greedy(ours, reference.sequences[rows, :PROMPT_LEN], NEW_TOKENS)
    print(
        f"[transformers gpu {family}] {rows.numel()} of {GENERATION_PROMPTS} prompts away "
        f"from ties, {NEW_TOKENS} tokens each"
    )
    assert torch.equal(generated.tokens, reference.tokens[rows])
