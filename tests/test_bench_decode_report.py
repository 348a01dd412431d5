"""``benchmarks/bench_decode.py --from-json`` on the CPU: saved H200 and H100 runs, re-reported.

The saved runs are ``docs/img/decode_h200.json`` and ``decode_h100.json`` (the tables in
docs/gpu.md), and the tenth session's H200 run, ``decode_h200_2026-12-05.json``, which names
no card. Their times are measured; the ``chosen`` column (and a block's ``auto``) must be
the path this checkout's rule takes at each count on the run's card, whatever rule the run
itself was taken under.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from benchmark_scripts import load_benchmark

from megamoe.core.backends.small_batch import crossover_tokens

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "docs" / "img" / "decode_h200_2026-12-05.json"  # names no card: an H200's
SAVED_RUNS = [SAVED, *(ROOT / "docs" / "img" / f"decode_{card}.json" for card in ("h200", "h100"))]
# a run of the DeepSeek-V3-shaped layer alone (no block rows)
LAYER_RUNS = [*SAVED_RUNS, ROOT / "docs" / "img" / "decode_h100_deepseekv3.json"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("bench_decode")


@pytest.mark.parametrize("saved", LAYER_RUNS, ids=lambda path: path.stem)
def test_the_saved_run_is_reported_with_this_checkouts_rule(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], saved: Path
) -> None:
    report = json.loads(saved.read_text())
    card = report.get("card", bench.SAVED_CARD)
    max_tokens = max(row["tokens"] for row in report["rows"])
    for row in report["rows"]:  # plant the opposite choice: the report must not keep it
        row["chosen"] = "megamoe" if row["chosen"] == "small_batch" else "small_batch"
    planted = tmp_path / "decode.json"
    planted.write_text(json.dumps(report))
    bench.main(["--from-json", str(planted)])
    lines = {
        (cells[0], int(cells[1])): cells
        for cells in (line.split() for line in capsys.readouterr().out.splitlines())
        if len(cells) > 10 and cells[1].isdigit()
    }
    assert len(lines) == len(report["rows"])
    for row in report["rows"]:
        work = bench.layer_of(row["layer"])
        limit = crossover_tokens(work, max_tokens, card)
        expected = "small_batch" if row["tokens"] <= limit else "megamoe"
        assert lines[(row["layer"], row["tokens"])][10] == expected, (row["layer"], row["tokens"])
        again = bench.rechosen(row, max_tokens, card)
        assert again["chosen"] == expected
        assert again["chosen_us"] == row["small" if expected == "small_batch" else "megamoe"]


@pytest.mark.parametrize("saved", SAVED_RUNS, ids=lambda path: path.stem)
def test_a_saved_blocks_auto_is_the_path_this_checkouts_rule_takes(
    bench: ModuleType, saved: Path
) -> None:
    report = json.loads(saved.read_text())
    card, blocks = report.get("card", bench.SAVED_CARD), report["blocks"]
    assert blocks
    block_max = max(row["tokens"] for row in blocks)
    for row in blocks:
        planted = row | {"auto_path": "nonsense", "auto": -1.0}
        again = bench.block_chosen(planted, block_max, card)
        limit = crossover_tokens(bench.layer_of(row["block"]), block_max, card)
        path = "small_batch" if row["tokens"] <= limit else "megamoe"
        assert again["auto_path"] == path, (row["block"], row["tokens"])
        assert again["auto"] == row[path]
        assert again["auto/megamoe"] == row[path] / row["megamoe"]


def test_the_floor_is_the_runs_cards(bench: ModuleType) -> None:
    """A run on an H100 SXM (3.35 TB/s) has a floor 4.8/3.35 times the H200's where the
    weights bound it; a saved run that names no card was an H200's; an unknown card is
    refused by name."""
    row = json.loads(SAVED.read_text())["rows"][0]
    assert row["tokens"] == 1  # one token: the weights' bytes bound the floor
    h200 = bench.rechosen(row, 8192, bench.SAVED_CARD)["floor"]
    h100 = bench.rechosen(row, 8192, "NVIDIA H100 80GB HBM3")["floor"]
    assert h100 / h200 == pytest.approx(4.8 / 3.35)
    assert h200 == pytest.approx(row["floor"])  # the saved run's own floor (an H200's)
    with pytest.raises(SystemExit, match=r"'NVIDIA B200'.*CARD_PEAKS"):
        bench.card_peaks("NVIDIA B200")
