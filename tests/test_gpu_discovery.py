"""What ``nox -s gpu_tests`` installs is what users run: adapters found by entry points.

``gpu_tests`` installs megamoe-core, -qwen4exp and -glm5next into the machine's python3
without dependencies (issue 38); here the registry finds both adapters through the
installed distributions' entry points, ``open_checkpoint`` picks each, and the
``megamoe`` command (the installed console script where there is one, else
``python -m megamoe.core.cli.main``) writes and inspects a sample of each.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from megamoe.core.adapters import ENTRY_POINT_GROUP, installed_adapters, open_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ADAPTERS = {"qwen4exp": "megamoe-qwen4exp", "glm5next": "megamoe-glm5next"}


def _megamoe() -> list[str]:
    script = Path(sys.executable).parent / "megamoe"
    found = str(script) if script.exists() else shutil.which("megamoe")
    return [found] if found else [sys.executable, "-m", "megamoe.core.cli.main"]


def test_entry_points_of_the_installed_distributions_find_both_adapters() -> None:
    points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert set(ADAPTERS) <= points.keys(), sorted(points)
    for name, distribution in ADAPTERS.items():
        dist = points[name].dist
        assert dist is not None and dist.metadata["Name"] == distribution, dist
    assert set(ADAPTERS) <= installed_adapters().keys()


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_the_command_writes_and_inspects_a_sample(tmp_path: Path, adapter: str) -> None:
    out = tmp_path / adapter
    run = [*_megamoe(), "sample", str(out), "--adapter", adapter, "--format", "bf16"]
    done = subprocess.run(run, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    reader, found = open_checkpoint(out)
    assert found.name == adapter and reader.layers
    done = subprocess.run([*_megamoe(), "inspect", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"-> adapter {adapter} ({ADAPTERS[adapter]})" in done.stdout, done.stdout
    assert "defaults    " in done.stdout, done.stdout
