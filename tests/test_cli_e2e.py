"""The megamoe command as a user runs it: a subprocess, installed adapters, exit codes, output."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.core.adapters import SyntheticSizes, installed_adapters
from megamoe.core.cli import main as cli
from megamoe.core.cli.verify import LOSSY_MXFP4_TOLERANCE, TOLERANCE
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint

ADAPTERS = installed_adapters()
CASES = [(name, fmt) for name, a in ADAPTERS.items() for fmt in a.checkpoint_formats]
SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)
SCRIPT = Path(sys.executable).parent / "megamoe"


def megamoe(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m megamoe.core.cli.main`` (the console script's target) in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "megamoe.core.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _table_rows(out: str, first: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first]]


def test_console_script_is_installed_and_shows_help() -> None:
    assert SCRIPT.is_file(), f"no megamoe console script beside {sys.executable}"
    done = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0
    for command in ("demo", "inspect", "convert", "verify", "bench"):
        assert command in done.stdout


@pytest.mark.parametrize("checkpoint_format", [WeightFormat(f) for f in cli.CHECKPOINT_FORMATS])
def test_demo_passes_for_every_adapter_loading_the_format(
    checkpoint_format: WeightFormat,
) -> None:
    done = megamoe("demo", "--format", checkpoint_format.value, "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    expected = sorted(n for n, a in ADAPTERS.items() if checkpoint_format in a.checkpoint_formats)
    rows = [r for name in expected for r in _table_rows(done.stdout, name)]
    assert [r[0] for r in rows] == expected
    for row in rows:
        assert row[1] == checkpoint_format.value and row[3] == "reference" and row[-1] == "ok"
        assert float(row[4]) <= float(row[5])  # max rel. error within the stated tolerance
    assert f"{len(expected)} of {len(expected)} combinations within tolerance" in done.stdout


def test_demo_unknown_adapter_is_a_usage_mistake() -> None:
    done = megamoe("demo", "--adapter", "llama")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"megamoe demo: error: --adapter llama: not installed; installed: {', '.join(ADAPTERS)}"
    ]


def test_demo_selecting_nothing_names_what_exists() -> None:
    done = megamoe("demo", "--adapter", "glm5next", "--format", "mxfp8")
    assert done.returncode == 2 and done.stdout == ""
    loads = ", ".join(f.value for f in ADAPTERS["glm5next"].checkpoint_formats)
    assert done.stderr == (
        f"megamoe demo: error: --format mxfp8: no selected adapter loads it (glm5next loads "
        f"{loads}); pick one of those\n"
    )


@pytest.mark.parametrize("adapter_name", list(ADAPTERS))
def test_quickstart_sample_inspect_convert_verify_against(
    tmp_path: Path, adapter_name: str
) -> None:
    src, out = tmp_path / "sample", tmp_path / "sample-mxfp4"
    done = megamoe("sample", str(src), "--adapter", adapter_name)
    assert done.returncode == 0, done.stderr
    release = ADAPTERS[adapter_name].checkpoint_formats[0].value
    assert f"({adapter_name}), routed experts stored as {release}" in done.stdout
    layers = ADAPTERS[adapter_name].moe_layers(json.loads((src / "config.json").read_text()))

    done = megamoe("inspect", str(src))
    assert done.returncode == 0, done.stderr
    assert f"adapter {adapter_name}" in done.stdout

    done = megamoe("convert", str(src), str(out), "--to", "mxfp4", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert f"next: megamoe verify {out} --against {src}" in done.stdout

    done = megamoe("verify", str(out), "--against", str(src), "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "conversion loss" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if ".mlp " in line]
    assert len(rows) == len(layers)
    for row in rows:
        cells = row[1:] if row[1] == "(mtp)" else row
        stored, run, loss, error, tol = cells[2], cells[3], cells[5], cells[6], cells[7]
        assert (stored, run, tol) == ("mxfp4", "mxfp4", repr(LOSSY_MXFP4_TOLERANCE))
        # The conversion's loss is most of the error against the source.
        assert 0.05 < float(loss) <= float(error) * 1.2 and float(error) <= float(tol)
    assert f"(max |out - ref| / max |ref| vs the float64 reference of {src})" in done.stdout

    # Its own reference: what the kernel path adds to the converted weights, much less.
    done = megamoe("verify", str(out), "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(
        float(line.split()[-4]) < 0.05 for line in done.stdout.splitlines() if ".mlp " in line
    )


@pytest.mark.parametrize("adapter_name", list(ADAPTERS))
def test_forced_mxfp4_passes_on_the_projects_own_checkpoints(
    tmp_path: Path, adapter_name: str
) -> None:
    src = tmp_path / "sample"
    assert megamoe("sample", str(src), "--adapter", adapter_name).returncode == 0
    done = megamoe("verify", str(src), "--moe-format", "mxfp4", "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    tolerances = {line.split()[-3] for line in done.stdout.splitlines() if ".mlp " in line}
    # Printed exactly as applied: the lossy MXFP4 tolerance, and the MTP layer's own.
    assert repr(LOSSY_MXFP4_TOLERANCE) in tolerances
    assert tolerances <= {repr(t) for t in (LOSSY_MXFP4_TOLERANCE, *TOLERANCE.values())}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_verify_shows_progress_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", "qwen4exp", "bf16", SIZES)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["verify", str(src), "--device", "cpu", "--layers", "0"]) == 0
    shown = terminal.getvalue()
    assert "model.language_model.layers.0.mlp: reference" in shown and "1/1" in shown
    terminal.seek(0)
    terminal.truncate()
    assert cli.main(["verify", str(src), "--device", "cpu", "--layers", "0", "--no-progress"]) == 0
    assert terminal.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    assert cli.main(["verify", str(src), "--device", "cpu", "--layers", "0"]) == 0
    assert sys.stderr.getvalue() == ""
    assert "1 of 1 layer(s) within tolerance" in capsys.readouterr().out


def test_convert_shows_progress_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", "qwen4exp", "bf16", SIZES)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["convert", str(src), str(tmp_path / "a"), "--to", "mxfp8"]) == 0
    assert "copy" in terminal.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    assert cli.main(["convert", str(src), str(tmp_path / "b"), "--to", "mxfp8"]) == 0
    assert sys.stderr.getvalue() == ""


@pytest.mark.parametrize(
    ("adapter_name", "checkpoint_format"), CASES, ids=[f"{a}-{f.value}" for a, f in CASES]
)
def test_inspect_convert_verify(
    tmp_path: Path, adapter_name: str, checkpoint_format: WeightFormat
) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", adapter_name, checkpoint_format, SIZES)
    target = "mxfp4" if checkpoint_format is WeightFormat.MXFP8 else "mxfp8"
    layers = ADAPTERS[adapter_name].moe_layers(json.loads((src / "config.json").read_text()))

    done = megamoe("inspect", str(src), "--ep-size", "2", "--arch", "sm100")
    assert done.returncode == 0, done.stderr
    assert f"adapter {adapter_name}" in done.stdout and "2 experts per rank" in done.stdout
    listed = [line for line in done.stdout.splitlines() if ".mlp " in line]
    assert [line.split()[2 if "(mtp)" in line else 1] for line in listed] == [
        layer.prefix for layer in layers
    ]

    out = tmp_path / "out"
    done = megamoe("convert", str(src), str(out), "--to", target)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: " in done.stdout and f"requantized to {target}" in done.stdout
    assert "100%" not in done.stderr  # not a terminal: no progress bar

    done = megamoe("verify", str(out), "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(layers)} of {len(layers)} layer(s) within tolerance" in done.stdout
    listed = [line.split() for line in done.stdout.splitlines() if ".mlp " in line]
    assert len(listed) == len(layers)
    assert {row[3 if row[1] == "(mtp)" else 2] for row in listed} == {target}  # stored format


def test_verify_fails_beyond_tolerance(tmp_path: Path) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", "qwen4exp", "bf16", SIZES)
    done = megamoe("verify", str(src), "--layers", "0", "--tolerance", "1e-9", "--device", "cpu")
    assert done.returncode == 1
    assert "FAIL" in done.stdout and "0 of 1 layer(s) within tolerance" in done.stdout


# ------------------------------------------------------------------ bad checkpoints
def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _expert_tensor(path: Path) -> tuple[str, Path]:
    name = next(n for n in sorted(_index(path)["weight_map"]) if ".experts.1.down_proj.weight" in n)
    return name, path / _index(path)["weight_map"][name]


def _rewrite(path: Path, change) -> None:
    name, shard = _expert_tensor(path)
    tensors = load_file(shard)
    change(tensors, name)
    save_file(tensors, shard, metadata={"format": "pt"})


def _config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(config))


BAD = {
    "missing shard": (lambda p: _expert_tensor(p)[1].unlink(), "shard file is missing"),
    "index names absent tensor": (
        lambda p: _rewrite(p, lambda t, n: t.pop(n)),
        "is named in model.safetensors.index.json but absent from this file",
    ),
    "truncated file": (
        lambda p: _expert_tensor(p)[1].write_bytes(_expert_tensor(p)[1].read_bytes()[:-512]),
        "the file is truncated or corrupt",
    ),
    "corrupt header": (
        lambda p: _expert_tensor(p)[1].write_bytes(b"\xff" * 16),
        "not a readable safetensors file",
    ),
    "wrong dtype": (
        lambda p: _rewrite(p, lambda t, n: t.__setitem__(n, t[n].view(torch.int16))),
        "has dtype torch.int16, expected torch.bfloat16 for bf16 experts",
    ),
    "float16 experts": (
        lambda p: _rewrite(p, lambda t, n: t.__setitem__(n, t[n].to(torch.float16))),
        "has dtype torch.float16; megamoe reads unquantized expert weights in bfloat16 only",
    ),
    "wrong shape": (
        lambda p: _rewrite(p, lambda t, n: t.__setitem__(n, t[n][:, :64].contiguous())),
        "has shape (256, 64), expected (256, 128)",
    ),
    "unknown model type": (
        lambda p: _config(
            p, model_type="mixtral", architectures=["MixtralForCausalLM"], text_config={}
        ),
        "no installed megamoe adapter handles model_type='mixtral' "
        "(architectures=['MixtralForCausalLM']); installed: glm5next (glm5_next, ",
    ),
    "unsupported quantization": (
        lambda p: _config(p, quantization_config={"quant_method": "gptq", "bits": 4}),
        "quantization_config quant_method='gptq' is not supported",
    ),
}


def _one_error_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode == 1, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megamoe {command}: error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_readable_line(tmp_path: Path, case: str) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", "qwen4exp", "bf16", SIZES)
    damage, message = BAD[case]
    damage(src)
    assert message in _one_error_line(megamoe("inspect", str(src)), "inspect")


@pytest.mark.parametrize("command", ["verify", "convert"])
def test_a_non_finite_tensor_is_one_line_naming_its_shard(tmp_path: Path, command: str) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", "qwen4exp", "bf16", SIZES)
    _rewrite(src, lambda tensors, name: tensors[name].__setitem__((0, 0), float("nan")))
    name, shard = _expert_tensor(src)
    extra = [str(tmp_path / "out"), "--to", "mxfp8"] if command == "convert" else []
    line = _one_error_line(megamoe(command, str(src), *extra), command)
    assert "experts.1.down_proj" in line and "non-finite value" in line
    assert line.endswith(f"; {name} was read from {shard}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # convert left nothing


@pytest.mark.parametrize("command", ["verify", "convert"])
def test_bad_checkpoint_stops_verify_and_convert_before_any_work(
    tmp_path: Path, command: str
) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", "qwen4exp", "bf16", SIZES)
    damage, message = BAD["wrong shape"]
    damage(src)
    extra = [str(tmp_path / "out"), "--to", "mxfp8"] if command == "convert" else []
    done = megamoe(command, str(src), *extra)
    assert message in _one_error_line(done, command)
    assert done.stdout == ""  # no table, no partial result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
