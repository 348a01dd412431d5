"""Host time of the small-batch path's Python per call, its kernel launches taken out.

An eager call of the small-batch experts path (``megamoe.core.kernels.experts_small_batch``)
is host-bound at decode sizes: what the GPU runs in 20-60 us takes 80-180 us queued eagerly
on the H200 (``bench_decode.py``'s ``small eager``). Part of that is Triton's launcher, part
is megamoe's own Python around it: the tile rule, the launch keys, the grids. This measures
the second alone, on any machine: ``SmallBatchExperts.forward`` for both real layers
(``bench_decode.LAYERS``) with its five launches replaced by no-ops (on the CPU where there
is no CUDA device), microseconds per call, the least of ``--rounds`` rounds of ``--calls``
calls. Beside it, in the same run, the host cost of the grid helpers: Triton 3.6's
``triton.cdiv`` (a constexpr function, unwrapping its arguments per call) against
``megamoe.core.kernels.launch.cdiv`` on plain ints.

    python benchmarks/bench_host.py --tokens 1,16,1024 --json host.json

Times are the machine's host CPU's: compare rows of one run (and runs of one machine).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
import types
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import torch
import triton

from bench_decode import LAYERS
from harness import format_table, write_json
from megamoe.core.kernels import experts_small_batch as kernels
from megamoe.core.kernels import launch

LAUNCHES = ("_route", "_place", "_l1", "_l2", "_combine")
H200_SMS = 132  # the persistent grids' size without a device to ask
COLUMNS = [("layer", "<10"), ("tokens", ">6d"), ("tiles", "<14"), ("host us", ">8.1f")]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    p.add_argument("--models", default="qwen4exp,glm53flash")
    p.add_argument("--calls", type=int, default=1000, help="calls per round")
    p.add_argument("--rounds", type=int, default=5, help="the least round counts")
    p.add_argument("--json", default="", help="write the rows here")
    return p.parse_args(argv)


def least_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Microseconds per call of ``fn``: the least of ``rounds`` rounds of ``calls`` calls."""
    for _ in range(calls // 10):
        fn()
    best = float("inf")
    for _ in range(rounds):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - begin) / calls)
    return 1e6 * best


def small_batch_call(name: str, device: torch.device, max_tokens: int) -> tuple[Any, Any]:
    """The layer's ``SmallBatchExperts`` and ``ExpertWeights`` (uninitialized weights)."""
    experts, top_k, hidden, inter, limit, _ = LAYERS[name]
    # Without a device the SM count is the H200's; with one, its own (patching the device
    # properties there would break CUDA's lazy initialization, which asks them too).
    props = types.SimpleNamespace(multi_processor_count=H200_SMS)
    no_device = (
        contextlib.nullcontext()
        if device.type == "cuda"
        else mock.patch.object(torch.cuda, "get_device_properties", return_value=props)
    )
    with no_device:
        call = kernels.SmallBatchExperts(
            num_experts=experts, first_expert=0, top_k=top_k, hidden=hidden, intermediate=inter,
            swiglu_limit=limit, max_tokens=max_tokens, device=device,
        )  # fmt: skip

    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    fp8 = torch.float8_e4m3fn
    w13_scale = empty(experts, 2 * inter // 128, hidden // 128)
    w2_scale = empty(experts, hidden // 128, inter // 128)
    weights = kernels.ExpertWeights(
        empty(experts, 2 * inter, hidden, dtype=fp8), w13_scale,
        empty(experts, hidden, inter, dtype=fp8), w2_scale,
    )  # fmt: skip
    return call, weights


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    counts = [int(t) for t in args.tokens.split(",")]
    for name in LAUNCHES:  # the Python around the launches only
        setattr(kernels, name, lambda *launch_args, **options: None)
    grid = {
        "triton.cdiv": least_us(lambda: triton.cdiv(40960, 1024), args.calls, args.rounds),
        "launch.cdiv": least_us(lambda: launch.cdiv(40960, 1024), args.calls, args.rounds),
    }
    print("grid helper us per call: " + ", ".join(f"{k} {v:.3f}" for k, v in grid.items()))
    print(format_table(COLUMNS, []), flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        call, weights = small_batch_call(name, device, max(counts))
        experts, top_k, hidden = LAYERS[name][:3]
        for tokens in counts:
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
            topk_weights = torch.rand(tokens, top_k, generator=gen).to(device)
            ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
            inputs = (weights, x, None, topk_weights, ids.to(device))
            us = least_us(functools.partial(call.forward, *inputs), args.calls, args.rounds)
            tiles = call.tiles(tokens)
            label = next(n for n in ("DECODE", "MIDSIZE", "BATCH", "WIDE")
                         if getattr(kernels, f"{n}_TILES") is tiles)  # fmt: skip
            rows.append({"layer": name, "tokens": tokens, "tiles": label, "host us": us})
            print(format_table(COLUMNS, [[rows[-1][c] for c, _ in COLUMNS]]).splitlines()[-1],
                  flush=True)  # fmt: skip
    if args.json:
        write_json(args.json, {"grid_helpers_us": grid, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
