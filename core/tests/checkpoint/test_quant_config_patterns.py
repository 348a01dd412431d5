"""``re:`` patterns of an untrusted ``quantization_config``: refused before they run when they
could backtrack for long; the real ones match as before (SPEC §3.6, §5 "Confined")."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from megamoe.core.checkpoint import quant_config
from megamoe.core.checkpoint.quant_config import (
    MAX_PATTERNS,
    detect_expert_format,
    detect_mlp_format,
)
from megamoe.core.checkpoint.safe_regex import MAX_PATTERN_CHARS
from megamoe.core.errors import CheckpointError
from megamoe.core.numerics.formats import WeightFormat

PREFIX = "model.layers.3.mlp.experts"
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
# Patterns that backtrack exponentially or as a high power of the name's length.
HOSTILE = [
    r"re:(.|.)*Z",  # the auditor's: quantified alternation, hangs `megamoe inspect`
    r"re:.*.*.*.*.*.*Z",  # six overlapping unbounded repeats: n^6
    r"re:.*.*Z",
    r"re:(a+)+$",
    r"re:(\w+\.)*x",  # nested repeats
    r"re:(a|aa)*b",
    r"re:(a?){30}a{30}",
    "re:" + "a?" * 30 + "a" * 30,  # no nesting, still 2^30
    "re:" + "(a|a)" * 9,
    r"re:.{0,60}.{0,60}.{0,60}Z",  # bounded but long repeats split like unbounded ones
    r"re:.*[a-z_.]+[a-z_.]+Z",
    r"re:.*a.*a.*a.*a.*a",  # five unbounded repeats
    r"re:(?:(?=.*x).)*",
    r"re:(a)\1",
    "re:" + "x" * (MAX_PATTERN_CHARS + 1),
    "re:(",
]
# Patterns real checkpoints carry (llm-compressor recipes, HF configs).
REAL = [
    r"re:.*lm_head",
    r"re:.*mlp.gate$",
    r"re:model.layers.\d+.mlp.shared_expert.*",
    r"re:.*self_attn.*",
    r"re:^model\.layers\.[0-9]+\.mlp\.gate$",
    r"re:.*(q_proj|k_proj|v_proj)$",
    r"re:.*mlp\.experts\.\d+\..*_proj$",
    r"re:(model\.)?layers\.\d+\.mlp\.(gate|shared_expert_gate)$",
    r"re:.*model\.layers\.\d+\.mlp\.experts\.\d+\..*",
    r"re:model.layers.(0|1|2).mlp.*",
    r"re:(?i).*LM_HEAD",
]
NAMES = [
    "lm_head",
    "model.layers.3.mlp.gate",
    "model.layers.3.mlp.gate_proj",
    "model.layers.3.mlp.shared_expert.down_proj",
    "model.layers.3.self_attn.k_proj",
    "model.layers.3.mlp.experts",
    "model.layers.3.mlp.experts.7.up_proj",
    "model.layers.1.mlp.experts.0.gate_proj",
    "layers.12.mlp.shared_expert_gate",
]


def _ct(**extra: Any) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": "dense", **extra}


@pytest.mark.parametrize("pattern", HOSTILE)
@pytest.mark.parametrize(
    ("config", "key"),
    [
        (lambda p: _ct(ignore=["lm_head", p]), "quantization_config.ignore"),
        (lambda p: {**FP8, "modules_to_not_convert": [p]}, "modules_to_not_convert"),
        (
            lambda p: _ct(format="mxfp8-quantized", config_groups={"g": {"targets": [p]}}),
            "quantization_config.config_groups.g.targets",
        ),
    ],
)
def test_a_pattern_that_could_backtrack_is_refused_before_it_runs(
    pattern: str, config: Any, key: str
) -> None:
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        detect_expert_format(config(pattern), PREFIX, num_experts=64)
    assert time.perf_counter() - start < 5.0  # it never ran: the first one hung for hours
    message = str(info.value)
    assert key in message
    assert repr(pattern) in message
    assert "rewrite it" in message and "list the module names" in message


def test_the_auditors_pattern_names_the_rule() -> None:
    with pytest.raises(CheckpointError, match=r"repeats a group .* holds alternatives"):
        detect_expert_format(_ct(ignore=[r"re:(.|.)*Z"]), PREFIX, num_experts=4)
    with pytest.raises(CheckpointError, match=r"no literal character between them"):
        detect_mlp_format(_ct(ignore=[r"re:.*.*.*.*.*.*Z"]), "model.layers.3.mlp.shared_expert")


def test_too_many_patterns_or_a_non_string_entry_are_refused() -> None:
    many = [rf"re:.*layers\.{i}\.self_attn.*" for i in range(MAX_PATTERNS + 1)]
    with pytest.raises(CheckpointError, match=rf"{MAX_PATTERNS + 1} re: or wildcard patterns"):
        detect_expert_format(_ct(ignore=many), PREFIX, num_experts=4)
    plain = [f"model.layers.{i}.self_attn.q_proj" for i in range(MAX_PATTERNS + 1)]
    assert detect_expert_format(_ct(ignore=plain), PREFIX, num_experts=4) is WeightFormat.BF16
    groups = {"g": {"targets": ["Linear", 3]}}
    with pytest.raises(CheckpointError, match=r"config_groups\.g\.targets must be a list"):
        detect_expert_format(_ct(config_groups=groups), PREFIX)
    with pytest.raises(CheckpointError, match=r"config_groups\.g\.targets must be a list"):
        detect_expert_format(_ct(config_groups={"g": {"targets": "Linear"}}), PREFIX)


@pytest.mark.parametrize("pattern", REAL)
def test_real_patterns_are_accepted_and_match_as_re_match(pattern: str) -> None:
    entries = quant_config._entries([pattern], "ignore")
    body = re.compile(pattern.removeprefix("re:"))
    for name in NAMES:
        assert quant_config._matches_any(entries, [name]) is bool(body.match(name)), name


WILDCARDS = ["model.layers.*.mlp.gate", "*.shared_expert.*", "lm_hea*"]


def test_the_patterns_share_one_expression_and_match_as_each_alone() -> None:
    """The re: and wildcard entries run as one alternation (one match per module name),
    except a pattern with global flags: a name matches where one entry alone matches it."""
    entries = quant_config._entries(REAL + WILDCARDS, "ignore")
    assert len(entries.patterns) == 2  # REAL's (?i) pattern keeps its own
    for name in NAMES:
        alone = [quant_config._entries([entry], "ignore") for entry in REAL + WILDCARDS]
        expected = any(quant_config._matches_any(one, [name]) for one in alone)
        assert quant_config._matches_any(entries, [name]) is expected, name
    assert quant_config._matches_any(entries, ["model.layers.3.mlp.shared_expert"])  # "x.*"


def test_patterns_whose_group_names_repeat_keep_their_own_expressions() -> None:
    entries = quant_config._entries([r"re:(?P<x>.*)lm_head", r"re:(?P<x>.*)\.gate$"], "ignore")
    assert len(entries.patterns) == 2
    assert quant_config._matches_any(entries, ["model.layers.3.mlp.gate"])
    assert not quant_config._matches_any(entries, ["model.layers.3.mlp.gate_proj"])


@pytest.mark.parametrize(
    ("ignore", "expected"),
    [
        ([r"re:.*mlp\.experts\.\d+\..*_proj$"], WeightFormat.BF16),
        ([r"re:.*model\.layers\.\d+\.mlp\.experts\.\d+\..*"], WeightFormat.BF16),
        ([r"re:.*mlp\.experts.*"], WeightFormat.BF16),
        ([r"re:.*(gate_proj|up_proj|down_proj)$"], WeightFormat.BF16),
        ([r"re:.*lm_head", r"re:.*mlp.gate$", r"re:.*self_attn.*"], WeightFormat.MXFP8),
        ([r"re:model.layers.\d+.mlp.shared_expert.*", "lm_head"], WeightFormat.MXFP8),
        ([r"re:^model\.layers\.[0-9]+\.mlp\.gate$"], WeightFormat.MXFP8),
    ],
)
def test_real_ignore_patterns_detect_as_before(ignore: list[str], expected: WeightFormat) -> None:
    config = _ct(format="mxfp8-quantized", ignore=ignore)
    assert detect_expert_format(config, PREFIX, num_experts=8) is expected


def test_a_pattern_over_some_experts_is_still_refused_as_partial() -> None:
    config = _ct(format="mxfp8-quantized", ignore=[r"re:.*experts\.[0-3]\..*_proj$"])
    with pytest.raises(NotImplementedError, match=r"ignores only some of its modules"):
        detect_expert_format(config, PREFIX, num_experts=8)
    config = _ct(format="mxfp8-quantized", ignore=[r"re:.*experts\.[4-7]\..*_proj$"])
    with pytest.raises(NotImplementedError, match=r"experts\.4\.gate_proj"):
        detect_expert_format(config, PREFIX, num_experts=8)


def test_a_long_plain_ignore_list_naming_experts_is_looked_up_not_scanned() -> None:
    """3,584 per-expert names of other layers against 1,536 expert modules: 5.5M entry
    comparisons before; set look-ups now."""
    ignore = [
        f"model.layers.{layer}.mlp.experts.{e}.down_proj"
        for layer in range(8)
        if layer != 3
        for e in range(512)
    ]
    start = time.perf_counter()
    assert detect_expert_format(
        {**FP8, "modules_to_not_convert": ignore}, PREFIX, num_experts=512
    ) is (WeightFormat.FP8_BLOCK)
    assert time.perf_counter() - start < 5.0  # 35 s before
    ignore += [f"{PREFIX}.{e}.{p}" for e in range(512) for p in ("gate_proj", "up_proj")]
    ignore += [f"{PREFIX}.{e}.down_proj" for e in range(512)]
    assert detect_expert_format(
        {**FP8, "modules_to_not_convert": ignore}, PREFIX, num_experts=512
    ) is (WeightFormat.BF16)
