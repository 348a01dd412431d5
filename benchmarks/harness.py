"""What the benchmark scripts share around the thing each measures.

CUDA-event and host timing, the device copy bandwidth that serves as a memory-bound ceiling,
model-like weights, a one-rank experts layer, ``src:dst`` format-pair options, and the
report (a fixed-width table, a JSON file). The scripts run as ``python3
benchmarks/bench_x.py``, so Python finds this module beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megamoe.core import testing
from megamoe.core.modules.experts import MegaMoEExperts
from megamoe.core.numerics.formats import WeightFormat


def add_shape_args(parser: argparse.ArgumentParser, experts: int, top_k: bool = True) -> None:
    """Add one layer's shape: ``--experts``, ``--top-k``, ``--hidden``, ``--intermediate``.

    Top-8, hidden 4096 and intermediate 1536 by default: a large MoE model's routed experts.
    """
    parser.add_argument("--experts", type=int, default=experts)
    if top_k:
        parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=1536)


def cuda_median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, each bracketed by CUDA events.

    Each call is synced on, so its time includes the host work before its first kernel.
    """
    return cuda_back_to_back_ms(fn, warmup, 1, batches=reps)


def cuda_back_to_back_ms(
    fn: Callable[[], object], warmup: int, reps: int, batches: int = 3
) -> float:
    """Milliseconds per call of ``fn`` queued ``reps`` times back to back (median of batches).

    No sync between the calls: two CUDA events bracket the whole batch. This is the time an
    engine sees per MoE layer in eager mode, where the host queues layer after layer and
    host work overlaps the GPU work already queued. ``cuda_median_ms`` syncs after every
    call, so it also counts host time before the first long kernel.
    """
    for _ in range(warmup):
        fn()
    sample = back_to_back_sample(fn, reps)
    return statistics.median(sample() for _ in range(batches)) / 1e3


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Host microseconds per call of ``fn``, ``reps`` calls back to back (no sync between)."""
    fn()
    return host_sample(fn, reps)()


def interleaved_us(
    samplers: Mapping[str, Callable[[], float]], warmup: int, rounds: int
) -> dict[str, float]:
    """Median microseconds of each sampler, sampled in turn, round after round.

    Each round takes one sample of every sampler, so that a drift of the host's speed (the
    lent H200's moved 2x within a run) reaches every column alike and the ratios between
    them stay side by side. Each round starts one sampler later than the last, so that no
    column always follows the same one: a graph replay right after host-bound eager calls
    ran up to 25 us slower on the H200 (most likely its clocks had dropped). ``warmup``
    samples of each are dropped first. Sample like with like (graph replays apart from
    eager calls).
    """
    for sample in samplers.values():
        for _ in range(warmup):
            sample()
    keys = list(samplers)
    taken: dict[str, list[float]] = {key: [] for key in keys}
    for round_ in range(rounds):
        start = round_ % len(keys)
        for key in keys[start:] + keys[:start]:
            taken[key].append(samplers[key]())
    return {key: statistics.median(values) for key, values in taken.items()}


def synced_sample(fn: Callable[[], object]) -> Callable[[], float]:
    """One call of ``fn`` bracketed by CUDA events and synced on, in us (a sampler).

    Like ``cuda_median_ms``'s calls, it counts the host work before the first kernel.
    """
    return back_to_back_sample(fn, 1)


def back_to_back_sample(fn: Callable[[], object], reps: int) -> Callable[[], float]:
    """us per call of ``fn`` queued ``reps`` times with no sync between (a sampler)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample() -> float:
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return 1e3 * start.elapsed_time(end) / reps

    return sample


def host_sample(fn: Callable[[], object], reps: int) -> Callable[[], float]:
    """Host us per call of ``fn``, ``reps`` calls back to back (a sampler; see ``host_us``)."""

    def sample() -> float:
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = time.perf_counter() - begin
        torch.cuda.synchronize()
        return 1e6 * elapsed / reps

    return sample


def cuda_graph_replay(fn: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """A CUDA graph of ``fn`` (warmed up on a side stream first), as a replay callable."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bytes_per_s(total_bytes: int, warmup: int, reps: int) -> float:
    """Device-to-device copy bandwidth: bytes read plus written per second.

    The copy moves about ``total_bytes`` in all (half read, half written); a buffer far
    larger than the L2 cache gives the HBM ceiling.
    """
    half = max(total_bytes // 2 // 16 * 16, 16)
    src = torch.randint(0, 255, (half,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * half / (cuda_median_ms(lambda: dst.copy_(src), warmup, reps) * 1e-3)


def model_like_bf16(shape: tuple[int, int, int], seed: int, device: str = "cuda") -> torch.Tensor:
    """Normal values, magnitude differing per expert and per 128x128 block (on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, n, k = shape
    blocks = (e, -(-n // 128), -(-k // 128))
    gain = 0.02 * torch.exp2(torch.rand(blocks, generator=gen, device=device) * 8.0 - 4.0)
    gain *= 1.0 + 0.05 * torch.arange(e, device=device).view(e, 1, 1)
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    for i in range(e):  # one expert at a time keeps the float32 temporaries small
        full = gain[i].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        out[i] = (torch.randn((n, k), generator=gen, device=device) * full).to(torch.bfloat16)
    return out


def one_rank_experts(
    shape: tuple[int, int, int],
    top_k: int,
    run: WeightFormat,
    checkpoint: WeightFormat,
    backend: str,
    max_tokens: int = 256,
    device: str = "cuda",
) -> MegaMoEExperts:
    """An empty experts layer of ``shape`` (experts, hidden, intermediate) on ``device``.

    One rank holds every expert; load its weights, then ``finalize()``.
    """
    return testing.one_rank_experts(
        *shape,
        top_k=top_k,
        weight_format=run,
        checkpoint_format=checkpoint,
        max_num_tokens=max_tokens,
        backend=backend,
        device=device,
    )


def bare_megamoe(
    experts: MegaMoEExperts,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """DeepGEMM's two Hopper calls on the experts' kernel weights and buffer, nothing else.

    ``mega_moe_pre_dispatch_sm90`` + ``fp8_mega_moe``, whatever path the experts module
    would take for the call (no megamoe code in between).
    """
    backend: Any = experts.backend
    module, _ = backend._kernel
    l1w, l1s, l2w, l2s = backend._layout.pieces
    buf = backend.symm_buffer.buffer
    clamp = {} if experts.swiglu_limit is None else {"activation_clamp": experts.swiglu_limit}

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        module.mega_moe_pre_dispatch_sm90(
            x, ids, weights, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, x.shape[0]
        )
        module.fp8_mega_moe(y, (l1w, l1s), (l2w, l2s), buf, **clamp)
        return y

    return run


def parse_format_pairs(text: str) -> list[tuple[WeightFormat, WeightFormat]]:
    """``"fp8_block:mxfp8,bf16:mxfp4"`` -> [(FP8_BLOCK, MXFP8), (BF16, MXFP4)]."""
    pairs = []
    for item in text.split(","):
        src, _, dst = item.partition(":")
        pairs.append((WeightFormat.parse(src), WeightFormat.parse(dst)))
    return pairs


def _column_layout(title: str, spec: str) -> tuple[str, str]:
    """Split ``"<20"``, ``">9.3f"``: (alignment and width widened to the title, the rest)."""
    align = spec[0] if spec[:1] in ("<", ">", "^") else ""
    body = spec[len(align) :]
    digits = len(body) - len(body.lstrip("0123456789"))
    width = max(int(body[:digits] or 0), len(title))
    return f"{align or '>'}{width}", body[digits:]


def format_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]]) -> str:
    """A header, a rule, then one line per row; ``None`` cells print as ``-``.

    Each column is ``(title, format spec)``: the spec formats the column's values
    (``">9.3f"``); its alignment (right by default) and width, widened to fit the title,
    lay out the title and the ``-`` cells.
    """
    layout = [_column_layout(title, spec) for title, spec in columns]
    head = " ".join(f"{title:{pad}}" for (title, _), (pad, _) in zip(columns, layout, strict=True))
    lines = [head.rstrip()]
    lines.append("-" * len(lines[0]))
    for row in rows:
        cells = (
            f"{'-' if value is None else format(value, rest):{pad}}"
            for value, (pad, rest) in zip(row, layout, strict=True)
        )
        lines.append(" ".join(cells).rstrip())
    return "\n".join(lines)


def write_json(path: str | Path, report: Any) -> None:
    """Write ``report`` as indented JSON and say where."""
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
