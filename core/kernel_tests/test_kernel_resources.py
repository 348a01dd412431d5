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

import pytest
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "kernel_resources.py"


def test_the_tile_shapes_compile_without_spills_and_their_programs_fit(tmp_path: Path) -> None:
    report = tmp_path / "resources.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(TOOL), "--json", str(report)],
        env=env | {"TRITON_CACHE_DIR": str(tmp_path / "triton")},
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(report.read_text())
    shapes = {(row["layer"], row["tiles"], row["kernel"]) for row in rows}
    assert len(shapes) == 2 * 4 * 2, sorted(shapes)  # both layers, four tile shapes, l1 and l2
    for row in rows:
        where = f"{row['layer']} {row['tiles']} {row['kernel']}"
        assert row["stack"] == 0, f"{where} spills registers: {row}"
        assert row["fit"] >= 1, f"{where}: no program fits an SM: {row}"
        if row["launched"] != "-":
            assert row["fit"] >= int(row["launched"]), f"{where}: programs left waiting: {row}"


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
