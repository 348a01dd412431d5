"""``benchmarks/fit_path_cost.py`` on the CPU: it recovers the models that made a run's times.

A run is planted whose times are exactly two known ``PathCost`` models' predictions (not the
checkout's); the fit must predict every row within 2% and place each layer's crossover where
those models do. A file that is not a bench_decode run is refused by name.
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


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_benchmark("fit_path_cost")


def test_the_fit_recovers_the_models_behind_a_run(tool: ModuleType, tmp_path: Path) -> None:
    rows = []
    for layer in ("qwen4exp", "glm53flash"):
        work = tool.layer_of(layer)
        for tokens in COUNTS:
            rows.append({"layer": layer, "tokens": tokens,
                         "small": work.predicted_us(SMALL, tokens),
                         "megamoe": work.predicted_us(MEGAMOE, tokens)})  # fmt: skip
    run = tmp_path / "decode.json"
    run.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "fit.json"
    result = tool.main([str(run), "--json", str(out)])
    assert json.loads(out.read_text())["crossovers"] == result["crossovers"]
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
