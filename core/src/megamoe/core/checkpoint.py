"""Read Hugging Face checkpoint directories tensor by tensor (SPEC §3.6)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megamoe.core.errors import CheckpointError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    """A checkpoint directory: ``config.json`` plus one or more safetensors files.

    Tensors are read one at a time through ``safe_open``; no file is read whole.

    Args:
        path: the checkpoint directory.

    Raises:
        CheckpointError: a missing config, index or shard file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise CheckpointError(f"{self.path}: no {CONFIG_FILE}; expected a HF checkpoint dir")
        self.config: dict[str, Any] = json.loads(config_path.read_text())
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE_FILE).is_file():
            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")
        for file in sorted(set(weight_map.values())):
            if not (self.path / file).is_file():
                raise CheckpointError(
                    f"{self.path}: shard file {file} named in {INDEX_FILE} is missing"
                )
        return weight_map

    def tensor_names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self.weight_map

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor.

        Raises:
            CheckpointError: the name is not in the checkpoint or absent from its file.
        """
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        with safe_open(self.path / file, framework="pt") as f:
            if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                raise CheckpointError(
                    f"{self.path}/{file}: tensor {name!r} is named in {INDEX_FILE} but absent"
                )
            return f.get_tensor(name)

    def iter_tensors(
        self, prefix: str, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the tensors under ``prefix + "."``, one at a time, file by file.

        Args:
            prefix: e.g. ``model.layers.3.mlp.experts``.
            keep: called with the name relative to the prefix; tensors it rejects are
                never read.

        Yields:
            ``(name relative to prefix, tensor)``.
        """
        head = prefix + "."
        by_file: dict[str, list[str]] = {}
        for name, file in self.weight_map.items():
            if name.startswith(head) and (keep is None or keep(name[len(head) :])):
                by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            with safe_open(self.path / file, framework="pt") as f:
                for name in sorted(names):
                    yield name[len(head) :], f.get_tensor(name)
