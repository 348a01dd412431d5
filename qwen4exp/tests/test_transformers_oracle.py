"""Qwen4-Exp (composite and text-only) and Qwen3-Next checkpoints written by transformers
5.24.0 load through megamoe and match transformers' own MoE modules.

Tiny random models (``testing/transformers_oracle.py``) are saved per expert and fused
(``save_original_format=False``), in BF16 and block-FP8 (float32 ``weight_scale_inv`` per
128x128, ``quantization_config`` at the top level), with an MTP layer at
``mtp.layers.0`` as the releases keep it. Every MoE layer, the MTP one included, is loaded
with ``open_checkpoint`` -> ``build_block`` -> ``load_from_checkpoint`` and its output
compared with a float64 copy of the transformers module (eager experts):
``max |ours - oracle| / max |oracle| <= 1e-2``, and the same experts for every token whose
softmax margin is above 1e-3 (nearer ties are left out: transformers rounds the logits to
bf16, megamoe computes them in float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from oracle_check import (
    MIN_AWAY_FROM_TIES,
    TOKENS,
    check_mtp_declared_only,
    compare_checkpoint,
)
from transformers_oracle import build_tiny_model, save_checkpoint

TOLERANCE = 1e-2
FAMILIES = ("qwen4_exp", "qwen4_exp_text", "qwen3_next")
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
    tiny = build_tiny_model(family, seed=7)
    path = save_checkpoint(tiny, tmp_path / "ckpt", mtp_layers=1, **LAYOUTS[layout])
    reader, results = compare_checkpoint(path, tiny)
    assert {r.prefix for r in results} == set(tiny.moe_blocks)
    assert [r.prefix for r in results if r.is_mtp] == ["mtp.layers.0.mlp"]
    for r in results:
        print(f"{family} {layout} {r.prefix}: rel. error {r.error:.2e}")
        assert r.error <= TOLERANCE, r
        assert r.compared_tokens >= MIN_AWAY_FROM_TIES * TOKENS, r
        assert r.routing_mismatches == 0, r
    stored = {layer.checkpoint_format.value for layer in reader.layers}
    assert stored == {"fp8_block" if layout.startswith("fp8_block") else "bf16"}


def test_declared_mtp_without_tensors_loads_the_main_layers(tmp_path: Path) -> None:
    check_mtp_declared_only(tmp_path / "ckpt", "qwen4_exp", TOLERANCE)


@pytest.mark.filterwarnings(NOT_POW2)
def test_inspect_verify_and_convert_work_on_the_release_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megamoe.core.cli import main as cli

    tiny = build_tiny_model("qwen4_exp", seed=5)
    path = save_checkpoint(tiny, tmp_path / "ckpt", fused=True, mtp_layers=1)
    assert cli.main(["inspect", str(path), "--arch", "sm90"]) == 0
    shown = capsys.readouterr().out
    assert "adapter qwen4exp" in shown
    assert "model.language_model.layers.0.mlp" in shown and "mtp.layers.0.mlp" in shown
    assert cli.main(["verify", str(path)]) == 0
    out = tmp_path / "fp8"
    assert cli.main(["convert", str(path), str(out), "--to", "fp8_block", "--no-progress"]) == 0
    assert cli.main(["verify", str(out)]) == 0
    _, results = compare_checkpoint(out, tiny)
    assert all(r.error <= 6e-2 for r in results), results
