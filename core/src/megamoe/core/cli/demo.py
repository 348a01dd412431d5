"""``megamoe demo``: every installed adapter and format, end to end, on this machine.

For each adapter and each format it loads: write a synthetic checkpoint into a temporary
directory, load every MoE layer on a single-rank setup, run a forward on the best backend
available and compare with the adapter's float64 reference. No network.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megamoe.core.adapters import ModelAdapter, SyntheticSizes
from megamoe.core.checkpoint.reader import CheckpointReader
from megamoe.core.cli.sample import select_adapters
from megamoe.core.cli.verify import LayerCheck, verify_layer
from megamoe.core.errors import UsageError
from megamoe.core.modules.parallel import ParallelSettings, single_rank_group
from megamoe.core.numerics.formats import WeightFormat
from megamoe.core.testing import write_synthetic_checkpoint

# The demo's checkpoints: small, and of sizes every MegaMoE kernel runs (the Hopper one
# takes hidden sizes in multiples of 512, intermediate ones in multiples of 256).
DEMO_SIZES = SyntheticSizes(hidden_size=512)
HEADERS = (
    "adapter",
    "format",
    "run format",
    "backend",
    "max rel. error",
    "tol.",
    "load s",
    "result",
)


@dataclass(frozen=True)
class DemoRow:
    """One adapter and checkpoint format, over all its MoE layers.

    Attributes:
        adapter: adapter name.
        checkpoint_format: the synthetic checkpoint's expert format.
        checks: one per MoE layer (empty when it failed before any forward).
        error: why it failed before a forward, else None.
    """

    adapter: str
    checkpoint_format: WeightFormat
    checks: tuple[LayerCheck, ...]
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Every layer within tolerance and no error."""
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def cells(self) -> tuple[str, ...]:
        """The table cells."""
        if self.error is not None:
            return (self.adapter, self.checkpoint_format.value, "-", "-", "-", "-", "-", "FAIL")
        worst = max(self.checks, key=lambda c: c.max_rel_error / c.tolerance)
        return (
            self.adapter,
            self.checkpoint_format.value,
            "/".join(sorted({c.run_format.value for c in self.checks})),
            "/".join(sorted({c.backend for c in self.checks})),
            f"{worst.max_rel_error:.2e}",
            repr(worst.tolerance),
            f"{sum(c.load_seconds for c in self.checks):.2f}",
            "ok" if self.ok else "FAIL",
        )


def default_device() -> torch.device:
    """The first CUDA device where there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_demo(
    *,
    device: torch.device | str | None = None,
    backend: str = "auto",
    sizes: SyntheticSizes | None = None,
    adapters: Sequence[str] | None = None,
    formats: Sequence[WeightFormat | str] | None = None,
    on_row: Callable[[DemoRow], None] | None = None,
) -> list[DemoRow]:
    """Run the demo over installed adapters.

    Args:
        device: where blocks run (None: CUDA if available, else CPU).
        backend: experts backend (``"auto"`` picks the best available).
        sizes: synthetic checkpoint sizes (``DEMO_SIZES`` when None).
        adapters: only these adapter names (None: all installed).
        formats: only these checkpoint formats (None: every format an adapter loads).
        on_row: called with each row as soon as it is done.

    Returns:
        One row per (adapter, format).

    Raises:
        LookupError: no adapter is installed.
        UsageError: see ``demo_combinations``.
    """
    combinations = demo_combinations(adapters, formats)
    sizes = DEMO_SIZES if sizes is None else sizes
    device = default_device() if device is None else torch.device(device)
    parallel = ParallelSettings(ep_group=single_rank_group(device))
    rows = []
    with tempfile.TemporaryDirectory(prefix="megamoe-demo-") as tmp:
        for adapter, fmt in combinations:
            path = Path(tmp) / f"{adapter.name}-{fmt.value}"
            try:
                write_synthetic_checkpoint(path, adapter, fmt, sizes)
                reader = CheckpointReader(path, adapter)
                checks = tuple(
                    verify_layer(
                        reader, adapter, layer, parallel=parallel, backend=backend, device=device
                    )
                    for layer in reader.layers
                )
                row = DemoRow(adapter.name, fmt, checks)
            except Exception as err:  # one broken combination must not hide the others
                row = DemoRow(adapter.name, fmt, (), f"{type(err).__name__}: {err}")
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def demo_combinations(
    adapters: Sequence[str] | None = None, formats: Sequence[WeightFormat | str] | None = None
) -> list[tuple[ModelAdapter, WeightFormat]]:
    """The (adapter, checkpoint format) pairs the demo runs: those installed and selected.

    Args:
        adapters: only these adapter names (None: all installed).
        formats: only these checkpoint formats (None: every format an adapter loads).

    Returns:
        The pairs, by adapter name then the adapter's format order; never empty.

    Raises:
        LookupError: no adapter is installed (the message names the pip command).
        UsageError: a requested adapter is not installed (see ``select_adapters``), or no
            selected adapter loads a selected format (the message names ``--format`` and
            what each selected adapter loads).
    """
    selected = select_adapters(adapters)
    wanted = None if formats is None else {WeightFormat.parse(f) for f in formats}
    pairs = [
        (adapter, fmt)
        for adapter in selected.values()
        for fmt in adapter.checkpoint_formats
        if wanted is None or fmt in wanted
    ]
    if not pairs:
        loads = "; ".join(
            f"{name} loads {', '.join(f.value for f in adapter.checkpoint_formats)}"
            for name, adapter in selected.items()
        )
        asked = ", ".join(sorted(f.value for f in wanted or ()))
        raise UsageError(
            f"--format {asked}: no selected adapter loads it ({loads}); pick one of those"
        )
    return pairs


def format_table(rows: Sequence[Sequence[str]], headers: Sequence[str] = HEADERS) -> str:
    """Rows as a plain fixed-width table with a header line."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [headers, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)
