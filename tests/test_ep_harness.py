"""``benchmarks/bench_ep.py`` on the CPU: gloo, the reference backend, toy sizes.

The harness runs as documented, ``torchrun --nproc-per-node N benchmarks/bench_ep.py``
(``--standalone``: torchrun picks a free port itself), with 2 and 4 processes, redundant
(EPLB) experts in one case, and every rank's error against the one-rank reference is
checked from its JSON report. A launch that hangs is killed, process group and all, and
fails. In-process checks cover the replica map and show that a wrong one fails the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_ep.py"
# Both sides emulate the kernel on the reference backend, so only float32 summation order
# may differ between N ranks and one: at most one bf16 ulp (2^-8) at the output's largest
# magnitude. Seen on the CPU: 0 (bit for bit). A misplaced expert or weight gives ~1.
TOLERANCE = 2.0**-8
LAUNCH_TIMEOUT_S = 90  # a hang fails here; a launch takes ~10 s on 2 cores
FAST = ["--backend", "reference", "--device", "cpu", "--toy", "--tokens", "1,8,64"]
FAST += ["--warmup", "0", "--reps", "2"]


def _torchrun(ranks: int, *args: str, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(BENCH), *FAST, *args, "--json", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: a timeout kills every rank
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{ranks} ranks hung for {LAUNCH_TIMEOUT_S} s:\n{output}")
    assert proc.returncode == 0, output
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("ranks", "model", "redundant", "experts_per_rank"),
    [(2, "glm", 0, 16), (4, "qwen", 4, 9)],  # toy E=32: (32 + R) / N
)
def test_every_rank_matches_the_one_rank_reference(
    tmp_path: Path, ranks: int, model: str, redundant: int, experts_per_rank: int
) -> None:
    report = _torchrun(
        ranks, "--model", model, "--redundant", str(redundant), out=tmp_path / "r.json"
    )
    assert (report["world_size"], report["redundant"]) == (ranks, redundant)
    assert report["experts_per_rank"] == experts_per_rank
    assert report["layer"]["model"] == model and report["run_format"] == "fp8_block"
    assert [row["tokens"] for row in report["rows"]] == [1, 8, 64]
    for row in report["rows"]:
        errors = row["max_rel_error_per_rank"]
        assert len(errors) == ranks and len(row["us_per_rank"]) == ranks
        assert all(0.0 <= e <= TOLERANCE for e in errors), (row["tokens"], errors)
        assert row["ok"] and row["us"] == max(row["us_per_rank"]) > 0
        assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens"] / row["us"] * 1e6)


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench_ep imported as the script sees itself (its ``harness`` beside it), one rank."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return load_benchmark("bench_ep")


def test_replicas_hold_the_routed_expert_and_share_its_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _bench(monkeypatch)
    experts, physical, tokens, top_k = 6, 10, 16, 3  # logical 0..3 have a second copy
    spread = bench.ReplicaSpread(experts, physical, tokens, top_k, torch.device("cpu"))
    ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32)
    ids[:, 0] = 1  # every token picks expert 1 in slot 0 (and 5 in slot 1): replicated and not
    ids[:, 1] = 5
    x, weights = torch.zeros(tokens, 8), torch.rand(tokens, top_k)
    x_out, w_out, mapped = spread(torch.nn.Identity(), (x, weights, ids))
    assert x_out is x and w_out is weights
    assert mapped.dtype == torch.int32 and bool((mapped < physical).all())
    assert torch.equal(mapped % experts, ids)  # each replica holds its logical expert
    assert sorted(mapped[:, 0].tolist()) == [1] * 8 + [7] * 8  # split evenly over 1 and 7
    assert set(mapped[:, 1].tolist()) == {5}  # one copy only


def test_a_wrong_replica_map_fails_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = _bench(monkeypatch)
    build = bench.ReplicaSpread.__init__

    def off_by_one(self: Any, num_logical: int, num_physical: int, *rest: Any) -> None:
        build(self, num_logical, num_physical, *rest)
        self.table = (self.table + 1) % num_physical  # each slot served by the next expert

    monkeypatch.setattr(bench.ReplicaSpread, "__init__", off_by_one)
    out = tmp_path / "wrong.json"
    args = [*FAST, "--tokens", "8", "--model", "qwen", "--redundant", "4", "--json", str(out)]
    assert bench.main(args) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert not row["ok"] and row["max_rel_error_per_rank"][0] > 0.1


def test_a_one_rank_run_is_the_baseline_of_the_same_layer_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench(monkeypatch)
    out = tmp_path / "one.json"
    assert bench.main([*FAST, "--model", "qwen", "--json", str(out)]) == 0
    one = json.loads(out.read_text())
    assert [row["vs_one_rank"] for row in one["rows"]] == [1.0, 1.0, 1.0]  # its own baseline
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bench.parse([*FAST, "--model", "qwen", "--baseline", str(out)]).baseline_us == {
        row["tokens"]: row["us"] for row in one["rows"]
    }
    with pytest.raises(SystemExit):
        bench.parse([*FAST, "--model", "glm", "--baseline", str(out)])
    error = capsys.readouterr().err
    assert f"--baseline {out}: another layer (differs in " in error
    assert "hidden" not in error and "model" in error and "swiglu_limit" in error
    assert "bench_ep.py --model glm --backend reference --device cpu --part block --toy" in error
