"""Qwen4Exp's combine on a GPU: the one-launch ``gated_add`` against the torch path.

The block's output is ``bf16(routed + sigmoid(x . g) * shared)``. For each token count,
CUDA-event medians after warm-up:

- ``one op``: a one-element ``add_``, timed the same way (the floor of an eager launch);
- ``torch``: the torch path (``Qwen4ExpMegaMoeBlock.combine`` without Triton): the gate's
  float32 logit (``router_logits``), its sigmoid, one float32 ``addcmul``, the bf16 cast;
- ``fused``: ``megamoe.qwen4exp.combine_triton.gated_add``, one launch;
- ``graphed``: CUDA graphs of each, replayed (GPU time), and ``host``: the host time per
  call, back to back;
- ``ceiling``: the bytes the fused kernel must move (three (T, H) bf16 reads, one write,
  the gate's weight) at the device's copy bandwidth (``harness.copy_bytes_per_s``).

    python3 benchmarks/bench_combine.py
    python3 benchmarks/bench_combine.py --tokens 1,256 --hidden 2048 --json c.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness import (
    copy_bytes_per_s,
    cuda_graph_replay,
    cuda_median_ms,
    format_table,
    host_us,
    write_json,
)
from megamoe.core.numerics.router_logits import router_logits
from megamoe.qwen4exp.combine_triton import gated_add

COLUMNS = (
    ("tokens", ">6.0f", "tokens"),
    ("one op", ">7.1f", "one_op_us"),
    ("torch", ">7.1f", "torch_us"),
    ("fused", ">7.1f", "fused_us"),
    ("torch graphed", ">13.1f", "torch_graphed_us"),
    ("fused graphed", ">13.1f", "fused_graphed_us"),
    ("ceiling", ">7.1f", "ceiling_us"),
    ("torch host", ">10.1f", "torch_host_us"),
    ("fused host", ">10.1f", "fused_host_us"),
    ("torch/fused graphed", ">19.2f", "graphed_speedup"),
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", default="1,16,128,256,1024,4096")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="bench_combine.json")
    return p.parse_args(argv)


def measure(count: int, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    """One table row at ``count`` tokens."""
    gen = torch.Generator(device="cuda").manual_seed(count)
    x, routed, shared = (
        torch.randn(count, args.hidden, device="cuda", generator=gen).bfloat16() for _ in range(3)
    )
    gate_weight = (torch.randn(1, args.hidden, device="cuda", generator=gen) * 0.02).bfloat16()
    one = torch.zeros(1, device="cuda")

    def torch_path() -> torch.Tensor:
        gate = torch.sigmoid(router_logits(x, gate_weight))
        return torch.addcmul(routed, shared, gate).to(torch.bfloat16)

    def fused() -> torch.Tensor:
        return gated_add(routed, shared, x, gate_weight)

    def time_us(fn: Callable[[], object]) -> float:
        return 1e3 * cuda_median_ms(fn, args.warmup, args.iters)

    moved = (4 * count + 1) * args.hidden * 2  # bytes: three reads and a write, plus g
    row: dict[str, Any] = {
        "tokens": float(count),
        "one_op_us": time_us(lambda: one.add_(1)),
        "torch_us": time_us(torch_path),
        "fused_us": time_us(fused),
        "torch_graphed_us": time_us(cuda_graph_replay(torch_path)),
        "fused_graphed_us": time_us(cuda_graph_replay(fused)),
        "ceiling_us": 1e6 * moved / bandwidth,
        "torch_host_us": host_us(torch_path, args.iters),
        "fused_host_us": host_us(fused, args.iters),
    }
    row["graphed_speedup"] = row["torch_graphed_us"] / row["fused_graphed_us"]
    return row


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.cuda.set_device(0)
    bandwidth = copy_bytes_per_s(1 << 30, args.warmup, 10)
    with torch.no_grad():
        rows = [measure(int(t), args, bandwidth) for t in args.tokens.split(",")]
    print(f"Qwen4Exp combine, H={args.hidden}, us (copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
    print(
        format_table([(t, s) for t, s, _ in COLUMNS], [[r[k] for _, _, k in COLUMNS] for r in rows])
    )
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
