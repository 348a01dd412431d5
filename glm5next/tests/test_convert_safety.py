"""Convert writes only inside OUT.partial-<pid>: no write through planted links, errors name
the file, stale partials of killed converts are removed, un-indexed weights are left out."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from untouched import deadline, nothing_changes_outside

from megamoe.core import convert as convert_module
from megamoe.core.adapters import SyntheticSizes
from megamoe.core.checkpoint.convert_output import PARTIAL_MARK
from megamoe.core.checkpoint.reader import CONFIG_FILE, INDEX_FILE, CheckpointReader
from megamoe.core.cli.main import main
from megamoe.core.convert import convert_checkpoint
from megamoe.core.testing import write_synthetic_checkpoint
from megamoe.glm5next import ADAPTER

SIZES = SyntheticSizes(
    hidden_size=128,
    intermediate_size=128,
    num_experts=4,
    top_k=2,
    num_layers=2,
    shared_intermediate_size=128,
)
SHARD = 150_000  # several shards and an index
SUBPROCESS_TIMEOUT_S = 60


def _checkpoint(path: Path) -> Path:
    write_synthetic_checkpoint(path, ADAPTER, "bf16", SIZES, max_shard_bytes=SHARD)
    (path / "tokenizer.json").write_text('{"vocab": 1}')
    return path


def _first_shard(src: Path) -> str:
    return sorted(set(json.loads((src / INDEX_FILE).read_text())["weight_map"].values()))[0]


def _partials(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(out.name + PARTIAL_MARK + "*"))


def _check_loads(out: Path) -> None:
    reader = CheckpointReader(out, ADAPTER)
    assert reader.layers
    for layer in reader.layers:
        reader.check_layer(layer)


# --- nothing is written through a name planted in the way ---------------------------------


def test_symlink_planted_at_the_partial_path_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, out, victim = _checkpoint(tmp_path / "src"), tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    partial = tmp_path / f"out{PARTIAL_MARK}{os.getpid()}"
    real_plan = convert_module._plan

    def plant_then_plan(*args, **kwargs):  # after the stale-partial scan, before mkdir
        partial.symlink_to(victim, target_is_directory=True)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(convert_module, "_plan", plant_then_plan)
    with (
        nothing_changes_outside(tmp_path, out),
        pytest.raises(FileExistsError, match=rf"{re.escape(str(partial))} appeared after"),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert os.readlink(partial) == str(victim), "the planted link was followed or removed"
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert not out.exists()


def test_stale_symlink_at_this_process_partial_is_unlinked_not_followed(tmp_path: Path) -> None:
    src, out, victim = _checkpoint(tmp_path / "src"), tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    partial = tmp_path / f"out{PARTIAL_MARK}{os.getpid()}"
    partial.symlink_to(victim, target_is_directory=True)
    with (
        nothing_changes_outside(tmp_path, out),
        pytest.warns(UserWarning, match=rf"removed stale partial output {re.escape(str(partial))}"),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert (victim / "keep.txt").read_text() == "precious"
    assert _partials(out) == []
    _check_loads(out)


@pytest.mark.parametrize("planted", ["shard", INDEX_FILE, CONFIG_FILE, "tokenizer.json"])
def test_symlink_planted_inside_the_partial_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    src, out, victim = _checkpoint(tmp_path / "src"), tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("precious")
    name = _first_shard(src) if planted == "shard" else planted
    real_write = convert_module._write

    def plant_then_write(reader, plan, dst, partial, progress):
        (partial / name).symlink_to(victim)
        return real_write(reader, plan, dst, partial, progress)

    monkeypatch.setattr(convert_module, "_write", plant_then_write)
    with (
        nothing_changes_outside(tmp_path, out),
        pytest.raises(FileExistsError, match=rf"File exists creating .*{re.escape(name)}$"),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert victim.read_text() == "precious"
    assert _partials(out) == [] and not out.exists()


def test_shard_name_that_is_not_a_plain_file_name_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    real_plan = convert_module._plan

    def escaping_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        first = next(iter(plan.files))
        plan.files["../escaped.safetensors"] = plan.files.pop(first)
        return plan

    monkeypatch.setattr(convert_module, "_plan", escaping_plan)
    with (
        nothing_changes_outside(tmp_path, out),
        pytest.raises(ValueError, match=r"'\.\./escaped\.safetensors' is not a single plain"),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert _partials(out) == [] and not out.exists()


def test_output_parent_must_exist(tmp_path: Path) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "missing" / "out"
    with (
        nothing_changes_outside(tmp_path, tmp_path / "missing"),
        pytest.raises(
            FileNotFoundError,
            match=rf"{re.escape(str(out.parent))}: the output's parent directory does not exist",
        ),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert not out.parent.exists()


# --- OS errors name the file; the partial directory is removed -----------------------------


def _enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["shard", "copy"])
def test_injected_enospc_names_the_file_and_leaves_no_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    partial = re.escape(str(tmp_path / f"out{PARTIAL_MARK}{os.getpid()}"))
    if where == "shard":
        real_pwrite, calls = os.pwrite, []

        def pwrite(fd: int, data: bytes, offset: int) -> int:
            calls.append(offset)
            if len(calls) == 5:  # midway: after the headers, among the tensors
                _enospc()
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite)
        want = rf"No space left on device writing {partial}/model-\S+\.safetensors$"
    else:
        monkeypatch.setattr(shutil, "copyfileobj", _enospc)
        want = (
            rf"No space left on device copying {re.escape(str(src))}/tokenizer\.json to "
            rf"{partial}/tokenizer\.json$"
        )
    with (
        nothing_changes_outside(tmp_path, out),
        pytest.raises(OSError, match=want) as info,
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert info.value.errno == errno.ENOSPC
    assert _partials(out) == [] and not out.exists()


def test_cli_reports_enospc_on_one_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    monkeypatch.setattr(os, "pwrite", _enospc)
    with nothing_changes_outside(tmp_path, out):
        code = main(["convert", str(src), str(out), "--to", "mxfp8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    partial = tmp_path / f"out{PARTIAL_MARK}{os.getpid()}"
    assert re.fullmatch(
        rf"megamoe convert: error: \[Errno {errno.ENOSPC}\] No space left on device writing "
        rf"{re.escape(str(partial))}/model-\S+\.safetensors\n",
        err,
    ), err
    assert _partials(out) == [] and not out.exists()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True, check=False, timeout=SUBPROCESS_TIMEOUT_S,
    )  # fmt: skip
    return mounted.returncode == 0


def test_real_enospc_on_a_small_tmpfs(tmp_path: Path) -> None:
    """The injected ENOSPC case above always runs; this one needs root and mount."""
    src, small = _checkpoint(tmp_path / "src"), tmp_path / "small"
    if not _mount_tmpfs(small, "64k"):
        pytest.skip("needs root and a working `mount -t tmpfs` (the injected ENOSPC test ran)")
    try:
        out = small / "out"
        with (
            nothing_changes_outside(tmp_path, out),
            pytest.raises(OSError, match=r"No space left on device \w+ .*small/out\.partial-"),
        ):
            convert_checkpoint(src, out, "mxfp8", progress=False)
        assert sorted(os.listdir(small)) == []
    finally:
        subprocess.run(["umount", str(small)], check=True, timeout=SUBPROCESS_TIMEOUT_S)


# --- stale and live partial directories ----------------------------------------------------

SLOW_CONVERT = textwrap.dedent(
    """
    import sys, time
    from megamoe.core import convert
    real = convert._convert_one

    def slow(*args, **kwargs):
        time.sleep(0.5)  # killed long before it finishes
        return real(*args, **kwargs)

    convert._convert_one = slow
    convert.convert_checkpoint(sys.argv[1], sys.argv[2], "mxfp8", progress=False)
    """
)


def test_sigkilled_convert_leaves_a_partial_the_next_convert_removes(tmp_path: Path) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    log = tmp_path / "child.log"
    with log.open("w") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-c", SLOW_CONVERT, str(src), str(out)],
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    partial = tmp_path / f"out{PARTIAL_MARK}{child.pid}"
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while not list(partial.glob("*.safetensors")):  # the child is writing shards
            assert child.poll() is None, f"convert ended before it was killed: {log.read_text()}"
            assert time.monotonic() < deadline, "the child convert never started writing"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=SUBPROCESS_TIMEOUT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=SUBPROCESS_TIMEOUT_S)
    assert partial.is_dir() and not out.exists(), "a killed convert leaves only its partial"
    want = (
        f"removed stale partial output {partial} of a convert that did not finish "
        f"(pid {child.pid} is gone)"
    )
    with (
        nothing_changes_outside(tmp_path, out),
        pytest.warns(UserWarning, match=re.escape(want)),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert _partials(out) == []
    _check_loads(out)


def test_partial_of_a_running_convert_is_refused(tmp_path: Path) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        partial = tmp_path / f"out{PARTIAL_MARK}{live.pid}"
        partial.mkdir()
        (partial / "config.json").write_text("{}")
        with (
            nothing_changes_outside(tmp_path, out),
            pytest.raises(
                FileExistsError,
                match=rf"{re.escape(str(partial))} exists and process {live.pid} is running: "
                rf"another convert is writing {re.escape(str(out))}",
            ),
        ):
            convert_checkpoint(src, out, "mxfp8", progress=False)
        assert (partial / "config.json").read_text() == "{}", "a live convert's partial touched"
        assert not out.exists()
    finally:
        live.kill()
        live.wait(timeout=SUBPROCESS_TIMEOUT_S)


# --- what is copied from the source directory ----------------------------------------------


def test_unindexed_weight_files_are_left_out_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    (src / "extra.bin").write_bytes(b"\0" * 64)
    (src / "stray.safetensors").write_bytes(b"\0" * 64)
    (src / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    (src / "README.md").write_text("# model card\n")
    with nothing_changes_outside(tmp_path, out):
        code = main(["convert", str(src), str(out), "--to", "mxfp8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    warning = (
        f"megamoe: warning: {src}: left out weight files that {INDEX_FILE} does not name: "
        "extra.bin, pytorch_model.bin.index.json, stray.safetensors\n"
    )
    assert warning in err
    assert err.count("warning:") == 1, err
    copied = sorted(p.name for p in out.iterdir() if not p.name.endswith(".safetensors"))
    assert copied == sorted([CONFIG_FILE, INDEX_FILE, "README.md", "tokenizer.json"])
    assert not (out / "stray.safetensors").exists()
    for name in ("README.md", "tokenizer.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
        assert stat.S_ISREG(os.lstat(out / name).st_mode)
    _check_loads(out)


def test_symlink_outside_the_checkpoint_is_left_out_with_a_warning(tmp_path: Path) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "gen.json").write_text('{"do_sample": true}')
    (src / "generation_config.json").symlink_to(elsewhere / "gen.json")
    (src / "tokenizer_alias.json").symlink_to("tokenizer.json")  # inside: no warning
    with (
        nothing_changes_outside(tmp_path, out),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        convert_checkpoint(src, out, "mxfp8", progress=False)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert f"generation_config.json (a symlink to {elsewhere / 'gen.json'})" in messages[0]
    assert "left out files linking outside the checkpoint directory" in messages[0]
    assert not (out / "generation_config.json").exists()
    assert not (out / "tokenizer_alias.json").is_symlink()
    assert (out / "tokenizer_alias.json").read_text() == '{"vocab": 1}'


def test_hugging_face_cache_links_to_blobs_copy_without_a_warning(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--model"
    src, out = _checkpoint(repo / "snapshots" / "abc123"), tmp_path / "out"
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text('{"vocab": 2}')
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(Path("..", "..", "blobs", "f00d"))
    with (
        nothing_changes_outside(tmp_path, out),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert (out / "tokenizer.json").read_text() == '{"vocab": 2}'


def test_fifo_and_directory_are_left_out_with_a_note(tmp_path: Path) -> None:
    src, out = _checkpoint(tmp_path / "src"), tmp_path / "out"
    os.mkfifo(src / "pipe")
    (src / "original").mkdir()
    (src / "original" / "consolidated.pth").write_bytes(b"\0" * 64)
    want = f"{src}: left out entries that are not regular files: original (directory), pipe (FIFO)"
    with (
        nothing_changes_outside(tmp_path, out),
        deadline(60),
        pytest.warns(UserWarning, match=re.escape(want)),
    ):
        convert_checkpoint(src, out, "mxfp8", progress=False)
    assert not (out / "pipe").exists() and not (out / "original").exists()
    _check_loads(out)
