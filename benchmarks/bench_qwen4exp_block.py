"""Qwen4Exp MoE block time with and without the auxiliary stream for the shared expert.

The shared expert (SwiGLU MLP times sigmoid gate) runs on an auxiliary CUDA stream beside
the router and joins before the MegaMoE launch. This measures the whole block both ways,
plus its parts alone (router, shared expert, routed experts), and reports the overlap:
time saved by the aux stream over the most it can save, min(router, shared expert).
Times are medians of CUDA-event timings after warm-up.

    python benchmarks/bench_qwen4exp_block.py                  # E=64, top-8, H=4096, I=1536
    python benchmarks/bench_qwen4exp_block.py --tokens 256 --json out.json

Weights are random block-FP8 (the Hopper kernel's format) made on the GPU: no checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterator

import torch

from megamoe.core import quant
from megamoe.core.backends.symm_buffer import resolve_group
from megamoe.core.parallel import ParallelSettings
from megamoe.core.shared_expert import AuxStream
from megamoe.qwen4exp import Qwen4ExpMegaMoeBlock

PREFIX = "model.layers.0.mlp"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=1536)
    # Qwen MoE models give the shared expert about four routed experts' width.
    p.add_argument("--shared-intermediate", type=int, default=6144)
    p.add_argument("--tokens", default="256,1024")
    p.add_argument("--backend", default="auto", help="auto, deepgemm or reference")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="bench_qwen4exp_block.json")
    return p.parse_args()


def time_us(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def config(args: argparse.Namespace) -> dict[str, object]:
    return {
        "model_type": "qwen4_exp",
        "hidden_size": args.hidden,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.intermediate,
        "shared_expert_intermediate_size": args.shared_intermediate,
        "num_hidden_layers": 1,
        "norm_topk_prob": True,
        "quantization_config": {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [f"{PREFIX}.gate", f"{PREFIX}.shared_expert_gate"],
        },
    }


def fp8(
    rows: int, cols: int, gen: torch.Generator, name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.03
    values, scale = quant.quantize_fp8_block(dense, name=name)
    yield f"{name}.weight", values
    yield f"{name}.weight_scale_inv", scale


def tensors(args: argparse.Namespace) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, s = args.hidden, args.intermediate, args.shared_intermediate
    yield (
        "gate.weight",
        (torch.randn(args.experts, h, device="cuda", generator=gen) * 0.02).bfloat16(),
    )
    yield (
        "shared_expert_gate.weight",
        (torch.randn(1, h, device="cuda", generator=gen) * 0.02).bfloat16(),
    )
    for proj, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
        yield from fp8(*shape, gen, f"shared_expert.{proj}")
    for e in range(args.experts):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield from fp8(*shape, gen, f"experts.{e}.{proj}")


def measure(block: Qwen4ExpMegaMoeBlock, count: int, args: argparse.Namespace) -> dict[str, float]:
    """Block time with and without the aux stream, and its parts alone, for ``count`` tokens."""
    device = block.device
    aux, serial = AuxStream(device, enabled=True), AuxStream(device, enabled=False)
    gen = torch.Generator(device=device).manual_seed(count)
    x = torch.randn(count, args.hidden, device=device, generator=gen).bfloat16()
    weights, ids = block.route(x)

    def run_block(stream: AuxStream) -> torch.Tensor:
        block.aux_stream = stream
        return block(x)

    def time(fn: Callable[[], object]) -> float:
        return time_us(fn, args.iters, args.warmup)

    row = {
        "tokens": float(count),
        "block_aux_us": time(lambda: run_block(aux)),
        "block_serial_us": time(lambda: run_block(serial)),
        "router_us": time(lambda: block.route(x)),
        "shared_us": time(lambda: block.shared_output(x)),
        "experts_us": time(lambda: block.experts(x, weights, ids)),
    }
    block.aux_stream = aux
    saved = row["block_serial_us"] - row["block_aux_us"]
    ideal = min(row["router_us"], row["shared_us"])
    row["saved_us"], row["overlap"] = saved, saved / ideal if ideal > 0 else 0.0
    return row


def main() -> None:
    args = parse()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    counts = [int(t) for t in args.tokens.split(",")]
    block = Qwen4ExpMegaMoeBlock(
        config(args),
        prefix=PREFIX,
        parallel=ParallelSettings(ep_group=resolve_group(None, device)),  # type: ignore[arg-type]
        backend=args.backend,
        device=device,
        max_num_tokens=max(counts),
    )
    block.load_weights(tensors(args))
    block.finalize()
    experts = block.experts
    print(
        f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate} "
        f"shared I={args.shared_intermediate}; run format {experts.weight_format.value}, "
        f"backend {experts.backend.name}"
    )
    rows = [measure(block, count, args) for count in counts]
    header = ("tokens", "aux us", "serial us", "saved us", "overlap", "router", "shared", "experts")
    print("  ".join(f"{h:>9}" for h in header))
    for r in rows:
        print(
            f"{int(r['tokens']):>9}  {r['block_aux_us']:>9.1f}  {r['block_serial_us']:>9.1f}  "
            f"{r['saved_us']:>9.1f}  {r['overlap']:>9.2f}  {r['router_us']:>9.1f}  "
            f"{r['shared_us']:>9.1f}  {r['experts_us']:>9.1f}"
        )
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
