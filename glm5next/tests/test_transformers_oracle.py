"""GLM-5.3-Flash, DeepSeek-V3 and GLM-4.5 checkpoints written by transformers 5.24.0 load
through megamoe and match transformers' own MoE modules.

Tiny random models (``testing/transformers_oracle.py``) are saved per expert and fused
(``save_original_format=False``), in BF16 and block-FP8 (float32 ``weight_scale_inv`` per
128x128, ``quantization_config`` at the top level), with an MTP layer laid out as the
releases keep it (decoder index ``num_hidden_layers``). Every MoE layer, the MTP one
included, is loaded with ``open_checkpoint`` -> ``build_block`` -> ``load_from_checkpoint``
and its output compared with a float64 copy of the transformers module (eager experts):
``max |ours - oracle| / max |oracle| <= 1e-2``, and the same experts for every token whose
selection margin is above 1e-3 (nearer ties are left out: bf16 inputs round the scores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from oracle_check import (
    MIN_AWAY_FROM_TIES,
    TOKENS,
    check_mtp_declared_only,
    compare_checkpoint,
    tokens,
)
from transformers_oracle import build_tiny_model, clamped_fraction, save_checkpoint

from megamoe.core.adapters import open_checkpoint

TOLERANCE = 1e-2
CLAMP = 1.5  # small enough that the clamp acts on a good share of gate and up values
FAMILIES = ("glm5_next", "deepseek_v3", "glm4_moe")
LAYOUTS = {
    "per-expert": {},
    "fused": {"fused": True},
    "fp8_block": {"fp8_block": True},
    # the shared expert kept BF16, each projection in modules_to_not_convert (transformers')
    "fp8_block-bf16-shared": {"fp8_block": True, "fp8_shared": False},
}
NOT_POW2 = "ignore:.*not powers of two:UserWarning"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_moe_layer_matches_transformers(tmp_path: Path, family: str, layout: str) -> None:
    clamp = {"swiglu_limit": CLAMP} if family == "glm5_next" else {}
    tiny = build_tiny_model(family, seed=11, **clamp)
    path = save_checkpoint(tiny, tmp_path / "ckpt", mtp_layers=1, **LAYOUTS[layout])
    reader, results = compare_checkpoint(path, tiny, unclamped=bool(clamp))
    assert {r.prefix for r in results} == set(tiny.moe_blocks)
    assert [r.is_mtp for r in results].count(True) == 1
    for r in results:
        print(f"{family} {layout} {r.prefix}: rel. error {r.error:.2e}")
        assert r.error <= TOLERANCE, r
        assert r.compared_tokens >= MIN_AWAY_FROM_TIES * TOKENS, r
        assert r.routing_mismatches == 0, r
        if clamp:
            # The comparison is sharp enough to see the clamp: without it, far off.
            assert r.unclamped_error is not None and r.unclamped_error > 10 * TOLERANCE, r
    stored = {layer.checkpoint_format.value for layer in reader.layers}
    assert stored == {"fp8_block" if layout.startswith("fp8_block") else "bf16"}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize(
    "setting",
    [
        # transformers builds the shared MLP 0 wide and saves its empty tensors: they load as
        # nothing
        {"n_shared_experts": 0},
        {"hidden_act": "swish"},  # transformers' other name of silu
    ],
    ids=["no shared experts", "swish"],
)
def test_a_config_transformers_accepts_matches_transformers(
    tmp_path: Path, setting: dict[str, object]
) -> None:
    tiny = build_tiny_model("glm5_next", seed=11, swiglu_limit=CLAMP, **setting)
    path = save_checkpoint(tiny, tmp_path / "ckpt", mtp_layers=1)
    _, results = compare_checkpoint(path, tiny)
    assert {r.prefix for r in results} == set(tiny.moe_blocks)
    for r in results:
        assert r.error <= TOLERANCE and r.routing_mismatches == 0, r


def test_the_clamp_acts_on_a_stated_share_of_values() -> None:
    tiny = build_tiny_model("glm5_next", seed=11, swiglu_limit=CLAMP)
    for prefix in tiny.moe_blocks:
        gate, up = clamped_fraction(tiny, prefix, tokens(256))
        print(f"{prefix}: {gate:.1%} of gate and {up:.1%} of up values clamped at {CLAMP}")
        assert gate >= 0.02 and up >= 0.02


def test_declared_mtp_without_tensors_loads_the_main_layers(tmp_path: Path) -> None:
    check_mtp_declared_only(tmp_path / "ckpt", "glm5_next", TOLERANCE)


@pytest.mark.filterwarnings(NOT_POW2)
def test_inspect_verify_and_convert_work_on_the_release_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megamoe.core.cli import main as cli

    tiny = build_tiny_model("glm5_next", seed=5, swiglu_limit=CLAMP)
    path = save_checkpoint(tiny, tmp_path / "ckpt", fp8_block=True, mtp_layers=1)
    assert cli.main(["inspect", str(path), "--arch", "sm100"]) == 0
    shown = capsys.readouterr().out
    assert "adapter glm5next" in shown
    assert "model.language_model.layers.3.mlp" in shown and "fp8_block" in shown
    assert "model.language_model.layers.4.mlp" in shown  # the MTP layer
    assert cli.main(["verify", str(path), "--layers", "1,mtp"]) == 0
    out = tmp_path / "mxfp8"
    assert cli.main(["convert", str(path), str(out), "--to", "mxfp8", "--no-progress"]) == 0
    assert cli.main(["verify", str(out)]) == 0
    converted, _ = open_checkpoint(out)
    assert {layer.checkpoint_format.value for layer in converted.layers} == {"mxfp8"}
    # The converted checkpoint still matches transformers (its experts now rounded to
    # MXFP8: a looser bound, which the per-expert FP8 original meets at 1e-2).
    _, results = compare_checkpoint(out, tiny)
    assert all(r.error <= 6e-2 for r in results), results
