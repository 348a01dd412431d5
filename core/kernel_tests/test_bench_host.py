"""``benchmarks/bench_host.py`` runs on a machine without a GPU and reports every row.

It replaces the small-batch kernels' launches with no-ops, so it runs in a process of its
own (this folder's other tests launch them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "bench_host.py"


def test_the_host_benchmark_times_each_layer_and_token_count(tmp_path: Path) -> None:
    report = tmp_path / "host.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    testing = str(ROOT / "testing")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [testing, env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(TOOL), "--tokens", "1,600,1400,2000", "--calls", "20", "--rounds", "2",
         "--json", str(report)],
        env=env, capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(report.read_text())
    rows = {(row["layer"], row["tokens"]): row for row in result["rows"]}
    assert set(rows) == {(layer, tokens) for layer in ("qwen4exp", "glm53flash")
                         for tokens in (1, 600, 1400, 2000)}  # fmt: skip
    assert rows[("qwen4exp", 1)]["tiles"] == "DECODE"
    assert rows[("qwen4exp", 600)]["tiles"] == "MIDSIZE"  # 11.7 pairs per expert
    assert rows[("glm53flash", 600)]["tiles"] == "MIDSIZE"  # 16.7
    assert rows[("qwen4exp", 1400)]["tiles"] == "BATCH"  # 27.3
    assert rows[("qwen4exp", 2000)]["tiles"] == "WIDE"  # 39.1
    assert rows[("glm53flash", 1400)]["tiles"] == "WIDE"  # 38.9
    assert all(row["host us"] > 0 for row in rows.values())
    assert set(result["grid_helpers_us"]) == {"triton.cdiv", "launch.cdiv"}
