"""``megamoe sample``: a small synthetic checkpoint in a model's release layout.

Something to try ``inspect``, ``convert`` and ``verify`` on without downloading a model:
the adapter's synthetic checkpoint (``ModelAdapter.synthetic_config`` and
``synthetic_tensors``: the release's config keys, tensor names, shards and index), written
next to ``OUT`` and renamed to ``OUT`` once complete, then opened as every command opens a
checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megamoe.core import adapters as adapter_registry
from megamoe.core.adapters import ModelAdapter, SyntheticSizes
from megamoe.core.checkpoint.layers import MoELayer
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.errors import UsageError
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint


@dataclass(frozen=True)
class Sample:
    """A written sample checkpoint.

    Attributes:
        path: its directory.
        adapter: the adapter whose layout it has.
        checkpoint_format: how its routed experts are stored.
        model_type: its ``config.json`` ``model_type``.
        layers: its MoE layers, as the checkpoint reader finds them.
        files: its safetensors files.
        tensor_bytes: bytes of all its tensors.
    """

    path: Path
    adapter: ModelAdapter
    checkpoint_format: WeightFormat
    model_type: str
    layers: tuple[MoELayer, ...]
    files: int
    tensor_bytes: int


def select_adapters(names: Sequence[str] | None = None) -> dict[str, ModelAdapter]:
    """The installed adapters named by ``--adapter`` (None: every installed one), by name.

    Raises:
        LookupError: no adapter is installed (the message names the pip command).
        UsageError: a name that is not installed; the message names ``--adapter`` and the
            installed ones.
    """
    installed = adapter_registry.installed_adapters()
    if not installed:
        raise LookupError(
            "no megamoe adapter is installed; pip install "
            + " ".join(adapter_registry.KNOWN_DISTRIBUTIONS.values())
        )
    if names is None:
        return installed
    unknown = [n for n in dict.fromkeys(names) if n not in installed]
    if unknown:
        raise UsageError(
            f"--adapter {', '.join(unknown)}: not installed; installed: {', '.join(installed)}"
        )
    return {n: installed[n] for n in dict.fromkeys(names)}


def write_sample(
    out: str | Path,
    adapter: str | None = None,
    fmt: WeightFormat | str | None = None,
    sizes: SyntheticSizes | None = None,
    seed: int = 0,
) -> Sample:
    """Write a synthetic checkpoint of ``adapter``'s model to the new directory ``out``.

    Args:
        out: the directory to create; its parent must exist.
        adapter: an installed adapter's name (None: the only one installed).
        fmt: how the routed experts are stored (None: the first format the adapter loads,
            its release's).
        sizes: layers and dimensions (``SyntheticSizes()`` when None).
        seed: reproducible contents.

    Returns:
        What was written.

    Raises:
        FileExistsError: ``out`` exists.
        FileNotFoundError: ``out``'s parent directory does not exist.
        LookupError: no adapter is installed.
        UsageError: ``adapter`` is not installed, or None with several installed; a
            format the adapter does not load (named with ``--format`` and those it loads).
        ValueError: sizes the adapter cannot lay out (named).
    """
    candidates = select_adapters(None if adapter is None else [adapter])
    if len(candidates) > 1:
        raise UsageError(f"--adapter is needed: one of {', '.join(candidates)}")
    chosen = next(iter(candidates.values()))
    run = chosen.checkpoint_formats[0] if fmt is None else WeightFormat.parse(fmt)
    if run not in chosen.checkpoint_formats:
        loads = ", ".join(f.value for f in chosen.checkpoint_formats)
        raise UsageError(
            f"--format {run.value}: {chosen.name} checkpoints store experts as {loads}; pick "
            "one of those (megamoe convert makes the others)"
        )
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"{out} already exists; remove it or choose another directory")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: no such directory (the parent of {out})")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.sample-", dir=out.parent))
    try:
        write_synthetic_checkpoint(staging, chosen, run, sizes, seed)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    reader = CheckpointReader(out, chosen)
    return Sample(
        path=out,
        adapter=chosen,
        checkpoint_format=run,
        model_type=str(reader.config.get("model_type")),
        layers=tuple(reader.layers),
        files=len(set(reader.weight_map.values())),
        tensor_bytes=sum(reader.tensor_spec(n).nbytes for n in reader.weight_map),
    )
