"""Tile shapes of the small-batch path side by side on one GPU, the floor beside them.

For each real layer (``bench_decode.LAYERS``) and token count, every ``--tiles`` shape
(``NAME`` or ``NAME:field=value,...`` over one of the module's shapes, as in
``kernel_resources.py``) runs the layer's small-batch kernels with the tile rule forced to
it, graphed, on the same block-FP8 weights and uniform random routing; every shape takes
one sample per round (``--rounds``), so the ratios are side by side. Each row says:

- ``us``: microseconds per layer, CUDA-graph replay median over ``--layers`` weight copies
  called in turn (no layer finds its weights in L2);
- ``floor``: the ratio to ``bench_decode``'s floor on this card (the active experts' bytes over its
  memory bandwidth, 4.8 TB/s on an H200, 3.35 on an H100 SXM);
- ``vs first``: the ratio to the first shape's time;
- ``bits``: whether the output equals the first shape's bit for bit (it must: the tile
  shape changes which program computes a row, not how);
- ``l1``, ``l2``, ``combine``...: each launch's microseconds per layer (torch profiler over
  eager calls).

    python benchmarks/bench_tiles.py --tokens 1536,2048,4096 \\
        --tiles "BATCH_TILES BATCH_TILES:claim=True BATCH_TILES:l2_per_sm=4" --json tiles.json

``--probes`` adds, after the shapes, the first shape again on kernels changed to show where
the time goes: timing probes, whose outputs are wrong by design (``bits`` False):

- ``unscaled``: l1 and l2 chain each step's tensor-core dot into the accumulator with no
  block scale (``acc = tl.dot(w, x, acc)``), so Triton keeps one dot running while the next
  step's operands arrive (``kernel_resources.py``'s ``in_flight`` 1, production 0): the most
  that a kernel scaling one step's dot while the next runs could save;
- ``weights_in_l2``: every expert's tiles read expert 0's weights (its block scales stay
  the expert's), which stay in L2: the time without the weights' memory traffic;
- ``unscaled+weights_in_l2``: both.

    python benchmarks/bench_tiles.py --models qwen4exp --tokens 2048,4096 --tiles WIDE_TILES \\
        --probes "unscaled weights_in_l2 unscaled+weights_in_l2" --json probes.json

``kernel_resources.py`` says beforehand whether a shape spills or fits fewer programs per
SM than it launches. Needs a CUDA device with DeepGEMM (the layers load through it).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench_decode import LAYERS, build_layer, calls_in_turn, floor_us, routing
from harness import back_to_back_sample, cuda_graph_replay, format_table, interleaved_us, write_json
from kernel_resources import PROBE_EDITS, probe_kernels, tile_shape
from megamoe.core.kernels import experts_small_batch as kernels

COLUMNS = [
    ("layer", "<10"),
    ("tokens", ">6d"),
    ("pairs/expert", ">12.1f"),
    ("tiles", "<40"),
    ("us", ">8.1f"),
    ("floor", ">6.2f"),
    ("vs first", ">8.3f"),
    ("bits", "<5"),
    ("launches us", "<40"),
]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,1536,2048,3072,4096")
    p.add_argument("--models", default="qwen4exp,glm53flash")
    p.add_argument("--tiles", default="MIDSIZE_TILES BATCH_TILES WIDE_TILES",
                   help="tile shapes, space-separated; the first is the baseline")  # fmt: skip
    p.add_argument("--probes", default="",
                   help="timing probes after the shapes, space-separated: "
                   f"{', '.join(PROBE_EDITS)}, or several joined by + (outputs wrong)")  # fmt: skip
    p.add_argument("--layers", type=int, default=2, help="weight copies per graph")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10, help="replays per sample")
    p.add_argument("--json", default="bench_tiles.json")
    return p.parse_args(argv)


@contextlib.contextmanager
def forced(tiles: kernels.Tiles) -> Iterator[None]:
    """Every call of the small-batch kernels takes ``tiles`` (the tile rule, replaced)."""
    rule = kernels.tiles_for
    kernels.tiles_for = lambda tokens, top_k, num_experts, expert_bytes: tiles
    try:
        yield
    finally:
        kernels.tiles_for = rule


@contextlib.contextmanager
def probed(module: ModuleType) -> Iterator[None]:
    """Every call of the small-batch path launches ``module``'s l1 and l2 kernels."""
    launches = kernels._l1, kernels._l2
    kernels._l1, kernels._l2 = module._l1, module._l2
    try:
        yield
    finally:
        kernels._l1, kernels._l2 = launches


def launch_us(fn: Any, layers: int, calls: int = 3) -> str:
    """Each kernel's microseconds per layer call, from the profiler over ``calls`` eager calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {
        event.key.strip("_").removesuffix("_kernel"): event.device_time_total / calls / layers
        for event in prof.key_averages()
        if event.device_type.name == "CUDA" and event.key.startswith("_")
    }
    return " ".join(f"{name}={us:.0f}" for name, us in times.items())


def measure(
    name: str,
    counts: list[int],
    shapes: list[tuple[str, Any, ModuleType | None]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """``name``'s rows: each (label, tile shape, probe kernels or None) at each token count."""
    experts, top_k = LAYERS[name][:2]
    layers = [build_layer(name, 100 + i, max(counts), "small_batch") for i in range(args.layers)]
    rows = []
    for tokens in counts:
        x, weights, ids = routing(name, tokens, seed=tokens)
        _, floor = floor_us(name, ids)
        call = calls_in_turn(layers, x, weights, ids)
        samplers, bits, split, first = {}, {}, {}, None
        for spec, tiles, probe in shapes:
            with forced(tiles), probed(probe) if probe else contextlib.nullcontext():
                out = layers[0](x, weights, ids).clone()
                first = out if first is None else first
                bits[spec] = torch.equal(out.view(torch.int16), first.view(torch.int16))
                samplers[spec] = back_to_back_sample(cuda_graph_replay(call), args.reps)
                split[spec] = launch_us(call, args.layers)
        times = interleaved_us(samplers, warmup=2, rounds=args.rounds)
        base = times[shapes[0][0]]
        for spec, _, _ in shapes:
            row = {"layer": name, "tokens": tokens, "pairs/expert": tokens * top_k / experts,
                   "tiles": spec, "us": times[spec] / args.layers,
                   "floor": times[spec] / args.layers / floor, "vs first": times[spec] / base,
                   "bits": str(bits[spec]), "launches us": split[spec]}  # fmt: skip
            rows.append(row)
            print(format_table(COLUMNS, [[row[c] for c, _ in COLUMNS]]).splitlines()[-1],
                  flush=True)  # fmt: skip
    del layers
    torch.cuda.empty_cache()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    shapes: list[tuple[str, Any, ModuleType | None]] = [
        (*tile_shape(spec), None) for spec in args.tiles.split()
    ]
    counts = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        first, tiles, _ = shapes[0]
        shapes += [
            (f"{first} {probe}", tiles, probe_kernels(probe, Path(folder)))
            for probe in args.probes.split()
        ]
        print(format_table(COLUMNS, []), flush=True)
        rows = []
        for name in args.models.split(","):
            rows += measure(name, counts, shapes, args)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
