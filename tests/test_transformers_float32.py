"""A float32 transformers model on megamoe's experts, on the CPU (issue 38).

``from_pretrained(..., dtype=torch.float32, experts_implementation="megamoe")``: megamoe
takes the float32 experts over in bfloat16, with one warning naming the rounding, and the
logits stay within the bfloat16 tolerance of ``"eager"`` float32 (transformers' own loop
in float32), on prompts away from routing ties (``model_agreement``). A dtype megamoe
cannot take (float64) is still refused with the dtype and the fix.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from model_agreement import (
    LOGITS_TOL,
    MIN_PROMPTS,
    ROUTING_MARGIN,
    TWO_MOE_LAYERS,
    away_from_ties,
    candidate_prompts,
    logits_error,
    routing_margins,
)
from transformers_oracle import build_tiny_model, save_checkpoint

import megamoe.transformers
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat

ROUNDING = "their weights and the tokens they get are rounded to bfloat16"


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_float32_model_runs_within_bf16_tolerance_of_eager_float32(
    tmp_path: Path, family: str
) -> None:
    limit = {"swiglu_limit": 1.5} if family == "glm5_next" else {}
    tiny = build_tiny_model(family, seed=0, **limit, **TWO_MOE_LAYERS[family])
    path = save_checkpoint(tiny, tmp_path / family)
    cls = type(tiny.model)
    eager = cls.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    model = cls.from_pretrained(
        path, dtype=torch.float32, experts_implementation=megamoe.transformers.IMPLEMENTATION
    ).eval()
    prompts = candidate_prompts(32, 8, tiny.text_config.vocab_size, seed=1)
    rows = away_from_ties(
        routing_margins(tiny, eager, prompts), ROUTING_MARGIN[family], MIN_PROMPTS, "routing"
    )
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # shown once per place, as outside pytest
        expected = eager(prompts[rows]).logits
        actual = model(prompts[rows]).logits
    rounding = [str(w.message) for w in caught if ROUNDING in str(w.message)]
    assert len(rounding) == 1, [str(w.message) for w in caught]  # one warning, two layers
    assert "torch.float32" in rounding[0] and "grouped_mm" in rounding[0], rounding[0]
    assert actual.dtype == torch.float32
    errors = logits_error(actual, expected)
    print(f"[float32 {family}] {rows.numel()} prompts, logits error {errors.max():.4f}")
    assert errors.max() <= LOGITS_TOL, errors.tolist()
    children = [m for m in model.modules() if isinstance(m, MegaMoEExperts)]
    assert len(children) == len(tiny.moe_blocks)
    assert {e.weight_format for e in children} == {WeightFormat.BF16}


def test_float32_model_with_moe_format_warns_of_both_roundings(tmp_path: Path) -> None:
    tiny = build_tiny_model("qwen4_exp", seed=0, **TWO_MOE_LAYERS["qwen4_exp"])
    path = save_checkpoint(tiny, tmp_path / "qwen")
    model = type(tiny.model).from_pretrained(path, dtype=torch.float32)
    with pytest.warns(UserWarning) as caught:
        megamoe.transformers.prepare(model, moe_format="mxfp8")
    messages = [str(w.message) for w in caught if ROUNDING in str(w.message)]
    assert messages and "in bfloat16 (then as mxfp8)" in messages[0], [
        str(w.message) for w in caught
    ]
    children = [m for m in model.modules() if isinstance(m, MegaMoEExperts)]
    assert {e.weight_format for e in children} == {WeightFormat.MXFP8}
    with torch.no_grad():
        out = model(candidate_prompts(2, 8, tiny.text_config.vocab_size, seed=2)).logits
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())


def test_float64_experts_are_refused_with_dtype_and_fix(tmp_path: Path) -> None:
    tiny = build_tiny_model("qwen4_exp", seed=0, **TWO_MOE_LAYERS["qwen4_exp"])
    path = save_checkpoint(tiny, tmp_path / "qwen")
    model = type(tiny.model).from_pretrained(path, dtype=torch.float64)
    with pytest.raises(TypeError) as raised:
        megamoe.transformers.prepare(model)
    message = str(raised.value)
    assert "model.language_model.layers.0.mlp.experts" in message, message
    assert "dtype torch.float64" in message and "dtype=torch.bfloat16" in message, message
