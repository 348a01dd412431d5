"""The megamoe command in-process, on the toy adapter: help, output, exit codes, errors."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.core.adapters import SyntheticSizes
from megamoe.core.cli import bench, commands
from megamoe.core.cli import main as cli
from megamoe.core.cli.inspection import expert_kernel_bytes, human_bytes
from megamoe.core.modules import block_setup
from megamoe.core.numerics import quant
from megamoe.core.numerics.formats import ARCHES, WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=128, num_experts=4)
COMMANDS = ("demo", "sample", "inspect", "convert", "verify", "bench")


@pytest.fixture
def checkpoint(tmp_path: Path, toy_adapter) -> Path:
    return write_synthetic_checkpoint(tmp_path / "ckpt", "toymoe", "fp8_block", SIZES)


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: megamoe {command}" in capsys.readouterr().out


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["convert", "a", "b", "--to", "nvfp4"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nvfp4'" in capsys.readouterr().err


def test_inspect_reports_layers_formats_and_bytes(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inspect", str(checkpoint), "--ep-size", "2", "--arch", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "toy_moe -> adapter toymoe (megamoe-toymoe)" in out
    assert "4 routed per layer, hidden 256, intermediate 128" in out
    assert "sm100 (--arch); expert parallel 2 -> 2 experts per rank" in out
    per_layer = 2 * expert_kernel_bytes(WeightFormat.MXFP8, 256, 128)
    # gate+up+down of one MXFP8 expert: 3 * 128 * 256 bytes + 3 * 128 * 8 scale bytes
    assert expert_kernel_bytes(WeightFormat.MXFP8, 256, 128) == 3 * 128 * 256 + 3 * 128 * 8
    rows = [line.split() for line in out.splitlines() if "model.layers." in line]
    assert len(rows) == 2
    for row in rows:
        assert row[2:5] == ["fp8_block", "mxfp8", "fp8_block"]  # stored, runs as, conversion
    assert f"per rank: {human_bytes(2 * per_layer)}" in out


def test_inspect_on_the_reference_target_converts_nothing(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inspect", str(checkpoint), "--arch", "reference"]) == 0
    rows = [
        line.split() for line in capsys.readouterr().out.splitlines() if "model.layers." in line
    ]
    assert [row[2:5] for row in rows] == [["fp8_block", "fp8_block", "none"]] * 2


def test_errors_are_one_line_with_exit_1(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inspect", str(checkpoint), "--ep-size", "3"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "megamoe inspect: error: --ep-size 3 does not divide the 4 routed experts"
    )
    assert (
        cli.main(["convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--to", "mxfp8"]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("megamoe convert: error: ") and "nope: not a directory" in err
    assert "Traceback" not in err


def test_debug_shows_the_exception(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="does not divide"):
        cli.main(["inspect", str(checkpoint), "--ep-size", "3", "--debug"])


def test_unknown_model_names_installed_adapters_and_pip(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert cli.main(["inspect", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    assert "model_type='mixtral'" in err and "installed: toymoe (toy_moe)" in err
    assert "pip install megamoe-qwen4exp megamoe-glm5next" in err


def test_convert_writes_and_reports(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quant, "_warned_not_power_of_two", set())
    out = tmp_path / "out"
    code = cli.main(["convert", str(checkpoint), str(out), "--to", "mxfp8", "--no-progress"])
    assert code == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if "warning" in line]
    assert warning == [
        "megamoe: warning: model.layers.0.mlp: the block-FP8 scales are not powers of two, so "
        "rounding them to UE8M0 (MXFP8, 1x32) changes the weights slightly. Pass --to fp8_block "
        "to keep block-FP8 (runs on Hopper and on the reference backend)."
    ]
    text = captured.out
    assert f"wrote {out}: 30 expert projection(s) requantized to mxfp8" in text
    assert "MB/s" in text
    assert cli.main(["convert", str(checkpoint), str(out), "--to", "mxfp8"]) == 1
    assert "already exists" in capsys.readouterr().err


def test_verify_reports_adapter_errors_as_one_line(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["verify", str(checkpoint), "--layers", "7"]) == cli.EXIT_USAGE
    assert "no MoE layer 7; the checkpoint's MoE layers are 0, 1" in capsys.readouterr().err
    assert cli.main(["verify", str(checkpoint), "--layers", "1", "--device", "cpu"]) == 1
    assert "the toy adapter has no MoE block" in capsys.readouterr().err


def test_bench_runs_only_the_scripts_shipped_with_megamoe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    planted = tmp_path / "cwd" / "benchmarks"
    planted.mkdir(parents=True)
    marker = tmp_path / "ran"
    (planted / "bench_requant.py").write_text(f"open({str(marker)!r}, 'w')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    # megamoe run from a (fake) source checkout: its scripts run, with their arguments.
    fake = tmp_path / "checkout"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "pyproject.toml").write_text("")
    (fake / "benchmarks").mkdir()
    (fake / "testing").mkdir()
    (fake / "testing" / "helper.py").write_text("NAME = 'the checkout helper'\n")
    (fake / "benchmarks" / "bench_requant.py").write_text(
        "import sys\nfrom helper import NAME\nprint('requant', sys.argv[1:], NAME)\n"
    )
    (fake / "benchmarks" / "bench_load.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(bench, "SOURCE_ROOT", fake)
    # The scripts need CUDA: pretend --device cuda resolved (no GPU needed to run them here).
    monkeypatch.setattr(commands, "resolve_device", lambda name: torch.device("cuda"))
    assert bench.shipped_bench_scripts() == [
        fake / "benchmarks" / "bench_requant.py",
        fake / "benchmarks" / "bench_load.py",
    ]
    assert cli.main(["bench", "--", "--quick"]) == 1  # bench_load.py failed
    assert "requant ['--quick'] the checkout helper" in capfd.readouterr().out  # testing/ found
    assert not marker.exists()  # the current directory's script never ran
    monkeypatch.setattr(bench, "SOURCE_ROOT", tmp_path / "site-packages")  # an installed wheel
    assert bench.shipped_bench_scripts() == []


def test_bench_finds_the_checkout_it_runs_from() -> None:
    """From this checkout (an editable install) its three scripts; from a wheel none."""
    module = Path(bench.__file__).resolve()
    assert module.parts[-4:] == bench.CHECKOUT_PATH.parts[-4:]  # megamoe/core/cli/bench.py
    checkout = Path(__file__).resolve().parents[3]
    if module == checkout / bench.CHECKOUT_PATH:
        assert checkout == bench.SOURCE_ROOT
        expected = [checkout / "benchmarks" / name for name in bench.BENCH_SCRIPTS]
    else:
        expected = []
    assert bench.shipped_bench_scripts() == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "CKPT", "--ep-size", "0"], "argument --ep-size: '0' is not an integer >= 1"),
        (["verify", "CKPT", "--tokens", "x"], "argument --tokens: 'x' is not an integer >= 1"),
        (["verify", "CKPT", "--device", "tpu"], "'tpu' is not one of cpu, cuda, cuda:N"),
        (["verify", "CKPT", "--tolerance", "-1"], "'-1' is not a number > 0"),
        (["verify", "CKPT", "--layers", "foo"], "--layers foo: no MoE layer foo"),
        (["verify", "CKPT", "--layers", ","], "--layers ',' selects no layer; name some of"),
        (["sample", "OUT", "--num-layers", "2000"], "--num-layers: '2000' is not an integer"),
        (["inspect", "CKPT", "--ep-size", "3"], "--ep-size 3 does not divide the 4 routed"),
        (
            ["verify", "CKPT", "--backend", "deepgemm", "--device", "cpu"],
            "experts backend 'deepgemm' cannot run fp8_block on cpu: ",
        ),
        (
            ["demo", "--backend", "deepgemm", "--device", "cpu", "--no-progress"],
            "pass --backend reference (or --backend auto) to use the torch reference path",
        ),
    ],
)
def test_usage_mistakes_exit_2(
    checkpoint: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    where = {"CKPT": str(checkpoint), "OUT": str(checkpoint.parent / "out")}
    argv = [where.get(a, a) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:  # argparse's own refusal
        code = exit_info.code
    assert code == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_cuda_device_this_machine_lacks_is_a_usage_mistake(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert cli.main(["verify", str(checkpoint), "--device", f"cuda:{count}"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--device cuda:{count}: this machine has {count} CUDA device(s) (" in err
    assert "); use --device cpu" in err


def test_builtin_requantize_bench_measures_against_a_copy() -> None:
    bandwidth = bench.copy_bandwidth(torch.device("cpu"), repeats=1, nbytes=1 << 20)
    assert bandwidth > 0
    results = bench.bench_requantize(
        num_experts=2, rows=128, cols=256, repeats=1, bandwidth=bandwidth
    )
    assert [r.name.split(" (")[0] for r in results] == [
        f"requantize {a.value} -> {b.value}" for a, b in bench.REQUANT_PAIRS
    ]
    bf16_to_mxfp8 = results[0]
    # 2 experts x 128 x 256: bf16 in, E4M3 + one UE8M0 byte per 32 out.
    assert bf16_to_mxfp8.bytes_moved == 2 * 128 * 256 * 2 + 2 * (128 * 256 + 128 * 8)
    for result in results:
        assert result.seconds > 0 and result.ceiling_seconds > 0
        assert result.ceiling_seconds == pytest.approx(result.bytes_moved / bandwidth)
        assert result.ratio == pytest.approx(result.ceiling_seconds / result.seconds)


def test_module_entry_point_matches_console_script() -> None:
    assert cli.main.__module__ == "megamoe.core.cli.main"
    assert sys.modules["megamoe.core.cli.main"] is cli


def test_demo_reports_a_failing_adapter_and_exits_1(
    toy_adapter, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", "--device", "cpu", "--format", "mxfp8"]) == 1
    captured = capsys.readouterr()
    rows = [line.split() for line in captured.out.splitlines() if line.startswith("toymoe")]
    assert rows == [["toymoe", "mxfp8", "-", "-", "-", "-", "-", "FAIL"]]
    assert "0 of 1 combinations within tolerance" in captured.out
    assert "toymoe mxfp8: NotImplementedError: the toy adapter has no MoE block" in captured.err


# ------------------------------------------------------------ one test per fixed CLI item
@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "-v", "inspect", "CKPT"],
        ["inspect", "CKPT", "--debug", "-v"],
        ["--debug", "inspect", "CKPT", "-v"],
    ],
)
def test_global_flags_work_before_and_after_the_command(argv: list[str]) -> None:
    args = cli.build_parser().parse_args(argv)
    assert (args.debug, args.verbose) == (True, True)
    plain = cli.build_parser().parse_args(["inspect", "CKPT"])
    assert (plain.debug, plain.verbose) == (False, False)


def test_debug_before_the_command_shows_the_exception(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="--ep-size 3 does not divide"):
        cli.main(["--debug", "inspect", str(checkpoint), "--ep-size", "3"])


def test_verbose_before_the_command_logs_info(checkpoint: Path) -> None:
    root = logging.getLogger()
    before = root.level
    try:
        assert cli.main(["-v", "inspect", str(checkpoint)]) == 0
        assert root.level == logging.INFO
        assert cli.main(["inspect", str(checkpoint)]) == 0
        assert root.level == logging.WARNING
    finally:
        root.setLevel(before)


def test_version_names_core_and_the_installed_adapters(
    toy_adapter, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"megamoe-core {version('megamoe-core')}; adapters:")


def test_help_and_version_import_no_torch() -> None:
    code = (
        "import sys\n"
        "from megamoe.core.cli import main as cli\n"
        "for argv in (['--help'], ['--version'], ['verify', '--help']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "mine = ('torch', 'megamoe')\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in mine))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = done.stdout.splitlines()[-1]
    assert (
        loaded
        == "LOADED ['megamoe', 'megamoe.core', 'megamoe.core.cli', 'megamoe.core.cli.exit_codes', "
        "'megamoe.core.cli.main', 'megamoe.core.errors']"
    )


def test_the_parser_spells_the_formats_and_targets_of_megamoe_core() -> None:
    # Every format the command offers exists (a format added to megamoe-core is offered
    # once the loaders and convert take it); checkpoint options take every stored format.
    assert set(cli.FORMATS) <= {f.value for f in WeightFormat}
    assert {"bf16", "fp8_block", "mxfp8", "mxfp4"} <= set(cli.FORMATS)
    assert set(cli.CHECKPOINT_FORMATS) == {f.value for f in WeightFormat}
    assert cli.ARCHES == ARCHES
    assert set(cli.TARGETS) == set(cli.FORMATS) - {"bf16"}


def test_a_missing_cuda_is_said_as_such_and_names_device(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cli.main(["bench", "--device", "cuda", "--builtin"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        "megamoe bench: error: --device cuda: this machine has 0 CUDA device(s) (this torch "
        "is a CPU-only build); use --device cpu\n"
    )
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert cli.main(["verify", str(checkpoint), "--device", "cuda"]) == cli.EXIT_USAGE
    assert "0 CUDA device(s) (no CUDA device is visible" in capsys.readouterr().err


def test_bench_on_cpu_in_a_checkout_runs_the_builtin_benchmarks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "pyproject.toml").write_text("")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_requant.py").write_text(f"open({str(marker)!r}, 'w')\n")
    monkeypatch.setattr(bench, "SOURCE_ROOT", tmp_path)
    argv = ["bench", "--device", "cpu", "--only", "requant", "--repeats", "1"]
    assert cli.main(argv) == 0
    out = capfd.readouterr().out
    assert "benchmarks/ scripts need a CUDA device (--device cpu); running the built-in" in out
    assert "megamoe bench on cpu" in out
    assert out.count("requantize ") == len(bench.REQUANT_PAIRS)
    assert not marker.exists()
    assert cli.main([*argv, "--", "--quick"]) == cli.EXIT_USAGE
    assert "arguments after -- (--quick) are for the benchmarks/ scripts" in capfd.readouterr().err


def test_bench_only_names_the_parts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--only", "requant,load"])
    assert exit_info.value.code == cli.EXIT_USAGE
    assert "'requant,load' names no part load; the parts are requant, forward, convert" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("command", "message", "said"),
    [
        (
            "verify",
            "moe_format='mxfp4' cannot run on sm90 (it runs: fp8_block); choose one of those "
            "or leave moe_format unset to convert automatically",
            "--moe-format mxfp4 cannot run on sm90 (it runs: fp8_block); choose one of those "
            "or leave --moe-format unset to convert automatically",
        ),
        (
            "verify",
            "64 tokens exceed max_num_tokens=32; build the layer with a larger max_num_tokens",
            "64 tokens exceed --tokens 32; build the layer with a larger --tokens",
        ),
        (
            "inspect",
            "Pass moe_format='mxfp8' to choose this",
            "Pass --moe-format mxfp8 to choose this",
        ),
        ("convert", "moe_format='mxfp8'", "moe_format='mxfp8'"),  # convert has no such flag
        (
            "verify",
            "the reference backend runs here; use backend='reference' or backend=auto",
            "the reference backend runs here; use --backend reference or --backend auto",
        ),
        ("demo", "use backend='reference'", "use --backend reference"),
    ],
)
def test_messages_speak_in_the_commands_flags(command: str, message: str, said: str) -> None:
    assert cli.speak_in_flags(command, message) == said


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_moe_format_the_target_cannot_run_is_a_usage_mistake_said_with_the_flag(
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    # verify resolves the target from --backend and --device: make this machine a Hopper one
    # (it refuses before loading anything, so nothing needs the GPU).
    monkeypatch.setattr(block_setup, "detect_arch", lambda device: "sm90")
    target = ["--arch", "sm90"] if command == "inspect" else ["--device", "cpu"]
    argv = [command, str(checkpoint), *target, "--moe-format", "mxfp4"]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"megamoe {command}: error: --moe-format mxfp4 cannot run on sm90")
    assert "moe_format" not in err


def test_sample_writes_a_checkpoint_the_other_commands_open(
    toy_adapter, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sample"
    argv = ["sample", str(out), "--format", "mxfp8", "--num-experts", "4", "--num-layers", "3"]
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: toy_moe (toymoe), routed experts stored as mxfp8; 3 MoE")
    assert f"next: megamoe inspect {out}" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample"]  # no staging left
    assert cli.main(["inspect", str(out), "--arch", "reference"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if ".mlp " in line]
    assert [row[2] for row in rows] == ["mxfp8"] * 3
    assert cli.main(argv) == cli.EXIT_FAIL
    assert capsys.readouterr().err == (
        f"megamoe sample: error: {out} already exists; remove it or choose another directory\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--adapter", "llama"], "--adapter llama: not installed; installed: toymoe"),
        (["--hidden-size", "100"], "argument --hidden-size: '100' is not a multiple of 128"),
        (["--num-experts", "1"], "--num-experts 1: fewer than the 2 experts each token is"),
    ],
)
def test_sample_usage_mistakes_exit_2(
    toy_adapter,
    tmp_path: Path,
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        code = cli.main(["sample", str(tmp_path / "out"), *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == cli.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sigterm_while_writing_a_sample_leaves_nothing_behind(
    toy_adapter,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from megamoe.core.cli import sample

    def terminated_midway(staging: Path, *args: object) -> None:
        (staging / "model-00001-of-00002.safetensors").write_bytes(b"half written")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(sample, "write_synthetic_checkpoint", terminated_midway)
    assert cli.main(["sample", str(tmp_path / "out")]) == cli.EXIT_TERMINATED
    assert "megamoe sample: terminated" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its hidden staging directory
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back


def test_a_closed_output_pipe_ends_quietly(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away (``megamoe inspect CKPT | head -0``)
    with open(write_end, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert cli.main(["inspect", str(checkpoint)]) == cli.EXIT_PIPE_CLOSED
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--arch", "sm100"],
            "MegaMoE for every call (the small-batch path: it runs block-FP8 layers on Hopper "
            "(kernel kind sm90_fp8), where --arch sm100 runs this layer on kernel kind ",
        ),
        (["--arch", "sm90", "--ep-size", "2"], "expert-parallel group has 2 (there MegaMoE"),
        (
            ["--arch", "sm100", "--ep-size", "2"],
            "where --arch sm100 runs this layer on kernel kind fp8xfp8; it runs one rank, where "
            "this layer's expert-parallel group has 2",
        ),
        (["--arch", "reference"], "where --arch reference runs this layer on the torch reference"),
    ],
)
def test_inspect_says_megamoe_takes_every_call_off_one_hopper_rank(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], options: list[str], expected: str
) -> None:
    assert cli.main(["inspect", str(checkpoint), *options]) == 0
    path = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("path"))
    assert expected in path


def test_inspect_gives_the_small_batch_crossover_on_one_hopper_rank(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from megamoe.core.cli import inspection

    seen = []

    def crossover(work, max_tokens, card):  # the rule's inputs are the checkpoint's layer
        seen.append((work, card))
        return {"H200": 37, "H100": 0}[card]

    monkeypatch.setattr(inspection, "crossover_tokens", crossover)
    assert cli.main(["inspect", str(checkpoint), "--arch", "sm90"]) == 0
    path = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("path"))
    # each card measured, by its own models
    assert "small-batch kernels on an H200: calls of up to 37 tokens, MegaMoE above; " in path
    assert "on an H100: none (the rule predicts MegaMoE faster at every size) (every layer" in path
    assert "other cards take the H200's rule" in path
    assert [card for _, card in seen] == ["H200", "H100"]
    work = seen[0][0]
    assert (work.num_experts, work.hidden, work.intermediate) == (4, 256, 128)


def test_inspect_says_when_the_rule_never_hands_a_call_to_megamoe(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layer this small (4 experts of 256 x 128) is predicted faster on the small-batch
    kernels at every size inspect considers, on every card measured: no crossover to state."""
    from megamoe.core.cli import inspection

    assert cli.main(["inspect", str(checkpoint), "--arch", "sm90"]) == 0
    path = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("path"))
    scan = inspection.EXPERTS_PATH_SCAN
    # the cards' rules agree here: said once for both
    assert f"on an H200 and an H100: every call up to the {scan} tokens considered (the" in path
    assert "MegaMoE above" not in path
    # per token: 256 FP8 columns and 2 float32 scales; per slot (2), 128 FP8 intermediate
    # columns, 2 float32 scales and 256 bf16 output columns: 264 + 2 * 648 bytes
    assert "scratch 1.6 KB per token it may take, shared by the layers of one shape" in path
