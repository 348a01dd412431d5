"""Qwen4-Exp and GLM-5.3-Flash in transformers 5.24.0 on megamoe's experts, on the CPU.

``experts_implementation="megamoe"`` against ``"eager"`` (transformers' own loop) on tiny
random models with two MoE layers (``model_agreement.TWO_MOE_LAYERS``; GLM clamps SwiGLU
at 1.5), for BF16 and block-FP8 checkpoints written by ``transformers_oracle``:

- logits of a forward within ``LOGITS_TOL`` (relative Frobenius error per prompt);
- greedy generation of 8 tokens gives the same tokens.

Both on prompts chosen away from near-ties from the eager run alone (``model_agreement``
says why and how). Measured while writing (64 prompts of 8 tokens): selection scores of the
two runs differ by up to 0.0016 (Qwen, softmax probabilities) and 0.006 (GLM, sigmoid
scores), hence ``ROUTING_MARGIN``; away from routing ties the logits are 0.005-0.007
(Qwen) and 0.007-0.009 (GLM) apart, where transformers' own ``batched_mm`` is 0.006-0.0095
from eager on GLM, and differ by at most 0.006 (Qwen) and 0.014 (GLM), hence
``TOP2_MARGIN`` at 1.7-1.8x those.

BF16 runs the user's path (``from_pretrained(..., experts_implementation="megamoe")``,
built at the first forward). Block-FP8: on a CPU transformers dequantizes FP8 experts
to BF16 while loading (and needs accelerate), so the model is built as ``from_pretrained``
builds it on a GPU, with transformers' own ``replace_with_fp8_linear`` and the
checkpoint's FP8 weights and scales merged per layer, then ``prepare()`` builds megamoe's
block-FP8 experts from them; eager runs the dequantized weights.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
    greedy,
    logits_error,
    routing_margins,
    same_routing,
)
from safetensors import safe_open
from transformers.integrations.finegrained_fp8 import FP8Experts, replace_with_fp8_linear
from transformers.utils.quantization_config import FineGrainedFP8Config
from transformers_oracle import INDEX_NAME, TinyModel, build_tiny_model, save_checkpoint

import megamoe.transformers
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat

FAMILIES = ("qwen4_exp", "glm5_next")
FORMATS = (WeightFormat.BF16, WeightFormat.FP8_BLOCK)
SWIGLU_LIMIT = 1.5  # GLM's clamp in these tests: it reaches a share of the activations
# 1.7-1.8x the largest logit difference measured between the runs (see above).
TOP2_MARGIN = {"qwen4_exp": 0.01, "glm5_next": 0.025}
PROMPTS, GENERATION_PROMPTS, PROMPT_LEN, NEW_TOKENS = 32, 256, 8, 8


@dataclass
class Models:
    """One tiny model three ways: eager, on megamoe, and its checkpoint."""

    tiny: TinyModel
    path: Path
    megamoe: torch.nn.Module

    @property
    def eager(self) -> torch.nn.Module:
        return self.tiny.model


def _build(family: str, fmt: WeightFormat, root: Path, seed: int = 0) -> Models:
    limit = {"swiglu_limit": SWIGLU_LIMIT} if family == "glm5_next" else {}
    tiny = build_tiny_model(family, seed=seed, **limit, **TWO_MOE_LAYERS[family])
    path = save_checkpoint(
        tiny, root / f"{family}-{fmt.value}", fp8_block=fmt is WeightFormat.FP8_BLOCK
    )
    if fmt is WeightFormat.BF16:
        model = type(tiny.model).from_pretrained(
            path, experts_implementation=megamoe.transformers.IMPLEMENTATION, dtype=torch.bfloat16
        )
    else:
        model = _fp8_experts_model(tiny, path)
        megamoe.transformers.prepare(model)
    return Models(tiny, path, model.eval())


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(files):
        with safe_open(path / name, "pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    return tensors


def _fp8_experts_model(tiny: TinyModel, path: Path) -> torch.nn.Module:
    """``tiny``'s model with its routed experts as transformers holds block-FP8 on a GPU."""
    model = copy.deepcopy(tiny.model)
    only_experts = [r"(?!.*\.mlp\.experts$).*"]  # every module but the routed experts
    config = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=only_experts)
    replace_with_fp8_linear(
        model, modules_to_not_convert=only_experts, quantization_config=config, pre_quantized=True
    )
    disk = _checkpoint_tensors(path)
    for prefix in tiny.moe_blocks:
        experts = model.get_submodule(f"{prefix}.experts")
        assert isinstance(experts, FP8Experts), type(experts)

        def merged(projs: tuple[str, ...], kind: str, prefix: str = prefix) -> torch.Tensor:
            n = tiny.moe_blocks[prefix].experts.num_experts
            return torch.stack(
                [
                    torch.cat([disk[f"{prefix}.experts.{e}.{p}.{kind}"] for p in projs])
                    for e in range(n)
                ]
            )

        for param, projs in (
            ("gate_up_proj", ("gate_proj", "up_proj")),
            ("down_proj", ("down_proj",)),
        ):
            for suffix, kind in (("", "weight"), ("_scale_inv", "weight_scale_inv")):
                value = torch.nn.Parameter(merged(projs, kind), requires_grad=False)
                setattr(experts, param + suffix, value)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, WeightFormat], Models]:
    root = tmp_path_factory.mktemp("transformers-experts")
    built: dict[tuple[str, WeightFormat], Models] = {}

    def get(family: str, fmt: WeightFormat) -> Models:
        if (family, fmt) not in built:
            built[family, fmt] = _build(family, fmt, root)
        return built[family, fmt]

    return get


def _megamoe_children(model: torch.nn.Module) -> dict[str, MegaMoEExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MegaMoEExperts)}


def _prompts(m: Models, seed: int, count: int = PROMPTS) -> torch.Tensor:
    return candidate_prompts(count, PROMPT_LEN, m.tiny.text_config.vocab_size, seed)


@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(
    models: Callable[[str, WeightFormat], Models], family: str, checkpoint_format: WeightFormat
) -> None:
    m = models(family, checkpoint_format)
    prompts = _prompts(m, seed=1)
    rows = away_from_ties(
        routing_margins(m.tiny, m.eager, prompts), ROUTING_MARGIN[family], MIN_PROMPTS, "routing"
    )
    with torch.no_grad():
        expected = m.eager(prompts[rows]).logits
        actual = m.megamoe(prompts[rows]).logits
    errors = logits_error(actual, expected)
    print(
        f"[transformers {family} {checkpoint_format.value}] {rows.numel()} prompts, "
        f"logits error {errors.min():.4f}..{errors.max():.4f}"
    )
    assert errors.max() <= LOGITS_TOL, errors.tolist()
    children = _megamoe_children(m.megamoe)
    assert {n.removesuffix(".experts.megamoe") for n in children} == set(m.tiny.moe_blocks)
    for experts in children.values():
        assert experts.weight_format is checkpoint_format  # the reference runs it as stored
        assert experts.backend.name == "reference"
        assert experts.swiglu_limit == (SWIGLU_LIMIT if family == "glm5_next" else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_routing_tells_runs_routed_apart(
    models: Callable[[str, WeightFormat], Models], family: str
) -> None:
    """The prompt filter of the GPU test: every prompt away from ties is routed alike, and
    a run whose first MoE layer outputs twice as much is routed apart on some prompts."""
    m = models(family, WeightFormat.BF16)
    prompts = _prompts(m, seed=1)
    alike = same_routing(m.tiny, m.eager, m.megamoe, prompts)
    margins = routing_margins(m.tiny, m.eager, prompts)
    rows = away_from_ties(margins, ROUTING_MARGIN[family], MIN_PROMPTS, "routing")
    assert alike[rows].all()
    louder = copy.deepcopy(m.eager)
    first = louder.get_submodule(f"{next(iter(m.tiny.moe_blocks))}.experts")
    with torch.no_grad():
        first.down_proj.mul_(2)
    apart = ~same_routing(m.tiny, m.eager, louder, prompts)
    assert apart.any() and not apart.all(), apart.tolist()


@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_eager(
    models: Callable[[str, WeightFormat], Models], family: str, checkpoint_format: WeightFormat
) -> None:
    m = models(family, checkpoint_format)
    expected = greedy(m.eager, _prompts(m, seed=2, count=GENERATION_PROMPTS), NEW_TOKENS)
    routing = routing_margins(m.tiny, m.eager, expected.sequences)
    rows = away_from_ties(
        torch.where(routing >= ROUTING_MARGIN[family], expected.top2_margins, -1.0),
        TOP2_MARGIN[family],
        MIN_PROMPTS,
        "routing and top-2 logit",
    )
    actual = greedy(m.megamoe, expected.sequences[rows, :PROMPT_LEN], NEW_TOKENS)
    print(
        f"[transformers {family} {checkpoint_format.value}] {rows.numel()} of "
        f"{GENERATION_PROMPTS} prompts away from ties, {NEW_TOKENS} tokens each"
    )
    assert torch.equal(actual.tokens, expected.tokens[rows]), (actual.tokens, expected.tokens[rows])


def test_batches_beyond_max_num_tokens_run_in_chunks(
    models: Callable[[str, WeightFormat], Models],
) -> None:
    m = models("qwen4_exp", WeightFormat.BF16)
    whole = m.megamoe
    chunked = type(whole).from_pretrained(m.path, dtype=torch.bfloat16)
    megamoe.transformers.prepare(chunked, max_num_tokens=24)
    calls: list[int] = []
    for experts in _megamoe_children(chunked).values():
        experts.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[0]))
    prompts = candidate_prompts(5, PROMPT_LEN, m.tiny.text_config.vocab_size, seed=3)  # 40 tokens
    with torch.no_grad():
        expected, actual = whole(prompts).logits, chunked(prompts).logits
    assert calls == [24, 16, 24, 16]  # two layers, every token, none dropped
    # Only the matrix sizes differ: far below LOGITS_TOL, far below a dropped chunk.
    assert logits_error(actual, expected).max() <= 1e-3


def test_the_clamp_is_applied(
    models: Callable[[str, WeightFormat], Models], tmp_path: Path
) -> None:
    """Without GLM's clamp megamoe would be far from eager on these prompts."""
    m = models("glm5_next", WeightFormat.BF16)
    unclamped_path = tmp_path / "unclamped"
    unclamped_path.mkdir()
    for file in m.path.iterdir():
        (unclamped_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((unclamped_path / "config.json").read_text())
    config["text_config"]["swiglu_limit"] = 1e4  # no activation comes near it
    (unclamped_path / "config.json").write_text(json.dumps(config))
    unclamped = type(m.megamoe).from_pretrained(unclamped_path, dtype=torch.bfloat16)
    megamoe.transformers.prepare(unclamped)
    assert {e.swiglu_limit for e in _megamoe_children(unclamped).values()} == {1e4}
    prompts = _prompts(m, seed=1)
    with torch.no_grad():
        expected = m.eager(prompts).logits
        clamped_error = logits_error(m.megamoe(prompts).logits, expected)
        unclamped_error = logits_error(unclamped(prompts).logits, expected)
    assert unclamped_error.median() >= 10 * clamped_error.median(), (unclamped_error, clamped_error)


def test_transformers_weights_are_freed(models: Callable[[str, WeightFormat], Models]) -> None:
    m = models("glm5_next", WeightFormat.FP8_BLOCK)
    for prefix in m.tiny.moe_blocks:
        experts = m.megamoe.get_submodule(f"{prefix}.experts")
        own = [n for n, _ in experts.named_parameters(recurse=False)]
        assert own == [], own  # gate_up_proj, down_proj and their scales are gone
        held = {n.split(".")[0] for n, _ in experts.named_parameters()}
        assert held == {megamoe.transformers.implementation.CHILD}


def _qwen_bf16(tmp_path: Path) -> torch.nn.Module:
    tiny = build_tiny_model("qwen4_exp", **TWO_MOE_LAYERS["qwen4_exp"])
    path = save_checkpoint(tiny, tmp_path / "qwen")
    return type(tiny.model).from_pretrained(path, dtype=torch.bfloat16)


GROUPED_MM = "experts_implementation='grouped_mm'"


@pytest.mark.parametrize(
    ("change", "error", "rule", "fix"),
    [
        (lambda e: setattr(e, "has_bias", True), NotImplementedError, "has_bias=True", GROUPED_MM),
        (
            lambda e: setattr(e, "is_transposed", True),
            NotImplementedError,
            "is_transposed=True",
            GROUPED_MM,
        ),
        (
            lambda e: setattr(e, "act_fn", torch.nn.GELU()),
            NotImplementedError,
            "act_fn=GELU",
            GROUPED_MM,
        ),
        (lambda e: e.double(), TypeError, "dtype torch.float64", "dtype=torch.bfloat16"),
    ],
    ids=["bias", "transposed", "gelu", "float64"],
)
def test_refuses_experts_it_does_not_compute(
    tmp_path: Path, change: Callable[[torch.nn.Module], object], error: type, rule: str, fix: str
) -> None:
    model = _qwen_bf16(tmp_path)
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    change(experts)
    with pytest.raises(error) as raised:
        megamoe.transformers.prepare(model)
    message = str(raised.value)
    assert "model.language_model.layers.0.mlp.experts" in message and rule in message, message
    assert fix in message, message


def test_prepare_once_before_the_first_forward(tmp_path: Path) -> None:
    model = _qwen_bf16(tmp_path)
    assert megamoe.transformers.prepare(model) == [
        "model.language_model.layers.0.mlp.experts",
        "model.language_model.layers.1.mlp.experts",
    ]
    with pytest.raises(RuntimeError, match="already runs on megamoe"):
        megamoe.transformers.prepare(model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        megamoe.transformers.prepare(torch.nn.Linear(2, 2))


def test_prepare_refuses_a_bad_path_option_before_changing_the_model(tmp_path: Path) -> None:
    model = _qwen_bf16(tmp_path)
    with pytest.raises(ValueError, match=r"^prepare\(\): small_batch_max_tokens=0; expected at"):
        megamoe.transformers.prepare(model, small_batch_max_tokens=0)
    with pytest.raises(ValueError, match=r"^prepare\(\): experts_path='fast'; expected one of"):
        megamoe.transformers.prepare(model, experts_path="fast")
    assert not _megamoe_children(model)  # nothing was built, no weight was taken over
    megamoe.transformers.prepare(model, experts_path="megamoe")
    experts = list(_megamoe_children(model).values())
    assert len(experts) == 2 and {e.experts_path for e in experts} == {"megamoe"}


def test_prepare_passes_small_batch_max_tokens_to_every_layer(tmp_path: Path) -> None:
    model = _qwen_bf16(tmp_path)
    megamoe.transformers.prepare(model, small_batch_max_tokens=4)
    experts = list(_megamoe_children(model).values())
    assert len(experts) == 2 and {e.small_batch_max_tokens for e in experts} == {4}


def test_megamoe_core_does_not_import_transformers() -> None:
    code = (
        "import sys, megamoe.core, megamoe.core.modules.experts, megamoe.core.checkpoint.reader, "
        "megamoe.core.backends.reference, megamoe.core.cli.main; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' "
        "or m == 'megamoe.transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
