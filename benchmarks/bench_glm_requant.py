"""Time ``Glm5NextMegaMoEExperts.requantize_block_fp8`` on one realistic GLM layer.

The layer: 64 routed experts plus the fused shared expert, H=4096, I=1536, stored as
block-FP8 (E4M3 with float32 128x128 scales, half of them powers of two), run as MXFP8.
Every shard is loaded (written in place), then only ``requantize_block_fp8(chunk=...)`` is
timed: it reads the E4M3 weights and block scales and writes E4M3 weights and UE8M0 1x32
scales in place. Bandwidth counts those bytes (read + written). Loads are not timed.

On CPU one run per chunk size (it takes seconds); on CUDA the median of ``--reps`` runs
after a warm-up, synchronized. "cpu s" is this process's CPU time over the same span
(all threads): on a shared machine it shows what the wall time would be without
contention. Prints a table, then one JSON object (``--json`` also writes it to a file).

Usage::

    python benchmarks/bench_glm_requant.py                    # CPU, and CUDA when present
    python benchmarks/bench_glm_requant.py --devices cpu --chunks 1,8 --json cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from harness import format_table, write_json
from megamoe.glm5next import Glm5NextMegaMoEExperts

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 64, 4096, 1536
BLOCK = 128
PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Row:
    """One device and chunk size."""

    device: str
    experts: int
    hidden: int
    intermediate: int
    chunk: int
    runs: int
    seconds: float
    process_cpu_seconds: float
    bytes_moved: int
    gb_per_s: float


COLUMNS = (
    ("device", "<8"),
    ("E", ">3"),
    ("H", ">5"),
    ("I", ">5"),
    ("chunk", ">5"),
    ("runs", ">4"),
    ("seconds", ">9.3f"),
    ("cpu s", ">9.3f"),
    ("GB/s", ">7.2f"),
)


def shard(rows: int, cols: int, expert: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Model-like block-FP8: finite E4M3 values, scales differing per block (half 2^k)."""
    gen = torch.Generator(device=device).manual_seed(1000 + expert)
    values = torch.randn((rows, cols), generator=gen, device=device) * 120.0
    weight_fp8 = values.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    blocks = (rows // BLOCK, cols // BLOCK)
    exponent = torch.randint(-14, -8, blocks, generator=gen, device=device).float()
    mantissa = 1.0 + torch.rand(blocks, generator=gen, device=device) * 0.9
    pow2 = torch.rand(blocks, generator=gen, device=device) < 0.5
    scale = torch.exp2(exponent) * torch.where(pow2, torch.ones_like(mantissa), mantissa)
    return weight_fp8, scale.float()


def build(device: str) -> Glm5NextMegaMoEExperts:
    return Glm5NextMegaMoEExperts(
        num_experts=NUM_EXPERTS,
        num_local_experts=NUM_EXPERTS,
        experts_start_idx=0,
        num_logical_experts=NUM_EXPERTS,
        top_k=8,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        weight_format="mxfp8",
        checkpoint_format="fp8_block",
        num_shared_experts=1,
        backend="reference",
        device=device,
        prefix="bench.mlp.experts",
    )


def load_all(module: Glm5NextMegaMoEExperts, device: str) -> None:
    """Write every shard in place (expert by expert: bounded host memory)."""
    shapes = {
        "gate_proj": (INTERMEDIATE, HIDDEN),
        "up_proj": (INTERMEDIATE, HIDDEN),
        "down_proj": (HIDDEN, INTERMEDIATE),
    }
    for expert in range(NUM_EXPERTS + 1):
        for i, proj in enumerate(PROJS):
            weight, scale = shard(*shapes[proj], 3 * expert + i, device)
            if expert == NUM_EXPERTS:
                module.load_shared_expert_weight(f"{proj}.weight", weight)
                module.load_shared_expert_weight(f"{proj}.weight_scale_inv", scale)
            else:
                module.load_weights(
                    [
                        (f"{expert}.{proj}.weight", weight),
                        (f"{expert}.{proj}.weight_scale_inv", scale),
                    ]
                )


def moved_bytes() -> int:
    elements = (NUM_EXPERTS + 1) * 3 * HIDDEN * INTERMEDIATE
    block_scales = elements // (BLOCK * BLOCK) * 4
    return 2 * elements + block_scales + elements // 32  # read E4M3 + scales, write E4M3 + UE8M0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(device: str, chunk: int, reps: int) -> Row:
    module = build(device)
    times, cpu_times = [], []
    for rep in range(reps + (1 if device.startswith("cuda") else 0)):
        load_all(module, device)
        sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        module.requantize_block_fp8(chunk=chunk)
        sync(device)
        if device.startswith("cuda") and rep == 0:
            continue  # warm-up (Triton compilation)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    seconds = statistics.median(times)
    moved = moved_bytes()
    return Row(
        device, NUM_EXPERTS, HIDDEN, INTERMEDIATE, chunk, len(times), seconds,
        statistics.median(cpu_times), moved, moved / seconds / 1e9,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="auto", help="cpu,cuda or auto (cpu + cuda if any)")
    parser.add_argument("--chunks", default="8", help="comma-separated chunk sizes (experts)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs on CUDA (CPU: 1)")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    if args.devices != "auto":
        devices = args.devices.split(",")
    warnings.simplefilter("ignore")  # the power-of-two warning is expected here
    rows = [
        run(device, int(chunk), 1 if device == "cpu" else args.reps)
        for device in devices
        for chunk in args.chunks.split(",")
    ]
    cells = [
        (
            r.device,
            r.experts,
            r.hidden,
            r.intermediate,
            r.chunk,
            r.runs,
            r.seconds,
            r.process_cpu_seconds,
            r.gb_per_s,
        )
        for r in rows
    ]
    print(format_table(COLUMNS, cells))
    result = {
        "benchmark": "glm5next requantize_block_fp8 (block-FP8 -> MXFP8 in place)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "rows": [asdict(r) for r in rows],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
