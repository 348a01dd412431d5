"""The small-batch kernels compiled for sm90 on CPU: no spills, and their programs fit an SM.

``benchmarks/kernel_resources.py`` compiles l1 and l2 of every tile shape the tile rule picks,
for both real layers, as the experts path launches them (Triton's wheel carries ``ptxas``),
in a process of its own: this folder's runs interpret the kernels, which compiles nothing.
A kernel that spills registers to its stack, or persistent programs of which an SM holds
fewer than the ``Tiles.l1_per_sm`` or ``l2_per_sm`` it starts (the rest start only as
others end, late for their share of the items), would be slow on the GPU with the same
bits: what only a benchmark on the GPU would otherwise show.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from benchmark_scripts import load_benchmark
from tile_forcing import weight_rows_spec

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "kernel_resources.py"


def compiled_rows(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """``kernel_resources.py``'s rows, compiled in a process of its own (no interpreter)."""
    report = tmp_path / "resources.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(TOOL), *args, "--json", str(report)],
        env=env | {"TRITON_CACHE_DIR": str(tmp_path / "triton")},
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows: list[dict[str, Any]] = json.loads(report.read_text())
    return rows


def test_the_tile_shapes_compile_without_spills_and_their_programs_fit(tmp_path: Path) -> None:
    rows = compiled_rows(tmp_path)
    shapes = {(row["layer"], row["tiles"], row["kernel"]) for row in rows}
    assert len(shapes) == 2 * 4 * 2, sorted(shapes)  # both layers, four tile shapes, l1 and l2
    for row in rows:
        where = f"{row['layer']} {row['tiles']} {row['kernel']}"
        assert row["stack"] == 0, f"{where} spills registers: {row}"
        assert row["fit"] >= 1, f"{where}: no program fits an SM: {row}"
        if row["launched"] != "-":
            assert row["fit"] >= int(row["launched"]), f"{where}: programs left waiting: {row}"


def test_the_wide_tiles_fit_three_programs_an_sm_without_spills(tmp_path: Path) -> None:
    """Past 32 pairs per expert: with the tokens as the dots' rows, l1 and l2 hold at most
    168 registers a thread without spilling, so three of each fit an SM; the same tiles
    with the weights' rows as the dots' rows (``WEIGHT_ROWS_WIDE``) take 255 and 249, and
    two fit."""
    rows = compiled_rows(tmp_path, "--tiles", f"WIDE_TILES {weight_rows_spec()}")
    by_shape = {(row["layer"], row["tiles"] == "WIDE_TILES", row["kernel"]): row for row in rows}
    for (layer, production, kernel), row in by_shape.items():
        where = f"{layer} {row['tiles']} {kernel}"
        assert row["stack"] == 0, f"{where} spills: {row}"
        assert row["fit"] == (3 if production else 2), f"{where}: {row}"
        assert row["fit"] >= int(row["launched"]), f"{where}: programs left waiting: {row}"
        if production:
            assert row["regs"] <= 168, f"{where}: {row}"
    assert len(by_shape) == 2 * 2 * 2, sorted(by_shape)


def test_the_timing_probes_apply_to_the_kernels_and_unscaled_keeps_a_dot_running(
    tmp_path: Path,
) -> None:
    """``bench_tiles.py --probes``' edits still find their production lines (a kernel change
    that moves one fails here, not on the GPU), and the unscaled probe's persistent kernels
    leave a tensor-core dot running at their waits where the production ones leave none."""
    tiles = f"WIDE_TILES {weight_rows_spec()}"
    for probe, in_flight in (("unscaled", 1), ("weights_in_l2", 0)):
        rows = compiled_rows(tmp_path, "--probe", probe, "--layers", "qwen4exp", "--tiles", tiles)
        assert len(rows) == 4, rows
        for row in rows:
            assert row["in_flight"] == in_flight, f"{probe}: {row}"


@pytest.fixture(scope="module")
def kernel_resources() -> ModuleType:
    return load_benchmark("kernel_resources")


def test_a_tile_shape_is_named_with_the_fields_it_changes(
    kernel_resources: ModuleType, gpu_like_interpreter: ModuleType
) -> None:
    """``--tiles`` of both tools: a module tile shape, or one with some fields changed."""
    kernels = gpu_like_interpreter
    assert kernel_resources.tile_shape("BATCH_TILES") == ("BATCH_TILES", kernels.BATCH_TILES)
    name, tiles = kernel_resources.tile_shape("BATCH_TILES:block_m=64,stages=4,pdl=True")
    expected = dataclasses.replace(kernels.BATCH_TILES, block_m=64, stages=4, pdl=True)
    assert (name, tiles) == ("BATCH_TILES:block_m=64,stages=4,pdl=True", expected)
    _, tiles = kernel_resources.tile_shape("BATCH_TILES:l1_per_sm=1,l2_per_sm=4")
    assert (tiles.l1_per_sm, tiles.l2_per_sm) == (1, 4)
    with pytest.raises(SystemExit, match="'NOPE' is no tile shape"):
        kernel_resources.tile_shape("NOPE")
    with pytest.raises(SystemExit, match="Tiles has no field 'block_k'"):
        kernel_resources.tile_shape("BATCH_TILES:block_k=64")


def test_dots_in_flight_is_the_most_wgmma_groups_a_wait_leaves_running(
    kernel_resources: ModuleType,
) -> None:
    """The ``in_flight`` column: 0 where every dot is waited for at once, 1 where one runs on."""
    waited_at_once = "wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;\n"
    assert kernel_resources.dots_in_flight(waited_at_once) == 0
    one_running = waited_at_once + "\twgmma.wait_group.sync.aligned  1;\n"
    assert kernel_resources.dots_in_flight(one_running) == 1
    with pytest.raises(ValueError, match=r"no wgmma\.wait_group"):
        kernel_resources.dots_in_flight("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32;")
