"""Damaged and hostile checkpoints: one validation for the API, inspect, verify and convert.

Every case damages a small sharded checkpoint one way and checks that opening it
(``open_checkpoint``: what loading uses) and the three commands refuse it with the same
exception and message, before any tensor data is read, and that ``convert`` changes
nothing outside its output (it writes no output at all). The toy adapter (conftest) keeps
these tests free of the real adapters; the shared-expert, scale and config-bound cases of
the real models live in the adapters' test suites.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from untouched import nothing_changes_outside

from megamoe.core.adapters import SyntheticSizes, open_checkpoint
from megamoe.core.checkpoint import files as checkpoint_files
from megamoe.core.checkpoint import reader as checkpoint_reader
from megamoe.core.checkpoint.reader import INDEX_FILE
from megamoe.core.cli import main as cli
from megamoe.core.convert import convert_checkpoint
from megamoe.core.errors import CheckpointError, NoAdapterError, UnsupportedCheckpointError
from megamoe.core.testing import write_synthetic_checkpoint

SIZES = SyntheticSizes(num_layers=2, hidden_size=256, intermediate_size=256, num_experts=4)
EXPERTS = "model.layers.1.mlp.experts"
EXPERT = f"{EXPERTS}.2.down_proj"
NORM = "model.norm.weight"  # a non-expert tensor, moved to a shard of its own
NORM_SHARD = "model-norm.safetensors"


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX_FILE).read_text())


def _write_index(ckpt: Path, index: dict) -> None:
    (ckpt / INDEX_FILE).write_text(json.dumps(index))


def _set_entry(ckpt: Path, name: str, file: object) -> None:
    index = _index(ckpt)
    index["weight_map"][name] = file
    _write_index(ckpt, index)


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / _index(ckpt)["weight_map"][name]


def _add_tensor(ckpt: Path, name: str, tensor: torch.Tensor, *, shard: str | None = None) -> None:
    """Store ``tensor`` in an existing shard (or a new one) and list it in the index."""
    path = ckpt / (shard or _index(ckpt)["weight_map"][EXPERT + ".weight"])
    tensors = load_file(path) if path.exists() else {}
    tensors[name] = tensor
    save_file(tensors, path)
    _set_entry(ckpt, name, path.name)


def _raw_shard(path: Path, header: object, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _config(ckpt: Path, **changes: object) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


# -- the damage ---------------------------------------------------------------------------


def _outside_name(ckpt: Path) -> None:
    """``../outside.safetensors`` with a same-named decoy inside the directory."""
    shard = _shard_of(ckpt, EXPERT + ".weight")
    (ckpt.parent / "outside.safetensors").write_bytes(shard.read_bytes())
    (ckpt / "outside.safetensors").write_bytes(shard.read_bytes())
    _set_entry(ckpt, EXPERT + ".weight", "../outside.safetensors")


def _absolute_name(ckpt: Path) -> None:
    outside = ckpt.parent / "victim.safetensors"
    outside.write_bytes(_shard_of(ckpt, EXPERT + ".weight").read_bytes())
    _set_entry(ckpt, EXPERT + ".weight", str(outside))


def _nested_name(ckpt: Path) -> None:
    (ckpt / "sub").mkdir()
    shard = _shard_of(ckpt, EXPERT + ".weight")
    (ckpt / "sub" / shard.name).write_bytes(shard.read_bytes())
    _set_entry(ckpt, EXPERT + ".weight", f"sub/{shard.name}")


def _non_string_name(ckpt: Path) -> None:
    _set_entry(ckpt, EXPERT + ".weight", 7)


def _link_to_device(ckpt: Path) -> None:
    os.symlink("/dev/zero", ckpt / "zero.safetensors")
    _set_entry(ckpt, EXPERT + ".weight", "zero.safetensors")


def _moved_out(ckpt: Path, name: str) -> Path:
    """Move checkpoint file ``name`` out of the directory, leaving a symlink to it."""
    elsewhere = ckpt.parent / "elsewhere" / name
    elsewhere.parent.mkdir(exist_ok=True)
    (ckpt / name).rename(elsewhere)
    os.symlink(elsewhere, ckpt / name)
    return elsewhere


def _shard_linked_outside(ckpt: Path) -> None:
    _moved_out(ckpt, _shard_of(ckpt, EXPERT + ".weight").name)


def _config_linked_outside(ckpt: Path) -> None:
    _moved_out(ckpt, "config.json")


def _config_linked_to_passwd(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    os.symlink("/etc/passwd", ckpt / "config.json")


def _index_linked_outside(ckpt: Path) -> None:
    _moved_out(ckpt, INDEX_FILE)


def _index_broken_link(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).unlink()
    os.symlink("gone.json", ckpt / INDEX_FILE)


def _index_a_directory(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).unlink()
    (ckpt / INDEX_FILE).mkdir()


def _shard_broken_link(ckpt: Path) -> None:
    shard = _shard_of(ckpt, EXPERT + ".weight")
    shard.unlink()
    os.symlink("gone.safetensors", shard)


def _shard_name_too_long(ckpt: Path) -> None:
    _set_entry(ckpt, EXPERT + ".weight", "a" * 300 + ".safetensors")


def _shard_name_lone_surrogate(ckpt: Path) -> None:
    _set_entry(ckpt, EXPERT + ".weight", "\ud800.safetensors")


LONG_INDEX = "9" * 5000


def _long_expert_index(ckpt: Path) -> None:
    _add_tensor(
        ckpt, f"{EXPERTS}.{LONG_INDEX}.gate_proj.weight", torch.zeros(2, dtype=torch.bfloat16)
    )


def _long_layer_index(ckpt: Path) -> None:
    name = f"model.layers.{LONG_INDEX}.mlp.experts.0.gate_proj.weight"
    _add_tensor(ckpt, name, torch.zeros(2, dtype=torch.bfloat16))


def _long_index_in_a_shard_only(ckpt: Path) -> None:
    """The index lists the shard's other tensors: the shard's own names are checked too."""
    _add_tensor(
        ckpt, f"{EXPERTS}.{LONG_INDEX}.up_proj.weight", torch.zeros(2, dtype=torch.bfloat16)
    )
    index = _index(ckpt)
    del index["weight_map"][f"{EXPERTS}.{LONG_INDEX}.up_proj.weight"]
    _write_index(ckpt, index)


def _with_raw_entry(name: str, entry: dict, data: bytes) -> Callable[[Path], None]:
    """Add a header entry (offsets at the end of the data section) to the norm's own shard."""

    def apply(ckpt: Path) -> None:
        shard = _norm_in_own_shard(ckpt)
        blob = shard.read_bytes()
        length = struct.unpack("<Q", blob[:8])[0]
        header, body = json.loads(blob[8 : 8 + length]), blob[8 + length :]
        header[name] = {**entry, "data_offsets": [len(body), len(body) + len(data)]}
        _raw_shard(shard, header, body + data)
        _set_entry(ckpt, name, NORM_SHARD)

    return apply


def _norm_in_own_shard(ckpt: Path) -> Path:
    """Move the final norm into a shard holding no expert tensor; returns that shard."""
    shard = _shard_of(ckpt, NORM)
    tensors = load_file(shard)
    norm = tensors.pop(NORM)
    save_file(tensors, shard)
    save_file({NORM: norm}, ckpt / NORM_SHARD)
    _set_entry(ckpt, NORM, NORM_SHARD)
    return ckpt / NORM_SHARD


def _damage_shard(where: str, damage: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(ckpt: Path) -> None:
        shard = _norm_in_own_shard(ckpt) if where == "non-expert" else None
        damage(shard or _shard_of(ckpt, EXPERT + ".weight"))

    return apply


def _three_bytes(shard: Path) -> None:
    shard.write_bytes(b"abc")


def _huge_header_length(shard: Path) -> None:
    shard.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")


def _json_array(shard: Path) -> None:
    _raw_shard(shard, [1, 2], b"")


def _no_data_offsets(shard: Path) -> None:
    _raw_shard(shard, {NORM: {"dtype": "BF16", "shape": [256]}}, bytes(512))


def _overlapping_offsets(shard: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    _raw_shard(shard, header, bytes(12))


def _range_longer_than_shape(shard: Path) -> None:
    _raw_shard(
        shard, {NORM: {"dtype": "BF16", "shape": [256], "data_offsets": [0, 1024]}}, bytes(1024)
    )


def _listed_in_two_shards(ckpt: Path) -> None:
    other = _shard_of(ckpt, f"{EXPERTS}.0.gate_proj.weight")
    tensors = load_file(other)
    tensors[EXPERT + ".weight"] = load_file(_shard_of(ckpt, EXPERT + ".weight"))[EXPERT + ".weight"]
    save_file(tensors, other)


def _duplicate_index_key(ckpt: Path) -> None:
    text = (ckpt / INDEX_FILE).read_text()
    name, file = EXPERT + ".weight", _index(ckpt)["weight_map"][EXPERT + ".weight"]
    entry = f'"{name}": "{file}"'
    (ckpt / INDEX_FILE).write_text(text.replace(entry, f"{entry}, {entry}", 1))


def _duplicate_config_key(ckpt: Path) -> None:
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace("{", '{"num_experts": 2, ', 1))


def _index_metadata_not_an_object(ckpt: Path) -> None:
    index = _index(ckpt)
    index["metadata"] = [index.get("metadata")]
    _write_index(ckpt, index)


def _unlisted_tensor(ckpt: Path) -> None:
    index = _index(ckpt)
    del index["weight_map"][EXPERT + ".weight"]
    _write_index(ckpt, index)


def _absent_tensor(ckpt: Path) -> None:
    shard = _shard_of(ckpt, EXPERT + ".weight")
    tensors = load_file(shard)
    del tensors[EXPERT + ".weight"]
    save_file(tensors, shard)


def _unknown_projection(ckpt: Path) -> None:
    _add_tensor(ckpt, f"{EXPERTS}.0.foo_proj.weight", torch.zeros(4, 4, dtype=torch.bfloat16))


def _expert_beyond_config(ckpt: Path) -> None:
    _add_tensor(ckpt, f"{EXPERTS}.4.down_proj.weight", torch.zeros(256, 256, dtype=torch.bfloat16))


def _leading_zero_expert(ckpt: Path) -> None:
    _add_tensor(ckpt, f"{EXPERTS}.02.down_proj.weight", torch.zeros(256, 256, dtype=torch.bfloat16))


def _fewer_experts_in_config(ckpt: Path) -> None:
    _config(ckpt, num_experts=2)


def _hidden_not_aligned(ckpt: Path) -> None:
    _config(ckpt, hidden_size=200)


def _unknown_model(ckpt: Path) -> None:
    _config(ckpt, model_type="llama", architectures=["LlamaForCausalLM"])


def _model_type_a_list(ckpt: Path) -> None:
    _config(ckpt, model_type=["toymoe"])


def _raw_json_key(path: Path, value: str) -> None:
    """Add ``"x": <value>`` to a JSON object file as text (json.dumps would refuse it)."""
    text = path.read_text().rstrip()
    path.write_text(text[:-1] + f', "x": {value}}}')


def _deep_config(ckpt: Path) -> None:
    _raw_json_key(ckpt / "config.json", "[" * 100_000 + "]" * 100_000)


def _long_integer_config(ckpt: Path) -> None:
    _raw_json_key(ckpt / "config.json", "1" * 5000)


def _deep_index(ckpt: Path) -> None:
    _raw_json_key(ckpt / "model.safetensors.index.json", "[" * 100_000 + "]" * 100_000)


PLAIN_NAME = r"must be the plain name of a file inside the checkpoint directory"
OUTSIDE = (
    r"is a symlink to .*elsewhere.*, outside the checkpoint directory .*; a file a checkpoint "
    r"names must lie inside its directory \(or, for a Hugging Face cache snapshot, in its "
    r"repository's blobs/\).*: copy the file into .* in place of the link"
)
EXTRA = "model.layers.1.mlp.extra.weight"  # under the MoE block: let through when empty
INT64 = r"must be non-negative with a product of at most 2\*\*63 - 1, the int64 sizes"
LONG = r"9+\.\.\.\(\d+ characters\)\.\.\.9+"
DIGITS = r"has an index of 5000 digits; a layer or expert index in a tensor name has at most 9"
SAFETENSORS = r"not a readable safetensors file \(Error while deserializing header: "
CASES: dict[str, tuple[Callable[[Path], None], type[Exception], str]] = {
    "index name with ..": (
        _outside_name,
        CheckpointError,
        r"'\.\./outside\.safetensors': .*" + PLAIN_NAME,
    ),
    "absolute index name": (
        _absolute_name,
        CheckpointError,
        PLAIN_NAME,
    ),
    "index name in a subdirectory": (
        _nested_name,
        CheckpointError,
        r"'sub/.*" + PLAIN_NAME,
    ),
    "index name not a string": (
        _non_string_name,
        CheckpointError,
        r"is int 7; a shard file name",
    ),
    "shard linked outside the checkpoint": (
        _shard_linked_outside,
        CheckpointError,
        r"model-\d+-of-\d+\.safetensors: shard file " + OUTSIDE,
    ),
    "config.json linked outside the checkpoint": (
        _config_linked_outside,
        CheckpointError,
        r"config\.json: config\.json " + OUTSIDE,
    ),
    "config.json linked to /etc/passwd": (
        _config_linked_to_passwd,
        CheckpointError,
        r"config\.json: config\.json is a symlink to /etc/passwd, outside the checkpoint",
    ),
    "index linked outside the checkpoint": (
        _index_linked_outside,
        CheckpointError,
        r"index\.json: the index " + OUTSIDE,
    ),
    "index a broken symlink": (
        _index_broken_link,
        CheckpointError,
        r"index\.json: the index is a broken symlink to 'gone\.json' \(No such file .*\); "
        r"remove it, or download",
    ),
    "index a directory": (
        _index_a_directory,
        CheckpointError,
        r"index\.json: the index is not a regular file \(a directory\); remove it, or download",
    ),
    "shard a broken symlink": (
        _shard_broken_link,
        CheckpointError,
        r"model-\d+-of-\d+\.safetensors: shard file is a broken symlink to 'gone\.safetensors'",
    ),
    "shard name of 312 bytes": (
        _shard_name_too_long,
        CheckpointError,
        r"index\.json: weight_map\['.*2\.down_proj\.weight'\] = 'a+\.\.\.\(312 characters\)"
        r"\.\.\.a+\.safetensors' \(312 bytes\): a shard file name has at most 255 bytes",
    ),
    "shard name with a lone surrogate": (
        _shard_name_lone_surrogate,
        CheckpointError,
        r"= '\\ud800\.safetensors': a shard file name must be text a file name can hold",
    ),
    "expert index of 5000 digits": (
        _long_expert_index,
        CheckpointError,
        rf"index\.json: tensor 'model\.layers\.1\.mlp\.experts\.{LONG}\.gate_proj\.weight' "
        + DIGITS,
    ),
    "layer index of 5000 digits": (
        _long_layer_index,
        CheckpointError,
        rf"index\.json: tensor 'model\.layers\.{LONG}\.mlp\.experts\.0\.gate_proj\.weight' "
        + DIGITS,
    ),
    "index of 5000 digits in a shard only": (
        _long_index_in_a_shard_only,
        CheckpointError,
        rf"model-\d+-of-\d+\.safetensors: tensor '.*experts\.{LONG}\.up_proj\.weight' " + DIGITS,
    ),
    "empty tensor with a dimension of 2^64 - 1": (
        _with_raw_entry(EXTRA, {"dtype": "BF16", "shape": [0, 2**64 - 1]}, b""),
        CheckpointError,
        rf"{NORM_SHARD}: tensor '{EXTRA}' has shape \[0, 18446744073709551615\]: .*" + INT64,
    ),
    "empty tensor whose strides overflow int64": (
        _with_raw_entry(EXTRA, {"dtype": "BF16", "shape": [2**62, 2, 0]}, b""),
        CheckpointError,
        rf"{NORM_SHARD}: tensor '{EXTRA}' has shape \[4611686018427387904, 2, 0\]: .*" + INT64,
    ),
    "tensor of a dtype megamoe does not read": (
        _with_raw_entry("extra", {"dtype": "C64", "shape": [2]}, bytes(16)),
        UnsupportedCheckpointError,
        rf"{NORM_SHARD}: tensor 'extra' has safetensors dtype 'C64', which megamoe does not "
        r"read \(it reads BOOL, U8, .*\): store the tensor in one of those, or remove it",
    ),
    "shard linked to a device": (
        _link_to_device,
        CheckpointError,
        r"zero\.safetensors: shard file is not a regular file",
    ),
    "expert shard of 3 bytes": (
        _damage_shard("expert", _three_bytes),
        CheckpointError,
        SAFETENSORS + "header too small",
    ),
    "non-expert shard of 3 bytes": (
        _damage_shard("non-expert", _three_bytes),
        CheckpointError,
        NORM_SHARD + ": " + SAFETENSORS + "header too small",
    ),
    "header length 2^60": (
        _damage_shard("non-expert", _huge_header_length),
        CheckpointError,
        SAFETENSORS + "header too large",
    ),
    "expert header length 2^60": (
        _damage_shard("expert", _huge_header_length),
        CheckpointError,
        SAFETENSORS + "header too large",
    ),
    "header a JSON array": (
        _damage_shard("non-expert", _json_array),
        CheckpointError,
        SAFETENSORS + "invalid JSON in header",
    ),
    "entry without data_offsets": (
        _damage_shard("non-expert", _no_data_offsets),
        CheckpointError,
        SAFETENSORS + r".*missing field `data_offsets`",
    ),
    "overlapping offsets": (
        _damage_shard("non-expert", _overlapping_offsets),
        CheckpointError,
        SAFETENSORS + "invalid offset",
    ),
    "expert overlapping offsets": (
        _damage_shard("expert", _overlapping_offsets),
        CheckpointError,
        SAFETENSORS + "invalid offset",
    ),
    "range longer than dtype x shape": (
        _damage_shard("non-expert", _range_longer_than_shape),
        CheckpointError,
        SAFETENSORS + "invalid shape, data type, or offset",
    ),
    "tensor in two shards": (
        _listed_in_two_shards,
        CheckpointError,
        r"tensor '.*2\.down_proj\.weight' is stored in two shards",
    ),
    "tensor listed twice in the index": (
        _duplicate_index_key,
        CheckpointError,
        r"not a valid index \(key '.*2\.down_proj\.weight' appears twice",
    ),
    "config key given twice": (
        _duplicate_config_key,
        CheckpointError,
        r"config\.json: not valid JSON \(key 'num_experts' appears twice .*keep the right one",
    ),
    "index metadata not an object": (
        _index_metadata_not_an_object,
        CheckpointError,
        r"not a valid index \('metadata' is a list, where an index has an object",
    ),
    "tensor of a shard not in the index": (
        _unlisted_tensor,
        CheckpointError,
        r"1 tensor\(s\) of the shards are not listed in model\.safetensors\.index\.json",
    ),
    "indexed tensor absent from its shard": (
        _absent_tensor,
        CheckpointError,
        r"'.*2\.down_proj\.weight' is named in model\.safetensors\.index\.json but absent",
    ),
    "unknown expert projection": (
        _unknown_projection,
        CheckpointError,
        r"'.*experts\.0\.foo_proj\.weight' is not a tensor of bf16 routed experts",
    ),
    "expert id beyond num_experts": (
        _expert_beyond_config,
        CheckpointError,
        r"is of expert 4, but config\.json gives 4 routed experts",
    ),
    "expert id with a leading zero": (
        _leading_zero_expert,
        CheckpointError,
        r"experts\.02\.down_proj\.weight' is not a tensor of bf16",
    ),
    "config with fewer experts than the checkpoint": (
        _fewer_experts_in_config,
        CheckpointError,
        r"is of expert 2, but config\.json gives 2 routed experts",
    ),
    "hidden_size not a multiple of 128": (
        _hidden_not_aligned,
        CheckpointError,
        r"config\.json: expert hidden_size=200 must be a positive multiple of 128",
    ),
    "no adapter for the model": (
        _unknown_model,
        NoAdapterError,
        r"config\.json: no installed megamoe adapter handles model_type='llama'",
    ),
    "model_type a list": (
        _model_type_a_list,
        CheckpointError,
        r"config\.json: model_type or architectures of the wrong type",
    ),
    "config nested 100000 deep": (
        _deep_config,
        CheckpointError,
        r"config\.json: JSON nested too deeply, which no model's config or index is",
    ),
    "config integer of 5000 digits": (
        _long_integer_config,
        CheckpointError,
        r"config\.json: JSON holding an integer of thousands of digits",
    ),
    "index nested 100000 deep": (
        _deep_index,
        CheckpointError,
        r"index\.json: JSON nested too deeply",
    ),
}


@pytest.fixture
def damaged(request: pytest.FixtureRequest, tmp_path: Path, toy_adapter) -> tuple[Path, str]:
    case = request.param
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", "toymoe", "bf16", SIZES, max_shard_bytes=300_000
    )
    CASES[case][0](ckpt)
    return ckpt, case


@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_the_api_refuses_it_before_reading_data(damaged: tuple[Path, str]) -> None:
    ckpt, case = damaged
    _, error, message = CASES[case]
    with pytest.raises(error, match=message):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_inspect_and_verify_refuse_it_with_the_same_message(
    damaged: tuple[Path, str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, case = damaged
    assert cli.main([command, str(ckpt)]) == cli.EXIT_FAIL
    err = capsys.readouterr().err
    assert err.startswith(f"megamoe {command}: error: ")
    assert len(err.strip().splitlines()) == 1
    assert _search(CASES[case][2], err), err


@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_convert_refuses_it_and_changes_nothing(
    damaged: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, case = damaged
    _, error, message = CASES[case]
    root, out = ckpt.parent, ckpt.parent / "out"
    with nothing_changes_outside(root, out):
        with pytest.raises(error, match=message):
            convert_checkpoint(ckpt, out, "mxfp8", progress=False)
        code = cli.main(["convert", str(ckpt), str(out), "--to", "mxfp8", "--no-progress"])
    assert code == cli.EXIT_FAIL
    assert _search(message, capsys.readouterr().err)
    assert not out.exists()
    assert not list(root.glob("out.partial-*"))


def _search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, " ".join(text.split())) is not None


def _hugging_face_cache(tmp_path: Path, subfolder: str = "") -> tuple[Path, Path]:
    """A checkpoint laid out as Hugging Face's cache does: ``<repo>/snapshots/<revision>/``
    (or a ``subfolder`` of it) holds symlinks to ``../../blobs/<hash>`` (one ``..`` more per
    folder), for config.json and the index too.

    Returns:
        The checkpoint directory and the repository's ``blobs/``.
    """
    repo = tmp_path / "hub" / "models--org--toy"
    snapshot, blobs = repo / "snapshots" / "0123abcd" / subfolder, repo / "blobs"
    write_synthetic_checkpoint(snapshot, "toymoe", "bf16", SIZES, max_shard_bytes=300_000)
    blobs.mkdir()
    for file in sorted(snapshot.iterdir()):
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(blob)
        os.symlink(os.path.relpath(blob, snapshot), file)
    return snapshot, blobs


@pytest.mark.parametrize("subfolder", ["", "weights"])
def test_a_hugging_face_cache_snapshot_is_read_through_its_links(
    tmp_path: Path, toy_adapter, capsys: pytest.CaptureFixture[str], subfolder: str
) -> None:
    snapshot, blobs = _hugging_face_cache(tmp_path, subfolder)
    assert all(f.is_symlink() for f in snapshot.iterdir())
    reader, _ = open_checkpoint(snapshot)
    shard = reader.file_of(EXPERT + ".weight")
    want = load_file(shard.resolve())[EXPERT + ".weight"]
    assert shard.resolve().parent == blobs
    assert torch.equal(reader.get_tensor(EXPERT + ".weight"), want)
    assert cli.main(["inspect", str(snapshot)]) == 0
    out = tmp_path / "out"
    with nothing_changes_outside(tmp_path, out):
        convert_checkpoint(snapshot, out, "mxfp8", progress=False)
    capsys.readouterr()
    assert not any(f.is_symlink() for f in out.iterdir())
    converted, _ = open_checkpoint(out)
    assert [layer.checkpoint_format.value for layer in converted.layers] == ["mxfp8"] * 2


@pytest.mark.parametrize("where", ["a snapshot", "a plain directory"])
def test_links_to_blobs_count_only_from_a_hugging_face_snapshot(
    tmp_path: Path, toy_adapter, where: str
) -> None:
    """A snapshot's files may lead to its repository's ``blobs/`` and nowhere else in it;
    a directory that is no snapshot may not lead to a ``blobs/`` beside it."""
    if where == "a snapshot":
        ckpt, blobs = _hugging_face_cache(tmp_path)
        moved = blobs.parent / "refs" / "shard"  # in the repository, not in blobs/
    else:
        ckpt = write_synthetic_checkpoint(
            tmp_path / "snapshot", "toymoe", "bf16", SIZES, max_shard_bytes=300_000
        )
        moved = tmp_path / "blobs" / "0123abcd"
    shard = _shard_of(ckpt, EXPERT + ".weight")
    moved.parent.mkdir()
    shard.resolve().rename(moved)
    shard.unlink(missing_ok=True)  # the link (a plain file was moved)
    os.symlink(os.path.relpath(moved, ckpt), shard)
    message = rf"{shard.name}: shard file is a symlink to {moved}, outside the checkpoint"
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(ckpt)


def test_reads_use_the_validated_file_not_a_decoy(tmp_path: Path, toy_adapter) -> None:
    """Headers and data come from one resolved file: replacing the link's target between
    opening and reading cannot make the reader mix a checked header with other data."""
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", "toymoe", "bf16", SIZES, max_shard_bytes=300_000
    )
    shard = _shard_of(ckpt, EXPERT + ".weight")
    real = ckpt / "store" / "real.safetensors"  # a link may lead into a subdirectory
    real.parent.mkdir()
    shard.rename(real)
    os.symlink(real, shard)
    reader, _ = open_checkpoint(ckpt)
    want = load_file(real)[EXPERT + ".weight"]
    decoy = {k: torch.full_like(v, 7) for k, v in load_file(real).items()}
    shard.unlink()
    save_file(decoy, shard)  # the name now holds other data; the reader keeps its file
    assert torch.equal(reader.get_tensor(EXPERT + ".weight"), want)


def test_the_no_adapter_error_is_a_lookup_error_too(tmp_path: Path, toy_adapter) -> None:
    ckpt = write_synthetic_checkpoint(tmp_path / "ckpt", "toymoe", "bf16", SIZES)
    _unknown_model(ckpt)
    with pytest.raises(LookupError):
        open_checkpoint(ckpt)
    with pytest.raises(CheckpointError):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("layout", ["index", "shards"])
def test_a_checkpoint_of_too_many_tensors_is_refused_before_its_headers_are_kept(
    tmp_path: Path, toy_adapter, monkeypatch: pytest.MonkeyPatch, layout: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", "toymoe", "bf16", SIZES, max_shard_bytes=300_000
    )
    listed = len(_index(ckpt)["weight_map"])
    if layout == "index":  # the index alone lists more than the cap
        monkeypatch.setattr(checkpoint_files, "MAX_TENSORS", listed - 1)
        message = rf"{INDEX_FILE}: lists {listed} tensors, more than the {listed - 1} a checkpoint"
    else:  # the index lists few; a shard stores many more it does not list
        monkeypatch.setattr(checkpoint_files, "MAX_TENSORS", listed + 5)
        save_file({f"extra.{i}": torch.zeros(1) for i in range(10)}, ckpt / NORM_SHARD)
        _set_entry(ckpt, "extra.0", NORM_SHARD)
        message = rf"brings the checkpoint's files to \d+, more than the {listed + 5} a checkpoint"
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(ckpt)
    assert cli.main(["inspect", str(ckpt)]) == cli.EXIT_FAIL
    assert _search(message, capsys.readouterr().err)


def test_an_empty_tensor_under_an_moe_block_is_built_from_its_header_not_read(
    tmp_path: Path, toy_adapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest dimensions torch holds pass the header check; safetensors never reads it."""
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", "toymoe", "bf16", SIZES, max_shard_bytes=300_000
    )
    shape = (0, 2**63 - 1)
    _with_raw_entry(EXTRA, {"dtype": "BF16", "shape": list(shape)}, b"")(ckpt)
    reader, _ = open_checkpoint(ckpt)
    read: list[str] = []

    def recording(f: object, name: str, piece: object) -> torch.Tensor:
        read.append(name)
        return real_read(f, name, piece)

    real_read = checkpoint_reader._read
    monkeypatch.setattr(checkpoint_reader, "_read", recording)
    tensors = dict(reader.iter_tensors("model.layers.1.mlp"))
    empty = reader.get_tensor(EXTRA)
    assert tensors["extra.weight"].shape == empty.shape == shape
    assert empty.dtype == torch.bfloat16
    assert EXTRA not in read
    assert "model.layers.1.mlp.gate.weight" in read  # the others are read as before


def test_an_unsupported_dtype_names_its_shard_once(tmp_path: Path, toy_adapter) -> None:
    ckpt = write_synthetic_checkpoint(
        tmp_path / "ckpt", "toymoe", "bf16", SIZES, max_shard_bytes=300_000
    )
    _with_raw_entry("extra", {"dtype": "F8_E4M3FNUZ", "shape": [2]}, bytes(2))(ckpt)
    with pytest.raises(UnsupportedCheckpointError) as caught:
        open_checkpoint(ckpt)
    message = str(caught.value)
    assert message.startswith(f"{ckpt / NORM_SHARD}: tensor 'extra' has safetensors dtype ")
    assert message.count(NORM_SHARD) == 1
    assert "download" not in message  # a dtype is no damage: another download is no fix
