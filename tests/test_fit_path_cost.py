"""``benchmarks/fit_path_cost.py`` on the CPU: it recovers the models that made a run's times.

Runs are planted whose times are exactly two known ``PathCost`` models' predictions (not the
checkout's), the real layers in one file and the DeepSeek-V3-shaped one in another; the fit of
both must predict every row within 2% and place each layer's crossover where those models do.
A file that is not a bench_decode run, and runs of two cards, are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import load_benchmark

from megamoe.core.backends.small_batch import PathCost, crossover_between

# Two models unlike the checkout's: a small-batch path twice as costly per program and
# slower at streaming, a MegaMoE with a larger fixed cost; both with a cost per pair
SMALL = PathCost(fixed_us=15.0, per_slot_us=0.0, per_program_us=0.005, bandwidth=4.2e12,
                 flops=3.0e14, per_pair_us=0.004)  # fmt: skip
MEGAMOE = PathCost(fixed_us=80.0, per_slot_us=0.04, per_program_us=0.0, bandwidth=4.0e12,
                   flops=6.0e14, per_pair_us=0.03)  # fmt: skip
COUNTS = (1, 4, 16, 64, 256, 1024, 2048, 4096)
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_benchmark("fit_path_cost")


def planted_run(tool: ModuleType, path: Path, layers: tuple[str, ...], card: str) -> Path:
    """A run of ``layers`` on ``card`` whose times are ``SMALL``'s and ``MEGAMOE``'s."""
    rows = []
    for layer in layers:
        work = tool.layer_of(layer)
        for tokens in COUNTS:
            rows.append({"layer": layer, "tokens": tokens,
                         "small": work.predicted_us(SMALL, tokens),
                         "megamoe": work.predicted_us(MEGAMOE, tokens)})  # fmt: skip
    path.write_text(json.dumps({"card": card, "rows": rows}))
    return path


def test_the_fit_recovers_the_models_behind_two_runs(tool: ModuleType, tmp_path: Path) -> None:
    real = planted_run(tool, tmp_path / "decode.json", ("qwen4exp", "glm53flash"), H100)
    shaped = planted_run(tool, tmp_path / "deepseekv3.json", ("deepseekv3",), H100)
    out = tmp_path / "fit.json"
    result = tool.main([str(real), str(shaped), "--json", str(out)])
    assert json.loads(out.read_text())["crossovers"] == result["crossovers"]
    assert set(result["crossovers"]) == {"qwen4exp", "glm53flash", "deepseekv3"}
    assert result["card"] == H100
    for row in result["rows"]:
        assert abs(row["fit error"]) < 0.02, row
    for layer, crossover in result["crossovers"].items():
        work = tool.layer_of(layer)
        expected = crossover_between(work, SMALL, MEGAMOE, 65536)
        assert abs(crossover["fitted"] - expected) <= 0.02 * expected, (layer, crossover)
        measured = max((t for t in COUNTS if t <= expected), default=0)
        assert crossover["measured"] == measured


def test_a_file_that_is_not_a_run_is_refused(tool: ModuleType, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"layers": []}))
    with pytest.raises(SystemExit, match=r"wrong\.json is not a bench_decode\.py --json"):
        tool.main([str(wrong)])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [{"layer": "llama", "tokens": 1, "small": 1.0}]}))
    with pytest.raises(SystemExit, match="has no rows of the layers"):
        tool.main([str(other)])


def test_runs_of_two_cards_are_refused(tool: ModuleType, tmp_path: Path) -> None:
    # one card's models are fitted to that card's runs alone
    h100 = planted_run(tool, tmp_path / "h100.json", ("qwen4exp",), H100)
    h200 = planted_run(tool, tmp_path / "h200.json", ("glm53flash",), "NVIDIA H200")
    with pytest.raises(SystemExit, match=r"different cards \(.*h100\.json: NVIDIA H100.*h200"):
        tool.main([str(h100), str(h200)])
