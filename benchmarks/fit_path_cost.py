"""Refit the small-batch rule's cost models to a ``bench_decode.py`` run, and show the crossovers.

The rule that picks the small-batch path or MegaMoE per call (``megamoe.core.backends.
small_batch``) predicts each path's time from the layer's work with a ``PathCost`` per path.
This reads ``bench_decode.py`` JSONs of one card (graphed medians of both paths per layer and
token count, measured side by side; several runs, say one of the real layers and one of
``deepseekv3``'s shape), fits each path's constants to every row of the runs by least
squares on the log of the time (the relative error; every constant positive, the terms a path
lacks kept at zero: the small-batch path pays no per-slot cost, MegaMoE no per-program one),
and prints:

- the fitted constants, as the code writes them (``CARD_COSTS``' entry of the run's card);
- each row: the measured time of each path, its prediction under the checkout's constants for
  the run's card and under the fitted ones, and the relative errors;
- each layer's crossover: measured (the last token count of the run before the first at
  which MegaMoE was faster), under the checkout's models and under the fitted ones.

    python benchmarks/fit_path_cost.py decode.json --json fit.json
    python benchmarks/fit_path_cost.py docs/img/decode_h100.json \
        docs/img/decode_h100_deepseekv3.json

Runs anywhere (no GPU): the times are the run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench_decode import LAYERS, SAVED_CARD, layer_of
from harness import format_table, write_json
from megamoe.core.backends.small_batch import (
    CardCosts,
    PathCost,
    card_costs,
    crossover_between,
    crossover_tokens,
)

# bench_decode's column of each path: its field of ``CardCosts``, the terms it lacks
PATHS = {"small": ("small", ("per_slot_us",)), "megamoe": ("megamoe", ("per_program_us",))}
CROSSOVER_SCAN = 65536  # as megamoe inspect
COLUMNS = [
    ("layer", "<10"), ("tokens", ">6d"), ("path", "<8"), ("measured", ">9.1f"),
    ("checkout", ">9.1f"), ("error", ">7.1%"), ("fitted", ">9.1f"), ("fit error", ">9.1%"),
]  # fmt: skip


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("decode_json", nargs="+", help="bench_decode.py's --json, one card's")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps per path")
    p.add_argument("--json", default="", help="write the constants, rows and crossovers here")
    return p.parse_args(argv)


def read_run(path: str) -> tuple[str, list[dict[str, Any]]]:
    """The run's card and its rows that time both paths, or SystemExit naming what is wrong.

    A run that names no card was an H200's (``bench_decode.SAVED_CARD``).
    """
    try:
        report = json.loads(Path(path).read_text())
        rows, card = report["rows"], report.get("card", SAVED_CARD)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"fit_path_cost: {path} is not a bench_decode.py --json ({err})") from err
    known = [row for row in rows if row.get("layer") in LAYERS and row.get("small")]
    if not known:
        raise SystemExit(f"fit_path_cost: {path} has no rows of the layers {sorted(LAYERS)}")
    return card, known


def fit(rows: list[dict[str, Any]], column: str, start: PathCost, steps: int) -> PathCost:
    """``column``'s PathCost that fits ``rows`` best in the log of the time, from ``start``."""
    absent = PATHS[column][1]
    names = [f.name for f in dataclasses.fields(PathCost) if f.name not in absent]
    # the constants' logs; bandwidth and FLOP/s enter as their inverses
    inverse = {"bandwidth", "flops"}
    logs = torch.tensor(
        [-math.log(getattr(start, n)) if n in inverse else math.log(getattr(start, n) or 1e-3)
         for n in names],
        dtype=torch.float64, requires_grad=True,
    )  # fmt: skip
    works = [(layer_of(row["layer"]), row["tokens"], math.log(row[column])) for row in rows]

    def cost(values: torch.Tensor) -> PathCost:
        constants = {n: 1.0 / v if n in inverse else v for n, v in zip(names, values, strict=True)}
        constants.update(dict.fromkeys(absent, 0.0))
        return PathCost(**constants)

    optimizer = torch.optim.Adam([logs], lr=0.02)
    for _ in range(steps):
        optimizer.zero_grad()
        model = cost(logs.exp())
        loss = sum((torch.log(w.predicted_us(model, t)) - m) ** 2 for w, t, m in works)
        loss.backward()
        optimizer.step()
    return cost([float(v) for v in logs.detach().exp()])


def measured_crossover(rows: list[dict[str, Any]], layer: str) -> int:
    """The last token count of the run before the first at which MegaMoE was faster."""
    last = 0
    for row in sorted((r for r in rows if r["layer"] == layer), key=lambda r: r["tokens"]):
        if row["megamoe"] < row["small"]:
            return last
        last = row["tokens"]
    return last


def read_runs(paths: Sequence[str]) -> tuple[str, list[dict[str, Any]]]:
    """The runs' card and all their rows, or SystemExit where two runs name other cards."""
    cards, rows = {}, []
    for path in paths:
        card, run_rows = read_run(path)
        cards[path] = card
        rows += run_rows
    if len(set(cards.values())) > 1:
        named = ", ".join(f"{path}: {card}" for path, card in cards.items())
        raise SystemExit(
            f"fit_path_cost: the runs are of different cards ({named}); a fit is one card's "
            "models: pass one card's runs"
        )
    return cards[paths[0]], rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    card, rows = read_runs(args.decode_json)
    key, checkout = card_costs(card)
    print(f"card: {card} (the checkout's models: CARD_COSTS[{key!r}])")
    models = {column: getattr(checkout, field) for column, (field, _) in PATHS.items()}
    fitted = {column: fit(rows, column, models[column], args.steps) for column in PATHS}
    print(f"{key}_COSTS = {CardCosts(small=fitted['small'], megamoe=fitted['megamoe'])}")
    table = []
    for row in rows:
        work = layer_of(row["layer"])
        for column, checkout_model in models.items():
            ours, theirs = (
                work.predicted_us(m, row["tokens"]) for m in (checkout_model, fitted[column])
            )
            measured = row[column]
            table.append([row["layer"], row["tokens"], column, measured, ours,
                          ours / measured - 1, theirs, theirs / measured - 1])  # fmt: skip
    print(format_table(COLUMNS, table))
    crossovers = {}
    for layer in dict.fromkeys(row["layer"] for row in rows):
        work = layer_of(layer)
        was = crossover_tokens(work, CROSSOVER_SCAN, card)
        new = crossover_between(work, fitted["small"], fitted["megamoe"], CROSSOVER_SCAN)
        crossovers[layer] = {"measured": measured_crossover(rows, layer), "checkout": was,
                             "fitted": new}  # fmt: skip
        print(f"{layer}: crossover measured after {crossovers[layer]['measured']} tokens "
              f"(the run's counts); checkout's models {was}; fitted {new}")  # fmt: skip
    result = {
        "card": card,
        "fitted": {column: dataclasses.asdict(model) for column, model in fitted.items()},
        "rows": [dict(zip((c for c, _ in COLUMNS), r, strict=True)) for r in table],
        "crossovers": crossovers,
    }
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
